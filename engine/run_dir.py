"""The run directory: the on-disk contract between the engine and everything that watches it.

```
runs/<run_id>/
  run.json                     one RunRecord (below): what ran, with what, how it went
  recipe/                      the snapshot of the recipe code that ran (uncommitted.patch beside
                               its files when the recipe had uncommitted changes)
  metrics.jsonl                one MetricRecord (JSON) per logged step
  console.log                  everything the run printed
  tensorboard/, wandb/, mlflow/, trackio/
                               other metrics backends' files, where they write locally
                               (run.json's metrics_destinations lists where metrics went)
  checkpoints/step-<NNNNNNNN>/ complete checkpoints only; saves in progress live in
                               checkpoints/.partial-step-<NNNNNNNN>/ until they are published
```

The filesystem is the source of truth, so runs outlive the process that started them. This
module is the single definition of that format and of run.json: ``RunRecord`` is the only
definition of run.json, read and written only through :func:`read_run`, :func:`create_run`,
:func:`update_run` and :func:`append_warning` (locked and atomic: :mod:`engine.run_files`);
:mod:`engine.run_checkpoints` defines the checkpoints' names and which are complete, and
:mod:`engine.run_metrics` a metrics line (``MetricRecord``) and its readers. It is torch-free (stdlib and pydantic): the MCP server imports it
to read runs without paying for a torch import.

run.json lives in the run directory, which the run's own processes may write: it is the run's
report (its step, warnings, where its metrics went, its view of its status), never a reason for
the server to act. What the server and the run's supervisor decide is kept in the server's
record of the run (:mod:`runner.server_record`), outside every sandbox's writable folders.
"""

from __future__ import annotations

import datetime as _dt
import os
import re
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Callable, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from engine.run_files import locked, read_bounded, write_json_atomic


RUNS_DIRNAME = "runs"
RUN_JSON = "run.json"
METRICS_JSONL = "metrics.jsonl"
CONSOLE_LOG = "console.log"
CHECKPOINTS_DIRNAME = "checkpoints"


# Run statuses. "starting" and "running" are live; the others are final.
RunStatus = Literal["starting", "running", "completed", "failed", "stopped"]
STARTING: RunStatus = "starting"
RUNNING: RunStatus = "running"
COMPLETED: RunStatus = "completed"
FAILED: RunStatus = "failed"
STOPPED: RunStatus = "stopped"
FINAL_STATUSES: frozenset[str] = frozenset({COMPLETED, FAILED, STOPPED})
SNAPSHOT_DIRNAME = "recipe"
UNCOMMITTED_PATCH = "uncommitted.patch"

RUN_ID_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
# Every process of a run (and of a launch check) carries its id in its environment
# (runner.processes finds them by it; a store's lock names its holder by it).
RUN_ID_VARIABLE = "TRAINWRIGHT_RUN_ID"
MAX_RECORD_BYTES = 16 * 2**20  # a run's record file, read at most: run.json, and the server's record of it
MAX_WARNINGS, MAX_WARNING_CHARS = 100, 2000


def utc_now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def new_run_id(recipe_name: str) -> str:
    """A sortable, readable, unique id: ``20261130-024512-causal_lm-3f9a``."""
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%d-%H%M%S")
    safe_name = re.sub(r"[^A-Za-z0-9_]+", "_", recipe_name).strip("_")[:40] or "run"
    return f"{stamp}-{safe_name}-{secrets.token_hex(2)}"


LOW_SPACE_BYTES = 1 << 20  # below this, a failed write is taken for a full disk


def free_bytes(path: Path | str) -> int | None:
    """The bytes free for this user on the file system of ``path`` (or of its nearest existing
    parent), or None where it cannot be told."""
    path = Path(path)
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        info = os.statvfs(path)
    except OSError:
        return None
    return info.f_bavail * info.f_frsize


def no_space_message(path: Path | str, what: str, free: int | None = None) -> str:
    """One line for a run that failed on a full disk: where, and how much is free there
    (``free``: as already measured; else measured now)."""
    free = free_bytes(path) if free is None else free
    shown = f"{free:,} bytes free" if free is not None else "free space unknown"
    return f"no space left on the device of {path} ({shown}): {what}; free some space, then resume from the last checkpoint"




# ---------------------------------------------------------------------------------------------
# run.json: several processes update it (the launcher, the supervisor, rank 0 of the engine), so
# every update is a locked read-modify-write that replaces the file atomically. A reader never
# sees a half-written file.
# ---------------------------------------------------------------------------------------------


# The checkpoint a run continues. (A comment, not a docstring: tools' schemas would repeat it.)
class ResumedFrom(BaseModel):
    model_config = ConfigDict(defer_build=True)

    run_id: str
    step: int
    path: str


# What a run trains on, and where its first phase is in tokenizing it: engine.data_summary,
# re-exported here, run.json's ``data``.
from engine.data_summary import DataPreparation as DataPreparation  # noqa: E402
from engine.data_summary import DataSummary as DataSummary  # noqa: E402



IsolationLevel = Literal["full", "partial", "none"]
RunKind = Literal["recipe", "script"]
CodeFrom = Literal["recipe", "checkpoint", "head"]
RunTarget = Literal["local", "slurm"]
RECIPE: RunKind = "recipe"
SCRIPT: RunKind = "script"
# A script's arguments become arguments of its command: bounded in number and length.
MAX_SCRIPT_ARGS, MAX_SCRIPT_ARG_CHARS, MAX_SCRIPT_ARG_NAME_CHARS = 64, 1000, 100


class MetricsDestination(BaseModel):
    """Where a run's metrics went: one per metrics backend the engine opened."""
    model_config = ConfigDict(defer_build=True)

    kind: str = Field(description="jsonl, tensorboard, wandb, mlflow or trackio.")
    location: str = Field(description="A file or folder, a tracking URI or a web address.")
    run: str | None = Field(None, description="The run there: project or experiment, and its name or id.")
    view: str | None = Field(None, description="How to look at it, or to upload an offline run.")


class SandboxMounts(BaseModel):
    """What a run's sandbox shows: read-only and writable folders, folders hidden inside them,
    and the bubblewrap it ran under (None: no sandbox)."""
    model_config = ConfigDict(defer_build=True)

    bwrap: str | None = None
    read_only: list[str] = []
    writable: list[str] = []
    hidden: list[str] = []


class HubModel(BaseModel):
    """A model (or data set) a run loads by Hub id, as the server resolved it (runner/hub.py)."""

    model_config = ConfigDict(defer_build=True, extra="ignore")

    given: str = Field(description="model.pretrained_path as given: org/name or org/name@revision.")
    repo_id: str
    revision: str = Field("main", description="The revision asked for (a branch, tag or commit).")
    commit: str = Field(description="The commit it resolved to; a resume loads this one.")
    path: str = Field(description="The snapshot folder in the server's Hugging Face cache, bound read-only.")
    bytes: int = Field(0, description="Size of the files fetched for the run.")
    repo_type: Literal["model", "dataset"] = Field("model", description="model.pretrained_path or data.dataset.")


# Who writes each field of a run's records, declared on the field (``Annotated[type, SERVER]``).
@dataclass(frozen=True)
class Owner:
    """The writer of a field of a run's records; what the tools show of a run
    (:func:`runner.server_record.known_run`) takes each field from its writer's record.

    ``writer``: ``server`` (the server and the run's supervisor, in the server's record, which
    every decision reads; run.json has a copy for the run's information), ``run`` (the run's own
    report in run.json: text and numbers to show, never acted on) or ``both`` (a list: the
    server's entries, then the run's own that differ). ``when_given``: the run's value only when
    it reports one. ``needs_record``: a fact only the server can vouch for (a process, the
    commit, the isolation, the limits, a SLURM job): a run the server did not start shows the
    field's default.
    """

    writer: Literal["server", "run", "both"]
    when_given: bool = False
    needs_record: bool = False


SERVER = Owner("server")
SERVER_ONLY = Owner("server", needs_record=True)
REPORTED = Owner("run")


class RunFacts(BaseModel):
    """The facts of a run that its record keeps and ``get_run`` shows (``mcp_server.models.RunInfo``
    derives from this class): each declared once, here."""
    model_config = ConfigDict(defer_build=True)

    status: Annotated[RunStatus, SERVER] = STARTING
    kind: Annotated[RunKind, SERVER] = Field(
        "recipe",
        description="recipe: an Engine subclass run by the engine; script: the user's own Python script, run as it "
        "is (its JSON lines on stdout are its metrics).",
    )
    recipe: Annotated[str, SERVER] = Field("", description="The recipe as launched, relative to the workspace.")
    snapshot: Annotated[str | None, SERVER] = Field(None, description="The folder of the code that ran (runs/<id>/recipe).")
    git_commit: Annotated[str | None, SERVER_ONLY] = Field(None, description="HEAD when the code was taken (None outside git).")
    recipe_dirty: Annotated[bool | None, SERVER_ONLY] = Field(
        None, description="The recipe had uncommitted changes (the run used them; see uncommitted.patch)."
    )
    nproc: Annotated[int, SERVER] = Field(1, description="Processes asked for.")
    world_size: Annotated[int | None, SERVER] = Field(None, description="Processes that ran.")
    created_at: Annotated[str | None, SERVER] = None
    started_at: Annotated[str | None, REPORTED] = None
    ended_at: Annotated[str | None, SERVER] = None
    exit_code: Annotated[int | None, SERVER] = None
    error: Annotated[str | None, SERVER] = Field(None, description="Why the run failed.")
    resumed_from: Annotated[ResumedFrom | None, SERVER_ONLY] = None
    overrides: Annotated[dict[str, Any], SERVER] = Field({}, description="Config overrides given at launch, dotted keys.")
    config_changes: Annotated[dict[str, Any], SERVER] = Field({}, description="Every key whose value differs from the code default.")
    limits: Annotated[dict[str, Any], SERVER_ONLY] = Field({}, description="The limits the run was started with.")
    warnings: Annotated[list[str], Owner("both")] = []
    network_isolated: Annotated[bool | None, SERVER_ONLY] = None
    network_note: Annotated[str | None, SERVER_ONLY] = None
    isolation: Annotated[IsolationLevel | None, SERVER_ONLY] = Field(None, description="The sandbox actually in force.")
    isolation_note: Annotated[str | None, SERVER_ONLY] = Field(None, description="What the isolation level is missing, if anything.")


class RunRecord(RunFacts):
    """run.json: everything known about one run. Each writer updates only its own fields (each
    declares its :class:`Owner`): the launcher creates it, the supervisor records processes and
    the outcome, rank 0 of the engine records the resolved config, its start, errors and
    warnings."""

    model_config = ConfigDict(extra="ignore", validate_assignment=True)

    id: Annotated[str, SERVER] = Field(description="The run id: <UTC time>-<recipe>-<random>.")
    snapshot_digest: Annotated[str | None, SERVER_ONLY] = Field(
        None, description="sha256 of the snapshot's files as written at launch; a resume of its code checks it."
    )
    script: Annotated[str | None, SERVER] = Field(
        None, max_length=MAX_SCRIPT_ARG_CHARS, description="kind script: the file that ran, relative to the snapshot."
    )
    script_args: Annotated[list[Annotated[str, Field(max_length=MAX_SCRIPT_ARG_CHARS)]], SERVER_ONLY] = Field(
        [], max_length=MAX_SCRIPT_ARGS, description="kind script: the arguments it was given."
    )
    resume_arg: Annotated[str | None, SERVER_ONLY] = Field(
        None, max_length=MAX_SCRIPT_ARG_NAME_CHARS,
        description="kind script: the option that takes a checkpoint's path on resume (e.g. --resume); None: no resume.",
    )
    code_from: Annotated[CodeFrom, SERVER] = Field(
        "recipe",
        description="recipe: the recipe folder at launch; checkpoint: the code of the run resumed "
        "from; head: the recipe folder at resume time.",
    )
    started_from: Annotated[ResumedFrom | None, SERVER_ONLY] = Field(
        None, description="A recipe launch from an earlier run's checkpoint (model.pretrained_path: run:ID@STEP): "
        "that run and step, and the folder it was exported to; the run's steps are its own."
    )
    dirty_files: Annotated[list[str], SERVER_ONLY] = Field([], description="Uncommitted files of the recipe (at most 20).")
    config: Annotated[dict[str, Any] | None, SERVER] = Field(None, description="The resolved config (defaults <- config.yaml <- overrides).")
    data: Annotated[DataSummary | None, Owner("run", when_given=True)] = Field(None, description="What the run trains on, counted before it started.")
    threads_per_process: Annotated[int | None, SERVER] = Field(None, description="OMP_NUM_THREADS of every process.")
    stop_requested: Annotated[bool, SERVER_ONLY] = False
    reason: Annotated[str | None, SERVER] = Field(None, description="Why the run stopped, when it was stopped.")
    final_step: Annotated[int | None, REPORTED] = None
    pid: Annotated[int | None, SERVER_ONLY] = Field(None, description="The supervisor (or the engine's rank 0 without one).")
    engine_pid: Annotated[int | None, Owner("run", needs_record=True)] = None
    child_pgid: Annotated[int | None, SERVER_ONLY] = None
    supervisor_started_at: Annotated[str | None, SERVER] = None
    workspace: Annotated[str | None, SERVER_ONLY] = None
    command: Annotated[list[str], SERVER_ONLY] = []
    sandbox: Annotated[SandboxMounts | None, SERVER_ONLY] = None
    hub_models: Annotated[list[HubModel], SERVER_ONLY] = Field([], description="Models and data sets loaded by Hub id: repo, revision and commit.")
    metrics_destinations: Annotated[list[MetricsDestination], REPORTED] = Field(
        [], description="Where the engine sent the metrics (metrics.jsonl, TensorBoard, W&B, MLflow, trackio)."
    )
    nnodes: Annotated[int, SERVER] = Field(1, description="Nodes (machines) of the run; nproc processes on each.")
    node_rank: Annotated[int | None, SERVER] = Field(None, description="This node's place among nnodes (0 creates the run, others join it).")
    rdzv_endpoint: Annotated[str | None, SERVER] = Field(None, description="host:port of torchrun's c10d rendezvous (nnodes > 1).")
    rdzv_id: Annotated[str | None, SERVER] = Field(None, description="The rendezvous id every node of the run passes (default: node 0's run id).")
    joins: Annotated[str | None, SERVER_ONLY] = Field(
        None, description="The run (node 0's) whose directory this node's processes write into: checkpoints need one folder."
    )
    target: Annotated[RunTarget, SERVER_ONLY] = Field("local", description="local: started here; slurm: an sbatch job.")
    slurm_script: Annotated[str | None, SERVER_ONLY] = Field(None, description="The job script, relative to the run directory (target slurm).")
    slurm_job_id: Annotated[str | None, SERVER_ONLY] = Field(None, description="The SLURM job id, once submitted.")
    slurm_state: Annotated[str | None, SERVER_ONLY] = Field(None, description="The job's last state from squeue, sacct or scontrol (PENDING (Resources), RUNNING, ...).")
    slurm_state_from: Annotated[str | None, SERVER_ONLY] = Field(
        None, description="Which command told slurm_state: squeue, sacct, or scontrol show job (and why not sacct)."
    )
    slurm_checked_at: Annotated[str | None, SERVER_ONLY] = Field(None, description="When squeue/sacct were last asked.")
    slurm_options: Annotated[dict[str, Any] | None, SERVER_ONLY] = Field(
        None, description="The job's slurm settings (partition, time, gpus_per_node, rdzv_port): a resume is a job with the same."
    )

    @field_validator("overrides", mode="before")
    @classmethod
    def _overrides_as_mapping(cls, value: Any) -> Any:
        # Runs recorded before overrides were a mapping kept "key=value" strings.
        if isinstance(value, list):
            return dict(str(item).partition("=")[::2] for item in value)
        return value

    @property
    def max_steps(self) -> int | None:
        steps = ((self.config or {}).get("train") or {}).get("max_steps")
        return steps if isinstance(steps, int) else None

    def effective_status(self) -> RunStatus:
        """The run's status as its report alone tells it (:func:`run_status`): the process
        recorded in ``pid`` (the supervisor, or the engine's rank 0 without one) watches it."""
        return run_status(self.status, lambda: pid_alive(self.pid) if self.pid else None)


def run_status(recorded: RunStatus, watcher_alive: Callable[[], bool | None]) -> RunStatus:
    """A run's status, the one rule every record follows: a final status stands; a live one
    stands while the process that watches the run lives, and is ``failed`` once that process is
    gone without recording an outcome. ``watcher_alive`` (asked only for a live status): None
    when no process here watches the run (its recorded status stands)."""
    if recorded in FINAL_STATUSES or watcher_alive() is not False:
        return recorded
    return FAILED


def _write_record(run_dir: Path, record: RunRecord) -> None:
    write_json_atomic(Path(run_dir) / RUN_JSON, record.model_dump(mode="json"))


def read_run(run_dir: Path) -> RunRecord:
    """The run's record. Raises OSError when it cannot be read and ValueError when it is not a
    RunRecord. A link or anything but a regular file is not read (the run may have put it
    there), and the error never quotes the file's content (it could be any host file)."""
    data = read_bounded(Path(run_dir) / RUN_JSON, MAX_RECORD_BYTES, f"{RUN_JSON} of {Path(run_dir).name}")
    try:
        return RunRecord.model_validate_json(data)
    except ValidationError as e:  # its message would quote the input
        first = e.errors(include_url=False, include_input=False, include_context=False)[0]
        where = ".".join(str(part) for part in first.get("loc", ())) or "the file"
        raise ValueError(f"{RUN_JSON} of {Path(run_dir).name} is not a run record "
                         f"({e.error_count()} errors; {where}: {first.get('msg')})") from None


def create_run(run_dir: Path, record: RunRecord) -> None:
    """Create the run directory and its first run.json. Fails if the run already exists."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=False)
    (run_dir / CHECKPOINTS_DIRNAME).mkdir()
    with locked(run_dir):
        _write_record(run_dir, record)


def update_run(run_dir: Path, **fields: Any) -> RunRecord:
    """Set ``fields`` of run.json (validated against RunRecord) and return the new record."""
    unknown = set(fields) - set(RunRecord.model_fields)
    if unknown:
        raise TypeError(f"RunRecord has no field {sorted(unknown)[0]!r}")
    run_dir = Path(run_dir)
    with locked(run_dir):
        record = read_run(run_dir)
        record = RunRecord.model_validate({**record.model_dump(), **fields})
        _write_record(run_dir, record)
    return record


def append_warning(run_dir: Path, message: str) -> RunRecord:
    """Add ``message`` to the run's warnings (once), under the lock."""
    run_dir = Path(run_dir)
    with locked(run_dir):
        record = read_run(run_dir)
        message = message[:MAX_WARNING_CHARS]
        if message not in record.warnings and len(record.warnings) < MAX_WARNINGS:
            record.warnings = [*record.warnings, message]
            _write_record(run_dir, record)
    return record




def pid_alive(pid: int | None) -> bool:
    """Whether the process ``pid`` is running: the one definition of a process's liveness
    (:mod:`runner.processes` and the server's record of a run's processes call it). A zombie
    counts as gone (its exit status only waits to be collected); 0, 1 and negative numbers name
    groups, init or every process, never a run's process."""
    if not isinstance(pid, int) or pid <= 1:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return True  # no /proc (not Linux): kill() found it
