"""`trainwright serve`: the tool list, --read-only, --http, the default workspace, no torch."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time

import pytest
from anyio.from_thread import start_blocking_portal
from mcp import Client, StdioServerParameters
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import create_mcp_http_client

from tests.mcp.conftest import ToolSession, closing_cleanly, connect, git, trainwright_command
from tests.support import TEMPLATE

TOOLS = {
    "list_skills", "get_skill", "apply_skill", "list_templates", "scaffold_recipe", "describe_recipe",
    "list_recipes", "launch_run", "list_runs", "get_run", "wait_run", "tail_metrics", "stop_run",
    "list_checkpoints", "resume_checkpoint", "export_checkpoint", "sample", "evaluate", "compare_runs",
    "estimate_run",
}
READ_ONLY_TOOLS = {"list_skills", "get_skill", "list_templates", "describe_recipe", "list_recipes", "list_runs",
                   "get_run", "wait_run", "tail_metrics", "list_checkpoints", "sample", "evaluate", "compare_runs",
                   "estimate_run"}
RUN_IDS = {"run_id", "run_a", "run_b"}
# A model or data set named by Hub id is downloaded by these: they reach the Hugging Face Hub.
HUB_TOOLS = {"scaffold_recipe", "describe_recipe", "launch_run", "resume_checkpoint", "estimate_run",
             "export_checkpoint"}  # to=hub:org/name pushes to it


def test_every_tool_is_listed_with_annotations_and_an_output_schema(client):
    tools = client.tools()
    assert set(tools) == TOOLS
    for name, tool in tools.items():
        hints = tool.annotations
        # True, or left out: false is the MCP spec's default (ToolAnnotations.readOnlyHint).
        assert hints.read_only_hint is (True if name in READ_ONLY_TOOLS else None), name
        if name in READ_ONLY_TOOLS:  # both hints mean something only for tools that change things
            assert hints.idempotent_hint is None and hints.destructive_hint is None, name
        else:
            assert hints.destructive_hint is (name == "stop_run"), name
        assert hints.open_world_hint is (None if name in HUB_TOOLS else False), name  # None: the default, true
        assert tool.output_schema["type"] == "object", name
        assert tool.description and "\n    " not in tool.description, name
    assert tools["apply_skill"].annotations.idempotent_hint is True
    assert not tools["launch_run"].annotations.idempotent_hint  # absent: false
    assert set(tools["apply_skill"].input_schema["properties"]) == {"skill", "recipe", "params", "dry_run", "target"}
    assert tools["apply_skill"].input_schema["required"] == ["skill", "recipe"]


def test_the_tool_list_fits_the_agent_budget_and_keeps_every_description(client):
    listing = client.portal.call(client.client.list_tools)
    answer = listing.model_dump_json(by_alias=True, exclude_none=True)
    assert len(answer.encode()) <= 20_000  # the whole tools/list answer, sent in every session
    schemas = json.loads(answer)["tools"]

    def titles(node, names=False):
        if isinstance(node, dict):
            here = [] if names or "title" not in node else [node["title"]]
            return here + [t for k, v in node.items() for t in titles(v, not names and k in ("properties", "$defs"))]
        return [t for item in node for t in titles(item)] if isinstance(node, list) else []

    for tool in schemas:
        assert titles(tool["inputSchema"]) == [] and titles(tool["outputSchema"]) == [], tool["name"]
        for name, prop in tool["inputSchema"].get("properties", {}).items():
            if name in RUN_IDS:  # a run's id, its name says: the bytes go to what a name cannot say
                assert prop == {"type": "string"}, f"{tool['name']}.{name}"
                continue
            assert prop.get("description"), f"{tool['name']}.{name} has no description"


def test_a_slow_call_does_not_hold_up_the_others(client, workspace):
    """launch_run waits seconds for the engine to check the config; meanwhile the server answers."""
    (workspace / "recipes").mkdir(exist_ok=True)
    if not (workspace / "recipes" / "slow").exists():
        shutil.copytree(TEMPLATE, workspace / "recipes" / "slow", ignore=shutil.ignore_patterns("__pycache__"))
    slow = client.portal.start_task_soon(
        client.client.call_tool, "launch_run", {"recipe": "recipes/slow", "overrides": {"train.max_stpes": 1}}
    )
    started = time.monotonic()
    assert len(client.tools()) == len(TOOLS)
    assert client.ok("list_runs")["runs"] == []
    answered_in = time.monotonic() - started
    assert not slow.done(), "the engine's check finished first: nothing was measured"
    assert answered_in < 2.0
    assert "unknown config key 'train.max_stpes'" in slow.result(timeout=300).content[0].text


def test_read_only_serves_only_the_tools_that_change_nothing(transport, tmp_path):
    with connect(transport, tmp_path, "--read-only") as read_only:
        assert set(read_only.tools()) == READ_ONLY_TOOLS
        message = read_only.error("apply_skill", skill="loss-guard", recipe="recipes/lm")
        assert "unknown tool" in message.lower() and "apply_skill" in message
        assert read_only.ok("list_runs") == {"runs": [], "truncated": False}
    assert not (tmp_path / ".git").exists()


def test_serve_takes_the_current_directory_and_makes_it_a_git_repository(tmp_path):
    command, *args = trainwright_command()
    parameters = StdioServerParameters(command=command, args=[*args, "serve"], cwd=str(tmp_path))
    with start_blocking_portal() as portal, closing_cleanly(portal.wrap_async_context_manager(Client(parameters))) as c:
        session = ToolSession(portal, c, "stdio")
        assert session.ok("list_templates")["templates"]
    assert git(tmp_path, "log", "--format=%an %s") == "trainwright trainwright: initialise workspace"
    assert "runs/" in (tmp_path / ".gitignore").read_text().splitlines()


def test_a_workspace_that_an_enclosing_repository_ignores_gets_its_own(tmp_path):
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / ".gitignore").write_text("/demo-workspace/\n")
    workspace = tmp_path / "demo-workspace"
    workspace.mkdir()
    with connect("memory", workspace) as client:
        client.ok("scaffold_recipe", template="causal_lm", name="lm", config={"train.max_steps": 2})
    assert git(workspace, "rev-parse", "--show-toplevel") == str(workspace.resolve())
    assert git(workspace, "log", "--format=%s") == (
        "recipe(lm): scaffold from template causal_lm\ntrainwright: initialise workspace"
    )


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _listening_addresses(port: int) -> list[str]:
    """The IPv4 addresses a socket listens on at ``port`` (Linux: /proc/net/tcp)."""
    try:
        lines = open("/proc/net/tcp").read().splitlines()[1:]
    except OSError:
        return []
    found = []
    for line in lines:
        local, state = line.split()[1], line.split()[3]
        address, port_hex = local.split(":")
        if state == "0A" and int(port_hex, 16) == port:  # 0A: LISTEN
            found.append(socket.inet_ntoa(bytes.fromhex(address)[::-1]))
    return found


def test_http_serves_streamable_http_on_localhost(tmp_path):
    port = _free_port()
    workspace = tmp_path / "ws"
    workspace.mkdir()
    server = subprocess.Popen(
        [*trainwright_command(), "serve", "--http", str(port), "--workspace", str(workspace)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "XDG_STATE_HOME": str(tmp_path / "state")},
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert server.poll() is None, f"the server exited: {server.stderr.read()}"
                assert time.monotonic() < deadline, "the server did not listen within 60 s"
                time.sleep(0.1)
        assert _listening_addresses(port) in ([], ["127.0.0.1"])  # [] where /proc/net/tcp is absent
        token = (tmp_path / "state" / "trainwright" / "http-token").read_text().strip()
        transport = streamable_http_client(
            f"http://127.0.0.1:{port}/mcp", http_client=create_mcp_http_client(headers={"Authorization": f"Bearer {token}"})
        )
        with start_blocking_portal() as portal:
            with closing_cleanly(portal.wrap_async_context_manager(Client(transport))) as c:
                session = ToolSession(portal, c, "http")
                assert set(session.tools()) == TOOLS
                assert "no run 'x' in this workspace" in session.error("get_run", run_id="x")
    finally:
        server.terminate()
        server.wait(timeout=30)


NO_TORCH_PROBE = """
import json, sys, anyio
from mcp import Client
from mcp_server.server import build_server

async def main():
    async with Client(build_server(sys.argv[1])) as client:
        await client.list_tools()
        for name, arguments in [("list_skills", {}), ("get_skill", {"skill": "gradient-checkpointing"}),
                                ("list_templates", {}), ("list_runs", {})]:
            assert not (await client.call_tool(name, arguments)).is_error, name

anyio.run(main)
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "transformers"))))
"""


def test_the_server_answers_without_importing_torch(tmp_path):
    result = subprocess.run(
        [sys.executable, "-c", NO_TORCH_PROBE, str(tmp_path)], capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.splitlines()[-1]) == []


COLD_START_PROBE = """
import json, sys, anyio
from mcp import Client
from mcp_server.server import build_server

async def main():
    async with Client(build_server(sys.argv[1])) as client:
        await client.list_tools()
        await client.list_resources()

anyio.run(main)
print(json.dumps(sorted(m for m in ("git.repo", "torch") if m in sys.modules)))  # `git` itself is a lazy stub
"""


def test_a_workspace_with_its_repository_starts_without_gitpython(tmp_path):
    """The cold start (bench/mcp_startup.py) skips GitPython (~30 ms) when the workspace's own
    repository is there; the first start, which initialises it, needs it."""
    first = subprocess.run([sys.executable, "-c", COLD_START_PROBE, str(tmp_path)], capture_output=True, text=True,
                           timeout=120)
    assert first.returncode == 0, first.stderr
    assert "git.repo" in json.loads(first.stdout.splitlines()[-1])
    assert (tmp_path / ".git" / "HEAD").is_file()
    again = subprocess.run([sys.executable, "-c", COLD_START_PROBE, str(tmp_path)], capture_output=True, text=True,
                           timeout=120)
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout.splitlines()[-1]) == []


@pytest.mark.parametrize("module", ["mcp_server.server", "mcp_server.cli", "mcp_server.operations.runs"])
def test_importing_the_server_modules_does_not_import_torch(module):
    probe = f"import sys, {module}; print('torch' in sys.modules, 'transformers' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert result.stdout.split() == ["False", "False"], result.stderr
