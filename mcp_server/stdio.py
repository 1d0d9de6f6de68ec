"""The stdio transport as the MCP SDK serves it, with one thing mended: a message holding a
number longer than Python reads (``sys.get_int_max_str_digits()``, 4,300 digits) is refused by
pydantic's JSON parser before any handler sees it, and the SDK drops it unanswered, so the client
waits for ever. Such a number is replaced here by :data:`mcp_server.limits.OVERLONG_NUMBER`, so
the request reaches the server with its id and is refused as bad input like any other."""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
from mcp.server.stdio import stdio_server

from mcp_server.limits import OVERLONG_NUMBER


def marked(line: str) -> str:
    """``line`` with each number whose integer part is longer than Python reads (an integer, or
    one with a fraction or an exponent, which pydantic refuses as well) replaced by
    OVERLONG_NUMBER (a JSON string); any other line, valid or not, as it came."""
    limit = sys.get_int_max_str_digits()
    if not re.search(r"\d{%d}" % (limit + 1), line):
        return line
    found = False

    def parsed(convert: Callable[[str], Any]) -> Callable[[str], Any]:
        def parse_number(text: str) -> Any:
            nonlocal found
            if len(re.split(r"[.eE]", text.lstrip("-"))[0]) > limit:
                found = True
                return OVERLONG_NUMBER
            return convert(text)
        return parse_number

    try:
        message = json.loads(line, parse_int=parsed(int), parse_float=parsed(float))
    except (ValueError, RecursionError):  # not JSON, or nested deeper than Python's parser goes
        return line
    return json.dumps(message, ensure_ascii=False) + "\n" if found else line


class _MarkedLines:
    """The lines of the server's stdin, each passed through :func:`marked`."""

    def __init__(self, lines: Any):
        self._lines = lines

    async def __aiter__(self) -> AsyncIterator[str]:
        async for line in self._lines:
            yield marked(line)


def _claimed_stdin() -> Any:
    """The process's stdin as a text file of its own; fd 0 then reads the null device, so the
    server's children never read the client's messages (what the SDK does for its own reader)."""
    private = os.dup(0)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    return open(private, encoding="utf-8", errors="replace", closefd=True)  # noqa: SIM115 - the transport owns it


async def serve_stdio(lowlevel: Any) -> None:
    """Serve ``lowlevel`` (the SDK's low-level server of an MCPServer) over stdio."""
    stdin = _claimed_stdin()
    try:
        lines = _MarkedLines(anyio.wrap_file(stdin))
        async with stdio_server(stdin=lines) as (read_stream, write_stream):  # type: ignore[arg-type]
            await lowlevel.run(read_stream, write_stream, lowlevel.create_initialization_options())
    finally:
        stdin.close()
