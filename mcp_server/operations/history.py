"""A run's history across resumes: the chain ``resumed_from`` links, as one metrics series.

A resumed run records ``resumed_from = {run_id, step, path}``: its own metrics start after that
step. Its history is the parent's records up to the resume step, then its own — and so on up
the chain. Reads stay bounded: each run's file is read from the end, only as far as needed.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine import run_dir as rd
from engine import run_metrics
from runner import server_record as sr
from workspace.workspace import NotFound, Workspace

MAX_CHAIN_RUNS = 20
MAX_RECORDS_READ = 20_000  # per run of the chain


@dataclass(frozen=True)
class Segment:
    """One run of a chain: its records with ``after_step < step <= until_step`` count."""

    run_id: str
    run_dir: Path
    after_step: int | None  # the step it resumed from (None: it started from scratch)
    until_step: int | None  # the step its successor resumed from (None: the newest run)


def resume_chain(ws: Workspace, run_id: str) -> list[Segment]:
    """The runs ``run_id`` continues, oldest first, ending with ``run_id`` itself (at most
    MAX_CHAIN_RUNS; a parent that was deleted or cannot be read ends the chain there)."""
    newest_first: list[Segment] = []
    current: Any = run_id
    until: int | None = None
    while current is not None and len(newest_first) < MAX_CHAIN_RUNS:
        try:
            run_dir = ws.run_dir(current)
            record = sr.known_run(ws.root, run_dir)  # the parent run is the server's record of it
        except (NotFound, OSError, ValueError):
            if not newest_first:
                raise
            break
        source = record.resumed_from
        after = source.step if source is not None else None
        newest_first.append(Segment(str(current), run_dir, after, until))
        current = source.run_id if source is not None else None
        until = after
        if any(s.run_id == current for s in newest_first):
            break  # a cycle (hand-edited run.json): stop
    return newest_first[::-1]


def _step(record: dict[str, Any]) -> int | None:
    step = record.get("step")
    return step if isinstance(step, int) and not isinstance(step, bool) else None


def segment_records(segment: Segment, need: int, after_step: int | None = None) -> tuple[list[dict[str, Any]], bool]:
    """The last ``need`` records of one run of the chain that belong to the history (and come
    after ``after_step``), oldest first, and whether more of them exist."""
    lower = segment.after_step
    if after_step is not None:
        lower = after_step if lower is None else max(lower, after_step)
    path = segment.run_dir / rd.METRICS_JSONL
    wanted = max(need, 1)
    while True:
        records, truncated = run_metrics.read_metrics_tail(path, wanted, lower)
        until = segment.until_step
        kept = [r for r in records if (step := _step(r)) is not None and (until is None or step <= until)]
        if len(kept) >= need or not truncated or wanted >= MAX_RECORDS_READ:
            more = len(kept) > need or (truncated and len(kept) >= need)
            return (kept[max(len(kept) - need, 0):] if need else []), more
        wanted = min(wanted * 4, MAX_RECORDS_READ)


def chain_tail(ws: Workspace, run_id: str, n: int, after_step: int | None = None
               ) -> tuple[list[dict[str, Any]], bool, list[Segment]]:
    """The last ``n`` records of the run's whole history (after ``after_step``), oldest first;
    whether more matched; and the chain."""
    chain = resume_chain(ws, run_id)
    collected: list[dict[str, Any]] = []
    truncated = False
    for index in range(len(chain) - 1, -1, -1):
        need = n - len(collected)
        records, more = segment_records(chain[index], need, after_step)
        collected = records + collected
        if len(collected) >= n:
            truncated = more or any(segment_records(s, 1, after_step)[0] for s in chain[:index])
            break
    return collected, truncated, chain


def chain_records(ws: Workspace, run_id: str) -> tuple[list[dict[str, Any]], list[Segment]]:
    """The whole history (each run's part bounded by MAX_RECORDS_READ), oldest first."""
    chain = resume_chain(ws, run_id)
    records: list[dict[str, Any]] = []
    for segment in chain:
        records += segment_records(segment, MAX_RECORDS_READ)[0]
    return records, chain
