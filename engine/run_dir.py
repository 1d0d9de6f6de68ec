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
module is the single definition of that format: ``RunRecord`` and ``MetricRecord`` are the
only definitions of run.json and of a metrics line, and run.json is read and written only
through :func:`read_run`, :func:`create_run`, :func:`update_run` and
:func:`append_warning`. It is torch-free (stdlib and pydantic): the MCP server imports it
to read runs without paying for a torch import.

run.json lives in the run directory, which the run's own processes may write: it is the run's
report (its step, warnings, where its metrics went, its view of its status), never a reason for
the server to act. What the server and the run's supervisor decide is kept in the server's
record of the run (:mod:`runner.server_record`), outside every sandbox's writable folders.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import fcntl
import json
import math
import os
import re
import secrets
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, BinaryIO, Callable, Iterator, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from engine import checkpoint_manifest as manifest
from engine.errors import BadInput, NotFound

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
MAX_RUN_JSON_BYTES = 16 * 2**20
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


def checkpoint_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def checkpoint_step(path: Path) -> int | None:
    """The step of a published checkpoint directory, or None when the name is not one."""
    match = _CHECKPOINT_NAME.fullmatch(path.name)
    return int(match.group(1)) if match else None


def list_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints of a run, oldest first: published (:func:`published_checkpoints`),
    and every file of each there at the size its manifest says (:mod:`engine.checkpoint_manifest`)."""
    return [(step, path) for step, path in published_checkpoints(run_dir) if manifest.problem(path, full=False) is None]


def unusable_checkpoints(run_dir: Path) -> list[tuple[int, str]]:
    """The published checkpoints that are not complete, with what is wrong with each."""
    found = ((step, manifest.problem(path, full=False)) for step, path in published_checkpoints(run_dir))
    return [(step, why) for step, why in found if why is not None]


def published_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """Checkpoints published under their final name with DCP's metadata in them, oldest first.

    A save that was interrupted lives under a ``.partial-`` name and is never listed.
    Nothing is followed through a link: run code writes this folder, and a link (the folder,
    a ``step-`` entry, or its ``.metadata``) could lead a resume (whose sandbox binds the
    checkpoint by path) to another run's files, or make the listing say whether a host path
    exists.
    """
    root = Path(run_dir) / CHECKPOINTS_DIRNAME
    try:
        root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | _NO_FOLLOW)
    except OSError:  # missing, a link, not a folder
        return []
    found = []
    try:
        for name in os.listdir(root_fd):
            step = checkpoint_step(Path(name))
            if step is None:
                continue
            try:
                entry_fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | _NO_FOLLOW, dir_fd=root_fd)
            except OSError:
                continue
            try:
                metadata = os.stat(DCP_METADATA, dir_fd=entry_fd, follow_symlinks=False)
            except OSError:
                continue
            finally:
                os.close(entry_fd)
            if stat.S_ISREG(metadata.st_mode):
                found.append((step, root / name))
    finally:
        os.close(root_fd)
    return sorted(found)


_SCRIPT_CHECKPOINT_STEP = re.compile(r"(\d{1,12})(?!.*\d)")


def list_script_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """The checkpoints a script run wrote in its own format, oldest first: each file or folder
    directly under ``checkpoints/`` whose name holds a number, the last number being its step
    (``step-200/``, ``ckpt_100.pt``, ``epoch3.pt``). Hidden names (a save in progress, by the
    usual ``.tmp`` habit) and links are not checkpoints, and nothing is followed through a link
    (the same reasons as :func:`list_checkpoints`); at one step the last name in order wins."""
    root = Path(run_dir) / CHECKPOINTS_DIRNAME
    try:
        root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | _NO_FOLLOW)
    except OSError:
        return []
    found: dict[int, Path] = {}
    try:
        for name in sorted(os.listdir(root_fd)):
            match = _SCRIPT_CHECKPOINT_STEP.search(name)
            if name.startswith(".") or match is None:
                continue
            try:
                info = os.stat(name, dir_fd=root_fd, follow_symlinks=False)
            except OSError:
                continue
            if stat.S_ISREG(info.st_mode) or stat.S_ISDIR(info.st_mode):
                found[int(match.group(1))] = root / name
    finally:
        os.close(root_fd)
    return sorted(found.items())


def run_checkpoints(run_dir: Path, kind: RunKind) -> list[tuple[int, Path]]:
    """A run's checkpoints as its kind defines them: the engine's complete ``step-<N>`` folders,
    or a script's own files (:func:`list_script_checkpoints`)."""
    return list_script_checkpoints(run_dir) if kind == SCRIPT else list_checkpoints(run_dir)


def latest_checkpoint(run_dir: Path) -> tuple[int, Path] | None:
    checkpoints = list_checkpoints(run_dir)
    return checkpoints[-1] if checkpoints else None


def corrupt_checkpoint_message(run_dir: Path, step: int, why: str, full: bool = False) -> str:
    """Why the checkpoint at ``step`` cannot be used, and the latest earlier one that can (its
    files checked by size; with ``full``, by digest too)."""
    earlier = [(s, path) for s, path in list_checkpoints(run_dir) if s < step]
    good = next((s for s, path in reversed(earlier) if not full or manifest.problem(path, full=True) is None), None)
    run_id = Path(run_dir).name
    then = (f"the latest good checkpoint before it is step {good} (resume_checkpoint(run_id={run_id!r}, step={good}))"
            if good is not None else "there is no good checkpoint before it")
    return f"checkpoint {checkpoint_dir_name(step)} of run {run_id} is corrupt: {why}; {then}"


def choose_checkpoint(run_dir: Path, kind: RunKind, step: object, verified: bool = False) -> tuple[int, Path]:
    """The checkpoint of the run at ``step`` (None: the latest complete one), as its kind defines
    them; a step whose checkpoint is not complete is refused with what is wrong and which
    earlier one is good. ``verified``: an engine checkpoint's digests are checked too (every
    byte read), before a run or a model is built on it."""
    chosen = _choose_checkpoint(run_dir, kind, step)
    if verified and kind != SCRIPT:
        why = manifest.problem(chosen[1], full=True)
        if why is not None:
            raise BadInput(corrupt_checkpoint_message(run_dir, chosen[0], why, full=True))
    return chosen


def _choose_checkpoint(run_dir: Path, kind: RunKind, step: object) -> tuple[int, Path]:
    run_id = Path(run_dir).name
    checkpoints = run_checkpoints(run_dir, kind)
    if step is not None and (isinstance(step, bool) or not isinstance(step, int)):
        raise BadInput(f"step must be an integer, got {step!r}")
    by_step = dict(checkpoints)
    if step is None and checkpoints:
        return checkpoints[-1]
    if step in by_step:
        return step, by_step[step]
    unusable = dict(unusable_checkpoints(run_dir)) if kind != SCRIPT else {}
    if step in unusable:
        raise BadInput(corrupt_checkpoint_message(run_dir, step, unusable[step]))
    if not checkpoints:
        broken = (f" ({len(unusable)} not complete: {corrupt_checkpoint_message(run_dir, max(unusable), unusable[max(unusable)])})"
                  if unusable else "")
        raise NotFound(f"run {run_id} has no complete checkpoint{broken}; list_checkpoints shows them as they come")
    raise NotFound(f"run {run_id} has no complete checkpoint at step {step}; "
                   f"available steps: {', '.join(str(s) for s, _ in checkpoints[-20:])}")


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


class DataSummary(BaseModel):
    """What a run trains on, counted before it starts (Engine.summarize_data): the source and
    paths given, files read, documents and tokens (end-of-document tokens included) in all and
    per split, and the tokenizer that counted them. ``tokens`` counts every token of the
    examples as trained on (cut to the sequence length); ``loss_tokens`` those the loss is over
    (an SFT's assistant turns, a preference pair's answers), None when that is every token."""
    model_config = ConfigDict(defer_build=True)

    source: str
    paths: list[str] = []
    files: int | None = None
    documents: int
    tokens: int
    train_documents: int
    eval_documents: int
    train_tokens: int
    eval_tokens: int
    tokenizer: str | None = None
    fingerprint: str | None = Field(
        None, description="SHA-256 over the data files' paths and bytes as counted; None for generated data."
    )
    format: str | None = Field(None, max_length=200, description="The records' format(s): messages, sharegpt, alpaca, ...")
    mask: str | None = Field(
        None, max_length=200,
        description="What the loss covers: generation_markers | turn_render (assistant turns) | completion | all_tokens.",
    )
    loss_tokens: int | None = Field(None, description="Tokens the loss covers (labels), after cutting to data.seq_len.")
    truncated: int | None = Field(None, description="Examples cut by data.seq_len (still trained on).")
    dropped: int | None = Field(None, description="Examples left out: nothing in them to learn.")
    dropped_why: str | None = Field(None, max_length=500, description="Why, with counts.")
    train_loss_tokens: int | None = None
    eval_loss_tokens: int | None = None
    seq_len_to_keep: int | None = Field(
        None, description="The data.seq_len at which every example dropped for its length would have tokens to learn."
    )
    skipped: list[str] = Field([], description="Files of the folders and globs given that were not read, and why.")

    def nothing_to_train(self) -> str | None:
        """Why a run on this data would train on nothing (a launch refuses it), or None."""
        if self.train_documents > 0:
            return None
        read = self.documents + (self.dropped or 0)
        if self.eval_documents:
            return (f"nothing to train on: all {_count(self.eval_documents, 'usable example')} of the data fall in "
                    f"the held-out split; lower data.eval_fraction or add data")
        if not read:
            return "nothing to train on: the data has no examples; check data.paths / data.dataset"
        advice = (f"; data.seq_len={self.seq_len_to_keep} would keep those cut by length"
                  if self.seq_len_to_keep else "")
        return (f"nothing to train on: all {_count(read, 'example')} read were left out "
                f"({self.dropped_why or 'nothing in them to learn'}){advice}")

    def describe(self) -> str:
        """One line, for the console, notes and reviews."""
        where = f" from {', '.join(self.paths[:3])}" if self.paths else ""
        files = f"{_count(self.files, 'file')}, " if self.files is not None else ""
        loss = f" ({self.loss_tokens:,} of them loss tokens)" if self.loss_tokens is not None else ""
        if self.skipped:
            files += f"{len(self.skipped) if not self.skipped[-1].startswith('…') else 'many'} skipped " \
                     f"({self.skipped[0]}{'; …' if len(self.skipped) > 1 else ''}), "
        return (
            f"data: {self.source}{where}: {files}{_count(self.documents, 'document')}, "
            f"{_count(self.tokens, 'token')}{loss} (train {self.train_documents:,} documents / "
            f"{self.train_tokens:,} tokens, eval {self.eval_documents:,} / {self.eval_tokens:,})"
            + (f"; format {self.format}, loss on {self.mask}" if self.format and self.mask else "")
            + (f", {self.truncated:,} truncated" if self.truncated else "")
            + (f", {self.dropped:,} dropped ({self.dropped_why})" if self.dropped else "")
        )


def _count(n: int, noun: str) -> str:
    return f"{n:,} {noun}" + ("" if n == 1 else "s")


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


class SandboxView(BaseModel):
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
    """The writer of a field of a run's records; a view of a run (:func:`runner.server_record.view`)
    takes each field from its writer's record.

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
    sandbox: Annotated[SandboxView | None, SERVER_ONLY] = None
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
    slurm_state: Annotated[str | None, SERVER_ONLY] = Field(None, description="The job's last state from squeue/sacct (PENDING, RUNNING, ...).")
    slurm_checked_at: Annotated[str | None, SERVER_ONLY] = Field(None, description="When squeue/sacct were last asked.")

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


@contextlib.contextmanager
def locked(run_dir: Path, lock_name: str = ".run.json.lock") -> Iterator[None]:
    lock_path = Path(run_dir) / lock_name
    with os.fdopen(_open_lock(lock_path), "rb") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)


# The run directory is written by recipe code, and the supervisor and the server (outside the
# sandbox) write and read run.json there: every name they open may be a link or a FIFO the run
# left. So nothing there is opened following a link or waiting on a FIFO.
_NO_FOLLOW = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def _open_lock(path: Path) -> int:
    """A descriptor of the regular lock file ``path``; anything else at its name (a link, a
    FIFO, left by the run) is removed first (unlinking never follows a link)."""
    for _ in range(3):
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | _NO_FOLLOW, 0o644)
        except OSError:  # ELOOP: a link; ENXIO and the like: not a file
            fd = None
        if fd is not None:
            if stat.S_ISREG(os.fstat(fd).st_mode):
                return fd
            os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    raise OSError(f"{path.name} in {path.parent} is not a regular file and could not be replaced")


def write_json_atomic(path: Path, data: Any) -> None:
    path = Path(path)
    # A new file with a random name (mkstemp: O_EXCL, which never follows a link): a name the run
    # could predict (the writer's pid is in run.json) may be a link it planted to a host file.
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o644)
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=2, sort_keys=True)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _write_record(run_dir: Path, record: RunRecord) -> None:
    write_json_atomic(Path(run_dir) / RUN_JSON, record.model_dump(mode="json"))


def read_bounded(path: Path, limit: int, what: str) -> bytes:
    """The bytes of a record file, opened without following a link or waiting on a FIFO:
    OSError when it is not a regular file, ValueError when it is larger than ``limit``."""
    fd = os.open(path, os.O_RDONLY | _NO_FOLLOW)
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{what} is not a regular file")
        data = f.read(limit + 1)
    if len(data) > limit:
        raise ValueError(f"{what} is larger than {limit} bytes")
    return data


def read_run(run_dir: Path) -> RunRecord:
    """The run's record. Raises OSError when it cannot be read and ValueError when it is not a
    RunRecord. A link or anything but a regular file is not read (the run may have put it
    there), and the error never quotes the file's content (it could be any host file)."""
    data = read_bounded(Path(run_dir) / RUN_JSON, MAX_RUN_JSON_BYTES, f"{RUN_JSON} of {Path(run_dir).name}")
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


# ---------------------------------------------------------------------------------------------
# metrics.jsonl
# ---------------------------------------------------------------------------------------------


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
        fd = os.open(path, os.O_RDONLY | _NO_FOLLOW)
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
