"""The operations behind the MCP tools and the CLI commands: one function per tool."""
