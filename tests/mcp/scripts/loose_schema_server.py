"""A one-tool MCP server over stdio whose input schema takes an array of anything (``items: {}``,
a schema with no validation keyword): what the Inspector's ``--strict`` check must flag, so that
tests/mcp/test_conformance.py knows the check it relies on finds something."""

from typing import Any

from mcp.server.mcpserver import MCPServer

server = MCPServer("loose-schema")


@server.tool()
def echo(values: list[Any]) -> str:
    """Return the values as text."""
    return repr(values)


if __name__ == "__main__":
    server.run()
