"""Fixtures for the end-to-end MCP tests: a real SDK client, in memory or over stdio.

Tests talk to the server through :class:`ToolSession`, a synchronous face on ``mcp.Client``
(the client runs in an event loop of its own thread, so each test body reads top to bottom).
Modules that take the ``client`` fixture run twice: once against ``build_server`` in memory and
once against ``trainwright serve`` spawned over stdio.
"""

from __future__ import annotations

import base64
import json
import math
import os
import shutil
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml
from anyio.from_thread import start_blocking_portal
from mcp import Client, StdioServerParameters

from tests.support import TINY

TRANSPORTS = ("memory", "stdio")
FINAL_STATUSES = ("completed", "failed", "stopped")

# A run of the tiny model that checkpoints twice: 6 steps, checkpoints at 3 and 6.
SHORT_RUN = {"train.max_steps": 6, "checkpoint.every": 3}
# Long enough that it is still running whenever a test looks; tests stop it.
ENDLESS_RUN = {"train.max_steps": 100_000, "checkpoint.every": 100_000}


def tiny_config(**extra: Any) -> dict[str, Any]:
    """tests.support.TINY as typed config values (``{"model.hidden_size": 64, ...}``)."""
    config = {key: yaml.safe_load(value) for key, value in (item.split("=", 1) for item in TINY)}
    config.update(extra)
    return config


def trainwright_command() -> list[str]:
    """``trainwright`` as installed next to this Python (the console script), or its module."""
    script = Path(sys.executable).with_name("trainwright")
    return [str(script)] if script.is_file() else [sys.executable, "-m", "mcp_server.cli"]


def stdio_parameters(workspace: Path, *serve_args: str) -> StdioServerParameters:
    """``trainwright serve --workspace WORKSPACE ...`` as an MCP host would start it.

    The SDK gives the server a minimal environment; PYTHONPATH is passed on so that a checkout
    on PYTHONPATH is what the server (and the runs it starts) import.
    """
    command, *args = trainwright_command()
    env = {"PYTHONPATH": os.environ["PYTHONPATH"]} if os.environ.get("PYTHONPATH") else None
    return StdioServerParameters(
        command=command, args=[*args, "serve", "--workspace", str(workspace), *serve_args],
        cwd=str(workspace), env=env,
    )


class ToolError(AssertionError):
    """A tool call that was expected to succeed came back as a tool error."""


class ToolSession:
    """Blocking calls on a connected ``mcp.Client``."""

    def __init__(self, portal, client: Client, transport: str):
        self.portal = portal
        self.client = client
        self.transport = transport

    def call(self, tool: str, progress: list | None = None, **arguments: Any):
        """``tools/call``; progress notifications, if ``progress`` is a list, are appended to it."""

        async def on_progress(value: float, total: float | None, message: str | None) -> None:
            progress.append((value, total, message))

        callback = on_progress if progress is not None else None
        return self.portal.call(lambda: self.client.call_tool(tool, arguments, progress_callback=callback))

    def ok(self, tool: str, progress: list | None = None, **arguments: Any) -> dict[str, Any]:
        """The structured result of a call that must succeed."""
        result = self.call(tool, progress, **arguments)
        if result.is_error:
            raise ToolError(f"{tool}({arguments}) failed: {result.content[0].text}")
        assert result.structured_content is not None, f"{tool} returned no structuredContent"
        # The text content carries the same object, for clients that ignore structuredContent.
        assert json.loads(result.content[0].text) == result.structured_content
        return result.structured_content

    def error(self, tool: str, **arguments: Any) -> str:
        """The message of a call that must fail as a tool error (not a protocol error)."""
        result = self.call(tool, **arguments)
        assert result.is_error, f"{tool}({arguments}) succeeded: {result.structured_content}"
        return result.content[0].text

    def tools(self) -> dict[str, Any]:
        listing = self.portal.call(self.client.list_tools)
        return {tool.name: tool for tool in listing.tools}

    def resources(self) -> list[str]:
        listing = self.portal.call(self.client.list_resources)
        return [str(resource.uri) for resource in listing.resources]

    def resource_templates(self) -> list[str]:
        listing = self.portal.call(self.client.list_resource_templates)
        return [template.uri_template for template in listing.resource_templates]

    def read_text(self, uri: str) -> str:
        (contents,) = self.portal.call(self.client.read_resource, uri).contents
        return contents.text

    def read_bytes(self, uri: str) -> tuple[bytes, str]:
        (contents,) = self.portal.call(self.client.read_resource, uri).contents
        return base64.b64decode(contents.blob), contents.mime_type

    def read_error(self, uri: str) -> str:
        from mcp.shared.exceptions import MCPError

        with pytest.raises(MCPError) as caught:
            self.portal.call(self.client.read_resource, uri)
        return str(caught.value)

    # -- runs ----------------------------------------------------------------------------------

    def wait_for_run(self, run_id: str, timeout: float = 300) -> dict[str, Any]:
        """get_run, polled until the run has ended and its supervisor has recorded the exit code.

        The engine records ``completed`` itself a moment before its processes exit; the
        supervisor then records the exit code and writes the git note.
        """
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            info = self.ok("get_run", run_id=run_id)
            if info["status"] in FINAL_STATUSES and info["exit_code"] is not None:
                return info
            time.sleep(0.3)
        raise AssertionError(f"run {run_id} did not end within {timeout} s: {info['status']}")

    def wait_for_step(self, run_id: str, step: int = 1, timeout: float = 180) -> dict[str, Any]:
        """tail_metrics, polled until the run has logged ``step``; returns the latest record."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            tail = self.ok("tail_metrics", run_id=run_id, n=1)
            if tail["records"] and tail["records"][-1]["step"] >= step:
                return tail["records"][-1]
            if tail["status"] in FINAL_STATUSES:
                raise AssertionError(f"run {run_id} ended ({tail['status']}) before step {step}")
            time.sleep(0.3)
        raise AssertionError(f"run {run_id} did not reach step {step} within {timeout} s")


@contextmanager
def connect(transport: str, workspace: Path, *serve_args: str) -> Iterator[ToolSession]:
    """A connected client: in memory (``build_server``) or over stdio (``trainwright serve``)."""
    if transport == "memory":
        from mcp_server.server import build_server

        client = Client(build_server(workspace, read_only="--read-only" in serve_args))
    elif transport == "stdio":
        client = Client(stdio_parameters(workspace, *serve_args))
    else:
        raise ValueError(f"unknown transport {transport!r}")
    with start_blocking_portal() as portal:
        with closing_cleanly(portal.wrap_async_context_manager(client)) as connected:
            yield ToolSession(portal, connected, transport)


@contextmanager
def closing_cleanly(context):
    """Enter ``context``; on the way out close it as if nothing had gone wrong.

    A failed assertion in a test body then surfaces as itself, not wrapped in the exception
    groups of the client's task groups.
    """
    value = context.__enter__()
    try:
        yield value
    finally:
        context.__exit__(None, None, None)


def git(workspace: Path, *args: str) -> str:
    """A git command in the workspace; its stdout, stripped."""
    result = subprocess.run(["git", *args], cwd=workspace, capture_output=True, text=True, check=True)
    return result.stdout.strip()


def run_note(workspace: Path, commit: str, run_id: str, timeout: float = 30) -> str:
    """The trainwright git note of ``commit`` once it has ``run_id``'s line: the supervisor
    writes it after it records the exit code (what wait_for_run waits for), so it may come a
    moment later."""
    deadline = time.monotonic() + timeout
    while True:
        result = subprocess.run(["git", "notes", "--ref=trainwright", "show", commit], cwd=workspace,
                                capture_output=True, text=True)
        if result.returncode == 0 and f"run {run_id}:" in result.stdout:
            return result.stdout.strip()
        if time.monotonic() > deadline:
            raise AssertionError(f"no note of run {run_id} on {commit} within {timeout} s: {result.stdout[-500:]}")
        time.sleep(0.2)


def head(workspace: Path) -> str:
    return git(workspace, "rev-parse", "HEAD")


def process_group_alive(pgid: int) -> bool:
    """Whether any process of the group (a run's engine: torchrun and its workers) is left."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def is_finite_number(value: object) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


@pytest.fixture(scope="module", params=TRANSPORTS)
def transport(request) -> str:
    if request.param == "stdio" and shutil.which(trainwright_command()[0]) is None:
        pytest.skip("the trainwright command is not installed")
    return request.param


@pytest.fixture(scope="module")
def workspace(transport, tmp_path_factory) -> Path:
    """A fresh, empty folder: the server makes it a git repository."""
    return tmp_path_factory.mktemp(f"workspace-{transport}")


@pytest.fixture(scope="module")
def client(transport, workspace) -> Iterator[ToolSession]:
    with connect(transport, workspace) as session:
        yield session
