"""The tool schemas agents see are snapshotted in tests/mcp/tool_schemas.json (see snapshot.py)."""

from __future__ import annotations

import json

import pytest

from tests.mcp.snapshot import SNAPSHOT, UPDATE_COMMAND, current_schemas, drift, render


def test_the_tool_schemas_match_the_snapshot():
    current = current_schemas()
    changes = drift(json.loads(SNAPSHOT.read_text()), current)
    if changes or render(current) != SNAPSHOT.read_text():
        pytest.fail(
            "The MCP tool schemas differ from tests/mcp/tool_schemas.json:\n  "
            + "\n  ".join(changes or ["(formatting only)"])
            + f"\nIf the change is intended, update the snapshot with `{UPDATE_COMMAND}` and commit "
            "tests/mcp/tool_schemas.json with it, so that reviewers see what agents will see.",
            pytrace=False,
        )


def test_the_drift_report_names_added_removed_and_changed_tools():
    recorded = [{"name": "a", "description": "x"}, {"name": "b", "description": "y"}]
    current = [{"name": "b", "description": "z", "inputSchema": {}}, {"name": "c"}]
    assert drift(recorded, current) == [
        "+ c: new tool",
        "- a: removed",
        "~ b: description, inputSchema changed",
    ]
