"""The run directory: the on-disk contract between the engine and everything that watches it.

```
runs/<run_id>/
  run.json                     id, recipe, git commit, config, world size, status, pid, exit code,
                               times, resumed_from
  metrics.jsonl                one JSON object per logged step
  console.log                  everything the run printed
  checkpoints/step-<NNNNNNNN>/ complete checkpoints only; saves in progress live in
                               checkpoints/.partial-step-<NNNNNNNN>/ until they are published
```

The filesystem is the source of truth, so runs outlive the process that started them. This
module is the single definition of that format. It is deliberately torch-free (stdlib only):
the MCP server imports it to read runs without paying for a torch import.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import fcntl
import json
import os
import re
import secrets
from pathlib import Path
from typing import Any, Iterator

RUNS_DIRNAME = "runs"
RUN_JSON = "run.json"
METRICS_JSONL = "metrics.jsonl"
CONSOLE_LOG = "console.log"
CHECKPOINTS_DIRNAME = "checkpoints"

# A checkpoint directory is published under this exact name only once it is complete.
_CHECKPOINT_NAME = re.compile(r"^step-(\d{8})$")
PARTIAL_PREFIX = ".partial-"
TRASH_PREFIX = ".trash-"
# DCP writes its metadata file last, after every rank's data is on disk.
DCP_METADATA = ".metadata"

# Run statuses. "starting" and "running" are live; the others are final.
STARTING, RUNNING, COMPLETED, FAILED, STOPPED = "starting", "running", "completed", "failed", "stopped"
FINAL_STATUSES = frozenset({COMPLETED, FAILED, STOPPED})

RUN_ID_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


def utc_now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def new_run_id(recipe_name: str) -> str:
    """A sortable, readable, unique id: ``20261130-024512-causal_lm-3f9a``."""
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%d-%H%M%S")
    safe_name = re.sub(r"[^A-Za-z0-9_]+", "_", recipe_name).strip("_")[:40] or "run"
    return f"{stamp}-{safe_name}-{secrets.token_hex(2)}"


def checkpoint_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def checkpoint_step(path: Path) -> int | None:
    """The step of a published checkpoint directory, or None when the name is not one."""
    match = _CHECKPOINT_NAME.match(path.name)
    return int(match.group(1)) if match else None


def list_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints of a run, oldest first.

    A checkpoint counts only when it was published under its final name and DCP's metadata is
    in it; a save that was interrupted lives under a ``.partial-`` name and is never listed.
    """
    root = Path(run_dir) / CHECKPOINTS_DIRNAME
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        step = checkpoint_step(entry)
        if step is not None and (entry / DCP_METADATA).is_file():
            found.append((step, entry))
    return sorted(found)


def latest_checkpoint(run_dir: Path) -> tuple[int, Path] | None:
    checkpoints = list_checkpoints(run_dir)
    return checkpoints[-1] if checkpoints else None


# ---------------------------------------------------------------------------------------------
# run.json: several processes update it (the launcher, the supervisor, rank 0 of the engine), so
# every update is a locked read-modify-write that replaces the file atomically. A reader never
# sees a half-written file.
# ---------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _locked(run_dir: Path) -> Iterator[None]:
    lock_path = Path(run_dir) / ".run.json.lock"
    with open(lock_path, "a") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)


def write_json_atomic(path: Path, data: Any) -> None:
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        json.dump(data, f, indent=2, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_run(run_dir: Path) -> dict[str, Any]:
    with open(Path(run_dir) / RUN_JSON) as f:
        return json.load(f)


def create_run(run_dir: Path, record: dict[str, Any]) -> None:
    """Create the run directory and its first run.json. Fails if the run already exists."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=False)
    (run_dir / CHECKPOINTS_DIRNAME).mkdir()
    with _locked(run_dir):
        write_json_atomic(run_dir / RUN_JSON, record)


def update_run(run_dir: Path, **fields: Any) -> dict[str, Any]:
    """Merge ``fields`` into run.json and return the new record."""
    run_dir = Path(run_dir)
    with _locked(run_dir):
        record = read_run(run_dir)
        record.update(fields)
        write_json_atomic(run_dir / RUN_JSON, record)
    return record


def append_to_run_list(run_dir: Path, key: str, value: Any) -> dict[str, Any]:
    """Append ``value`` to the list ``key`` of run.json (e.g. ``warnings``), under the lock."""
    run_dir = Path(run_dir)
    with _locked(run_dir):
        record = read_run(run_dir)
        record[key] = [*(record.get(key) or []), value]
        write_json_atomic(run_dir / RUN_JSON, record)
    return record


# ---------------------------------------------------------------------------------------------
# metrics.jsonl
# ---------------------------------------------------------------------------------------------


# Run output is written by recipe code, so a reader survives any of it: a line longer than
# MAX_METRICS_LINE_BYTES, one that is not JSON (or nested beyond the parser's depth) or a record
# whose ``step`` is not an integer, or that nests deeper than MAX_METRICS_DEPTH, is skipped, and no reader looks further back than a bounded
# window from the end of the file.
MAX_METRICS_LINE_BYTES = 1 << 20
MAX_METRICS_DEPTH = 8
METRICS_WINDOW_BYTES = 16 << 20


def read_metrics_tail(
    path: Path, n: int, after_step: int | None = None, block_size: int = 64 * 1024,
    max_bytes: int = METRICS_WINDOW_BYTES,
) -> tuple[list[dict[str, Any]], bool]:
    """The last ``n`` records of a metrics file (with ``step > after_step`` when given).

    Reads backwards from the end in blocks, so the cost depends on ``n``, not on the length of
    the file (and never exceeds ``max_bytes``). Returns ``(records_oldest_first, truncated)``
    where ``truncated`` says that more matching records exist than were returned (or that the
    window ended first). A partially written last line, and any unusable line, is skipped.
    """
    path = Path(path)
    if not path.is_file() or n <= 0:
        return [], False
    records: list[dict[str, Any]] = []
    truncated = False
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        position = f.tell()
        floor = max(0, position - max_bytes)
        leftover = b""
        skipping = False  # inside a line too long to keep: drop bytes until its start
        done = False
        while position > floor and not done:
            read_size = min(block_size, position - floor)
            position -= read_size
            f.seek(position)
            block = f.read(read_size)
            if skipping:
                cut = block.rfind(b"\n")
                if cut < 0:
                    continue
                block, skipping = block[: cut + 1], False
                chunk = block
            else:
                chunk = block + leftover
            lines = chunk.split(b"\n")
            # The first piece may be the end of a line that starts in an earlier block.
            leftover = lines.pop(0) if position > floor else b""
            if len(leftover) > MAX_METRICS_LINE_BYTES:
                leftover, skipping = b"", True
            for line in reversed(lines):
                record = _parse_metrics_line(line)
                if record is None:
                    continue
                if after_step is not None and record["step"] <= after_step:
                    done = True
                    break
                if len(records) == n:
                    truncated = True
                    done = True
                    break
                records.append(record)
        if not done and position > 0:
            truncated = True  # the window ended before the file's start: older records may match
        if not done and leftover and position == 0:
            record = _parse_metrics_line(leftover)
            if record is not None and (after_step is None or record["step"] > after_step):
                if len(records) == n:
                    truncated = True
                else:
                    records.append(record)
    records.reverse()
    return records, truncated


def _parse_metrics_line(line: bytes) -> dict[str, Any] | None:
    """One metrics record, or None for a line that is not one (see MAX_METRICS_LINE_BYTES)."""
    if len(line) > MAX_METRICS_LINE_BYTES:
        return None
    line = line.strip()
    if not line:
        return None
    try:
        record = json.loads(line)
    except (ValueError, RecursionError):  # a line still being written, or not a record
        return None
    if not isinstance(record, dict) or not _shallow(record, MAX_METRICS_DEPTH):
        return None
    step = record.get("step")
    return record if isinstance(step, int) and not isinstance(step, bool) else None


def _shallow(value: Any, depth: int) -> bool:
    """Whether ``value`` nests at most ``depth`` levels of lists and objects."""
    level = [value]
    for _ in range(depth + 1):
        level = [v for item in level if isinstance(item, (dict, list))
                 for v in (item.values() if isinstance(item, dict) else item)]
        if not level:
            return True
    return False


def read_all_metrics(path: Path, max_bytes: int = METRICS_WINDOW_BYTES) -> list[dict[str, Any]]:
    """The records of a metrics file, in order, from at most its last ``max_bytes`` (for plots,
    tests and reviews)."""
    path = Path(path)
    if not path.is_file():
        return []
    with open(path, "rb") as f:
        size = f.seek(0, os.SEEK_END)
        start = max(0, size - max_bytes)
        f.seek(max(0, start - 1))
        if start > 0 and f.read(1) != b"\n":
            f.readline(MAX_METRICS_LINE_BYTES + 1)  # the rest of a line that began before the window
        records = []
        while True:
            line = f.readline(MAX_METRICS_LINE_BYTES + 1)
            if not line:
                break
            if len(line) > MAX_METRICS_LINE_BYTES:  # too long: skip to its end in bounded reads
                while line and not line.endswith(b"\n"):
                    line = f.readline(MAX_METRICS_LINE_BYTES + 1)
                continue
            record = _parse_metrics_line(line)
            if record is not None:
                records.append(record)
        return records


def pid_alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie is dead for our purposes: its exit status is only waiting to be collected.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


def effective_status(record: dict[str, Any]) -> str:
    """The run's true status: a live status whose supervising process is gone is ``failed``."""
    status = record.get("status", STARTING)
    if status in FINAL_STATUSES:
        return status
    if record.get("pid") and not pid_alive(record["pid"]):
        return FAILED
    return status
