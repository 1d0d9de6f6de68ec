"""metrics.jsonl: the one definition of a metrics line (:class:`MetricRecord`), and its readers.

A run writes its metrics file and may write anything into it, so every reader here is bounded
(line length, nesting, the bytes it reads from the end), follows no link the run left
(:func:`open_run_output`), and keeps only finite numbers it is asked for
(:func:`finite_number`). A run's speed (:class:`RunSpeed`) is computed here once for every
reader. Torch-free.
"""

from __future__ import annotations

import json
import math
import os
import stat
from pathlib import Path
from typing import Any, BinaryIO

from pydantic import BaseModel, ConfigDict, Field

from engine.run_dir import METRICS_JSONL, RunRecord
from engine.run_files import NO_FOLLOW

class MetricRecord(BaseModel):
    """One line of metrics.jsonl. Rates and ``step_time_s`` are averaged over the logging window
    (the steps since the previous record); the phase timings are those of its last step. A
    recipe may log more keys; they are kept as they are. Non-finite floats are written as the
    strings "nan", "inf", "-inf" (JSON has no NaN)."""

    model_config = ConfigDict(defer_build=True, extra="allow")

    step: int = Field(description="Optimizer steps taken when the record was logged.")
    loss: float | str | None = Field(None, description="Mean training loss per supervised token of the step.")
    eval_loss: float | str | None = Field(None, description="Mean loss on the evaluation batches.")
    lr: float | None = Field(None, description="Learning rate after the step.")
    grad_norm: float | str | None = Field(None, description="Total gradient norm before clipping.")
    tokens_per_s: float | None = Field(
        None, description="Tokens the model read per second (every position but padding; an SFT prompt counts), window average.")
    loss_tokens_per_s: float | None = Field(
        None, description="Tokens the loss is over per second (the labels: an SFT reply, not its prompt), window average.")
    step_time_s: float | None = Field(None, description="Seconds per step, window average.")
    data_s: float | None = Field(None, description="Last step: seconds to get the batch.")
    fwd_bwd_s: float | None = Field(None, description="Last step: seconds of forward and backward.")
    optim_s: float | None = Field(None, description="Last step: seconds of clipping and the optimizer.")
    peak_mem_mb: float | None = Field(
        None, description="Peak memory of the busiest process: CUDA max allocated on a GPU, RSS on a CPU (engine/memory.py)."
    )
    rss_peak_mb: list[float] | None = Field(None, description="Each process's CPU RSS high-water mark (VmHWM), rank order.")
    cuda_max_allocated_mb: list[float] | None = Field(None, description="Each process's CUDA max allocated memory.")
    cuda_max_reserved_mb: list[float] | None = Field(None, description="Each process's CUDA max reserved memory.")
    tokens_seen: int | None = Field(None, description="Tokens the model read so far (padding left out), as tokens_per_s counts them.")
    loss_tokens_seen: int | None = Field(None, description="Tokens the loss was over so far, as loss_tokens_per_s counts them.")
    padding_frac: float | None = Field(None, description="Share of the last step's positions that were padding (masked prompt tokens are not).")
    eta_s: float | None = Field(None, description="Seconds left at the window's pace.")
    mfu: float | None = Field(None, description="Model FLOPs utilisation (where the peak is known).")
    elapsed_s: float | None = Field(
        None, description="Seconds since the run's process started (a script's: since the supervisor started it).")


# Run output is written by recipe code, so a reader survives any of it: a line longer than
# MAX_METRICS_LINE_BYTES, one that is not JSON (or nested beyond the parser's depth) or a record
# whose ``step`` is not an integer, or that nests deeper than MAX_METRICS_DEPTH, is skipped, and no reader looks further back than a bounded
# window from the end of the file.
MAX_METRICS_LINE_BYTES = 1 << 20
MAX_METRICS_DEPTH = 8
METRICS_WINDOW_BYTES = 16 << 20


def finite_number(value: Any) -> float | None:
    """A metrics value as a finite float, or None: a recipe may log anything, also integers too
    large for a float (``10**400``), strings, booleans and non-finite values."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        value = float(value)
    except OverflowError:
        return None
    return value if math.isfinite(value) else None


def open_run_output(path: Path) -> BinaryIO | None:
    """A file the run writes (metrics, console) opened for reading, or None when it is missing
    or not a regular file: never through a link the run put there (it could name any host
    file), never waiting on a FIFO."""
    try:
        fd = os.open(path, os.O_RDONLY | NO_FOLLOW)
    except OSError:
        return None
    f = os.fdopen(fd, "rb")
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        f.close()
        return None
    return f


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
    f = open_run_output(path) if n > 0 else None
    if f is None:
        return [], False
    records: list[dict[str, Any]] = []
    truncated = False
    with f:
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


# Records latest_metrics() merges: a recipe's own records (rewards, an evaluation) written after
# the step's record do not hide its loss.
LATEST_METRICS_RECORDS = 16


def latest_metrics(path: Path) -> dict[str, Any] | None:
    """The latest value of each key among the last ``LATEST_METRICS_RECORDS`` records (its
    ``step`` is the newest record's), or None when there is none. The one definition of a
    run's "latest metrics": a recipe may log several records per step."""
    records, _ = read_metrics_tail(path, LATEST_METRICS_RECORDS)
    if not records:
        return None
    merged: dict[str, Any] = {}
    for record in records:
        merged.update(record)
    return merged


class RunSpeed(BaseModel):
    """A run's speed, the one definition every reader shows (note, review, get_run, list_runs):
    the mean over its training steps after the warm-up, and the last logging window's."""
    model_config = ConfigDict(defer_build=True)

    mean_tokens_per_s: float | None = Field(
        None, description="Tokens read per second (tokens_per_s: padding left out) over the training steps after the warm-up (total tokens / total time)."
    )
    last_window_tokens_per_s: float | None = Field(None, description="The last logging window's tokens/s.")
    measured_steps: int = Field(0, description="Training steps the mean is over.")
    warmup_steps: int = Field(
        0, description="Steps left out of the mean: the first logging window (compilation, first allocations)."
    )

    def describe(self) -> str:
        """One line: ``mean 1,201 tokens/s over steps 6-30 (warm-up: first 5 steps excluded); last window 1,250``."""
        parts = []
        if self.mean_tokens_per_s is not None:
            warmup = (f"first {self.warmup_steps} step(s) of warm-up excluded" if self.warmup_steps
                      else "no window after the warm-up: includes it")
            parts.append(f"mean {self.mean_tokens_per_s:,.0f} tokens/s over {self.measured_steps} step(s) ({warmup})")
        if self.last_window_tokens_per_s is not None:
            parts.append(f"last window {self.last_window_tokens_per_s:,.0f} tokens/s")
        return "; ".join(parts)


def run_speed(records: list[dict[str, Any]], start_step: int = 0) -> RunSpeed | None:
    """The speed of a run from its metrics records (oldest first), or None without a training
    record. A training record is one with ``tokens_per_s`` and ``step_time_s`` (the engine's
    window averages); other records (evaluations, a recipe's own) are ignored. The first window
    is the warm-up and is left out of the mean, unless it is the only one; the mean weighs each
    window by its time (its tokens / its seconds), so it is the run's tokens over its time.
    ``start_step``: the step a resumed run started after (the first window's start)."""
    windows: list[tuple[int, float, float]] = []  # (steps, seconds, tokens/s)
    previous = start_step
    for record in records:
        speed, step_time, step = (finite_number(record.get("tokens_per_s")), finite_number(record.get("step_time_s")),
                                  record.get("step"))
        if speed is None or step_time is None or speed < 0 or step_time < 0 or not isinstance(step, int):
            continue
        if step <= previous:  # a record out of order (or repeated): not a new window
            continue
        windows.append((step - previous, (step - previous) * step_time, speed))
        previous = step
    if not windows:
        return None
    warmup = windows[0][0] if len(windows) > 1 else 0
    measured = windows[1:] if len(windows) > 1 else windows
    seconds = sum(w[1] for w in measured)
    tokens = sum(w[1] * w[2] for w in measured)
    mean = tokens / seconds if seconds > 0 else None
    return RunSpeed(mean_tokens_per_s=mean, last_window_tokens_per_s=windows[-1][2],
                    measured_steps=sum(w[0] for w in measured), warmup_steps=warmup)


def read_run_speed(run_dir: Path, record: RunRecord | None = None) -> RunSpeed | None:
    """:func:`run_speed` of a run directory's metrics.jsonl (a resumed run's windows start
    after the step it resumed from)."""
    start = record.resumed_from.step if record is not None and record.resumed_from is not None else 0
    return run_speed(read_all_metrics(Path(run_dir) / METRICS_JSONL), start_step=start)


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
    f = open_run_output(path)
    if f is None:
        return []
    with f:
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
