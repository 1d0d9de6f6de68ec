"""Run processes: check, spawn detached under a supervisor, stop.

A run is started in three moves, so that a bad request leaves nothing behind:

1. ``check_launch`` runs ``python -m engine.launch RECIPE --check`` (the engine validates the
   config and the world size) in the same sandbox and with the same limits as the run, and
   raises :class:`LaunchRefused` with the engine's message; every process the check started
   is ended when it ends;
2. ``start_run`` creates the server's record of the run (``.trainwright/runs/<id>/``, see
   :mod:`runner.server_record`) and ``runs/<id>/run.json`` (the run's copy, which it may
   rewrite), and spawns ``python -m runner.supervise`` in its own session, which starts the
   engine (its ranks under :mod:`runner.local_ranks` when ``nproc > 1``, torchrun over several
   nodes) in a process group of its own, with the limits of :class:`~workspace.settings.RunLimits`, writes its output
   to ``console.log`` and records the outcome;
3. the caller gets the run id at once: nothing waits for the run.

``stop_run`` asks the supervisor to end every process of the run and record ``stopped``; when
the supervisor is gone it ends them itself (see :mod:`runner.processes`). Every process it
signals is one the server or the supervisor started, recognised by its recorded identity
(pid, start time and session), never by a number the run wrote.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from engine import run_dir as rd
from runner import server_record as sr
from workspace.workspace import data_cache_dir, record_dir, records_root
from engine.config import override_args
from engine.data_files import DATA_CACHE_VARIABLE, WORKSPACE_VARIABLE
from engine.errors import MAX_ERROR_CHARS, BadInput, LaunchRefused
from engine.openmp import sleep_while_waiting
from engine.seams import LaunchVerdict, read_verdict
from sandbox import bwrap
from workspace.settings import RunLimits
from sandbox.environment import THREADS_VARIABLE, run_environment, threads_per_process
from runner.hub import ModelBinding
from sandbox.network import LOOPBACK_ENV
from runner.local_ranks import launcher_command
from runner.nodes import Nodes, torchrun_args
from runner.capacity import capacity_lock, check_capacity
from runner.processes import RUN_ID_VARIABLE, end_processes, hidden_state, run_contained, run_processes
from runner.provenance import CodeOrigin, snapshot_digest, snapshot_files, write_snapshot
from runner.scripts import ScriptLaunch, script_command

__all__ = ["LaunchPlan", "LaunchRefused", "RunLimits", "check_launch", "engine_command", "start_run", "stop_run"]

CHECK_TIMEOUT_S = 180


def engine_command(
    recipe_dir: Path,
    run_dir: Path,
    nproc: int,
    overrides: list[str],
    resume_from: Path | None = None,
    config_json: Path | None = None,
    nodes: Nodes = Nodes(),
    rdzv_id: str = "",
) -> list[str]:
    """The engine's command: one process, the ranks of one node under :mod:`runner.local_ranks`
    (torch-free), or this machine's node of a run over several under torchrun."""
    if nodes.multi:
        command = [sys.executable, "-m", "torch.distributed.run", *torchrun_args(nodes, nproc, rdzv_id),
                   "-m", "engine.launch"]
    elif nproc > 1:
        command = [*launcher_command(nproc), "-m", "engine.launch"]
    else:
        command = [sys.executable, "-m", "engine.launch"]
    return command + engine_args(recipe_dir, run_dir, overrides, resume_from, config_json)


def engine_args(
    recipe_dir: Path, run_dir: Path, overrides: list[str], resume_from: Path | None = None,
    config_json: Path | None = None,
) -> list[str]:
    """What follows ``-m engine.launch`` in a run's command."""
    args = [str(recipe_dir), "--run-dir", str(run_dir)]
    if resume_from is not None:
        args += ["--resume-from", str(resume_from)]
    if config_json is not None:
        args += ["--config-json", str(config_json)]
    # "--set=KEY=VALUE" in one word: a value that starts with "-" is not read as an option.
    return args + [f"--set={override}" for override in overrides]


def check_launch(
    workspace: Path,
    recipe_dir: Path,
    nproc: int,
    overrides: list[str],
    config_json: Path | None = None,
    limits: RunLimits = RunLimits(),
    read_only: list[Path] | None = None,
    models: ModelBinding = ModelBinding(),
    estimate: tuple[str, float | None] | None = None,
    keys_only: bool = False,
) -> LaunchVerdict:
    """Validate a launch with the engine itself; return its verdict: the resolved ``config``,
    ``config_changes`` (keys that differ from the code defaults) and the ``data`` summary
    (with ``estimate`` = (device, its memory in GiB or None): also the run's ``estimate``).
    ``keys_only``: only the resolved config and its keys, not checked against its data or model
    (a template's keys before its model and data are named).

    The check imports the recipe, so it runs as the run will: in the sandbox (seeing
    ``read_only``, default the workspace, and nothing writable), with the run's resource limits
    and allow-listed environment, where possible without network, in a session of its own.
    Its output is read from pipes as it comes (:func:`runner.processes.run_contained`), so a
    helper that keeps them open cannot hold the check; when its main process exits (or times out)
    every process it started is ended. The verdict is validated (:func:`engine.seams.read_verdict`): recipe code can print
    a verdict of its own.
    """
    command = [sys.executable, "-m", "engine.launch", str(recipe_dir), "--check", "--nproc", str(nproc)]
    if config_json is not None:
        command += ["--config-json", str(config_json)]
    command += [f"--set={override}" for override in overrides] + (["--keys-only"] if keys_only else [])
    if estimate is not None:
        device, memory_gib = estimate
        command += ["--estimate", device] + ([f"--device-memory-gib={memory_gib}"] if memory_gib is not None else [])
    mark = f"check-{secrets.token_hex(8)}"
    # A check writes nothing but the tokenized data the run then maps (.trainwright/data-cache),
    # not even the recipe's bytecode cache. It gets what the run gets (pass_env included), so it
    # can tell that a credential the run needs is missing.
    cache = data_cache_dir(workspace, create=True)
    env = run_environment(extra={
        THREADS_VARIABLE: "1", "PYTHONDONTWRITEBYTECODE": "1", RUN_ID_VARIABLE: mark,
        WORKSPACE_VARIABLE: str(workspace), DATA_CACHE_VARIABLE: str(cache), **models.env(),
    }, pass_env=limits.pass_env)
    visible = [Path(workspace)] if read_only is None else [Path(p) for p in read_only]
    visible += [Path(p) for p in (recipe_dir, config_json) if p is not None] + models.read_only()
    try:
        stdout, stderr = run_contained(command, workspace, visible, [cache], env, limits, CHECK_TIMEOUT_S, mark)
    except OSError as e:
        raise LaunchRefused(f"the engine could not be started to check the recipe: {e}") from None
    except subprocess.TimeoutExpired:
        raise LaunchRefused(f"checking the recipe took over {CHECK_TIMEOUT_S} s") from None
    verdict = read_verdict(stdout)
    if verdict is None:
        last = (stderr.strip().splitlines() or ["no output"])[-1]
        raise LaunchRefused(f"the engine could not check the recipe: {last[:MAX_ERROR_CHARS]}")
    return verdict


def _create_run_dir(workspace: Path, runs_root: Path, recipe_label: str,
                    record: sr.ServerRecord) -> tuple[str, Path, Path]:
    """A new run directory and server record with a fresh id (ids made in the same second may
    collide: retry); returns the id, the run directory and the record's folder."""
    for _ in range(20):
        run_id = rd.new_run_id(Path(recipe_label).name)
        run_dir = Path(runs_root) / run_id
        folder = record_dir(workspace, run_id)
        if folder.exists() or os.path.lexists(run_dir):
            continue
        first = record.model_copy(update={"id": run_id, "run_dir": str(run_dir)})
        try:
            sr.create_record(folder, first)
        except FileExistsError:
            continue
        try:
            rd.create_run(run_dir, rd.RunRecord.model_validate(first.model_dump(include=set(rd.RunRecord.model_fields))))
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        return run_id, run_dir, folder
    raise RuntimeError("could not find a free run id")


@dataclass(frozen=True)
class LaunchPlan:
    """One launch as checked, which :func:`start_run` starts: built once by each caller — a
    launch, a resume, a run of a script, a node joining a run, a SLURM job.

    ``code_dir``: the code the run executes a snapshot of (for a node that ``joins``, node 0's
    snapshot, run as it is); ``verdict``: :func:`check_launch`'s (None for a script);
    ``recorded_config``: the engine starts from the verdict's config kept in the run's own
    run.json (a resume, a joining node), not from the recipe's ``config.yaml``; ``threads`` pins
    the run's thread count (a resume passes the original run's); ``expected_digest``:
    :func:`~runner.provenance.snapshot_digest` of ``code_dir`` when it was checked, a snapshot
    that differs starts nothing. ``nodes``: this machine's node of a run over several
    (:mod:`runner.nodes`); ``joins``: node 0's run directory, for a node with ``node_rank`` > 0.
    ``target="slurm"``: the run directory is made, nothing is started (:mod:`runner.slurm`
    writes and submits the job). ``models``: the Hub models the run loads (:mod:`runner.hub`).
    ``script``: a run of the user's own script (:mod:`runner.scripts`), not of a recipe.
    ``resumed_from``: the checkpoint the run continues (a resume; a script's ``run:`` argument);
    ``started_from``: the folder of an earlier run's checkpoint the model starts from, nothing else
    of that run (a recipe's ``model.pretrained_path: run:ID@STEP``). Either is shown read-only.
    """

    code_dir: Path
    recipe_label: str
    nproc: int
    origin: CodeOrigin
    overrides: dict[str, Any] = field(default_factory=dict)
    verdict: LaunchVerdict | None = None
    code_from: rd.CodeFrom = "recipe"
    resumed_from: rd.ResumedFrom | None = None
    started_from: rd.ResumedFrom | None = None
    recorded_config: bool = False
    limits: RunLimits = RunLimits()
    threads: int | None = None
    warnings: tuple[str, ...] = ()
    expected_digest: str | None = None
    nodes: Nodes = Nodes()
    joins: Path | None = None
    target: rd.RunTarget = "local"
    models: ModelBinding = ModelBinding()
    script: ScriptLaunch | None = None


def start_run(workspace: Path, runs_root: Path, plan: LaunchPlan) -> sr.ServerRecord:
    """Create the run directory with a snapshot of ``plan.code_dir`` and the server's record of
    the run, and spawn its supervisor; return the server's first record.

    The run's sandbox shows the workspace read-only without git's, trainwright's and other runs'
    folders, its own run directory read-write, and its code snapshot read-only; what it shows is
    recorded in the server's record (``sandbox``), which the supervisor reads. Refused with
    :class:`LaunchRefused` when the workspace's caps on concurrent runs or processes would be
    exceeded; a refusal leaves nothing behind.
    """
    workspace, runs_root = Path(workspace), Path(runs_root)
    limits = plan.limits
    if plan.nodes.multi and plan.target == "local":
        limits = replace(limits, network="shared")  # the nodes must reach each other
    threads = plan.threads or threads_per_process(plan.nproc, limits.threads_per_process)
    record = _first_record(workspace, plan, limits, threads)
    files = _snapshot_files(plan)
    runs_root.mkdir(parents=True, exist_ok=True)
    with capacity_lock(runs_root):  # two launches at once cannot both take the last place
        if plan.target == "local":  # a SLURM job runs on the cluster's nodes
            check_capacity(records_root(workspace), plan.nproc, limits)
        run_id, run_dir, folder = _create_run_dir(workspace, runs_root, plan.recipe_label, record)
    try:
        snapshot, digest = _write_snapshot(plan, run_dir, files)
    except BaseException:
        shutil.rmtree(run_dir, ignore_errors=True)  # nothing started: leave nothing behind
        shutil.rmtree(folder, ignore_errors=True)
        raise
    prepared = _prepared(workspace, plan, run_id, run_dir, snapshot, digest)
    sr.update_record(folder, **prepared)
    rd.update_run(run_dir, **prepared)
    if plan.target != "local":
        return sr.read_record(folder)
    return _spawn_supervisor(workspace, plan, limits, threads, run_id, run_dir, folder, snapshot)


def _first_record(workspace: Path, plan: LaunchPlan, limits: RunLimits, threads: int) -> sr.ServerRecord:
    """The server's record of the run before its directory exists (its id still ``pending``)."""
    warnings = list(plan.warnings)
    origin = plan.origin
    if origin.recipe_dirty:
        warnings.append(
            f"the recipe had uncommitted changes ({', '.join(origin.dirty_files[:5])}); the run uses "
            f"them, and {rd.SNAPSHOT_DIRNAME}/{rd.UNCOMMITTED_PATCH} in its run directory holds the "
            f"diff against {(origin.git_commit or '')[:10]}"
        )
    verdict, nodes, script = plan.verdict, plan.nodes, plan.script
    record = sr.ServerRecord(
        id="pending",
        recipe=plan.recipe_label,
        code_from=plan.code_from,
        git_commit=origin.git_commit,
        recipe_dirty=origin.recipe_dirty,
        dirty_files=origin.dirty_files,
        overrides=plan.overrides,
        config=verdict.config if verdict is not None else None,
        config_changes=verdict.config_changes if verdict is not None else {},
        data=verdict.data if verdict is not None else None,
        nproc=plan.nproc,
        world_size=plan.nproc * nodes.nnodes,
        target=plan.target,
        nnodes=nodes.nnodes,
        node_rank=nodes.node_rank if nodes.multi else None,
        rdzv_endpoint=nodes.rdzv_endpoint,
        joins=plan.joins.name if plan.joins is not None else None,
        created_at=rd.utc_now(),
        resumed_from=plan.resumed_from,
        started_from=plan.started_from,
        limits=asdict(limits),
        threads_per_process=threads,
        workspace=str(workspace),
        warnings=warnings,
        hub_models=list(plan.models.models),
    )
    if script is not None:
        record = record.model_copy(update=dict(kind=rd.SCRIPT, script=script.script, script_args=script.args,
                                               resume_arg=script.resume_arg))
    return record


def _snapshot_files(plan: LaunchPlan) -> list[Path]:
    """The files of the run's snapshot (none for a joining node, which runs node 0's); refused
    before any write when they cannot be held."""
    if plan.joins is not None:
        return []
    if plan.script is not None and plan.script.alone:
        return [Path(plan.script.script)]
    files = snapshot_files(plan.code_dir)
    if plan.code_from != "checkpoint" and Path(rd.UNCOMMITTED_PATCH) in files:
        # Only a snapshot's own record of uncommitted changes may have that name: a recipe's file
        # would read as a diff the run never had.
        raise BadInput(f"{plan.recipe_label}/{rd.UNCOMMITTED_PATCH}: a run's snapshot keeps the recipe's "
                       "uncommitted changes under that name; rename the file")
    return files


def _write_snapshot(plan: LaunchPlan, run_dir: Path, files: list[Path]) -> tuple[Path, str]:
    """The run's code snapshot, written (a joining node runs node 0's snapshot as it is, checked
    by the caller), and its digest; refused when the code changed since it was checked."""
    snapshot = write_snapshot(plan.code_dir, run_dir, None, files) if plan.joins is None else Path(plan.code_dir)
    digest = snapshot_digest(snapshot)
    if plan.expected_digest is not None and digest != plan.expected_digest:
        raise BadInput(
            f"the code of {plan.recipe_label} changed after it was checked (the check's verdict, config and "
            "data summary would not describe the run); launch again once it stops changing"
        )
    if plan.joins is None and plan.code_from != "checkpoint" and plan.origin.patch:
        (snapshot / rd.UNCOMMITTED_PATCH).write_text(plan.origin.patch)
        digest = snapshot_digest(snapshot)  # the recorded digest covers the patch too
    return snapshot, digest


def _prepared(workspace: Path, plan: LaunchPlan, run_id: str, run_dir: Path, snapshot: Path,
              digest: str) -> dict[str, Any]:
    """What both records get once the snapshot is written: where it is, the command the
    supervisor runs and what the run's sandbox shows."""
    resume_path = Path(plan.resumed_from.path) if plan.resumed_from else None
    start_path = Path(plan.started_from.path) if plan.started_from else None
    visible = [workspace, snapshot] + [p for p in (resume_path, start_path) if p is not None]
    visible += plan.models.read_only()
    engine_dir = plan.joins if plan.joins is not None else run_dir  # one folder for every node's shards
    nodes = plan.nodes
    rdzv_id = nodes.rdzv_id or run_id
    if plan.script is None:
        # A resume (or a joining node) starts from the config its check resolved, kept in its own
        # run.json: the run.json it came from may have changed since the check read it.
        command = engine_command(snapshot, engine_dir, plan.nproc, override_args(plan.overrides), resume_path,
                                 run_dir / rd.RUN_JSON if plan.recorded_config else None,
                                 nodes=nodes, rdzv_id=rdzv_id)
    else:
        command = script_command(snapshot / plan.script.script, plan.script.args, plan.nproc, nodes, rdzv_id)
    return dict(
        snapshot=snapshot.relative_to(workspace).as_posix() if snapshot.is_relative_to(workspace) else str(snapshot),
        snapshot_digest=digest,
        command=command,
        rdzv_id=rdzv_id if nodes.multi else None,
        sandbox=rd.SandboxMounts(
            bwrap=bwrap.find_bwrap(), read_only=[str(p) for p in visible],
            writable=[str(p) for p in dict.fromkeys([run_dir, engine_dir, data_cache_dir(workspace, create=True)])],
            hidden=[str(p) for p in hidden_state(workspace)],
        ),
    )


def _spawn_supervisor(workspace: Path, plan: LaunchPlan, limits: RunLimits, threads: int, run_id: str,
                      run_dir: Path, folder: Path, snapshot: Path) -> sr.ServerRecord:
    """``python -m runner.supervise FOLDER`` in a session of its own, with the run's
    environment; the record with its pid and identity."""
    extra = {THREADS_VARIABLE: str(threads), RUN_ID_VARIABLE: run_id, WORKSPACE_VARIABLE: str(workspace),
             DATA_CACHE_VARIABLE: str(data_cache_dir(workspace)), "PYTHONDONTWRITEBYTECODE": "1", **plan.models.env()}
    if plan.script is not None:
        # The script imports its own modules from its snapshot (PYTHONSAFEPATH keeps the folder
        # of the script off sys.path, as for a recipe), then what the environment has.
        extra["PYTHONPATH"] = os.pathsep.join(p for p in (str(snapshot), os.environ.get("PYTHONPATH", "")) if p)
    if not plan.nodes.multi or plan.nodes.local_endpoint:
        # Every process of the run is on this machine: the collectives stay on loopback (also
        # with a shared network, where the host's name need not resolve).
        extra.update(LOOPBACK_ENV)
    env = run_environment(extra=extra, pass_env=limits.pass_env)
    if plan.script is not None:
        sleep_while_waiting(env)  # the engine governs its threads' waits; a script's cannot be
    with open(run_dir / rd.CONSOLE_LOG, "ab") as console:
        process = subprocess.Popen(
            [sys.executable, "-m", "runner.supervise", str(folder)],
            cwd=workspace,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=console,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # outlives the server; a server restart does not touch it
        )
    identity = sr.identify(process.pid)  # it is in a session of its own by the time Popen returns
    sr.mirror_to_report(run_dir, pid=process.pid)
    return sr.update_record(folder, pid=process.pid, supervisor=identity)


def stop_run(folder: Path, timeout_s: float | None = None) -> sr.ServerRecord:
    """End every process of the run whose server record is in ``folder`` and record
    ``stopped``. Returns the final record. Only processes the server or the supervisor started
    are signalled, each checked by its recorded identity."""
    record = sr.read_record(folder)
    if record.status in rd.FINAL_STATUSES:
        return record
    if record.effective_status() == rd.FAILED:
        # The supervisor is gone without recording an outcome: the run has ended, and failed.
        # Whatever it left running is ended; its outcome stays a failure, not a stop by request.
        end_processes(run_processes(record), grace_s=0.0)
        fields = dict(status=rd.FAILED, ended_at=rd.utc_now(), error=record.error or sr.SUPERVISOR_GONE)
        sr.mirror_to_report(record.run_dir, **fields)
        return sr.update_record(folder, **fields)
    record = sr.update_record(folder, stop_requested=True)
    sr.mirror_to_report(record.run_dir, stop_requested=True)
    grace = record.run_limits().stop_grace_s
    timeout_s = grace + 20.0 if timeout_s is None else timeout_s
    supervisor = record.supervisor
    if supervisor is not None and supervisor.send_signal(signal.SIGTERM):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            record = sr.read_record(folder)
            supervisor_alive = supervisor.alive()
            if record.status in rd.FINAL_STATUSES and not supervisor_alive:
                return record
            if not supervisor_alive:
                break  # it died before it could record the outcome
            time.sleep(0.1)
    # No supervisor (it crashed or was killed), or it did not finish: end the run's processes
    # ourselves, all of them, wherever they are in the process tree.
    record = sr.read_record(folder)
    if record.engine_group is not None:
        record.engine_group.signal_group(signal.SIGKILL)
    end_processes(run_processes(record), grace_s=min(grace, 5.0))
    record = sr.read_record(folder)
    if record.status in rd.FINAL_STATUSES:
        return record
    fields = dict(status=rd.STOPPED, ended_at=rd.utc_now(), reason="stopped by request")
    sr.mirror_to_report(record.run_dir, **fields)
    return sr.update_record(folder, **fields)
