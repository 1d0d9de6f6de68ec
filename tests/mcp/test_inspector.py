"""The official MCP Inspector CLI lists the tools of `trainwright serve` and calls them.

The Inspector is an npm package run with `npx`; the first run downloads it (about 20 s), so
each command gets a timeout. Version 0.15.0 is the last one that runs on Node 20 (later
versions need Node 22); set TRAINWRIGHT_INSPECTOR to use another. Skipped, with the reason,
where npx is not installed. Inspector 2.12 on Node 22 (its ``--strict`` schema check) runs in
tests/mcp/test_conformance.py.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest

from tests.mcp.conftest import trainwright_command
from tests.mcp.test_server import TOOLS

INSPECTOR = os.environ.get("TRAINWRIGHT_INSPECTOR", "@modelcontextprotocol/inspector@0.15.0")
FIRST_RUN_TIMEOUT_S = 300  # includes downloading the package on a clean machine
MIN_NODE_MAJOR = 18

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def npx() -> str:
    path, node = shutil.which("npx"), shutil.which("node")
    if path is None or node is None:
        pytest.skip("npx (Node.js) is not installed: the MCP Inspector CLI runs with npx")
    version = subprocess.run([node, "--version"], capture_output=True, text=True, timeout=30).stdout.strip()
    if int(version.lstrip("v").split(".")[0]) < MIN_NODE_MAJOR:
        pytest.skip(f"Node {version} is too old for the MCP Inspector (needs {MIN_NODE_MAJOR}+)")
    return path


def inspect(npx: str, workspace, *method: str, timeout: float = 120) -> dict:
    """``npx -y INSPECTOR --cli trainwright serve --workspace WORKSPACE METHOD...``, parsed."""
    command = [npx, "-y", INSPECTOR, "--cli", *trainwright_command(), "serve", "--workspace", str(workspace),
               *method]
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=workspace)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the MCP Inspector did not answer within {timeout:.0f} s: {' '.join(command)}")
    assert result.returncode == 0, f"{' '.join(command)} exited {result.returncode}:\n{result.stderr[-3000:]}"
    return json.loads(result.stdout)


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    return tmp_path_factory.mktemp("inspector")


def test_the_inspector_lists_every_tool_with_its_schemas(npx, workspace):
    listing = inspect(npx, workspace, "--method", "tools/list", timeout=FIRST_RUN_TIMEOUT_S)
    tools = {tool["name"]: tool for tool in listing["tools"]}
    assert set(tools) == TOOLS
    assert tools["get_skill"]["inputSchema"]["required"] == ["skill"]
    assert tools["stop_run"]["annotations"]["destructiveHint"] is True
    assert all(tool["outputSchema"]["type"] == "object" for tool in tools.values())


def test_the_inspector_calls_a_tool_and_gets_structured_content(npx, workspace):
    result = inspect(npx, workspace, "--method", "tools/call", "--tool-name", "get_skill",
                     "--tool-arg", "skill=gradient-checkpointing")
    assert result["isError"] is False
    assert result["structuredContent"]["name"] == "gradient-checkpointing"
    assert result["structuredContent"]["skill_md"].startswith("---\nname: gradient-checkpointing\n")


def test_the_inspector_sees_a_bad_call_as_a_tool_error(npx, workspace):
    result = inspect(npx, workspace, "--method", "tools/call", "--tool-name", "get_run",
                     "--tool-arg", "run_id=no-such-run")
    assert result["isError"] is True
    assert "no run 'no-such-run' in this workspace; list_runs shows the runs" in result["content"][0]["text"]
