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

from mcp_server.limits import MAX_MESSAGE_CHARS, OVERLONG_MESSAGE, OVERLONG_NUMBER

EDGE_CHARS = 4_096  # of a line too long to read: its first and last characters, where the id and method are
CHUNK_CHARS = 1 << 16  # the rest of such a line is read and dropped in pieces of this size
_ID = r'"id"\s*:\s*(-?(?:0|[1-9]\d{0,18})|"(?:[^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4}){0,200}")'  # JSON's escapes alone: json.loads reads it
_METHOD = r'"method"\s*:\s*"([A-Za-z/_]{1,64})"'


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


def overlong(head: str, tail: str) -> str | None:
    """The request handed on in place of a line longer than MAX_MESSAGE_CHARS, from its first and
    last characters: a call with OVERLONG_MESSAGE for arguments (the server refuses it as too large
    before it looks at the tool's name), or None where no id is found (a notification: nothing waits
    for an answer). The id and method are looked for before ``"params"`` (where clients put them),
    else at the very end of the line."""
    params_at = head.find('"params"')
    before = head if params_at < 0 else head[:params_at]
    found = re.search(_ID, before) or re.search(_ID + r"\s*}\s*$", tail)
    if found is None:
        return None
    method = re.search(_METHOD, before) or re.search(_METHOD + r"\s*(?:,\s*" + _ID + r")?\s*}\s*$", tail)
    name = "tools/call" if method is None or method.group(1) == "tools/call" else method.group(1)
    params: dict[str, Any] = {"name": "", "arguments": {"message": OVERLONG_MESSAGE}}
    if name != "tools/call":  # another request: its parameters refused by the SDK, answered with an error
        params = {"message": OVERLONG_MESSAGE}
    return json.dumps({"jsonrpc": "2.0", "id": json.loads(found.group(1)), "method": name, "params": params}) + "\n"


class BoundedLines:
    """The lines of the server's stdin: each within MAX_MESSAGE_CHARS passed through
    :func:`marked`, each longer one read in pieces and replaced by :func:`overlong`."""

    def __init__(self, stdin: Any):
        self._stdin = stdin

    async def _read(self, limit: int) -> str:
        return await anyio.to_thread.run_sync(self._stdin.readline, limit)

    async def __aiter__(self) -> AsyncIterator[str]:
        while line := await self._read(MAX_MESSAGE_CHARS + 1):
            if len(line) <= MAX_MESSAGE_CHARS or line.endswith("\n"):
                yield marked(line)
                continue
            head, tail = line[:EDGE_CHARS], line[-EDGE_CHARS:]
            while (piece := await self._read(CHUNK_CHARS)) and not piece.endswith("\n"):
                tail = (tail + piece)[-EDGE_CHARS:]
            replacement = overlong(head, (tail + piece)[-EDGE_CHARS:])
            if replacement is not None:
                yield replacement


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
        lines = BoundedLines(stdin)
        async with stdio_server(stdin=lines) as (read_stream, write_stream):  # type: ignore[arg-type]
            await lowlevel.run(read_stream, write_stream, lowlevel.create_initialization_options())
    finally:
        stdin.close()
