"""Runs as SLURM jobs: the ``sbatch`` script, submission, status through ``squeue``/``sacct``/``scontrol``, ``scancel``.

A run with ``target="slurm"`` gets a job script in its run directory (:data:`SCRIPT_NAME`): one
task per node (``srun``), each a torchrun agent with ``nproc`` processes; the agents meet at a
c10d rendezvous on the job's first node (``scontrol show hostnames "$SLURM_JOB_NODELIST"``).
The script runs the run's code snapshot with this Python, in this workspace, and writes into
the run directory, so the cluster's nodes must see them at the same paths (a shared
filesystem, as on a cluster's login node). It is submitted with ``sbatch`` when ``sbatch`` is
on PATH, with the run's allow-listed environment (:mod:`sandbox.environment`); otherwise it is
returned for the user to submit. The job runs under the cluster's controls, not in
trainwright's sandbox (SECURITY.md).

Every call here is bounded (:data:`COMMAND_TIMEOUT_S`); status queries report their errors as a
note instead of raising, so ``get_run`` always answers.
"""

from __future__ import annotations

import datetime as _dt
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from engine import checkpoint_manifest
from engine import run_dir as rd
from engine.run_checkpoints import corrupt_checkpoint_message
from runner import server_record as sr
from workspace.workspace import data_cache_dir, record_dir
from engine.data_files import DATA_CACHE_VARIABLE, WORKSPACE_VARIABLE
from engine.errors import MAX_QUOTED_CHARS, BadInput
from sandbox.environment import THREADS_VARIABLE, run_environment
from runner.processes import RUN_ID_VARIABLE
from runner.nodes import DEFAULT_RDZV_PORT, JOB_FIRST_NODE, Nodes

if TYPE_CHECKING:  # runner.lifecycle is imported when a job starts: it costs the server nothing before
    from runner.lifecycle import LaunchPlan

SCRIPT_NAME = "job.sbatch"
STAGED_CHECKPOINT_DIRNAME = "resume-from"  # in the server's record of a job: what it resumes from
COMMAND_TIMEOUT_S = 10.0
CANCEL_WAIT_S = 20.0  # stop_run waits this long at most for a cancelled job's processes to end
SLURM_KEYS = ("partition", "time", "gpus_per_node", "rdzv_port")
DEFAULT_TIME = "01:00:00"
# SLURM's time formats: minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS.
_TIME = re.compile(r"^(\d+|\d+:\d{2}|\d+:\d{2}:\d{2}|\d+-\d+|\d+-\d+:\d{2}|\d+-\d+:\d{2}:\d{2})$")
_PARTITION = re.compile(r"^[A-Za-z0-9_.-]{1,64}(,[A-Za-z0-9_.-]{1,64})*$")
_JOB_ID = sr.SLURM_JOB_ID  # the one definition: what sbatch answered, and what squeue/scancel get

# squeue's and sacct's job states → run statuses.
LIVE_STATES = {
    "PENDING": rd.STARTING, "CONFIGURING": rd.STARTING, "REQUEUED": rd.STARTING, "REQUEUE_HOLD": rd.STARTING,
    "REQUEUE_FED": rd.STARTING, "RESV_DEL_HOLD": rd.STARTING, "SUSPENDED": rd.RUNNING, "STOPPED": rd.RUNNING,
    "RUNNING": rd.RUNNING, "COMPLETING": rd.RUNNING, "RESIZING": rd.RUNNING, "SIGNALING": rd.RUNNING,
    "STAGE_OUT": rd.RUNNING,
}
FINAL_STATES = {
    "COMPLETED": rd.COMPLETED, "CANCELLED": rd.STOPPED, "FAILED": rd.FAILED, "TIMEOUT": rd.FAILED,
    "NODE_FAIL": rd.FAILED, "OUT_OF_MEMORY": rd.FAILED, "BOOT_FAIL": rd.FAILED, "DEADLINE": rd.FAILED,
    "PREEMPTED": rd.FAILED, "REVOKED": rd.FAILED, "SPECIAL_EXIT": rd.FAILED,
}


@dataclass(frozen=True)
class SlurmOptions:
    """What the job asks the cluster for (beyond its nodes and processes)."""

    partition: str | None = None
    time: str = DEFAULT_TIME
    gpus_per_node: int | None = None  # None: as many as processes per node
    rdzv_port: int = DEFAULT_RDZV_PORT


def check_options(options: Mapping[str, Any] | None) -> SlurmOptions:
    """``slurm`` settings of a launch, or :class:`BadInput` naming the key to change."""
    options = dict(options or {})
    unknown = sorted(str(k) for k in options if k not in SLURM_KEYS)
    if unknown:
        raise BadInput(f"unknown slurm setting {unknown[0]!r}; valid: {', '.join(SLURM_KEYS)}")
    partition = options.get("partition")
    if partition is not None and (not isinstance(partition, str) or not _PARTITION.fullmatch(partition)):
        raise BadInput(f"slurm partition must be a partition name (letters, digits, '_', '.', '-'), got {partition!r}")
    time = options.get("time", DEFAULT_TIME)
    if not isinstance(time, str) or not _TIME.fullmatch(time):
        raise BadInput(f"slurm time must be a SLURM time limit such as '90', '04:00:00' or '1-12:00:00', got {time!r}")
    gpus = options.get("gpus_per_node")
    if gpus is not None and (isinstance(gpus, bool) or not isinstance(gpus, int) or not 0 <= gpus <= 64):
        raise BadInput(f"slurm gpus_per_node must be an integer from 0 to 64, got {gpus!r}")
    port = options.get("rdzv_port", DEFAULT_RDZV_PORT)
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise BadInput(f"slurm rdzv_port must be an integer from 1 to 65535, got {port!r}")
    return SlurmOptions(partition=partition, time=time, gpus_per_node=gpus, rdzv_port=port)


# What each node's task adds to torchrun's options, from its own SLURM variables (single-quoted:
# the task's shell expands them): its node name as the address the others reach it at, and
# whether it serves the rendezvous (the job's node 0, the script's $head_node). torchrun would
# otherwise take both from the machine's host name, which need not be the node's name nor
# resolve to an address the other nodes reach (a host name that resolves to loopback, as on
# many machines, makes every node think itself the master at 127.0.0.1).
NODE_OPTIONS = '--local-addr "$SLURMD_NODENAME" --rdzv-conf "is_host=$((SLURM_NODEID == 0))"'
TASK_SHELL = f"bash -c 'exec \"$0\" -m torch.distributed.run {NODE_OPTIONS} \"$@\"'"


def torchrun_line(python: str, nnodes: int, nproc: int, rdzv_id: str, engine_args: list[str], port: int) -> str:
    """The job's srun/torchrun line; ``$head_node`` is the job's first node (set by the script).
    Each task is a shell that runs ``python -m torch.distributed.run`` with :data:`NODE_OPTIONS`."""
    words = [TASK_SHELL, shlex.quote(python), "--nnodes", str(nnodes),
             "--nproc-per-node", str(nproc), "--rdzv-backend", "c10d",
             f'--rdzv-endpoint "${{head_node}}:{port}"', "--rdzv-id", shlex.quote(rdzv_id),
             "-m", "engine.launch", *(shlex.quote(a) for a in engine_args)]
    return "srun --kill-on-bad-exit=1 " + " ".join(words)


def _one_line(text: str) -> str:
    """``text`` for a comment line of the script: a recipe folder's name may hold a newline,
    which would add #SBATCH directives or commands to the job."""
    return text.encode("unicode_escape").decode("ascii")[:300]


def job_script(record: rd.RunRecord, run_dir: Path, options: SlurmOptions, python: str,
               engine_args: list[str], exported: Mapping[str, str]) -> str:
    """The sbatch script of a run (``engine_args``: what follows ``-m engine.launch``;
    ``exported``: the variables the run's processes need from trainwright, exported by the script
    itself, since a cluster may submit with ``--export=NONE`` and srun's tasks take the job's
    environment)."""
    gpus = record.nproc if options.gpus_per_node is None else options.gpus_per_node
    header = [
        "#!/bin/bash",
        f"# trainwright run {record.id}: {_one_line(record.recipe)}, {record.nnodes} node(s) x {record.nproc} process(es)",
        f"#SBATCH --job-name={record.id[:64]}",
        f"#SBATCH --nodes={record.nnodes}",
        "#SBATCH --ntasks-per-node=1",
    ]
    if gpus:
        header.append(f"#SBATCH --gpus-per-node={gpus}")
    header.append(f"#SBATCH --time={options.time}")
    if options.partition:
        header.append(f"#SBATCH --partition={options.partition}")
    header += [
        # Relative to the job's working directory, the workspace it is submitted from (a
        # directive cannot quote a path with spaces).
        f"#SBATCH --output={rd.RUNS_DIRNAME}/{record.id}/{rd.CONSOLE_LOG}",
        "#SBATCH --open-mode=append",
        # A job that loses a node fails (NODE_FAIL) rather than wait to start again: SLURM would
        # run this script from its first step into the same run directory. Its resume is
        # resume_checkpoint, a new job from its last checkpoint.
        "#SBATCH --no-requeue",
    ]
    body = [
        "set -euo pipefail",
        "# The rendezvous is on the job's first node.",
        'mapfile -t nodes < <(scontrol show hostnames "$SLURM_JOB_NODELIST")',
        'head_node="${nodes[0]}"',
        "export " + " ".join(f"{name}={shlex.quote(value)}" for name, value in sorted(exported.items())),
        "export PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1",
        f"cd {shlex.quote(record.workspace or str(run_dir.parent.parent))}",
        "# shellcheck disable=SC2016  # the task's shell expands its node's variables",
        torchrun_line(python, record.nnodes, record.nproc, record.rdzv_id or record.id, engine_args,
                      options.rdzv_port),
    ]
    return "\n".join(header + [""] + body) + "\n"


def _environment(env: Mapping[str, str]) -> dict[str, str]:
    """The run's environment, plus what SLURM's own commands read (their configuration)."""
    merged = dict(env)
    for name, value in os.environ.items():
        if name.startswith(("SLURM_CONF", "SBATCH_", "SQUEUE_", "SACCT_")) and name not in merged:
            merged[name] = value
    return merged


def _run(command: list[str], env: Mapping[str, str], cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(command, env=_environment(env), cwd=cwd, stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, errors="replace", timeout=COMMAND_TIMEOUT_S)


def sbatch_available(env: Mapping[str, str]) -> str | None:
    return shutil.which("sbatch", path=env.get("PATH"))


def submit(script: Path, env: Mapping[str, str], cwd: Path) -> str:
    """``sbatch --parsable SCRIPT`` → the job id; :class:`BadInput` with sbatch's message when refused."""
    try:
        result = _run(["sbatch", "--parsable", str(script)], env, cwd)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise BadInput(f"sbatch could not be run: {e}") from None
    if result.returncode != 0:
        last = (result.stderr.strip().splitlines() or [f"exit status {result.returncode}"])[-1]
        raise BadInput(f"sbatch refused the job: {last[:500]}")
    job_id = (result.stdout.strip().splitlines() or [""])[-1].split(";")[0].strip()
    if not _JOB_ID.fullmatch(job_id):
        raise BadInput(f"sbatch answered {result.stdout.strip()[:200]!r}, not a job id")
    return job_id


@dataclass(frozen=True)
class JobState:
    """What SLURM says of a job: its state (None: nobody could say, ``note`` says why), its exit
    code (``"1:0"``: status and signal) and which command said so (``source``)."""

    state: str | None
    exit_code: str | None = None
    source: str | None = None
    note: str | None = None


def _said(result: subprocess.CompletedProcess, silent: str) -> str:
    """What a command that gave no answer said: its last line on stderr (or stdout, when it
    failed), else ``silent`` (it succeeded) or its exit status."""
    text = result.stderr.strip() or (result.stdout.strip() if result.returncode else "")
    lines = text.splitlines()
    return (lines[-1] if lines else silent if result.returncode == 0 else f"exit status {result.returncode}")[:200]


# scontrol prints a job's state before its reason, and its exit code a few fields later; the job's
# name (before them) and its comment (after) are the job's own text, which it may set to anything.
_SCONTROL_STATE = re.compile(r"(?:^|\s)JobState=(\S+) Reason=")
_SCONTROL_EXIT_CODE = re.compile(r"\sExitCode=(\d+:\d+)(?=\s|$)")


def _scontrol_fields(text: str) -> tuple[str | None, str | None, str | None]:
    """``(JobState, ExitCode, None)`` of ``scontrol show job -o``'s one line, or ``(None, None,
    why)`` when it spells no state, or more than one: a job that names ``JobState=`` in its name
    or comment makes its state unknown, never what it spelt."""
    states = list(_SCONTROL_STATE.finditer(text))
    if len(states) != 1:
        return None, None, (f"its answer names JobState {len(states)} times (a job name or comment spells it), "
                            "so it says nothing sure") if states else None
    exit_code = _SCONTROL_EXIT_CODE.search(text, states[0].end())
    return states[0].group(1), exit_code.group(1) if exit_code else None, None


def query_state(job_id: str, env: Mapping[str, str]) -> JobState:
    """A job's state: ``squeue`` while it is queued or running (a pending job with squeue's
    reason: ``PENDING (Resources)``); once squeue has forgotten it, ``sacct``; where there is no
    accounting store (sacct says so), ``scontrol show job``, which remembers an ended job for
    the cluster's ``MinJobAge`` (300 s by default).

    Never raises: when none answers, state is None and the note says what each said."""
    if not isinstance(job_id, str) or not _JOB_ID.fullmatch(job_id):  # never an option of squeue/sacct/scontrol
        return JobState(None, note="the run has no valid SLURM job id")
    notes = []
    try:
        result = _run(["squeue", "-h", "-j", job_id, "-o", "%T|%r"], env)
        state, _, reason = (result.stdout.strip().splitlines() or [""])[0].partition("|")
        if result.returncode == 0 and state.strip():
            state, reason = state.strip().upper(), reason.strip()
            if state == "PENDING" and reason and reason != "None":
                state = f"{state} ({reason[:80]})"
            return JobState(state, source="squeue")
        if result.returncode != 0:
            notes.append(f"squeue: {_said(result, 'no such job')}")
    except (OSError, subprocess.TimeoutExpired) as e:
        notes.append(f"squeue: {e}")
    try:
        result = _run(["sacct", "-n", "-X", "-P", "-j", job_id, "-o", "State,ExitCode"], env)
        lines = [line for line in result.stdout.splitlines() if line.strip()]
        if result.returncode == 0 and lines:
            state, _, exit_code = lines[0].partition("|")
            return JobState(state.strip(), exit_code.strip() or None, "sacct")  # e.g. "CANCELLED by 1000"
        notes.append(f"sacct: {_said(result, 'no record of the job')}")
    except (OSError, subprocess.TimeoutExpired) as e:
        notes.append(f"sacct: {e}")
    try:
        result = _run(["scontrol", "show", "job", "-o", job_id], env)
        state, exit_code, unsure = _scontrol_fields(result.stdout)
        if result.returncode == 0 and state:
            # Which command answered, and why not sacct (no accounting store, as a rule).
            return JobState(state, exit_code, f"scontrol show job; {notes[-1]}")
        notes.append(f"scontrol: {unsure or _said(result, 'no record of the job')}")
    except (OSError, subprocess.TimeoutExpired) as e:
        notes.append(f"scontrol: {e}")
    return JobState(None, note=f"the state of SLURM job {job_id} is unknown ({'; '.join(notes)})")


def status_of(state: str) -> rd.RunStatus | None:
    """The run status of a SLURM job state (``CANCELLED by 0`` → stopped); None when unknown."""
    word = state.split()[0].rstrip("+") if state.split() else ""
    return LIVE_STATES.get(word) or FINAL_STATES.get(word)


def refresh(folder: Path, env: Mapping[str, str], min_interval_s: float = 0.0) -> tuple[sr.ServerRecord, str | None]:
    """Ask SLURM how a job the server submitted goes and record it in the server's record of the
    run (``folder``); returns the record and a note when SLURM could not say (the record is then
    left as it was). Not again within ``min_interval_s`` of the last question (a waiting loop
    must not flood the scheduler). A run the server did not submit is never asked about."""
    record = sr.read_record(folder)
    if record.target != "slurm" or not record.slurm_job_id or record.status in rd.FINAL_STATUSES:
        return record, None
    if min_interval_s and record.slurm_checked_at:
        try:
            last = _dt.datetime.fromisoformat(record.slurm_checked_at)
            if (_dt.datetime.now(_dt.timezone.utc) - last).total_seconds() < min_interval_s:
                return record, None
        except (ValueError, TypeError):
            pass
    answer = query_state(record.slurm_job_id, env)
    if answer.state is None:
        return sr.update_record(folder, slurm_checked_at=rd.utc_now()), answer.note
    state, exit_code = answer.state, answer.exit_code
    status = status_of(state)
    fields: dict[str, Any] = {"slurm_state": state[:100], "slurm_state_from": answer.source,
                              "slurm_checked_at": rd.utc_now()}
    if status is None:
        return _record(folder, record, **fields), f"SLURM job {record.slurm_job_id} is in state {state[:100]}, unknown here"
    fields["status"] = status
    if status == rd.RUNNING and not record.started_at:
        fields["started_at"] = rd.utc_now()
    if status in rd.FINAL_STATUSES:
        fields.update(ended_at=rd.utc_now(), exit_code=exit_status(exit_code))
        if status == rd.FAILED and not record.error:
            fields["error"] = f"SLURM job {record.slurm_job_id} ended {state[:100]} (exit code {exit_code or '?'}); see console.log"
        if status == rd.STOPPED and not record.reason:
            fields["reason"] = f"SLURM job {record.slurm_job_id} {state[:100].lower()}"
    return _record(folder, record, **fields), None


def exit_status(exit_code: str | None) -> int | None:
    """SLURM's ``STATUS:SIGNAL`` as a process's exit code: the status, or minus the signal that
    ended the job (``0:15`` → -15); None when SLURM gave none."""
    status, _, signal_number = (exit_code or "").partition(":")
    if not status.isdigit():
        return None
    return -int(signal_number) if signal_number.isdigit() and int(signal_number) else int(status)


def _record(folder: Path, record: sr.ServerRecord, **fields: Any) -> sr.ServerRecord:
    """``fields`` into the server's record, and a copy into the run's run.json."""
    sr.mirror_to_report(record.run_dir, **fields)
    return sr.update_record(folder, **fields)


def cancel(folder: Path, env: Mapping[str, str]) -> sr.ServerRecord:
    """``scancel`` the job the server submitted for this run and record it stopped;
    :class:`BadInput` when scancel refuses."""
    record, _ = refresh(folder, env)  # a job that has ended is not cancelled
    if record.status in rd.FINAL_STATUSES:
        return record
    job = record.slurm_job_id
    if job:
        if not _JOB_ID.fullmatch(job):  # checked when recorded; never an option of scancel
            raise BadInput(f"run {record.id} has no valid SLURM job id")
        try:
            result = _run(["scancel", job], env)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise BadInput(f"scancel could not be run ({e}); the job {job} may still run") from None
        if result.returncode != 0:
            last = (result.stderr.strip().splitlines() or [f"exit status {result.returncode}"])[-1]
            raise BadInput(f"scancel {job} failed: {last[:MAX_QUOTED_CHARS]}; the job may still run")
    fields: dict[str, Any] = {"status": rd.STOPPED, "stop_requested": True,
                              "reason": f"cancelled (scancel {job})" if job else "stopped by request"}
    if job:  # scancel only asks: the job's processes end after SLURM's signals
        answer = _until_ended(job, env)
        if answer.state is not None:
            fields.update(slurm_state=answer.state[:100], slurm_state_from=answer.source,
                          exit_code=exit_status(answer.exit_code))
        fields["slurm_checked_at"] = rd.utc_now()
    return _record(folder, record, ended_at=rd.utc_now(), **fields)


def _until_ended(job_id: str, env: Mapping[str, str]) -> JobState:
    """The job's state once SLURM says it has ended (or forgotten it), or as it is after
    :data:`CANCEL_WAIT_S`."""
    deadline = time.monotonic() + CANCEL_WAIT_S
    while True:
        answer = query_state(job_id, env)
        if answer.state is None or status_of(answer.state) not in (rd.STARTING, rd.RUNNING):
            return answer
        if time.monotonic() > deadline:
            return answer
        time.sleep(0.5)


def start_job(workspace: Path, runs_root: Path, plan: LaunchPlan, options: SlurmOptions) -> tuple[sr.ServerRecord, str]:
    """A run as a SLURM job: its run directory and snapshot (:func:`~runner.lifecycle.start_run`
    with ``plan`` as a SLURM target), the job script in it, and the job submitted when
    ``sbatch`` is on PATH and the server's settings allow it (``runs.slurm``); returns the record
    and the script. A job that sbatch refuses leaves nothing behind."""
    from engine.config import override_args
    from runner.lifecycle import engine_args, start_run

    endpoint_shown = f"{JOB_FIRST_NODE}:{options.rdzv_port}"
    rdzv_id, limits = plan.nodes.rdzv_id, plan.limits
    plan = replace(plan, target="slurm",
                   nodes=Nodes(nnodes=plan.nodes.nnodes, rdzv_endpoint=endpoint_shown, rdzv_id=rdzv_id))
    record = start_run(workspace, runs_root, plan)
    run_dir = Path(runs_root) / record.id
    folder = record_dir(workspace, record.id)
    try:
        resume_from = stage_checkpoint(plan.resumed_from, folder) if plan.resumed_from else None
    except BadInput:
        shutil.rmtree(run_dir, ignore_errors=True)
        shutil.rmtree(folder, ignore_errors=True)
        raise
    record = _record(folder, record, rdzv_id=rdzv_id or record.id, rdzv_endpoint=endpoint_shown)
    snapshot = run_dir / rd.SNAPSHOT_DIRNAME
    # As a local run's supervisor starts the engine: a resume from its checkpoint (as staged),
    # with the config its check resolved (kept in its run.json), at its thread count.
    args = engine_args(snapshot, run_dir, override_args(plan.overrides), resume_from,
                       run_dir / rd.RUN_JSON if plan.recorded_config else None)
    exported = {RUN_ID_VARIABLE: record.id, THREADS_VARIABLE: str(record.threads_per_process or 1),
                WORKSPACE_VARIABLE: str(workspace), DATA_CACHE_VARIABLE: str(data_cache_dir(workspace, create=True))}
    text = job_script(record, run_dir, options, sys.executable, args, exported)
    script = run_dir / SCRIPT_NAME
    tmp = script.with_name(f".{SCRIPT_NAME}.tmp")
    tmp.write_text(text)
    tmp.chmod(0o755)
    os.replace(tmp, script)
    env = run_environment(pass_env=limits.pass_env)
    fields: dict[str, Any] = {"slurm_script": SCRIPT_NAME, "command": ["sbatch", str(script)],
                              "slurm_options": asdict(options)}
    why_not = None
    if not limits.slurm:
        why_not = ("the server's settings do not allow submitting jobs (runs.slurm: true in the file given to "
                   "`trainwright serve --config`)")
    elif sbatch_available(env) is None:
        why_not = "sbatch is not on PATH"
    if why_not is None:
        try:
            job_id = submit(script, env, Path(workspace))
        except BadInput:
            shutil.rmtree(run_dir, ignore_errors=True)
            shutil.rmtree(folder, ignore_errors=True)
            raise
        fields.update(slurm_job_id=job_id, slurm_state="SUBMITTED", slurm_checked_at=rd.utc_now())
    else:
        label = f"{rd.RUNS_DIRNAME}/{record.id}/{SCRIPT_NAME}"
        fields.update(status=rd.STOPPED, ended_at=rd.utc_now(),
                      reason=f"not submitted: {why_not}; submit it on the cluster with `sbatch {label}`")
    return _record(folder, record, **fields), text


def stage_checkpoint(resumed_from: rd.ResumedFrom, folder: Path) -> Path:
    """The checkpoint a job resumes from, copied into the server's record of the job (a folder
    that no run writes) and verified there, digests included; the job's script names the copy.
    A job starts later than the server checked the checkpoint, and a run that can write the
    checkpoint's folder (the run it came from, while it runs) could swap it meanwhile: a link,
    or other files with a manifest to match. :class:`BadInput` when the copy does not verify."""
    source = Path(resumed_from.path)
    staged = folder / STAGED_CHECKPOINT_DIRNAME / source.name
    why = checkpoint_manifest.copy_verified(source, staged)
    if why is not None:
        raise BadInput(corrupt_checkpoint_message(source.parent.parent, resumed_from.step, why, full=True))
    return staged
