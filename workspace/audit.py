"""The audit log: every tool call, appended to ``.trainwright/audit.jsonl`` in the workspace.

One JSON object per call: time, tool, arguments (secrets redacted, long values cut), outcome
(``ok`` or ``error``), the error message, and the commit or run id the call produced. Lines are
written with a single ``O_APPEND`` write, so concurrent calls never interleave within a line.
"""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path
from typing import Any, Iterator

from engine import run_dir as rd
from sandbox.environment import looks_secret
from sandbox.redact import redact
from workspace.paths import PathRefused
from workspace.workspace import open_real_dir, open_state_file

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
    """The audit log of a workspace. A writer (``hold=True``, the server) opens ``.trainwright/``
    once (at start, or at its first entry when the folder does not exist yet), refusing a link
    there, and writes through that descriptor from then on, so swapping the folder (or the file)
    for a link never redirects a write."""

    def __init__(self, state_dir: Path, hold: bool = False):
        self.path = Path(state_dir) / AUDIT_FILENAME
        self._dir_fd: int | None = None
        if hold and os.path.lexists(self.path.parent):
            self._dir_fd = open_real_dir(self.path.parent)

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
        if self._dir_fd is None:
            self._dir_fd = open_real_dir(self.path.parent, create=True)
        fd = open_state_file(self._dir_fd, AUDIT_FILENAME, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)

    def tail(self, n: int, block_size: int = 64 * 1024) -> list[dict[str, Any]]:
        """The last ``n`` entries, oldest first; reads from the end, so a long log costs nothing."""
        if n <= 0 or not self.path.is_file():
            return []
        lines: list[bytes] = []
        with self._read() as f:
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

    def _read(self):
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise PathRefused(f"{self.path} is a symbolic link, not the workspace's audit log") from None
            raise
        return os.fdopen(fd, "rb")

    def entries(self) -> Iterator[dict[str, Any]]:
        if not self.path.is_file():
            return
        with self._read() as f:
            for line in f:
                try:
                    yield json.loads(line)
                except ValueError:
                    continue
