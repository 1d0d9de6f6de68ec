"""``trainwright serve --read-only`` lists and serves only the tools that change nothing."""

from __future__ import annotations

import sys

import anyio
import pytest
from mcp import Client, StdioServerParameters

from mcp_server.server import build_server
from tests.sandbox.helpers import error_text, fake_run, live_client, make_workspace, tree_hash

RUN_ID = "20260101-000000-lm-abcd"
READ_ONLY_TOOLS = {"list_skills", "get_skill", "list_templates", "describe_recipe", "list_recipes", "list_runs",
                   "get_run", "wait_run", "tail_metrics", "list_checkpoints", "sample", "evaluate", "compare_runs",
                   "estimate_run"}
CHANGING_CALLS = {
    "apply_skill": {"skill": "gradient-checkpointing", "recipe": "recipes/lm"},
    "scaffold_recipe": {"template": "causal_lm", "name": "fresh"},
    "launch_run": {"recipe": "recipes/lm"},
    "stop_run": {"run_id": RUN_ID},
    "resume_checkpoint": {"run_id": RUN_ID},
    "export_checkpoint": {"run_id": RUN_ID, "to": "exports/x"},
}


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = make_workspace(tmp_path_factory.mktemp("read-only") / "ws")
    fake_run(root, RUN_ID, status="running", pid=None)
    return root


def test_only_read_only_tools_are_listed_and_each_says_so(workspace):
    with live_client(build_server(workspace, read_only=True)) as client:
        tools = client.list_tools()
    assert {t.name for t in tools} == READ_ONLY_TOOLS
    for t in tools:
        assert t.annotations.read_only_hint is True and t.annotations.destructive_hint is None, t.name
    with live_client(build_server(workspace)) as client:
        everything = {t.name: t for t in client.list_tools()}
    assert set(everything) - READ_ONLY_TOOLS == set(CHANGING_CALLS)
    assert not any(everything[name].annotations.read_only_hint for name in CHANGING_CALLS)


def test_tools_that_change_something_are_not_served_and_nothing_changes(workspace):
    before = tree_hash(workspace)
    with live_client(build_server(workspace, read_only=True)) as client:
        for tool, arguments in CHANGING_CALLS.items():
            result = client.call(tool, arguments)
            assert result.is_error and "unknown tool" in error_text(result), tool
        for tool, arguments in {
            "list_skills": {}, "get_skill": {"skill": "lora"}, "list_templates": {}, "list_runs": {},
            "get_run": {"run_id": RUN_ID}, "tail_metrics": {"run_id": RUN_ID}, "list_checkpoints": {"run_id": RUN_ID},
            "describe_recipe": {"recipe": "recipes/lm"}, "list_recipes": {},
            "wait_run": {"run_id": RUN_ID, "timeout_s": 1},
        }.items():
            result = client.call(tool, arguments)
            assert not result.is_error, (tool, error_text(result))
    assert tree_hash(workspace) == before


def test_a_read_only_server_does_not_create_a_repository(tmp_path):
    build_server(tmp_path, read_only=True)
    assert not (tmp_path / ".git").exists() and list(tmp_path.iterdir()) == []


def test_the_cli_flag_serves_only_read_only_tools_over_stdio(workspace):
    async def listed() -> set[str]:
        params = StdioServerParameters(
            command=sys.executable,
            args=["-m", "mcp_server.cli", "serve", "--read-only", "--workspace", str(workspace)],
        )
        async with Client(params) as client:
            tools = (await client.list_tools()).tools
            refused = await client.call_tool("launch_run", {"recipe": "recipes/lm"})
            assert refused.is_error
            return {t.name for t in tools}

    assert anyio.run(listed) == READ_ONLY_TOOLS
