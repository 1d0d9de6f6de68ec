"""Runs of the user's own training script: its command, its arguments, its metrics.

A script run (``launch_run`` on a ``.py`` file, or on a folder whose ``train.py`` is not a
recipe) runs the script as it is, in the sandbox of every run (:mod:`runner.lifecycle`), from a
snapshot of its code: the file alone, or the folder it is the ``train.py`` of. Nothing imports
it first (there is no launch check: running it is the only way to know what it does). It runs
with its run directory as its working directory (the workspace is read-only; ``checkpoints/``
there is what ``list_checkpoints`` lists), under ``torchrun`` when ``nproc`` > 1.

Its metrics are the lines it prints to stdout that are JSON objects with an integer ``step``
(``{"step": 10, "loss": 2.31}``); ``trainwright.track`` prints such a line. The supervisor
(outside the sandbox) reads the script's output as it comes, copies it to ``console.log`` and
turns those lines into metrics records (:class:`ScriptMetrics`): script output is untrusted,
so a line is bounded, only finite numbers are kept, and the number of records is bounded. The
scalars of TensorBoard event files the script writes in its run directory become records the
same way (:class:`EventScalars`).
"""

from __future__ import annotations

import json
import os
import re
import stat
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from pydantic import ValidationError

from engine import run_dir as rd
from engine import run_metrics
from engine.errors import BadInput
from runner.nodes import Nodes, torchrun_args
from runner.tensorboard_events import UNREAD, EventFiles

SCRIPT_NAME = "train.py"
DOCS_PAGE = "docs/script-to-recipe.md"
# A metrics line is short; a longer line is console output only.
MAX_METRIC_LINE_BYTES = 4096
MAX_METRIC_KEYS = 32
MAX_METRIC_KEY_CHARS = 64
MAX_SCRIPT_METRIC_RECORDS = 100_000
MAX_STEP = 10**12


@dataclass(frozen=True)
class ScriptLaunch:
    """A script run as launched: its file in the code folder, its arguments, the option that
    takes a checkpoint's path on resume, and whether the file alone is the code (else its
    folder is)."""

    script: str
    args: list[str] = field(default_factory=list)
    resume_arg: str | None = None
    alone: bool = False


def check_args(args: object) -> list[str]:
    """A script's arguments as given: a list of at most ``MAX_SCRIPT_ARGS`` strings, each at most
    ``MAX_SCRIPT_ARG_CHARS`` long, printable (no NUL or other control characters)."""
    if args is None:
        return []
    if not isinstance(args, list) or not all(isinstance(arg, str) for arg in args):
        raise BadInput(f'args must be a list of strings (the script\'s command line: ["--epochs", "3"]), '
                       f"got {type(args).__name__}{' with a non-string item' if isinstance(args, list) else ''}")
    if len(args) > rd.MAX_SCRIPT_ARGS:
        raise BadInput(f"args holds {len(args)} items; a script takes at most {rd.MAX_SCRIPT_ARGS}")
    for index, arg in enumerate(args):
        if len(arg) > rd.MAX_SCRIPT_ARG_CHARS:
            raise BadInput(f"args[{index}] is {len(arg)} characters long; at most {rd.MAX_SCRIPT_ARG_CHARS}")
        if not arg.isprintable():
            raise BadInput(f"args[{index}] holds a control character (NUL, newline, ...); give plain text")
    return list(args)


# An argument that names an earlier run's checkpoint, for a script that trains further from it:
# ``run:RUN_ID`` (its latest complete checkpoint) or ``run:RUN_ID@STEP``, alone or as an option's
# value (``--init=run:RUN_ID@40``). The server puts the checkpoint's path in its place.
CHECKPOINT_REFERENCE = re.compile(r"(?P<option>-[^=]*=)?run:(?P<run_id>[A-Za-z0-9._-]+)(?:@(?P<step>[0-9]{1,12}))?")


@dataclass(frozen=True)
class CheckpointReference:
    """``args[index]`` names run ``run_id``'s checkpoint at ``step`` (None: its latest), after
    ``option`` (``"--init="``, or ``""`` when the argument is the reference alone)."""

    index: int
    option: str
    run_id: str
    step: int | None


def checkpoint_reference(args: list[str]) -> CheckpointReference | None:
    """The one argument of ``args`` that names an earlier run's checkpoint
    (:data:`CHECKPOINT_REFERENCE`); None when none does. Two are refused: a run starts from one
    checkpoint."""
    found = [(index, match) for index, arg in enumerate(args)
             if (match := CHECKPOINT_REFERENCE.fullmatch(arg)) is not None]
    if len(found) > 1:
        raise BadInput(f"args name {len(found)} runs' checkpoints (run:RUN_ID[@STEP]); a run starts from one")
    if not found:
        return None
    index, match = found[0]
    step = match.group("step")
    return CheckpointReference(index, match.group("option") or "", match.group("run_id"),
                               None if step is None else int(step))


def check_resume_arg(resume_arg: object) -> str | None:
    """The option that passes a checkpoint's path to the script on resume: ``--resume``,
    ``--ckpt_path``, ``-r`` (None: the script cannot be resumed)."""
    if resume_arg is None:
        return None
    if (not isinstance(resume_arg, str) or not 2 <= len(resume_arg) <= rd.MAX_SCRIPT_ARG_NAME_CHARS
            or not resume_arg.startswith("-") or not all(c.isalnum() or c in "-_." for c in resume_arg)):
        raise BadInput(f"resume_arg must be the script's option that takes a checkpoint path, as it is typed "
                       f"(--resume, --ckpt_path), at most {rd.MAX_SCRIPT_ARG_NAME_CHARS} characters; got {resume_arg!r}")
    return resume_arg


def neither_recipe_nor_script(label: str) -> str:
    """The message for a folder that is neither of the two things a run can start from."""
    return (f"{label!r} is neither a recipe folder (a recipe.py defining one Engine subclass; scaffold_recipe makes "
            f"one) nor a training script (a .py file, or a folder with a {SCRIPT_NAME}): launch_run takes either; "
            f"{DOCS_PAGE} says what only a recipe gives")


def script_command(script: Path, args: list[str], nproc: int, nodes: Nodes = Nodes(), rdzv_id: str = "") -> list[str]:
    """``python SCRIPT ARGS``, or the same under torchrun (which sets RANK, LOCAL_RANK,
    WORLD_SIZE, MASTER_ADDR and MASTER_PORT for each process) when ``nproc`` > 1."""
    if nproc > 1 or nodes.multi:
        return [sys.executable, "-m", "torch.distributed.run", *torchrun_args(nodes, nproc, rdzv_id),
                str(script), *args]
    return [sys.executable, str(script), *args]


def check_resumable(record: rd.RunRecord) -> None:
    """Refuse to resume a script run launched without ``resume_arg``, saying how to go on."""
    if record.resume_arg is None:
        raise BadInput(
            f"run {record.id} is a script run launched without resume_arg, so nothing says how to pass its script a "
            "checkpoint; launch the script again with resume_arg naming its option for a checkpoint path "
            '(e.g. "--resume"), or make it a recipe for resumes the engine does itself (' + DOCS_PAGE + ")"
        )


def resume_args(record: rd.RunRecord, checkpoint: Path, args: list[str] | None = None) -> list[str]:
    """The arguments of a script run that continues ``record`` from ``checkpoint``: ``args``
    (new ones, checked; default: its own), without an earlier resume's option, then
    ``resume_arg PATH``."""
    check_resumable(record)
    assert record.resume_arg is not None
    args = list(record.script_args) if args is None else check_args(args)
    if record.resume_arg in args:  # a resume of a resume: the newer checkpoint replaces the older
        at = args.index(record.resume_arg)
        del args[at:at + 2]
    return [*args, record.resume_arg, str(checkpoint)]


class ScriptMetrics:
    """Turns a script's stdout lines into metrics records appended to ``metrics.jsonl``.

    A line counts when it is at most ``MAX_METRIC_LINE_BYTES`` long and a JSON object with an
    integer ``step`` (0 to ``MAX_STEP``); of its other keys, those that are short names with a
    finite number as value are kept (at most ``MAX_METRIC_KEYS``), the rest dropped. A record
    with nothing but its step, one whose step is below the last record's (a process of a
    multi-process run printing late, or again), or a copy of the previous one is not written; one
    at the last record's step adds its values to that record (one record per step: a trainer's
    end-of-training summary logs the last step again); after ``MAX_SCRIPT_METRIC_RECORDS`` records nothing more is, and the console says so once.

    A line read from the output is stamped with ``elapsed_s``, the seconds since this reader
    started (as the script did), unless it has one; a record that has no ``step_time_s`` gets the
    time per step since the previous stamped record, so a script that logs no timing is still
    timed (and compared) by its steps.
    """

    def __init__(self, metrics_file: BinaryIO):
        self.started = time.monotonic()
        self.out = metrics_file
        self.written = 0
        self.last: dict[str, Any] | None = None
        self.given: dict[str, Any] | None = None  # the last record as it came, before stamping
        self.last_offset = 0  # where the last record's line starts
        self.full = False
        self.lock = threading.Lock()

    def feed(self, line: bytes) -> str | None:
        """Record ``line`` if it is a metrics line; returns a note for the console, if any."""
        return self.add(parse_metric_line(line), stamp=True)

    def add(self, record: dict[str, Any] | None, stamp: bool = False) -> str | None:
        """Record ``record`` (a :func:`checked_record`; ``stamp``: it was just printed, so now is
        its time); the output's reader and the event files' share this, so it takes a lock."""
        with self.lock:
            return self._add(record, stamp)

    def _add(self, record: dict[str, Any] | None, stamp: bool) -> str | None:
        if record is None or record == self.given or record == self.last:
            return None
        if self.last is not None and record["step"] < self.last["step"]:
            return None
        self.given = record
        if self.last is not None and record["step"] == self.last["step"]:
            # More values of the step just written (a trainer's end-of-training summary logs at
            # the last step again): the step's one record is rewritten with them.
            merged = {**self.last, **record}
            merged = checked_record(merged) or self.last
            if merged != self.last:
                self.out.truncate(self.last_offset)
                self.out.seek(self.last_offset)
                self.out.write(json.dumps(_as_metric_record(merged)).encode() + b"\n")
                self.out.flush()
                self.last = merged
            return None
        if stamp and "elapsed_s" not in record:
            record = {**record, "elapsed_s": round(time.monotonic() - self.started, 3)}
        last = self.last
        if (last is not None and "step_time_s" not in record and isinstance(record.get("elapsed_s"), float)
                and isinstance(last.get("elapsed_s"), float) and record["elapsed_s"] >= last["elapsed_s"]):
            record = {**record, "step_time_s": round((record["elapsed_s"] - last["elapsed_s"])
                                                     / (record["step"] - last["step"]), 6)}
        if self.written >= MAX_SCRIPT_METRIC_RECORDS:
            if self.full:
                return None
            self.full = True
            return f"[trainwright] {MAX_SCRIPT_METRIC_RECORDS} metrics records written: later ones are not recorded"
        self.last_offset = self.out.seek(0, os.SEEK_END)
        self.out.write(json.dumps(_as_metric_record(record)).encode() + b"\n")
        self.out.flush()
        self.written += 1
        self.last = record
        return None


def _as_metric_record(record: dict[str, Any]) -> dict[str, Any]:
    """``record`` as a :class:`~engine.run_metrics.MetricRecord` line; a value of the wrong type
    for one of its fields (``tokens_seen`` is an integer) is left out."""
    for _ in range(2):
        try:
            return run_metrics.MetricRecord(**record).model_dump(exclude_none=True)
        except ValidationError as e:
            wrong = {str(error["loc"][0]) for error in e.errors() if error["loc"]}
            record = {key: value for key, value in record.items() if key == "step" or key not in wrong}
    return {"step": record["step"]}


def parse_metric_line(line: bytes) -> dict[str, Any] | None:
    """One script output line as a metrics record (step and finite numbers), or None."""
    line = line.strip()
    if not line.startswith(b"{") or len(line) > MAX_METRIC_LINE_BYTES:
        return None
    try:
        value = json.loads(line)
    except (ValueError, RecursionError):
        return None
    return checked_record(value)


def checked_record(value: object) -> dict[str, Any] | None:
    """``value`` (from a JSON line or an event file) as a metrics record: an integer step
    and the finite numbers under short names, or None."""
    if not isinstance(value, dict):
        return None
    step = value.get("step")
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= MAX_STEP:
        return None
    record: dict[str, Any] = {"step": step}
    for key, number in value.items():
        if len(record) > MAX_METRIC_KEYS:
            break
        finite = run_metrics.finite_number(number)
        if (key == "step" or finite is None or not isinstance(key, str) or not 0 < len(key) <= MAX_METRIC_KEY_CHARS
                or not key.isidentifier()):
            continue
        record[key] = number if isinstance(number, int) and abs(number) < 2**53 else finite
    return record if len(record) > 1 else None


def open_metrics_for_append(path: Path) -> BinaryIO | None:
    """The run's metrics file opened for appending by the supervisor (outside the sandbox), or
    None when something other than a regular file is at its name: the run can write its run
    directory, and a link there could name any host file."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                     0o644)
    except OSError:
        return None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        return None
    return os.fdopen(fd, "ab")


def copy_output(source: BinaryIO, console: BinaryIO, metrics: ScriptMetrics | None) -> None:
    """Copy a script's output from ``source`` to ``console`` as it comes, feeding each line to
    ``metrics``; a line longer than ``MAX_METRIC_LINE_BYTES`` is copied in pieces and is no
    metrics line. Returns when ``source`` ends."""
    inside_long_line = False
    while True:
        piece = source.readline(MAX_METRIC_LINE_BYTES + 1)
        if not piece:
            return
        console.write(piece)
        console.flush()
        complete = piece.endswith(b"\n")
        if metrics is not None and complete and not inside_long_line:
            note = metrics.feed(piece)
            if note:
                console.write(note.encode() + b"\n")
        inside_long_line = not complete


class EventScalars:
    """Scalars of a script's TensorBoard event files (:mod:`runner.tensorboard_events`) as
    metrics records: the values of one step, from consecutive events, make one record (of at
    most ``MAX_METRIC_KEYS`` keys: later new tags of that step are dropped)."""

    def __init__(self, run_dir: Path, metrics: ScriptMetrics):
        self.files = EventFiles(run_dir)
        self.metrics = metrics
        self.pending: dict[str, Any] | None = None
        self.unread = 0
        self.lock = threading.Lock()  # the supervisor's reading thread, then its final look

    def poll(self, final: bool = False) -> None:
        """Record what the files hold now; ``final``: the script has ended, its last step too."""
        with self.lock:
            self._poll(final)

    def _poll(self, final: bool) -> None:
        for step, values in self.files.new_scalars():
            unread = int(values.pop(UNREAD, 0))
            if unread and not self.unread:
                print(f"[trainwright] a TensorBoard scalar at step {step} is a tensor that is not one float or "
                      "double: not recorded (further ones neither)", flush=True)
            self.unread += unread
            if self.pending is not None and self.pending["step"] != step:
                self.metrics.add(checked_record(self.pending))
                self.pending = None
            if self.pending is None:
                self.pending = {"step": step}
            for key, value in values.items():
                if key in self.pending or len(self.pending) <= MAX_METRIC_KEYS:
                    self.pending[key] = value
            self.pending["step"] = step
        if final and self.pending is not None:
            self.metrics.add(checked_record(self.pending))
            self.pending = None
