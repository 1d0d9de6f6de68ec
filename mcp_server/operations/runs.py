"""Run operations: launch, list, inspect, tail, stop, list checkpoints, resume.

Each function is one tool (and one CLI command). They read the run directories on disk, so
they see every run as it is, also runs started before this process.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import yaml

from engine import run_dir as rd
from mcp_server.limits import MAX_RESULT_CHARS, bounded, json_chars
from mcp_server.models import (
    CheckpointInfo,
    CheckpointList,
    LaunchRunResult,
    MetricsTail,
    ResumedFrom,
    RunInfo,
    RunList,
    RunSummary,
)
from sandbox import runs as sandbox_runs
from sandbox.git import head_commit
from sandbox.paths import confine_config_paths
from sandbox.workspace import NotFound, Workspace

MAX_NPROC = max(8, os.cpu_count() or 1)
MAX_TAIL_RECORDS = 200
MAX_LIST_RUNS = 100
CONSOLE_TAIL_BYTES = 4000
MAX_OVERRIDES = 64
MAX_OVERRIDE_CHARS = 512
MAX_LISTED_CHECKPOINTS = 100
MAX_RUN_INFO_CHECKPOINTS = 20
MAX_ERROR_CHARS = 2000
MAX_RECORD_CHARS = 4000


def _check_nproc(nproc: object) -> int:
    if isinstance(nproc, bool) or not isinstance(nproc, int):
        raise ValueError(f"nproc must be an integer, got {nproc!r}")
    if not 1 <= nproc <= MAX_NPROC:
        raise ValueError(f"nproc must be between 1 and {MAX_NPROC}, got {nproc}")
    return nproc


def override_strings(overrides: dict[str, Any] | list[str] | None) -> list[str]:
    """``{"train.max_steps": 50}`` or ``["train.max_steps=50"]`` → ``["train.max_steps=50"]``."""
    if overrides is None:
        return []
    if isinstance(overrides, dict):
        items = []
        for key, value in overrides.items():
            if not isinstance(key, str) or not key or "=" in key or "\x00" in key:
                raise ValueError(f"override key {key!r} must be a dotted config key like 'train.max_steps'")
            items.append(f"{key}={json.dumps(value)}")
    elif isinstance(overrides, list) and all(isinstance(x, str) for x in overrides):
        items = list(overrides)
    else:
        raise ValueError("overrides must be a mapping of dotted config keys to values")
    if len(items) > MAX_OVERRIDES:
        raise ValueError(f"at most {MAX_OVERRIDES} overrides")
    for item in items:
        if "\x00" in item or len(item) > MAX_OVERRIDE_CHARS:
            raise ValueError(f"override {item[:60]!r}... is too long or contains a NUL byte")
        if "=" not in item:
            raise ValueError(f"override {item!r} must be key=value")
    return items


def override_values(items: list[str]) -> dict[str, Any]:
    """``["data.paths=[a, b]"]`` → ``{"data.paths": ["a", "b"]}`` (values read as YAML, as the engine does)."""
    values: dict[str, Any] = {}
    for item in items:
        key, _, raw = item.partition("=")
        try:
            values[key.strip()] = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError:
            values[key.strip()] = raw
    return values


def _checked_overrides(ws: Workspace, overrides: dict[str, Any] | list[str] | None) -> list[str]:
    """Override strings, with every value that names a file confined to the workspace."""
    items = override_strings(overrides)
    confine_config_paths(ws.root, override_values(items))
    return items


def launch_run(
    ws: Workspace,
    recipe: str,
    nproc: int = 1,
    overrides: dict[str, Any] | list[str] | None = None,
    limits: sandbox_runs.RunLimits | None = None,
) -> LaunchRunResult:
    """Check, then start a run; ``limits`` default to the workspace's ``.trainwright/config.yaml``."""
    recipe_dir = ws.recipe(recipe)
    nproc = _check_nproc(nproc)
    items = _checked_overrides(ws, overrides)
    limits = ws.run_limits() if limits is None else limits
    sandbox_runs.check_capacity(ws.runs_dir, nproc, limits)  # before the check's cost; again at start
    sandbox_runs.check_launch(ws.root, recipe_dir, nproc, items, limits=limits)
    record = sandbox_runs.start_run(
        ws.root, ws.runs_dir, recipe_dir, ws.label(recipe_dir), nproc, items,
        git_commit=head_commit(ws.root), limits=limits,
    )
    return LaunchRunResult(
        run_id=record["id"], status=record["status"], run_dir=ws.label(ws.runs_dir / record["id"])
    )


def resume_checkpoint(
    ws: Workspace,
    run_id: str,
    step: int | None = None,
    nproc: int | None = None,
    overrides: dict[str, Any] | list[str] | None = None,
    limits: sandbox_runs.RunLimits | None = None,
) -> LaunchRunResult:
    """A new run that continues ``run_id`` from its checkpoint at ``step`` (default: latest).

    With as many processes as the original, the new run computes with the original's thread
    count, so on CPU its losses continue the original's bit for bit.
    """
    source_dir = ws.run_dir(run_id)
    source = rd.read_run(source_dir)
    checkpoints = rd.list_checkpoints(source_dir)
    if not checkpoints:
        raise NotFound(f"run {run_id} has no complete checkpoint to resume from")
    if step is None:
        chosen_step, checkpoint = checkpoints[-1]
    else:
        if isinstance(step, bool) or not isinstance(step, int):
            raise ValueError(f"step must be an integer, got {step!r}")
        by_step = dict(checkpoints)
        if step not in by_step:
            raise NotFound(
                f"run {run_id} has no complete checkpoint at step {step}; "
                f"available steps: {', '.join(str(s) for s, _ in checkpoints)}"
            )
        chosen_step, checkpoint = step, by_step[step]
    if not source.get("config"):
        raise NotFound(f"run {run_id} recorded no config, so it cannot be resumed")
    recipe_dir = ws.recipe(source["recipe"])
    nproc = _check_nproc(source.get("nproc", 1) if nproc is None else nproc)
    items = _checked_overrides(ws, overrides)
    limits = ws.run_limits() if limits is None else limits
    config_json = source_dir / rd.RUN_JSON
    sandbox_runs.check_capacity(ws.runs_dir, nproc, limits)
    sandbox_runs.check_launch(ws.root, recipe_dir, nproc, items, config_json=config_json, limits=limits)
    same_shape = nproc == source.get("nproc") and not limits.threads_per_process
    resumed_from = ResumedFrom(run_id=source["id"], step=chosen_step, path=ws.label(checkpoint))
    record = sandbox_runs.start_run(
        ws.root, ws.runs_dir, recipe_dir, ws.label(recipe_dir), nproc, items,
        git_commit=head_commit(ws.root),
        resumed_from={**resumed_from.model_dump(), "path": str(checkpoint)},
        config_json=config_json,
        limits=limits,
        threads=source.get("threads_per_process") if same_shape else None,
    )
    return LaunchRunResult(
        run_id=record["id"], status=record["status"],
        run_dir=ws.label(ws.runs_dir / record["id"]), resumed_from=resumed_from,
    )


def _resumed_from(ws: Workspace, record: dict[str, Any]) -> ResumedFrom | None:
    source = record.get("resumed_from")
    if not source:
        return None
    path = Path(source["path"])
    label = ws.label(path) if path.is_absolute() and ws.root in path.parents else str(path)
    return ResumedFrom(run_id=source["run_id"], step=source["step"], path=label)


def _max_steps(record: dict[str, Any]) -> int | None:
    return ((record.get("config") or {}).get("train") or {}).get("max_steps")


def get_run(ws: Workspace, run_id: str) -> RunInfo:
    run_dir = ws.run_dir(run_id)
    record = rd.read_run(run_dir)
    status = rd.effective_status(record)
    latest_records, _ = rd.read_metrics_tail(run_dir / rd.METRICS_JSONL, 1)
    latest = latest_records[-1] if latest_records else None
    error = record.get("error") or record.get("reason")
    if status == rd.FAILED and record.get("status") != rd.FAILED:
        error = error or "the run's supervisor is gone without recording an outcome (killed?)"
    if error is not None:
        error = bounded(str(error), MAX_ERROR_CHARS)[0]
    console_tail = None
    if status == rd.FAILED:
        console_tail = _tail_text(run_dir / rd.CONSOLE_LOG, CONSOLE_TAIL_BYTES)
    return RunInfo(
        run_id=record["id"],
        status=status,
        recipe=record.get("recipe", ""),
        run_dir=ws.label(run_dir),
        git_commit=record.get("git_commit"),
        nproc=record.get("nproc"),
        world_size=record.get("world_size"),
        created_at=record.get("created_at"),
        started_at=record.get("started_at"),
        ended_at=record.get("ended_at"),
        exit_code=record.get("exit_code"),
        error=error,
        resumed_from=_resumed_from(ws, record),
        step=latest.get("step") if latest else None,
        max_steps=_max_steps(record),
        eta_s=latest.get("eta_s") if latest and status == rd.RUNNING else None,
        latest=_bounded_record(latest) if latest else None,
        checkpoints=[
            CheckpointInfo(step=s, path=ws.label(p))
            for s, p in rd.list_checkpoints(run_dir)[-MAX_RUN_INFO_CHECKPOINTS:]
        ],
        console_tail=console_tail,
        warnings=[bounded(str(w), 500)[0] for w in list(record.get("warnings") or [])[:20]],
        network_isolated=record.get("network_isolated"),
        network_note=record.get("network_note"),
        isolation=record.get("isolation"),
        isolation_note=record.get("isolation_note"),
        limits=record.get("limits"),
    )


def _bounded_record(record: dict[str, Any]) -> dict[str, Any]:
    """A metrics record as returned to an agent: a recipe may log large values; those are cut."""
    if json_chars(record) <= MAX_RECORD_CHARS:
        return record
    kept: dict[str, Any] = {}
    for key, value in record.items():
        if isinstance(value, (int, float, bool)) or value is None:
            kept[str(key)[:100]] = value
        else:
            kept[str(key)[:100]] = bounded(json.dumps(value, default=str), 200)[0]
        if json_chars(kept) > MAX_RECORD_CHARS:
            kept.pop(str(key)[:100])
            kept["truncated"] = True
            break
    return kept


def _tail_text(path: Path, max_bytes: int) -> str | None:
    if not path.is_file():
        return None
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        size = f.tell()
        f.seek(max(0, size - max_bytes))
        data = f.read()
    text = data.decode("utf-8", errors="replace")
    if size > max_bytes:
        text = "…" + text.split("\n", 1)[-1]
    return text


def list_runs(ws: Workspace, limit: int = 50) -> RunList:
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_LIST_RUNS:
        raise ValueError(f"limit must be an integer between 1 and {MAX_LIST_RUNS}")
    run_ids = ws.run_ids()
    summaries = []
    for run_id in run_ids[:limit]:
        run_dir = ws.runs_dir / run_id
        try:
            record = rd.read_run(run_dir)
        except (OSError, ValueError):
            continue
        latest, _ = rd.read_metrics_tail(run_dir / rd.METRICS_JSONL, 1)
        summaries.append(
            RunSummary(
                run_id=run_id,
                status=rd.effective_status(record),
                recipe=str(record.get("recipe", ""))[:300],
                created_at=record.get("created_at"),
                step=latest[-1].get("step") if latest else None,
                max_steps=_max_steps(record),
                loss=latest[-1].get("loss") if latest else None,
            )
        )
    return RunList(runs=summaries, truncated=len(run_ids) > limit)


def tail_metrics(ws: Workspace, run_id: str, n: int = 20, after_step: int | None = None) -> MetricsTail:
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_TAIL_RECORDS:
        raise ValueError(f"n must be an integer between 1 and {MAX_TAIL_RECORDS}")
    if after_step is not None and (isinstance(after_step, bool) or not isinstance(after_step, int)):
        raise ValueError(f"after_step must be an integer or null, got {after_step!r}")
    run_dir = ws.run_dir(run_id)
    records, truncated = rd.read_metrics_tail(run_dir / rd.METRICS_JSONL, n, after_step)
    # Keep the newest records that fit the result budget (an agent's client rejects more).
    kept: list[dict[str, Any]] = []
    budget = MAX_RESULT_CHARS // 2
    for record in reversed(records):
        record = _bounded_record(record)
        budget -= json_chars(record) + 2
        if budget < 0:
            truncated = True
            break
        kept.append(record)
    kept.reverse()
    return MetricsTail(
        run_id=run_id, status=rd.effective_status(rd.read_run(run_dir)), records=kept, truncated=truncated
    )


def stop_run(ws: Workspace, run_id: str) -> RunInfo:
    sandbox_runs.stop_run(ws.run_dir(run_id))
    return get_run(ws, run_id)


def list_checkpoints(ws: Workspace, run_id: str) -> CheckpointList:
    run_dir = ws.run_dir(run_id)
    checkpoints = rd.list_checkpoints(run_dir)
    return CheckpointList(
        run_id=run_id,
        checkpoints=[CheckpointInfo(step=s, path=ws.label(p)) for s, p in checkpoints[-MAX_LISTED_CHECKPOINTS:]],
        truncated=len(checkpoints) > MAX_LISTED_CHECKPOINTS,
    )
