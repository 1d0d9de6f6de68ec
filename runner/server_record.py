"""The server's record of a run: what the server and the run's supervisor decided and saw.

A run has two records with two owners:

- ``runs/<id>/run.json`` (:class:`engine.run_dir.RunRecord`) is in the run directory, which the
  run's processes may write: it is the run's **report** (its step, warnings, where its metrics
  went, its own view of its status) and is read as untrusted input;
- ``.trainwright/runs/<id>/record.json`` (:class:`ServerRecord`, below) is written only by the
  server and the run's supervisor, outside every sandbox's writable folders (the sandbox shows
  ``.trainwright/`` as an empty folder; SECURITY.md): which processes are the run's and how to
  recognise them, the commit, recipe and snapshot digest, the dirty flag and files, the
  isolation it got, the target and SLURM job, the limits, the parent run, and the outcome.

Every decision (stop, capacity, status, notes, resume, joins, SLURM, review) reads the server's
record; :func:`known_run` gives tools the server's record with the few fields that are the run's own
taken from its report. Each field declares its writer (:class:`engine.run_dir.Owner`, in
``Annotated``); :data:`REPORTED_FIELDS` and what a run the server did not start shows are
derived from those declarations. A ``ServerRecord`` is a ``RunRecord`` (the same
fields and meanings) plus the identities of the processes the server started.

Torch-free (stdlib and pydantic): the server imports it.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import functools
import os
import re
import signal
import stat
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, field_validator

from engine import run_dir as rd
from engine import run_files
from engine.errors import BadInput
from workspace.git import COMMIT_ID
from workspace.settings import RunLimits
from workspace.workspace import RECORD_JSON, record_dir

_RECORD_LOCK = ".record.json.lock"
# A run whose supervisor has not been recorded this long after its creation never got one (the
# launcher died in between): it is not running.
STARTING_GRACE_S = 60.0

SLURM_JOB_ID = re.compile(r"^\d{1,20}(_\d{1,20})?$")

NOT_STARTED_BY_SERVER = (
    "this run was not started by trainwright's server (it has no record in .trainwright/runs/): its status "
    "and provenance are only what its own run.json says, and the server never signals or resumes it as its code"
)


class ProcessIdentity(BaseModel):
    """A process the server or the supervisor started, as the kernel knows it: its pid, when it
    started (``/proc/<pid>/stat`` field 22, in clock ticks since boot) and its session. A pid
    alone may be reused by any other process once the run's has ended; the three together
    are not."""
    model_config = ConfigDict(defer_build=True)

    pid: int = Field(gt=1)
    start_ticks: int = Field(ge=0)
    session: int = Field(ge=0)  # 0 when the session's leader is outside this PID namespace (a container)

    def alive(self) -> bool:
        """The same process is still running (not a zombie)."""
        now = identify(self.pid)
        return now is not None and now == self

    def send_signal(self, sig: int) -> bool:
        """Signal this process, and nothing else: a pidfd pins the process before its identity
        is checked, so a pid reused in between is never signalled."""
        try:
            fd = os.pidfd_open(self.pid)
        except (OSError, AttributeError):
            return False
        try:
            if not self.alive():
                return False
            signal.pidfd_send_signal(fd, sig)
            return True
        except OSError:
            return False
        finally:
            os.close(fd)

    def signal_group(self, sig: int) -> bool:
        """Signal the process group this process leads (it was started in a session of its own:
        its pid is its group's id), while it is the process that was recorded."""
        if self.session != self.pid or not self.alive():
            return False
        try:
            os.killpg(self.pid, sig)
            return True
        except (ProcessLookupError, PermissionError):
            return False


def identify(pid: int | None) -> ProcessIdentity | None:
    """The identity of the live process ``pid`` (:func:`engine.run_dir.pid_alive`), or None
    (gone, a zombie, or not a process id the server could have started: 0, 1 and negative
    numbers name groups or every process)."""
    if pid is None or not rd.pid_alive(pid):
        return None
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read().decode("ascii", errors="replace")
    except OSError:
        return None
    fields = text.rsplit(")", 1)[-1].split()
    try:
        session, start_ticks = int(fields[3]), int(fields[19])
    except (IndexError, ValueError):
        return None
    if session < 0:
        return None
    return ProcessIdentity(pid=pid, start_ticks=start_ticks, session=session)


class ServerRecord(rd.RunRecord):
    """``.trainwright/runs/<id>/record.json``: the run as the server and its supervisor know it
    (see the module docstring). Written only outside the sandbox; every value that becomes an
    argument of a command is checked here when it is written and when it is read."""

    run_dir: Annotated[str | None, rd.SERVER_ONLY] = Field(None, description="The run directory (where the run writes).")
    supervisor: Annotated[ProcessIdentity | None, rd.SERVER_ONLY] = Field(
        None, description="The supervisor the server started."
    )
    engine_group: Annotated[ProcessIdentity | None, rd.SERVER_ONLY] = Field(
        None, description="The leader of the engine's process group (bwrap in the sandbox), started by the supervisor."
    )
    started_by_server: Annotated[bool, rd.SERVER] = Field(
        True, description="False only for a run that has no server record (its report alone)."
    )

    @field_validator("git_commit")
    @classmethod
    def _commit_is_a_sha(cls, value: str | None) -> str | None:
        if value is not None and not COMMIT_ID.fullmatch(value):
            raise ValueError("git_commit must be a full commit id (40 or 64 lower-case hex digits)")
        return value

    @field_validator("slurm_job_id")
    @classmethod
    def _job_id_is_a_job_id(cls, value: str | None) -> str | None:
        if value is not None and not SLURM_JOB_ID.fullmatch(value):
            raise ValueError("slurm_job_id must be a SLURM job id (digits, or digits_digits)")
        return value

    @field_validator("pid", "child_pgid", "engine_pid")
    @classmethod
    def _a_single_process(cls, value: int | None) -> int | None:
        if value is not None and value <= 1:
            raise ValueError("a process id of a run is above 1")
        return value

    def run_limits(self) -> RunLimits:
        """The limits the run was started with, read back into their model (the record keeps
        them as JSON in ``limits``; a key it lacks has the settings' default, and a grace that is
        not above 0, which the settings never give, is the default one: a stop always warns first)."""
        limits = _limits_model().validate_python(self.limits)
        if not limits.stop_grace_s > 0:
            limits = dataclasses.replace(limits, stop_grace_s=RunLimits.stop_grace_s)
        return limits

    def supervisor_alive(self) -> bool:
        return self.supervisor is not None and self.supervisor.alive()

    def effective_status(self) -> rd.RunStatus:
        """The run's status as the server knows it (:func:`engine.run_dir.run_status`): final only
        from the supervisor's (or the server's) own record of the outcome; live while the
        supervisor the server started lives (before one is recorded: for
        ``STARTING_GRACE_S`` after the record was made); failed once it is gone without
        recording one. A run the server did not start here (its report alone, a SLURM job) is
        what its record says."""
        return rd.run_status(self.status, self._watcher_alive)

    def _watcher_alive(self) -> bool | None:
        if not self.started_by_server or self.target != "local":
            return None
        if self.supervisor is None:  # the launcher has not recorded it yet, or died first
            return _age_s(self.created_at) < STARTING_GRACE_S
        return self.supervisor.alive()


SUPERVISOR_GONE = "the run's supervisor is gone without recording an outcome (killed?)"


@functools.cache
def _limits_model() -> TypeAdapter[RunLimits]:
    return TypeAdapter(RunLimits)  # built on first use: the server's start does not pay for it


def _owners() -> dict[str, rd.Owner]:
    """Each field's :class:`~engine.run_dir.Owner`, as the field declares it."""
    owners = {}
    for name, info in ServerRecord.model_fields.items():
        declared = [m for m in info.metadata if isinstance(m, rd.Owner)]
        if len(declared) != 1:
            raise TypeError(f"ServerRecord.{name} must declare its owner once (Annotated[..., Owner(...)])")
        owners[name] = declared[0]
    return owners


OWNERS = _owners()
# The fields of what tools show of a run that come from its own report (run.json), not from the server; and
# those that come from it when it gives one (the data summary: the engine counts again when the
# data changed after the check).
REPORTED_FIELDS = tuple(n for n, o in OWNERS.items() if o.writer == "run" and not o.when_given)
REPORTED_WHEN_GIVEN = tuple(n for n, o in OWNERS.items() if o.writer == "run" and o.when_given)
# Lists of the server's entries, then the run's own.
MERGED_FIELDS = tuple(n for n, o in OWNERS.items() if o.writer == "both")


def _age_s(stamp: str | None) -> float:
    try:
        created = _dt.datetime.fromisoformat(stamp or "")
    except ValueError:
        return float("inf")
    if created.tzinfo is None:
        return float("inf")
    return (_dt.datetime.now(_dt.timezone.utc) - created).total_seconds()


# ---------------------------------------------------------------------------------------------
# Where the records live, and their reading and writing (locked, atomic, never through a link)
# ---------------------------------------------------------------------------------------------


def _real_dirs(path: Path, depth: int) -> None:
    """Create the last ``depth`` folders of ``path`` where missing; refuse a link or anything but
    a folder in their place (the agent can write the workspace)."""
    parts = [path.parents[i] for i in range(depth - 2, -1, -1)] + [path]
    for folder in parts:
        try:
            os.mkdir(folder, 0o755)
        except FileExistsError:
            pass
        info = os.lstat(folder)
        if not stat.S_ISDIR(info.st_mode):
            raise BadInput(f"{folder} is a link or a file; trainwright keeps its records of runs in real folders: "
                           "replace it by a folder")


def _write(folder: Path, record: ServerRecord) -> None:
    run_files.write_json_atomic(folder / RECORD_JSON, record.model_dump(mode="json"))


def create_record(folder: Path, record: ServerRecord) -> None:
    """The first record of a run (its folder is created; one that exists already is an error)."""
    folder = Path(folder)
    _real_dirs(folder.parent, 2)
    os.mkdir(folder, 0o755)
    with run_files.locked(folder, _RECORD_LOCK):
        _write(folder, record)


def read_record(folder: Path) -> ServerRecord:
    """The server's record in ``folder``. FileNotFoundError when there is none; OSError when it
    cannot be read; ValueError when it is not a record (never quoting it)."""
    data = run_files.read_bounded(Path(folder) / RECORD_JSON, rd.MAX_RECORD_BYTES, f"the server's record of {Path(folder).name}")
    try:
        return ServerRecord.model_validate_json(data)
    except ValidationError as e:
        raise ValueError(f"the server's record of run {Path(folder).name} is not valid "
                         f"({e.error_count()} errors)") from None


def update_record(folder: Path, **fields: Any) -> ServerRecord:
    """Set ``fields`` of the server's record (validated) and return it."""
    unknown = set(fields) - set(ServerRecord.model_fields)
    if unknown:
        raise TypeError(f"ServerRecord has no field {sorted(unknown)[0]!r}")
    folder = Path(folder)
    with run_files.locked(folder, _RECORD_LOCK):
        record = read_record(folder)
        record = ServerRecord.model_validate({**record.model_dump(), **fields})
        _write(folder, record)
    return record


def mirror_to_report(run_dir: Path | str | None, **fields: Any) -> None:
    """Copy ``fields`` into the run's run.json as well, for the run's own information and for
    readers of the run directory alone; never read back for a decision. A run.json the run has
    made unreadable is left as it is."""
    if not run_dir:
        return
    try:
        rd.update_run(Path(run_dir), **fields)
    except (OSError, ValueError, TypeError):
        pass


# ---------------------------------------------------------------------------------------------
# What tools read
# ---------------------------------------------------------------------------------------------


def _report(run_dir: Path) -> rd.RunRecord | None:
    try:
        return rd.read_run(run_dir)
    except (OSError, ValueError):
        return None


def known_run(workspace: Path | str, run_dir: Path | str) -> ServerRecord:
    """A run as tools show it and decide on it: the server's record, with the fields that are
    the run's own report (:data:`REPORTED_FIELDS`, and its warnings after the server's) from its
    run.json when that can be read. A run the server did not start (no record: the engine run
    by hand, or a run made before records existed) is its report alone, with every field the
    server would own blanked (no processes, no commit, no isolation, no SLURM job) and a warning
    that says so. Raises OSError or ValueError only when neither record can be read."""
    run_dir = Path(run_dir)
    try:
        record = read_record(record_dir(workspace, run_dir.name))
    except FileNotFoundError:
        return _unverified(run_dir)
    return merge(record, _report(run_dir))


def merge(record: ServerRecord, report: rd.RunRecord | None) -> ServerRecord:
    """``record`` with the fields that are the run's own taken from its ``report`` (if any)."""
    if report is None:
        return record
    update: dict[str, Any] = {name: getattr(report, name) for name in REPORTED_FIELDS}
    update.update({name: getattr(report, name) for name in REPORTED_WHEN_GIVEN if getattr(report, name) is not None})
    for name in MERGED_FIELDS:
        known = set(getattr(record, name))
        update[name] = [*getattr(record, name), *(w for w in getattr(report, name) if w not in known)]
    return record.model_copy(update=update)


def report(run_dir: Path | str) -> rd.RunRecord | None:
    """The run's report (its run.json), or None when it cannot be read as one."""
    return _report(Path(run_dir))


def _unverified(run_dir: Path) -> ServerRecord:
    report = rd.read_run(run_dir)
    # What only the server can vouch for (no processes, no commit, no isolation, no SLURM job) is
    # each field's default.
    blank = {name: ServerRecord.model_fields[name].get_default(call_default_factory=True)
             for name, owner in OWNERS.items() if owner.needs_record}
    data = {**report.model_dump(), **blank, "id": run_dir.name, "started_by_server": False,
            "warnings": [NOT_STARTED_BY_SERVER, *report.warnings][: rd.MAX_WARNINGS]}
    return ServerRecord.model_validate(data)


