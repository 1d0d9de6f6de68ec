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


VALIDATION_KEYWORDS = {"type", "enum", "const", "anyOf", "oneOf", "allOf", "not", "$ref"}


def property_schemas(schema, path: str):
    """Every (path, schema) of a property in ``schema``, at any depth."""
    if isinstance(schema, dict):
        for name, value in (schema.get("properties") or {}).items():
            yield f"{path}.{name}", value
        for key, value in schema.items():
            yield from property_schemas(value, f"{path}/{key}")
    elif isinstance(schema, list):
        for item in schema:
            yield from property_schemas(item, path)


def type_arrays(schema, path: str):
    if isinstance(schema, dict):
        if isinstance(schema.get("type"), list):
            yield path
        for key, value in schema.items():
            yield from type_arrays(value, f"{path}/{key}")
    elif isinstance(schema, list):
        for item in schema:
            yield from type_arrays(item, path)


def test_the_tool_schemas_are_portable_no_type_arrays_and_every_property_validated():
    tools = current_schemas()
    arrays = [p for tool in tools for kind in ("inputSchema", "outputSchema")
              for p in type_arrays(tool.get(kind, {}), f"{tool['name']}:{kind}")]
    assert arrays == []
    unvalidated = [p for tool in tools for kind in ("inputSchema", "outputSchema")
                   for p, schema in property_schemas(tool.get(kind, {}), f"{tool['name']}:{kind}")
                   if not VALIDATION_KEYWORDS & set(schema)]
    assert unvalidated == []
    nullable_step = {"anyOf": [{"type": "integer"}, {"type": "null"}]}
    wait_run = next(tool for tool in tools if tool["name"] == "wait_run")
    assert wait_run["outputSchema"]["properties"]["step"] == nullable_step  # null is sent: said so
    assert wait_run["inputSchema"]["properties"]["until_step"] == {  # null is the default: left out
        "description": "Default: end.", "type": "integer"}
