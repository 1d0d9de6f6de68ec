"""Bounds on what a tool returns: agents' clients reject very large results (Claude Code at
about 25k tokens), so every text that can grow is cut, and the result says that it was."""

from __future__ import annotations

MAX_DIFF_CHARS = 40_000
MAX_DOC_CHARS = 40_000


def bounded(text: str, limit: int) -> tuple[str, bool]:
    """``text`` cut to ``limit`` characters (with a marker), and whether it was cut."""
    if len(text) <= limit:
        return text, False
    return text[:limit] + f"\n… [cut: {len(text) - limit} more characters]\n", True
