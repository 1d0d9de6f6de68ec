"""The audit log: every tool call, appended to ``.trainwright/audit.jsonl`` in the workspace.

One JSON object per call: time, tool, arguments (secrets redacted, long values cut), outcome
(``ok`` or ``error``), the error message, and the commit or run id the call produced. Lines are
written with a single ``O_APPEND`` write, so concurrent calls never interleave within a line.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterator

from engine import run_dir as rd
from sandbox.environment import looks_secret
from sandbox.redact import redact

AUDIT_FILENAME = "audit.jsonl"
MAX_VALUE_CHARS = 500


def _clean(value: Any, depth: int = 0) -> Any:
    if depth > 4:
        return "…"
    if isinstance(value, dict):
        return {
            str(k)[:100]: ("***" if looks_secret(str(k)) else _clean(v, depth + 1))
            for k, v in list(value.items())[:50]
        }
    if isinstance(value, (list, tuple)):
        return [_clean(v, depth + 1) for v in list(value)[:50]]
    if isinstance(value, str):
        text = redact(value)
        return text if len(text) <= MAX_VALUE_CHARS else text[:MAX_VALUE_CHARS] + "…"
    if value is None or isinstance(value, (bool, int, float)):
        return value
    return _clean(repr(value), depth + 1)


class AuditLog:
    def __init__(self, state_dir: Path):
        self.path = Path(state_dir) / AUDIT_FILENAME

    def record(self, tool: str, arguments: dict[str, Any], outcome: str, *, error: str | None = None,
               commit: str | None = None, run_id: str | None = None) -> None:
        entry = {
            "time": rd.utc_now(),
            "tool": tool,
            "arguments": _clean(arguments),
            "outcome": outcome,
        }
        if error is not None:
            entry["error"] = _clean(error)
        if commit:
            entry["commit"] = commit
        if run_id:
            entry["run_id"] = run_id
        line = (json.dumps(entry, separators=(",", ":"), default=str) + "\n").encode()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)

    def tail(self, n: int, block_size: int = 64 * 1024) -> list[dict[str, Any]]:
        """The last ``n`` entries, oldest first; reads from the end, so a long log costs nothing."""
        if n <= 0 or not self.path.is_file():
            return []
        lines: list[bytes] = []
        with open(self.path, "rb") as f:
            f.seek(0, os.SEEK_END)
            position, leftover = f.tell(), b""
            while position > 0 and len(lines) <= n:
                size = min(block_size, position)
                position -= size
                f.seek(position)
                parts = (f.read(size) + leftover).split(b"\n")
                leftover = parts.pop(0) if position > 0 else b""
                lines = parts + lines
            if leftover:
                lines = [leftover] + lines
        found = []
        for line in lines:
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            if isinstance(entry, dict):
                found.append(entry)
        return found[-n:]

    def entries(self) -> Iterator[dict[str, Any]]:
        if not self.path.is_file():
            return
        with open(self.path) as f:
            for line in f:
                try:
                    yield json.loads(line)
                except ValueError:
                    continue
