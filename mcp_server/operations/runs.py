"""Run operations: launch, list, inspect, tail, stop, list checkpoints, resume.

Each function is one tool (and one CLI command). They read the runs on disk, so they see every
run as it is, also runs started before this process: what the server decided and saw from the
server's record of each run, what the run reported from its run directory (untrusted:
:func:`runner.server_record.view`).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from engine import run_dir as rd
from runner import server_record as sr
from engine.config import Overrides, override_args, overrides_to_dict
from engine.errors import BadInput, NotFound
from mcp_server.limits import (
    AGENT_BUDGET_CHARS,
    DEFAULT_TAIL_RECORDS,
    MAX_TAIL_RECORDS,
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
from runner import hub
from runner import lifecycle as run_lifecycle
from runner.capacity import check_capacity
from runner import scripts
from runner import slurm as slurm_jobs
from sandbox.environment import run_environment
from runner.nodes import Nodes, check_allowed, check_nodes
from workspace.paths import confine_config
from runner.provenance import (
    CodeOrigin, check_snapshot_unchanged, code_at_commit, code_description, recipe_origin, snapshot_digest,
)
from workspace.workspace import RunSource, Workspace

MAX_NPROC = max(8, os.cpu_count() or 1)
MAX_LIST_RUNS = 100
CONSOLE_TAIL_BYTES = 1500
MAX_LISTED_CHECKPOINTS = 50
MAX_UNUSABLE_SHOWN = 10  # list_checkpoints' checkpoints that are not complete, newest
MAX_DESTINATIONS = 10
MAX_RUN_INFO_CHECKPOINTS = 10
MAX_ERROR_CHARS = 1000
MAX_RECORD_CHARS = 1500
MAX_SHOWN_WARNINGS, MAX_WARNING_CHARS = 5, 300
MAX_CONFIG_CHARS = 1200
# run.json is written by the run as well as by trainwright, and data paths come from a recipe's
# config.yaml: every other text of a run, as returned, is cut to this many characters.
MAX_FIELD_CHARS = 300
MAX_DATA_PATHS_SHOWN = 5


def run_view(ws: Workspace, run_id: object) -> tuple[Path, sr.ServerRecord]:
    """The run directory and the run as the server knows it (:func:`runner.server_record.view`)."""
    run_dir = ws.run_dir(run_id)
    try:
        return run_dir, sr.view(ws.root, run_dir)
    except (OSError, ValueError) as e:  # no server record, and a run.json that is not one
        why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise BadInput(f"run {run_id} cannot be read ({why[:300]})") from None


@contextlib.contextmanager
def _config_file(record: sr.ServerRecord):
    """A file with ``record``'s config (the server's) for a launch check to start from: the
    run.json of the run it continues is the run's to rewrite."""
    folder = Path(tempfile.mkdtemp(prefix="trainwright-config-"))
    try:
        path = folder / rd.RUN_JSON
        rd.write_json_atomic(path, rd.RunRecord(id=record.id, config=record.config).model_dump(mode="json"))
        yield path
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def check_nproc(nproc: object) -> int:
    if isinstance(nproc, bool) or not isinstance(nproc, int):
        raise BadInput(f"nproc must be an integer, got {nproc!r}")
    if not 1 <= nproc <= MAX_NPROC:
        raise BadInput(f"nproc must be between 1 and {MAX_NPROC}, got {nproc}")
    return nproc


def checked_overrides(ws: Workspace, overrides: Overrides) -> dict[str, Any]:
    """Flat overrides, with every value that names a file confined to the workspace (the merged
    config the engine resolves is confined again, whatever its nesting)."""
    flat = overrides_to_dict(overrides)
    confine_config(ws.root, flat)
    return flat


TARGETS = ("local", "slurm")


def launch_run(
    ws: Workspace,
    recipe: str,
    nproc: int = 1,
    overrides: Overrides = None,
    limits: run_lifecycle.RunLimits | None = None,
    nnodes: int = 1,
    rdzv: dict[str, Any] | None = None,
    target: str = "local",
    slurm: dict[str, Any] | None = None,
    progress: hub.Progress | None = None,
    args: list[str] | None = None,
    resume_arg: str | None = None,
    commit: str | None = None,
) -> LaunchRunResult:
    """Check, then start a run of a snapshot of the recipe as it is now (uncommitted changes
    included, and said so), or as ``commit`` holds it (a commit id or revision such as
    ``<sha>^``: :func:`~runner.provenance.code_at_commit`); ``limits`` default to the
    workspace's settings. ``recipe`` may also name the user's own training script
    (:func:`launch_script`), which takes ``args`` and ``resume_arg``.

    ``nnodes`` > 1 starts this machine's node of a run over several, meeting at ``rdzv``
    (``endpoint``, ``id``, ``node_rank``; :mod:`runner.nodes`); ``target="slurm"`` makes the
    run a SLURM job over ``nnodes`` nodes instead (``slurm``: partition, time, gpus_per_node,
    rdzv_port; :mod:`runner.slurm`). A ``model.pretrained_path`` that is a Hub id is downloaded
    first (:mod:`runner.hub`), with ``progress`` called on the way."""
    if target not in TARGETS:
        raise BadInput(f"target must be one of {', '.join(TARGETS)}, got {target!r}")
    source = ws.run_source(recipe)
    if source.script is not None:
        if commit:
            raise BadInput("commit runs a recipe as a commit holds it; a script runs as it is now")
        if overrides:
            raise BadInput("overrides set a recipe's config keys; a script takes its command line as args")
        if nnodes != 1 or rdzv or target != "local" or slurm:
            raise BadInput("a script runs on this machine (nproc processes under torchrun); nnodes, rdzv and "
                           f"target slurm are for recipes ({scripts.DOCS_PAGE})")
        return launch_script(ws, source, nproc, args, resume_arg, limits)
    if args is not None or resume_arg is not None:
        raise BadInput(f"args and resume_arg are for a training script; {ws.label(source.code_dir)!r} is a recipe, "
                       "whose config is set by overrides")
    nodes, options = _checked_target(nnodes, rdzv, target, slurm)
    if commit and nodes.node_rank > 0:
        raise BadInput("a joining node runs node 0's code: leave commit out")
    recipe_dir = ws.recipe(recipe)
    nproc = check_nproc(nproc)
    flat = checked_overrides(ws, overrides)
    with contextlib.ExitStack() as code:
        if commit:
            recipe_dir, origin = code.enter_context(code_at_commit(ws.root, recipe_dir, commit))
        else:
            origin = recipe_origin(ws.root, recipe_dir)
        return _launch_recipe(ws, recipe, recipe_dir, origin, nproc, flat, limits, nodes, target,
                              options, progress)


def _launch_recipe(ws: Workspace, recipe: str, recipe_dir: Path, origin: CodeOrigin, nproc: int,
                   flat: dict[str, Any], limits: run_lifecycle.RunLimits | None, nodes: Nodes, target: str,
                   options: slurm_jobs.SlurmOptions | None, progress: hub.Progress | None) -> LaunchRunResult:
    """:func:`launch_run` of a recipe whose code is in ``recipe_dir`` (the recipe folder, or a
    commit's copy of it) and comes from ``origin``."""
    limits, warnings = ws.run_limits_and_warnings() if limits is None else (limits, [])
    joins = None
    first: sr.ServerRecord | None = None
    if target == "local":
        check_allowed(nodes, limits)
        if nodes.node_rank > 0:
            joins, recipe_dir, first = _joined_run(ws, nodes, ws.label(recipe_dir), flat)
            origin = CodeOrigin(first.git_commit, first.recipe_dirty, first.dirty_files)
        check_capacity(sr.records_root(ws.root), nproc, limits)  # before the check's cost; again at start
    checked = snapshot_digest(recipe_dir)  # the check imports the recipe: it may change itself
    models = bind_hub_models(ws, hub.recipe_config(recipe_dir, flat), hub.recipe_config(recipe_dir, flat, hub.DATASET_KEY),
                         limits, progress) if target == "local" \
        else hub.ModelBinding()
    with contextlib.ExitStack() as stack:
        config_json = stack.enter_context(_config_file(first)) if first is not None else None
        verdict = run_lifecycle.check_launch(ws.root, recipe_dir, nproc * nodes.nnodes, override_args(flat),
                                            config_json=config_json, limits=limits, models=models)
    confine_config(ws.root, verdict.config)
    if target == "local":
        hub.verify(models, ws.root, verdict.config)
    warnings = [*warnings, *_skipped_data(verdict.data)]
    label = ws.label(ws.recipe(recipe))
    plan = run_lifecycle.LaunchPlan(
        recipe_dir, label, nproc, origin, flat, verdict, limits=limits, warnings=tuple(warnings),
        expected_digest=checked, nodes=nodes, joins=joins, recorded_config=first is not None, models=models,
    )
    if options is not None:  # target slurm
        record, script = slurm_jobs.start_job(ws.root, ws.real_dir(ws.runs_dir), plan, options)
        return _launch_result(ws, record, slurm_script=script)
    return _launch_result(ws, run_lifecycle.start_run(ws.root, ws.real_dir(ws.runs_dir), plan))


def _checked_target(nnodes: int, rdzv: dict[str, Any] | None, target: str, slurm: dict[str, Any] | None,
                    ) -> tuple[Nodes, slurm_jobs.SlurmOptions | None]:
    """The nodes of a run, and its SLURM options for target slurm (None: local)."""
    if target == "slurm":
        options = slurm_jobs.check_options(slurm)
        rendezvous = dict(rdzv or {})
        if set(rendezvous) - {"id"}:
            raise BadInput("with target slurm the rendezvous is on the job's first node: leave rdzv endpoint and "
                           "node_rank out (slurm rdzv_port sets its port)")
        return check_nodes(nnodes, {"endpoint": "localhost", **rendezvous} if nnodes > 1 else rendezvous), options
    if slurm:
        raise BadInput("slurm settings are for target slurm: pass target='slurm' too, or leave them out")
    return check_nodes(nnodes, rdzv), None


def launch_script(
    ws: Workspace, source: RunSource, nproc: int, args: object, resume_arg: object,
    limits: run_lifecycle.RunLimits | None = None,
) -> LaunchRunResult:
    """Start a run of the user's own script (:mod:`runner.scripts`) from a snapshot of it as
    it is now, in the sandbox and with the limits of every run; nothing imports it first."""
    assert source.script is not None
    nproc = check_nproc(nproc)
    launch = scripts.ScriptLaunch(source.script, scripts.check_args(args), scripts.check_resume_arg(resume_arg),
                                  source.alone)
    limits, warnings = ws.run_limits_and_warnings() if limits is None else (limits, [])
    check_capacity(sr.records_root(ws.root), nproc, limits)
    code = source.code_dir / source.script if source.alone else source.code_dir
    plan = run_lifecycle.LaunchPlan(source.code_dir, ws.label(code), nproc, recipe_origin(ws.root, code),
                                   limits=limits, warnings=tuple(warnings), script=launch)
    return _launch_result(ws, run_lifecycle.start_run(ws.root, ws.real_dir(ws.runs_dir), plan))


def bind_hub_models(ws: Workspace, value: Any, dataset: Any, limits: run_lifecycle.RunLimits,
                progress: hub.Progress | None, recorded: list[rd.HubModel] | None = None) -> hub.ModelBinding:
    """The Hub model ``value`` and data set ``dataset`` name (where they name one), downloaded
    as the trusted settings allow."""
    return hub.bind(ws.root, value, dataset=dataset, recorded=recorded or [],
                    allow_pickled=limits.allow_pickled_weights,
                    remote_code=limits.trust_remote_code, progress=progress)


def _joined_run(ws: Workspace, nodes: Nodes, recipe_label: str, overrides: dict[str, Any]
                ) -> tuple[Path, Path, sr.ServerRecord]:
    """For a node with node_rank > 0: node 0's run directory, its snapshot, and the server's
    record of node 0's run (its config and code origin)."""
    run_dir, first = run_view(ws, nodes.rdzv_id)
    mismatch = [
        f"{name} {mine!r} (node 0: {theirs!r})"
        for name, mine, theirs in (("nnodes", nodes.nnodes, first.nnodes), ("rdzv endpoint", nodes.rdzv_endpoint,
                                   first.rdzv_endpoint), ("recipe", recipe_label, first.recipe))
        if mine != theirs
    ]
    if not first.started_by_server or first.node_rank != 0 or first.target != "local":
        mismatch.append(f"run {first.id} is not node 0 of a run over several nodes that this server started")
    if mismatch:
        raise BadInput(f"node {nodes.node_rank} must join node 0's run as it was launched: {'; '.join(mismatch)}")
    if overrides:
        raise BadInput(f"a joining node runs with node 0's config ({first.id}): leave overrides out")
    if first.effective_status() in rd.FINAL_STATUSES:
        raise BadInput(f"run {first.id} has ended ({first.effective_status()}); launch a new run from node 0")
    snapshot = run_dir / rd.SNAPSHOT_DIRNAME
    check_snapshot_unchanged(first, snapshot)
    return run_dir, snapshot, first


MAX_HUB_MODELS_SHOWN = 4


def _hub_shown(record: rd.RunRecord) -> list[str]:
    return [hub_model_shown(m) for m in record.hub_models[:MAX_HUB_MODELS_SHOWN]]


def _launch_result(ws: Workspace, record: rd.RunRecord, slurm_script: str | None = None) -> LaunchRunResult:
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


CODE_CHOICES = ("checkpoint", "head")


def resume_checkpoint(
    ws: Workspace,
    run_id: str,
    step: int | None = None,
    nproc: int | None = None,
    overrides: Overrides = None,
    limits: run_lifecycle.RunLimits | None = None,
    code: str = "checkpoint",
    progress: hub.Progress | None = None,
) -> LaunchRunResult:
    """A new run that continues ``run_id`` from its checkpoint at ``step`` (default: latest).

    ``code="checkpoint"`` runs the code the original run ran (its snapshot); ``code="head"``
    the recipe as it is now (e.g. after a skill was applied). With as many processes as the
    original, the new run computes with the original's thread count, so on CPU its losses
    continue the original's bit for bit. A model loaded by Hub id is loaded at the commit the
    original recorded (downloaded again if the cache lost it).
    """
    if code not in CODE_CHOICES:
        raise BadInput(f"code must be one of {', '.join(CODE_CHOICES)}, got {code!r}")
    source_dir, source = run_view(ws, run_id)
    if source.kind == rd.SCRIPT:
        return _resume_script(ws, source_dir, source, step, nproc, overrides, limits, code)
    chosen_step, checkpoint = _chosen_checkpoint(source_dir, source, step)
    if not source.config:
        raise NotFound(f"run {run_id} recorded no config, so it cannot be resumed")
    code_dir, origin = _resumed_code(ws, source_dir, source, code)
    nproc = check_nproc(source.nproc if nproc is None else nproc)
    flat = checked_overrides(ws, overrides)
    limits, warnings = ws.run_limits_and_warnings() if limits is None else (limits, [])
    check_capacity(sr.records_root(ws.root), nproc, limits)
    checked = snapshot_digest(code_dir)
    model = hub.model_value(flat) or hub.model_value(source.config)
    dataset = hub.config_value(flat, hub.DATASET_KEY) or hub.config_value(source.config, hub.DATASET_KEY)
    models = bind_hub_models(ws, model, dataset, limits, progress, recorded=source.hub_models)
    with _config_file(source) as config_json:
        verdict = run_lifecycle.check_launch(
            ws.root, code_dir, nproc, override_args(flat), config_json=config_json, limits=limits, models=models
        )
    confine_config(ws.root, verdict.config)
    hub.verify(models, ws.root, verdict.config)
    _check_steps_left(source, chosen_step, verdict.config)
    warnings = [*warnings, *_data_drift(source, verdict.data)]
    same_shape = nproc == source.nproc and not limits.threads_per_process
    plan = run_lifecycle.LaunchPlan(
        code_dir, source.recipe, nproc, origin, flat, verdict, code_from="checkpoint" if code == "checkpoint" else "head",
        resumed_from=rd.ResumedFrom(run_id=source.id, step=chosen_step, path=str(checkpoint)),
        recorded_config=True, limits=limits, warnings=tuple(warnings),
        threads=source.threads_per_process if same_shape else None, expected_digest=checked, models=models,
    )
    return _launch_result(ws, run_lifecycle.start_run(ws.root, ws.real_dir(ws.runs_dir), plan))


def _resumed_code(ws: Workspace, source_dir: Path, source: sr.ServerRecord, code: str) -> tuple[Path, CodeOrigin]:
    """The code a resume runs, and where it came from: the run's own snapshot (unchanged since
    the run, checked before the launch check imports it), or the recipe as it is now."""
    if code == "head":
        code_dir = ws.recipe(source.recipe)
        return code_dir, recipe_origin(ws.root, code_dir)
    if not source.started_by_server:
        raise BadInput(f"run {source.id} was not started by this server, so nothing says which code it ran or "
                       "that its snapshot is unchanged; resume it with code='head'")
    code_dir = source_dir / rd.SNAPSHOT_DIRNAME
    if not (code_dir / "recipe.py").is_file():
        raise BadInput(f"run {source.id} kept no snapshot of its code; resume it with code='head'")
    check_snapshot_unchanged(source, code_dir)
    return code_dir, CodeOrigin(source.git_commit, source.recipe_dirty, source.dirty_files)


def _chosen_checkpoint(run_dir: Path, source: rd.RunRecord, step: object) -> tuple[int, Path]:
    """The checkpoint of the run at ``step`` (None: the latest), as its kind defines them; an
    engine checkpoint is verified file by file, digests included, before a run is started on it."""
    return rd.choose_checkpoint(run_dir, source.kind, step, verified=True)


def _resume_script(
    ws: Workspace, source_dir: Path, source: sr.ServerRecord, step: object, nproc: int | None,
    overrides: Overrides, limits: run_lifecycle.RunLimits | None, code: str,
) -> LaunchRunResult:
    """A new run of a script run's script with the checkpoint's path after its ``resume_arg``
    (the script reads its own checkpoint; how well it continues is the script's doing)."""
    if not source.started_by_server:
        raise BadInput(f"run {source.id} was not started by this server, so nothing but its own files says how to "
                       "run its script; launch the script again (launch_run) with resume_arg")
    if overrides:
        raise BadInput("overrides set a recipe's config keys; a script run is resumed with the args it was launched with")
    scripts.check_resumable(source)  # refused, saying how, without a resume_arg
    chosen_step, checkpoint = _chosen_checkpoint(source_dir, source, step)
    args = scripts.resume_args(source, checkpoint)
    if code == "checkpoint":
        code_dir = source_dir / rd.SNAPSHOT_DIRNAME
        if not source.script or not (code_dir / source.script).is_file():
            raise BadInput(f"run {source.id} kept no snapshot of its script; resume it with code='head'")
        check_snapshot_unchanged(source, code_dir)
        launch_from = RunSource(code_dir, source.script)
        origin = CodeOrigin(source.git_commit, source.recipe_dirty, source.dirty_files)
    else:
        launch_from = ws.run_source(source.recipe)
        if launch_from.script is None:
            raise BadInput(f"{source.recipe!r} is a recipe now, not the script run {source.id} ran; launch it anew")
        origin = recipe_origin(ws.root, launch_from.code_dir / launch_from.script if launch_from.alone
                               else launch_from.code_dir)
    nproc = check_nproc(source.nproc if nproc is None else nproc)
    limits, warnings = ws.run_limits_and_warnings() if limits is None else (limits, [])
    check_capacity(sr.records_root(ws.root), nproc, limits)
    assert launch_from.script is not None
    plan = run_lifecycle.LaunchPlan(
        launch_from.code_dir, source.recipe, nproc, origin, code_from="checkpoint" if code == "checkpoint" else "head",
        resumed_from=rd.ResumedFrom(run_id=source.id, step=chosen_step, path=str(checkpoint)),
        limits=limits, warnings=tuple(warnings),
        script=scripts.ScriptLaunch(launch_from.script, args, source.resume_arg, launch_from.alone),
    )
    return _launch_result(ws, run_lifecycle.start_run(ws.root, ws.real_dir(ws.runs_dir), plan))


def _skipped_data(counted: rd.DataSummary | None) -> list[str]:
    """A warning that names the data files the run will not read, and why."""
    skipped = counted.skipped if counted is not None else []
    if not skipped:
        return []
    return [f"data: {len(skipped) if not skipped[-1].startswith('…') else 'more than 10'} file(s) of the "
            f"folders or globs given are not read: {'; '.join(skipped[:5])}"]


def _check_steps_left(source: rd.RunRecord, step: int, config: dict[str, Any]) -> None:
    """A resume with nothing left to train (the checkpoint is at or past ``train.max_steps``) is
    refused, saying how to continue, instead of starting a run that does nothing."""
    max_steps = (config.get("train") or {}).get("max_steps")
    if isinstance(max_steps, int) and not isinstance(max_steps, bool) and step >= max_steps:
        raise BadInput(
            f"run {source.id}'s checkpoint at step {step} has nothing left to train (train.max_steps is "
            f"{max_steps}): to train further, pass overrides {{\"train.max_steps\": {step + max(step, 1)}}} "
            f"(any value above {step}); to use the model as it is, export_checkpoint, sample or evaluate it"
        )


def _data_drift(source: rd.RunRecord, now: rd.DataSummary | None) -> list[str]:
    """A warning when a resume would train on other data than the run it continues."""
    if source.data is None or now is None:
        return []
    before = source.data
    if (now.fingerprint, now.documents, now.tokens) == (before.fingerprint, before.documents, before.tokens):
        return []
    return [f"the data differs from what run {source.id} trained on: it counted {before.describe()}; "
            f"the resume counts {now.describe()}"]


def _resumed_from(ws: Workspace, record: rd.RunRecord) -> rd.ResumedFrom | None:
    source = record.resumed_from
    if source is None:
        return None
    path = Path(source.path)
    label = ws.label(path) if path.is_absolute() and ws.root in path.parents else str(path)
    return source.model_copy(update={"path": label})


def get_run(ws: Workspace, run_id: str) -> RunInfo:
    run_dir = ws.run_dir(run_id)
    slurm_note = None
    if sr.has_record(ws.root, run_id):
        # A SLURM job the server submitted: ask squeue/sacct (bounded; what they cannot say is a
        # warning, not an error).
        _, slurm_note = slurm_jobs.refresh(ws.record_dir(run_id), run_environment())
    _, record = run_view(ws, run_id)
    status = record.effective_status()
    latest = rd.latest_metrics(run_dir / rd.METRICS_JSONL)
    error = record.error or record.reason
    if status == rd.FAILED and record.status != rd.FAILED:
        error = error or sr.SUPERVISOR_GONE
    if error is not None:
        error = bounded(str(error), MAX_ERROR_CHARS)[0]
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
        speed=_speed_text(rd.read_run_speed(run_dir, record)),
        checkpoints=[
            CheckpointInfo(step=s, path=ws.label(p))
            for s, p in rd.run_checkpoints(run_dir, record.kind)[-MAX_RUN_INFO_CHECKPOINTS:]
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
    shown = [bounded(w, MAX_WARNING_CHARS)[0] for w in warnings[:MAX_SHOWN_WARNINGS]]
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
    f = rd.open_run_output(path)  # not through a link the run left (it could name a host file)
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
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_LIST_RUNS:
        raise BadInput(f"limit must be an integer between 1 and {MAX_LIST_RUNS}")
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
    record = sr.view(ws.root, run_dir)
    latest = rd.latest_metrics(run_dir / rd.METRICS_JSONL)
    speed = rd.read_run_speed(run_dir, record)
    return RunSummary(
        run_id=run_id,
        status=record.effective_status(),
        recipe=record.recipe[:300],
        created_at=record.created_at,
        step=latest["step"] if latest else None,
        max_steps=record.max_steps,
        loss=_number(latest.get("loss")) if latest else None,
        mean_tokens_per_s=_rounded(speed.mean_tokens_per_s) if speed else None,
        last_window_tokens_per_s=_rounded(speed.last_window_tokens_per_s) if speed else None,
    )


def _speed_text(speed: rd.RunSpeed | None) -> str | None:
    return speed.describe() or None if speed is not None else None


def _rounded(value: float | None) -> float | None:
    return round(value, 1) if value is not None else None


def _number(value: Any) -> float | None:
    """A finite number from run output, or None (a recipe may log anything)."""
    return rd.finite_number(value)


def tail_metrics(
    ws: Workspace, run_id: str, n: int = DEFAULT_TAIL_RECORDS, after_step: int | None = None,
    follow_resumes: bool = False,
) -> MetricsTail:
    """The latest ``n`` records (after ``after_step``); with ``follow_resumes``, of the run's
    whole history: the runs it was resumed from, each up to the step the next one took over."""
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_TAIL_RECORDS:
        raise BadInput(f"n must be an integer between 1 and {MAX_TAIL_RECORDS}")
    if after_step is not None and (isinstance(after_step, bool) or not isinstance(after_step, int)):
        raise BadInput(f"after_step must be an integer or null, got {after_step!r}")
    run_dir = ws.run_dir(run_id)
    resumes: list[ResumePoint] = []
    if follow_resumes:
        records, truncated, chain = history.chain_tail(ws, run_id, n, after_step)
        resumes = [ResumePoint(run_id=s.run_id, step=s.after_step) for s in chain if s.after_step is not None]
    else:
        records, truncated = rd.read_metrics_tail(run_dir / rd.METRICS_JSONL, n, after_step)
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
        run_id=run_id, status=run_view(ws, run_id)[1].effective_status(), records=kept, truncated=truncated,
        resumes=resumes,
    )


def stop_run(ws: Workspace, run_id: str) -> StopRunResult:
    """Stop the run (a SLURM job the server submitted: scancel); the result is small (get_run
    has the rest). Only a run this server started can be stopped by it."""
    _, record = run_view(ws, run_id)
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
    run_dir, record = run_view(ws, run_id)
    checkpoints = rd.run_checkpoints(run_dir, record.kind)
    return CheckpointList(
        run_id=run_id,
        checkpoints=[CheckpointInfo(step=s, path=ws.label(p)) for s, p in checkpoints[-MAX_LISTED_CHECKPOINTS:]],
        truncated=len(checkpoints) > MAX_LISTED_CHECKPOINTS,
        unusable=[f"{rd.checkpoint_dir_name(step)}: {why}" for step, why in
                  (rd.unusable_checkpoints(run_dir) if record.kind != rd.SCRIPT else [])[-MAX_UNUSABLE_SHOWN:]],
    )
