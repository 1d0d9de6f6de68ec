"""The agent-facing surface of the MCP server, snapshotted in tests/mcp/tool_schemas.json.

Each tool's name, description, input and output schema and annotations, as ``tools/list``
returns them. A change to any of them is a change to what agents see, so it shows up in review
as a diff of that file; ``tests/mcp/test_tool_schemas.py`` fails until the snapshot is updated.

    python -m tests.mcp.snapshot          # rewrite tests/mcp/tool_schemas.json
    python -m tests.mcp.snapshot --check  # exit 1 (and say which tools) when it is out of date
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

SNAPSHOT = Path(__file__).resolve().parent / "tool_schemas.json"
UPDATE_COMMAND = "python -m tests.mcp.snapshot"


def current_schemas() -> list[dict[str, Any]]:
    """``tools/list`` of a server on a scratch workspace, sorted by tool name: the schemas built
    from the declarations, not read from the cache (mcp_server.tool_schemas)."""
    from mcp_server.server import build_server, tool_schemas

    with tempfile.TemporaryDirectory(prefix="trainwright-snapshot-") as workspace:
        return tool_schemas(build_server(workspace, cached_schemas=False))


def render(schemas: list[dict[str, Any]]) -> str:
    return json.dumps(schemas, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def drift(recorded: list[dict[str, Any]], current: list[dict[str, Any]]) -> list[str]:
    """One line per tool that was added, removed or changed (and in which parts)."""
    before = {tool["name"]: tool for tool in recorded}
    after = {tool["name"]: tool for tool in current}
    lines = [f"+ {name}: new tool" for name in sorted(after.keys() - before.keys())]
    lines += [f"- {name}: removed" for name in sorted(before.keys() - after.keys())]
    for name in sorted(before.keys() & after.keys()):
        parts = sorted(key for key in before[name].keys() | after[name].keys()
                       if before[name].get(key) != after[name].get(key))
        if parts:
            lines.append(f"~ {name}: {', '.join(parts)} changed")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=UPDATE_COMMAND, description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="compare only; exit 1 when out of date")
    args = parser.parse_args(argv)
    current = current_schemas()
    if args.check:
        recorded = json.loads(SNAPSHOT.read_text()) if SNAPSHOT.is_file() else []
        lines = drift(recorded, current)
        print("\n".join(lines) or f"{SNAPSHOT.name} is up to date ({len(current)} tools)")
        return 1 if lines else 0
    SNAPSHOT.write_text(render(current))
    print(f"wrote {SNAPSHOT} ({len(current)} tools)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
