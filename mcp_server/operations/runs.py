"""Reading runs: list, inspect, tail, stop, list checkpoints; and the result a launch returns.

Each function is one tool (and one CLI command), or a reader other tools use
(:func:`known_run`, :func:`tail_text`, :func:`bounded_record`). They read the runs on disk,
so they see every run as it is, also runs started before this process: what the server decided
and saw from the server's record of each run, what the run reported from its run directory
(untrusted: :func:`runner.server_record.known_run`). Starting runs is
:mod:`mcp_server.operations.launch`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from engine import run_dir as rd
from engine import run_checkpoints
from engine import run_metrics
from runner import server_record as sr
from workspace.workspace import has_record
from engine.errors import MAX_QUOTED_CHARS, BadInput
from mcp_server.limits import (
    AGENT_BUDGET_CHARS,
    DEFAULT_TAIL_RECORDS,
    MAX_RUN_ERROR_CHARS,
    bounded,
    bounded_mapping,
    cut_strings,
    json_chars,
)
from mcp_server.models import (
    CheckpointInfo,
    CheckpointList,
    LaunchRunResult,
    MetricsTail,
    ResumePoint,
    RunInfo,
    RunList,
    RunSummary,
    StopRunResult,
    hub_model_shown,
)
from mcp_server.operations import history
from runner import lifecycle as run_lifecycle
from runner import slurm as slurm_jobs
from runner.provenance import code_description
from sandbox.environment import run_environment
from workspace.workspace import Workspace

CONSOLE_TAIL_BYTES = 1500
MAX_LISTED_CHECKPOINTS = 50
MAX_UNUSABLE_SHOWN = 10  # list_checkpoints' checkpoints that are not complete, newest
MAX_DESTINATIONS = 10
MAX_RUN_INFO_CHECKPOINTS = 10
MAX_RECORD_CHARS = 1500
MAX_SHOWN_WARNINGS, MAX_SHOWN_WARNING_CHARS = 5, 300  # get_run's warnings (run.json keeps them longer)
MAX_CONFIG_CHARS = 1200
# run.json is written by the run as well as by trainwright, and data paths come from a recipe's
# config.yaml: every other text of a run, as returned, is cut to this many characters.
MAX_FIELD_CHARS = 300
MAX_DATA_PATHS_SHOWN = 5


def known_run(ws: Workspace, run_id: object) -> tuple[Path, sr.ServerRecord]:
    """The run directory and the run as the server knows it (:func:`runner.server_record.known_run`)."""
    run_dir = ws.run_dir(run_id)
    try:
        return run_dir, sr.known_run(ws.root, run_dir)
    except (OSError, ValueError) as e:  # no server record, and a run.json that is not one
        why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise BadInput(f"run {run_id} cannot be read ({why[:MAX_QUOTED_CHARS]})") from None


MAX_HUB_MODELS_SHOWN = 4


def _hub_shown(record: rd.RunRecord) -> list[str]:
    return [hub_model_shown(m) for m in record.hub_models[:MAX_HUB_MODELS_SHOWN]]


def launch_result(ws: Workspace, record: rd.RunRecord, slurm_script: str | None = None) -> LaunchRunResult:
    """What launch_run and resume_checkpoint return for the run they started."""
    return _bounded_fields(LaunchRunResult(
        run_id=record.id, status=record.status, run_dir=ws.label(ws.runs_dir / record.id),
        code=code_description(record), config_changes=bounded_mapping(record.config_changes, MAX_CONFIG_CHARS),
        data=_data(record), resumed_from=_resumed_from(ws, record),
        # A job that was not submitted says why first.
        warnings=_shown_warnings(([record.reason] if record.reason else []) + record.warnings),
        nodes=_nodes(record),
        slurm_script=bounded(slurm_script, MAX_SCRIPT_CHARS)[0] if slurm_script is not None else None,
    ))


def _nodes(record: rd.RunRecord) -> str | None:
    """One line on where a run's processes are, for a run beyond this machine alone."""
    if record.nnodes <= 1 and record.target == "local":
        return None
    where = f"{record.nnodes} node(s) x {record.nproc} process(es)"
    if record.target == "slurm":
        where += f", SLURM job {record.slurm_job_id or '(not submitted)'}"
        if record.slurm_state:
            where += f" {record.slurm_state}"
            if record.slurm_state_from:
                where += f" (from {record.slurm_state_from})"
    else:
        where += f", this is node {record.node_rank}"
        if record.joins:
            where += f" (joins run {record.joins})"
    return f"{where}; c10d rendezvous {record.rdzv_endpoint}, id {record.rdzv_id}"


_ALREADY_BOUNDED = frozenset({"error", "console_tail", "warnings", "overrides", "config_changes", "latest",
                              "slurm_script", "nodes"})
MAX_SCRIPT_CHARS = 4000


def _bounded_fields(result: Any) -> Any:
    """``result`` (a pydantic model) with every text not bounded by its producer cut to
    ``MAX_FIELD_CHARS``."""
    dumped = result.model_dump(mode="json")
    return type(result).model_validate(cut_strings(dumped, MAX_FIELD_CHARS, keep=_ALREADY_BOUNDED))


def _resumed_from(ws: Workspace, record: rd.RunRecord) -> rd.ResumedFrom | None:
    """The checkpoint the run continues, or (``started_from``) the earlier run's checkpoint its
    model started from, its path relative to the workspace."""
    source = record.resumed_from or record.started_from
    if source is None:
        return None
    path = Path(source.path)
    label = ws.label(path) if path.is_absolute() and ws.root in path.parents else str(path)
    return source.model_copy(update={"path": label})


def get_run(ws: Workspace, run_id: str) -> RunInfo:
    run_dir = ws.run_dir(run_id)
    slurm_note = None
    if has_record(ws.root, run_id):
        # A SLURM job the server submitted: ask squeue/sacct (bounded; what they cannot say is a
        # warning, not an error).
        _, slurm_note = slurm_jobs.refresh(ws.record_dir(run_id), run_environment())
    _, record = known_run(ws, run_id)
    status = record.effective_status()
    latest = run_metrics.latest_metrics(run_dir / rd.METRICS_JSONL)
    error = record.error or record.reason
    if status == rd.FAILED and record.status != rd.FAILED:
        error = error or sr.SUPERVISOR_GONE
    if error is not None:
        error = bounded(str(error), MAX_RUN_ERROR_CHARS)[0]
    console_tail = None
    if status == rd.FAILED:
        console_tail = tail_text(run_dir / rd.CONSOLE_LOG, CONSOLE_TAIL_BYTES)
    return _bounded_fields(RunInfo.of(
        record,
        # The record's facts as shown:
        status=status,
        error=error,
        resumed_from=_resumed_from(ws, record),
        overrides=bounded_mapping(record.overrides, MAX_CONFIG_CHARS),
        config_changes=bounded_mapping(record.config_changes, MAX_CONFIG_CHARS),
        warnings=_shown_warnings(record.warnings + ([slurm_note] if slurm_note else [])),
        # What get_run adds:
        hub_models=_hub_shown(record),
        run_id=record.id,
        run_dir=ws.label(run_dir),
        code=code_description(record),
        data=_data(record),
        step=latest.get("step") if latest else None,
        max_steps=record.max_steps,
        eta_s=_number(latest.get("eta_s")) if latest and status == rd.RUNNING else None,
        latest=bounded_record(latest) if latest else None,
        speed=_speed_text(run_metrics.read_run_speed(run_dir, record)),
        checkpoints=[
            CheckpointInfo(step=s, path=ws.label(p))
            for s, p in run_checkpoints.run_checkpoints(run_dir, record.kind)[-MAX_RUN_INFO_CHECKPOINTS:]
        ],
        metrics_destinations=[_destination(ws, d) for d in record.metrics_destinations[:MAX_DESTINATIONS]],
        console_tail=console_tail,
        nodes=_nodes(record),
    ))


def _destination(ws: Workspace, destination: rd.MetricsDestination) -> str:
    """One line: ``kind: location (run there); how to view it``, with paths in the workspace
    relative to it (run code wrote the record: its text is only shown, never followed)."""
    root = f"{ws.root}{os.sep}"
    location = destination.location
    path = Path(os.path.normpath(location))
    if path.is_absolute() and ws.root in path.parents:
        location = path.relative_to(ws.root).as_posix()
    line = f"{destination.kind}: {location}"
    if destination.run:
        line += f" ({destination.run})"
    if destination.view:
        line += f"; {destination.view.replace(root, '')}"
    return line


def _data(record: rd.RunRecord) -> dict[str, Any] | None:
    """The data summary as returned: the first paths (run.json keeps all of them)."""
    if record.data is None:
        return None
    data = record.data.model_dump(mode="json")
    paths = data.get("paths") or []
    if len(paths) > MAX_DATA_PATHS_SHOWN:
        data["paths"] = paths[:MAX_DATA_PATHS_SHOWN] + [f"… {len(paths) - MAX_DATA_PATHS_SHOWN} more (run.json)"]
    return data


def _shown_warnings(warnings: list[str]) -> list[str]:
    shown = [bounded(w, MAX_SHOWN_WARNING_CHARS)[0] for w in warnings[:MAX_SHOWN_WARNINGS]]
    if len(warnings) > MAX_SHOWN_WARNINGS:
        shown.append(f"… and {len(warnings) - MAX_SHOWN_WARNINGS} more warnings (runs/<id>/run.json)")
    return shown


def bounded_record(record: dict[str, Any]) -> dict[str, Any]:
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


def tail_text(path: Path, max_bytes: int) -> str | None:
    f = run_metrics.open_run_output(path)  # not through a link the run left (it could name a host file)
    if f is None:
        return None
    with f:
        f.seek(0, os.SEEK_END)
        size = f.tell()
        f.seek(max(0, size - max_bytes))
        data = f.read(max_bytes)  # the run may grow the file meanwhile: never more than asked
    text = data.decode("utf-8", errors="replace")
    if size > max_bytes:
        text = "…" + text.split("\n", 1)[-1]
    return text


def list_runs(ws: Workspace, limit: int = 20) -> RunList:
    run_ids = ws.run_ids()
    summaries = []
    for run_id in run_ids[:limit]:
        try:
            summaries.append(_summary(ws, run_id))
        except (OSError, ValueError):
            continue  # a run.json being replaced, or not a run
        except Exception:  # noqa: BLE001 — one run's bad files never hide the workspace's runs
            summaries.append(RunSummary(run_id=run_id, status="unreadable", recipe=""))
    return RunList(runs=summaries, truncated=len(run_ids) > limit)


def _summary(ws: Workspace, run_id: str) -> RunSummary:
    run_dir = ws.runs_dir / run_id
    record = sr.known_run(ws.root, run_dir)
    latest = run_metrics.latest_metrics(run_dir / rd.METRICS_JSONL)
    speed = run_metrics.read_run_speed(run_dir, record)
    return RunSummary(
        run_id=run_id,
        status=record.effective_status(),
        recipe=record.recipe[:MAX_FIELD_CHARS],
        created_at=record.created_at,
        step=latest["step"] if latest else None,
        max_steps=record.max_steps,
        loss=_number(latest.get("loss")) if latest else None,
        mean_tokens_per_s=_rounded(speed.mean_tokens_per_s) if speed else None,
        last_window_tokens_per_s=_rounded(speed.last_window_tokens_per_s) if speed else None,
    )


def _speed_text(speed: run_metrics.RunSpeed | None) -> str | None:
    return speed.describe() or None if speed is not None else None


def _rounded(value: float | None) -> float | None:
    return round(value, 1) if value is not None else None


def _number(value: Any) -> float | None:
    """A finite number from run output, or None (a recipe may log anything)."""
    return run_metrics.finite_number(value)


def tail_metrics(
    ws: Workspace, run_id: str, n: int = DEFAULT_TAIL_RECORDS, after_step: int | None = None,
    follow_resumes: bool = False,
) -> MetricsTail:
    """The latest ``n`` records (after ``after_step``); with ``follow_resumes``, of the run's
    whole history: the runs it was resumed from, each up to the step the next one took over."""
    run_dir = ws.run_dir(run_id)
    resumes: list[ResumePoint] = []
    if follow_resumes:
        records, truncated, chain = history.chain_tail(ws, run_id, n, after_step)
        resumes = [ResumePoint(run_id=s.run_id, step=s.after_step) for s in chain if s.after_step is not None]
    else:
        records, truncated = run_metrics.read_metrics_tail(run_dir / rd.METRICS_JSONL, n, after_step)
    # Keep the newest records that fit the result budget (an agent's client rejects more).
    kept: list[dict[str, Any]] = []
    budget = AGENT_BUDGET_CHARS - 1000
    for record in reversed(records):
        record = bounded_record(record)
        budget -= json_chars(record) + 2
        if budget < 0:
            truncated = True
            break
        kept.append(record)
    kept.reverse()
    return MetricsTail(
        run_id=run_id, status=known_run(ws, run_id)[1].effective_status(), records=kept, truncated=truncated,
        resumes=resumes,
    )


def stop_run(ws: Workspace, run_id: str) -> StopRunResult:
    """Stop the run (a SLURM job the server submitted: scancel); the result is small (get_run
    has the rest). Only a run this server started can be stopped by it."""
    _, record = known_run(ws, run_id)
    if not record.started_by_server:
        raise BadInput(f"run {run_id} was not started by this server, which knows none of its processes; "
                       "stop it where it was started")
    if record.target == "slurm":
        slurm_jobs.cancel(ws.record_dir(run_id), run_environment())
    else:
        run_lifecycle.stop_run(ws.record_dir(run_id))
    info = get_run(ws, run_id)
    return StopRunResult(
        run_id=info.run_id, status=info.status, step=info.step, error=info.error,
        checkpoints=[c.step for c in info.checkpoints],
    )


def list_checkpoints(ws: Workspace, run_id: str) -> CheckpointList:
    run_dir, record = known_run(ws, run_id)
    checkpoints = run_checkpoints.run_checkpoints(run_dir, record.kind)
    return CheckpointList(
        run_id=run_id,
        checkpoints=[CheckpointInfo(step=s, path=ws.label(p)) for s, p in checkpoints[-MAX_LISTED_CHECKPOINTS:]],
        truncated=len(checkpoints) > MAX_LISTED_CHECKPOINTS,
        unusable=[f"{run_checkpoints.checkpoint_dir_name(step)}: {why}" for step, why in
                  (run_checkpoints.unusable_checkpoints(run_dir) if record.kind != rd.SCRIPT else [])[-MAX_UNUSABLE_SHOWN:]],
    )
