"""Launching runs: one pipeline for every way a run starts.

A caller says what it wants started as a :class:`Launch`: a recipe (as it is now, or as a commit
holds it), the user's own script, a resume of a run, this machine's node of a run over several,
a SLURM job. ``launch_run`` and ``resume_checkpoint`` only build one (the A/B's arms are
``launch_run``\\ s of two commits). Then every launch takes the same two steps:

1. :func:`plan` checks it into a :class:`~runner.lifecycle.LaunchPlan`: the node rules and the
   capacity of the trusted limits, the Hub models it names (downloaded as the settings allow),
   the sandboxed launch check (:func:`runner.lifecycle.check_launch`, skipped for a script,
   which nothing imports first), and the caller's own look at the checked config (``review``);
2. :func:`start` starts the plan (:func:`runner.lifecycle.start_run`, or
   :func:`runner.slurm.start_job` for a SLURM job) and returns the tool's result
   (:func:`~mcp_server.operations.runs.launch_result`).

Reading runs is :mod:`mcp_server.operations.runs`.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Literal

from engine import run_dir as rd
from engine import run_checkpoints
from engine import run_files
from runner import server_record as sr
from workspace.workspace import records_root
from engine.config import Overrides, override_args, overrides_to_dict
from engine.errors import BadInput, NotFound
from engine.seams import LaunchVerdict
from mcp_server.models import LaunchRunResult
from mcp_server.operations.runs import launch_result, known_run
from mcp_server.operations.starting_model import starting_model
from runner import hub
from runner import lifecycle as run_lifecycle
from runner import scripts
from runner import slurm as slurm_jobs
from runner.capacity import check_capacity
from runner.nodes import Nodes, check_allowed, check_nodes
from runner.provenance import CodeOrigin, check_snapshot_unchanged, code_at_commit, recipe_origin, snapshot_digest
from workspace.paths import confine_config
from workspace.settings import RunLimits
from workspace.workspace import RunSource, Workspace

Review = Callable[[LaunchVerdict], list[str]]


def no_review(verdict: LaunchVerdict) -> list[str]:
    return []


@dataclass(frozen=True)
class Launch:
    """What a caller asks to start, before any check.

    ``code_dir``: the code the run executes a snapshot of (a recipe folder, a commit's copy of
    it, a run's snapshot, the folder of a script); ``label``: the recipe as recorded;
    ``overrides``: flat and confined (:func:`checked_overrides`). ``continues``: the run whose
    recorded config the launch check starts from (a resume, a joining node), instead of the
    recipe's ``config.yaml``. ``started_from``: the earlier run's checkpoint the model starts from
    (:mod:`~mcp_server.operations.starting_model`), its exported folder shown read-only to the
    launch check and the run. ``hub_values``: the model and data set values the run names, bound on this
    machine (None: a SLURM job's nodes or a script load their own). ``review``: the caller's own
    look at the checked config: the warnings to add, or a :class:`BadInput` refusal.
    """

    code_dir: Path
    label: str
    origin: CodeOrigin
    nproc: int
    overrides: dict[str, Any] = field(default_factory=dict)
    script: scripts.ScriptLaunch | None = None
    code_from: rd.CodeFrom = "recipe"
    resumed_from: rd.ResumedFrom | None = None
    started_from: rd.ResumedFrom | None = None
    continues: sr.ServerRecord | None = None
    nodes: Nodes = Nodes()
    joins: Path | None = None
    slurm: slurm_jobs.SlurmOptions | None = None
    hub_values: tuple[Any, Any] | None = None
    recorded_models: tuple[rd.HubModel, ...] = ()
    threads: int | None = None
    review: Review = no_review


# ---------------------------------------------------------------------------------------------
# The pipeline
# ---------------------------------------------------------------------------------------------


def plan(ws: Workspace, launch: Launch, limits: RunLimits, warnings: list[str],
         progress: hub.Progress | None = None) -> run_lifecycle.LaunchPlan:
    """``launch`` checked, as :func:`start` starts it; ``limits`` the trusted ones for this run
    (:func:`run_limits`), ``warnings`` what choosing them said."""
    local = launch.slurm is None
    if local:  # a SLURM job runs on the cluster's nodes, under its own limits
        check_capacity(records_root(ws.root), launch.nproc, limits)  # again at start
    if launch.script is not None:
        return run_lifecycle.LaunchPlan(launch.code_dir, launch.label, launch.nproc, launch.origin,
                                        code_from=launch.code_from, resumed_from=launch.resumed_from, limits=limits,
                                        warnings=tuple(warnings), script=launch.script)
    checked = snapshot_digest(launch.code_dir)  # the check imports the recipe: it may change itself
    models = bind_hub_models(ws, *launch.hub_values, limits, progress, recorded=list(launch.recorded_models)) \
        if local and launch.hub_values is not None else hub.ModelBinding()
    starts = [Path(launch.started_from.path)] if launch.started_from is not None else []
    with _config_file(launch.continues) as config_json:
        verdict = run_lifecycle.check_launch(ws.root, launch.code_dir, launch.nproc * launch.nodes.nnodes,
                                             override_args(launch.overrides), config_json=config_json,
                                             limits=limits, read_only=[ws.root, *starts], models=models)
    confine_config(ws.root, verdict.config)
    if local:
        hub.verify(models, ws.root, verdict.config)
    return run_lifecycle.LaunchPlan(
        launch.code_dir, launch.label, launch.nproc, launch.origin, launch.overrides, verdict,
        code_from=launch.code_from, resumed_from=launch.resumed_from, started_from=launch.started_from,
        recorded_config=launch.continues is not None, limits=limits, threads=launch.threads,
        warnings=tuple([*warnings, *launch.review(verdict)]), expected_digest=checked, nodes=launch.nodes, joins=launch.joins, models=models,
    )


def start(ws: Workspace, plan: run_lifecycle.LaunchPlan, slurm: slurm_jobs.SlurmOptions | None = None,
          ) -> LaunchRunResult:
    """Start ``plan`` (a SLURM job with ``slurm``) and return what the tool returns."""
    runs_root = ws.real_dir(ws.runs_dir)
    if slurm is not None:
        record, script = slurm_jobs.start_job(ws.root, runs_root, plan, slurm)
        return launch_result(ws, record, slurm_script=script)
    return launch_result(ws, run_lifecycle.start_run(ws.root, runs_root, plan))


def launch(ws: Workspace, request: Launch, limits: RunLimits | None = None,
           progress: hub.Progress | None = None) -> LaunchRunResult:
    """:func:`plan`, then :func:`start`: what every tool that starts a run calls."""
    limits, warnings = run_limits(ws, limits)
    if request.slurm is None:
        check_allowed(request.nodes, limits)
    return start(ws, plan(ws, request, limits, warnings, progress), request.slurm)


def run_limits(ws: Workspace, limits: RunLimits | None) -> tuple[RunLimits, list[str]]:
    """The limits of the next run: ``limits`` when a caller chose them, else the workspace's."""
    return ws.run_limits_and_warnings() if limits is None else (limits, [])


# ---------------------------------------------------------------------------------------------
# The tools: each builds a Launch
# ---------------------------------------------------------------------------------------------


def launch_run(
    ws: Workspace,
    recipe: str,
    nproc: int = 1,
    overrides: Overrides = None,
    limits: RunLimits | None = None,
    nnodes: int = 1,
    rdzv: dict[str, Any] | None = None,
    target: rd.RunTarget = "local",
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
    (:func:`script_launch`), which takes ``args`` and ``resume_arg`` (and ``commit`` too).

    ``nnodes`` > 1 starts this machine's node of a run over several, meeting at ``rdzv``
    (``endpoint``, ``id``, ``node_rank``; :mod:`runner.nodes`); ``target="slurm"`` makes the
    run a SLURM job over ``nnodes`` nodes instead (``slurm``: partition, time, gpus_per_node,
    rdzv_port; :mod:`runner.slurm`). A ``model.pretrained_path`` that is a Hub id is downloaded
    first (:mod:`runner.hub`), with ``progress`` called on the way; one that names an earlier
    run's checkpoint (``run:RUN_ID[@STEP]``) is that checkpoint exported
    (:mod:`~mcp_server.operations.starting_model`)."""
    source = ws.run_source(recipe)
    if source.script is not None:
        _check_script_arguments(overrides, nnodes != 1 or rdzv or target != "local" or slurm)
        with contextlib.ExitStack() as code:
            at_commit = code.enter_context(code_at_commit(ws.root, source.code_dir, commit, source.script,
                                                          source.alone)) if commit else None
            return launch(ws, script_launch(ws, source, nproc, args, resume_arg, at_commit), limits)
    if args is not None or resume_arg is not None:
        raise BadInput(f"args and resume_arg are for a training script; {ws.label(source.code_dir)!r} is a recipe, "
                       "whose config is set by overrides")
    nodes, options = _checked_target(nnodes, rdzv, target, slurm)
    if commit and nodes.node_rank > 0:
        raise BadInput("a joining node runs node 0's code: leave commit out")
    recipe_dir = ws.recipe(recipe)
    flat = checked_overrides(ws, overrides)
    with contextlib.ExitStack() as code:
        if commit:
            code_dir, origin = code.enter_context(code_at_commit(ws.root, recipe_dir, commit))
        else:
            code_dir, origin = recipe_dir, recipe_origin(ws.root, recipe_dir)
        flat, started_from = starting_model(ws, code_dir, flat, progress, local=options is None) \
            if nodes.node_rank == 0 else (flat, None)
        binds_here = options is None and nodes.node_rank == 0  # a joining node binds node 0's; a job's nodes their own
        hub_values = (hub.recipe_config(code_dir, flat), hub.recipe_config(code_dir, flat, hub.DATASET_KEY)) \
            if binds_here else None
        request = Launch(code_dir, ws.label(recipe_dir), origin, nproc, flat, nodes=nodes, slurm=options,
                         started_from=started_from, hub_values=hub_values, review=skipped_data)
        if nodes.node_rank > 0:
            limits, warnings = run_limits(ws, limits)
            check_allowed(nodes, limits)  # before node 0's run is read
            return start(ws, plan(ws, joining_node(ws, request), limits, warnings, progress))
        return launch(ws, request, limits, progress)


def _check_script_arguments(overrides: Overrides, elsewhere: object) -> None:
    """A script runs on this machine, with its own command line."""
    if overrides:
        raise BadInput("overrides set a recipe's config keys; a script takes its command line as args")
    if elsewhere:
        raise BadInput("a script runs on this machine (nproc processes under torchrun); nnodes, rdzv and "
                       f"target slurm are for recipes ({scripts.DOCS_PAGE})")


def script_launch(ws: Workspace, source: RunSource, nproc: int, args: object, resume_arg: object,
                  at_commit: tuple[Path, CodeOrigin] | None = None) -> Launch:
    """A run of the user's own script (:mod:`runner.scripts`) from a snapshot of it as it is
    now, or of the copy a commit holds (``at_commit``: :func:`~runner.provenance.code_at_commit`),
    in the sandbox and with the limits of every run; nothing imports it first."""
    assert source.script is not None
    given, started_from = started_from_checkpoint(ws, scripts.check_args(args))
    script = scripts.ScriptLaunch(source.script, given, scripts.check_resume_arg(resume_arg), source.alone)
    code = source.code
    code_dir, origin = at_commit or (source.code_dir, recipe_origin(ws.root, code))
    return Launch(code_dir, ws.label(code), origin, nproc, script=script, resumed_from=started_from)


def started_from_checkpoint(ws: Workspace, args: list[str]) -> tuple[list[str], rd.ResumedFrom | None]:
    """A script's ``args`` with the earlier run's checkpoint they name (``run:RUN_ID[@STEP]``:
    :data:`runner.scripts.CHECKPOINT_REFERENCE`) replaced by its path, and that checkpoint as
    the run's ``resumed_from``, which its sandbox shows read-only. The run and its checkpoint
    come from the server's records and the checkpoints listed complete, never a path a run
    wrote; a recipe run's checkpoint is the engine's, which a script cannot load."""
    reference = scripts.checkpoint_reference(args)
    if reference is None:
        return args, None
    source_dir, source = known_run(ws, reference.run_id)
    if source.kind != rd.SCRIPT:
        raise BadInput(f"run {source.id} ran a recipe: its checkpoints are the engine's, not a script's; "
                       "export_checkpoint(run_id, to=DIR) writes a Hugging Face folder, whose path the script can take")
    step, checkpoint = run_checkpoints.choose_checkpoint(source_dir, source.kind, reference.step, verified=True)
    given = list(args)
    given[reference.index] = reference.option + str(checkpoint)
    return given, rd.ResumedFrom(run_id=source.id, step=step, path=str(checkpoint))


def joining_node(ws: Workspace, request: Launch) -> Launch:
    """``request`` for a node with node_rank > 0: node 0's snapshot, run as it is, with node
    0's config (its run is the one this node joins)."""
    nodes = request.nodes
    run_dir, first = known_run(ws, nodes.rdzv_id)
    mismatch = [
        f"{name} {mine!r} (node 0: {theirs!r})"
        for name, mine, theirs in (("nnodes", nodes.nnodes, first.nnodes), ("rdzv endpoint", nodes.rdzv_endpoint,
                                   first.rdzv_endpoint), ("recipe", request.label, first.recipe))
        if mine != theirs
    ]
    if not first.started_by_server or first.node_rank != 0 or first.target != "local":
        mismatch.append(f"run {first.id} is not node 0 of a run over several nodes that this server started")
    if mismatch:
        raise BadInput(f"node {nodes.node_rank} must join node 0's run as it was launched: {'; '.join(mismatch)}")
    if request.overrides:
        raise BadInput(f"a joining node runs with node 0's config ({first.id}): leave overrides out")
    if first.effective_status() in rd.FINAL_STATUSES:
        raise BadInput(f"run {first.id} has ended ({first.effective_status()}); launch a new run from node 0")
    snapshot = run_dir / rd.SNAPSHOT_DIRNAME
    check_snapshot_unchanged(first, snapshot)
    return Launch(snapshot, request.label, CodeOrigin(first.git_commit, first.recipe_dirty, first.dirty_files),
                  request.nproc, nodes=nodes, joins=run_dir, continues=first, started_from=first.started_from,
                  hub_values=(hub.recipe_config(snapshot, {}), hub.recipe_config(snapshot, {}, hub.DATASET_KEY)),
                  review=skipped_data)


def resume_checkpoint(
    ws: Workspace,
    run_id: str,
    step: int | None = None,
    nproc: int | None = None,
    overrides: Overrides = None,
    limits: RunLimits | None = None,
    code: Literal["checkpoint", "head"] = "checkpoint",
    progress: hub.Progress | None = None,
    args: list[str] | None = None,
) -> LaunchRunResult:
    """A new run that continues ``run_id`` from its checkpoint at ``step`` (default: latest);
    a script run's script is given ``args`` when they are given (default: its own).

    ``code="checkpoint"`` runs the code the original run ran (its snapshot); ``code="head"``
    the recipe as it is now (e.g. after a skill was applied). With as many processes as the
    original, the new run computes with the original's thread count, so on CPU its losses
    continue the original's bit for bit. A model loaded by Hub id is loaded at the commit the
    original recorded (downloaded again if the cache lost it). A SLURM job's resume is a job
    again, on as many nodes, with the job's slurm settings.
    """
    source_dir, source = known_run(ws, run_id)
    if source.kind == rd.SCRIPT:
        return launch(ws, _script_resume(ws, source_dir, source, step, nproc, overrides, code, args), limits)
    if args is not None:
        raise BadInput(f"args are a script's command line; run {run_id} ran a recipe: change its config with overrides")
    chosen_step, checkpoint = run_checkpoints.choose_checkpoint(source_dir, source.kind, step, verified=True)
    if not source.config:
        raise NotFound(f"run {run_id} recorded no config, so it cannot be resumed")
    code_dir, origin = _resumed_code(ws, source_dir, source, code)
    nproc = source.nproc if nproc is None else nproc
    flat = checked_overrides(ws, overrides)
    limits, warnings = run_limits(ws, limits)
    same_shape = nproc == source.nproc and not limits.threads_per_process
    # A SLURM job's resume is a job again: on as many nodes, with the job's slurm settings.
    job = source.target == "slurm"
    request = Launch(
        code_dir, source.recipe, origin, nproc, flat, code_from=code,
        nodes=Nodes(nnodes=source.nnodes) if job else Nodes(),
        slurm=slurm_jobs.check_options(source.slurm_options) if job else None,
        resumed_from=rd.ResumedFrom(run_id=source.id, step=chosen_step, path=str(checkpoint)), continues=source,
        started_from=source.started_from,  # its model's pretrained_path, still shown
        hub_values=(hub.model_value(flat) or hub.model_value(source.config),
             hub.config_value(flat, hub.DATASET_KEY) or hub.config_value(source.config, hub.DATASET_KEY)),
        recorded_models=tuple(source.hub_models), threads=source.threads_per_process if same_shape else None,
        review=_resume_review(source, chosen_step),
    )
    return start(ws, plan(ws, request, limits, warnings, progress), request.slurm)


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


def _script_resume(ws: Workspace, source_dir: Path, source: sr.ServerRecord, step: object, nproc: int | None,
                   overrides: Overrides, code: Literal["checkpoint", "head"], args: list[str] | None = None) -> Launch:
    """A new run of a script run's script with the checkpoint's path after its ``resume_arg``
    (the script reads its own checkpoint; how well it continues is the script's doing), given
    its own arguments or ``args``."""
    if not source.started_by_server:
        raise BadInput(f"run {source.id} was not started by this server, so nothing but its own files says how to "
                       "run its script; launch the script again (launch_run) with resume_arg")
    if overrides:
        raise BadInput("overrides set a recipe's config keys; a script run is resumed with the args it was launched "
                       "with, or with new ones: args=[...]")
    scripts.check_resumable(source)  # refused, saying how, without a resume_arg
    chosen_step, checkpoint = run_checkpoints.choose_checkpoint(source_dir, source.kind, step, verified=True)
    args = scripts.resume_args(source, checkpoint, args)
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
        origin = recipe_origin(ws.root, launch_from.code)
    assert launch_from.script is not None
    return Launch(
        launch_from.code_dir, source.recipe, origin, source.nproc if nproc is None else nproc,
        code_from=code, resumed_from=rd.ResumedFrom(run_id=source.id, step=chosen_step, path=str(checkpoint)),
        script=scripts.ScriptLaunch(launch_from.script, args, source.resume_arg, launch_from.alone),
    )


# ---------------------------------------------------------------------------------------------
# Inputs, checked where they come in
# ---------------------------------------------------------------------------------------------


def checked_overrides(ws: Workspace, overrides: Overrides) -> dict[str, Any]:
    """Flat overrides, with every value that names a file confined to the workspace (the merged
    config the engine resolves is confined again, whatever its nesting)."""
    flat = overrides_to_dict(overrides)
    confine_config(ws.root, flat)
    return flat


def bind_hub_models(ws: Workspace, value: Any, dataset: Any, limits: RunLimits, progress: hub.Progress | None,
                    recorded: list[rd.HubModel] | None = None, weights: bool = True) -> hub.ModelBinding:
    """The Hub model ``value`` and data set ``dataset`` name (where they name one), downloaded
    as the trusted settings allow (``weights=False``: the model's config and tokenizer only)."""
    return hub.bind(ws.root, value, dataset=dataset, recorded=recorded or [],
                    allow_pickled=limits.allow_pickled_weights,
                    remote_code=limits.trust_remote_code, progress=progress, weights=weights)


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


# ---------------------------------------------------------------------------------------------
# The callers' reviews of a checked config
# ---------------------------------------------------------------------------------------------


def skipped_data(verdict: LaunchVerdict) -> list[str]:
    """A warning that names the data files the run will not read, and why."""
    skipped = verdict.data.skipped if verdict.data is not None else []
    if not skipped:
        return []
    return [f"data: {len(skipped) if not skipped[-1].startswith('…') else 'more than 10'} file(s) of the "
            f"folders or globs given are not read: {'; '.join(skipped[:5])}"]


def _resume_review(source: sr.ServerRecord, step: int) -> Review:
    """A resume's look at its checked config: refused when nothing is left to train (the
    checkpoint is at or past ``train.max_steps``), saying how to continue, instead of starting a
    run that does nothing; a warning when it would train on other data than the run it continues."""

    def review(verdict: LaunchVerdict) -> list[str]:
        max_steps = (verdict.config.get("train") or {}).get("max_steps")
        if isinstance(max_steps, int) and not isinstance(max_steps, bool) and step >= max_steps:
            raise BadInput(
                f"run {source.id}'s checkpoint at step {step} has nothing left to train (train.max_steps is "
                f"{max_steps}): to train further, pass overrides {{\"train.max_steps\": {step + max(step, 1)}}} "
                f"(any value above {step}); to use the model as it is, export_checkpoint, sample or evaluate it"
            )
        before, now = source.data, verdict.data
        if before is None or now is None:
            return []
        if (now.fingerprint, now.documents, now.tokens) == (before.fingerprint, before.documents, before.tokens):
            return []
        if now.preparing is not None and now.fingerprint == before.fingerprint:
            return []  # the same files, left to the run to tokenize again (its store was removed)
        return [f"the data differs from what run {source.id} trained on: it counted {before.describe()}; "
                f"the resume counts {now.describe()}"]

    return review


@contextlib.contextmanager
def _config_file(record: sr.ServerRecord | None) -> Iterator[Path | None]:
    """A file with ``record``'s config (the server's) for a launch check to start from: the
    run.json of the run it continues is the run's to rewrite. None without a record."""
    if record is None:
        yield None
        return
    folder = Path(tempfile.mkdtemp(prefix="trainwright-config-"))
    try:
        path = folder / rd.RUN_JSON
        run_files.write_json_atomic(path, rd.RunRecord(id=record.id, config=record.config).model_dump(mode="json"))
        yield path
    finally:
        shutil.rmtree(folder, ignore_errors=True)
