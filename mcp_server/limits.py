"""Bounds on what a tool takes and returns: agents' clients reject very large results (Claude
Code at about 25k tokens), so every text that can grow is cut, and the result says that it was.

``MAX_RESULT_CHARS`` is the budget of one tool result as JSON; the tools keep well inside it
(diffs and documents are cut at ``MAX_DIFF_CHARS``, metrics at half the budget), and
:meth:`mcp_server.server.Tools.call` refuses, rather than sends, anything larger.
"""

from __future__ import annotations

import json
from typing import Any

MAX_DIFF_CHARS = 40_000
MAX_DOC_CHARS = 40_000
MAX_RESULT_CHARS = 60_000  # ≈ 15–20k tokens of JSON
MAX_ERROR_CHARS = 2_000  # an error message (it may echo the caller's input)
MAX_ARGUMENTS_CHARS = 100_000  # the arguments of one tool call, as JSON


def bounded(text: str, limit: int) -> tuple[str, bool]:
    """``text`` cut to ``limit`` characters (with a marker), and whether it was cut."""
    if len(text) <= limit:
        return text, False
    return text[:limit] + f"\n… [cut: {len(text) - limit} more characters]\n", True


def text_bytes(value: Any) -> int:
    """The size of ``value`` as an agent reads it: the MCP SDK writes a result's text content
    as JSON indented by 2 (structuredContent carries the same object again)."""
    return len(json.dumps(value, indent=2, ensure_ascii=False, default=str).encode())


def json_chars(value: Any) -> int:
    """The length of ``value`` as compact JSON (what a client receives, near enough)."""
    return len(json.dumps(value, separators=(",", ":"), default=str))
