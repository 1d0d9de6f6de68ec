"""The supervisor of one run: ``python -m runner.supervise RECORD_DIR``.

Started in a session of its own by :func:`runner.lifecycle.start_run`, it outlives whoever started
it. Everything it acts on comes from the server's record of the run (``RECORD_DIR``, see
:mod:`runner.server_record`), never from the run directory its run writes. It becomes a child
subreaper and spawns the engine command of that record inside the bubblewrap sandbox
(:mod:`sandbox.bwrap`: its own user, PID and network namespaces, a mount view of the paths in
the record's ``sandbox``), in a new process group, with the resource limits of ``limits``. Where the sandbox cannot be made it falls back to moving itself into a
network namespace with only loopback (:mod:`sandbox.network`, where the platform allows and
``limits.network`` is ``isolated``); either way it records the level it got (``isolation``:
``full``, ``partial`` or ``none``, with ``isolation_note``) and prints it on the console. It
writes the engine's output to ``console.log`` (its own stdout), enforces the wall-time limit,
and when the engine exits records the outcome: ``completed``, ``failed`` (with the exit code
and the engine's error) or ``stopped``, in the server's record (and a copy in ``run.json``).
Whatever the outcome, no process of the run is left behind: every descendant and every process
marked with the run's id is ended.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from engine import run_dir as rd
from engine import run_metrics
from engine.errors import MAX_ERROR_CHARS
from engine.run_files import open_beneath
from runner import server_record as sr
from sandbox import bwrap
from workspace.git import add_note
from sandbox.network import LOOPBACK_ENV, isolate_network
from runner.processes import (
    apply_limits, become_subreaper, children, descendants, end_processes, kill_group, marked,
)
from runner.provenance import code_description
from runner.scripts import EventScalars, ScriptMetrics, copy_output, open_metrics_for_append


EVENT_FILES_EVERY_S = 2.0  # how often a script's TensorBoard event files are read


class Supervisor:
    def __init__(self, record_dir: Path):
        self.record_dir = Path(record_dir)
        self.record = sr.read_record(self.record_dir)
        if not self.record.run_dir:
            raise ValueError(f"the server's record in {record_dir} names no run directory")
        self.run_dir = Path(self.record.run_dir)
        self.limits = self.record.run_limits()
        self.stop_reason: str | None = None
        self.child: subprocess.Popen | None = None
        self.bound_fds: tuple[int, ...] = ()  # what the sandbox binds by descriptor
        self.sandboxed = False
        self.output_reader: threading.Thread | None = None
        self.event_scalars: EventScalars | None = None  # a script's TensorBoard scalars

    def terminate(self) -> None:
        """SIGTERM to the engine's process group.

        In the sandbox the group to signal is the sandbox's own session (bwrap's init inside
        ignores SIGTERM from outside; the engine gets it); SIGTERM to bwrap itself would kill
        the whole sandbox at once, with no grace.
        """
        if self.child is None:
            return
        inner = children(self.child.pid) if self.sandboxed else set()
        if inner:
            for pid in inner:
                kill_group(pid, signal.SIGTERM)
        else:
            kill_group(self.child.pid, signal.SIGTERM)

    def request_stop(self, reason: str) -> None:
        if self.stop_reason is None:
            self.stop_reason = reason
            self.terminate()

    def contain(self) -> tuple[list[str], dict]:
        """Subreaper and sandbox; returns the command to spawn and what was achieved, for run.json."""
        become_subreaper()
        network = self.limits.network
        workspace = self.record.workspace
        mounts = self.record.sandbox
        if mounts is None:  # a record made without a launcher's mounts: the workspace, read-only
            mounts = rd.SandboxMounts(bwrap=bwrap.find_bwrap(), read_only=[workspace] if workspace else [],
                                    writable=[str(self.run_dir)])
        writable_record = [w for w in mounts.writable if bwrap.under(self.record_dir, Path(os.path.abspath(w)))]
        if writable_record:  # the run could then rewrite what the server trusts
            raise ValueError(f"the run's writable folder {writable_record[0]} holds the server's record of it")
        shared_because = bwrap.SHARED_NETWORK_REASON
        if self.record.nnodes > 1:
            shared_because = (f"a run over {self.record.nnodes} nodes uses the host's network for its rendezvous "
                              f"({self.record.rdzv_endpoint}) and collectives")
        bound = self.bound_checkpoint()
        wrapped = bwrap.wrap(
            self.record.command, [p for p in mounts.read_only if p not in bound], mounts.writable, network=network,
            # Recorded by the server (None: the sandbox is disabled there); the run's own
            # environment does not choose it.
            cwd=self.working_dir(), bwrap=mounts.bwrap or "", hidden=mounts.hidden, network_reason=shared_because,
            bound_fds=bound,
        )
        self.bound_fds = tuple(bound.values()) if wrapped.sandboxed else ()
        self.sandboxed = wrapped.sandboxed
        if wrapped.sandboxed:
            report = wrapped.report
        else:
            if network == "isolated":
                isolated, note = isolate_network()
            else:
                isolated, note = False, shared_because
            report = bwrap.fallback_report(wrapped.reason, isolated, note)
        if report["network_isolated"]:
            for key, value in LOOPBACK_ENV.items():
                os.environ.setdefault(key, value)
        print(f"[trainwright] isolation: {report['isolation']} ({report['isolation_note']})", flush=True)
        return wrapped.command, report

    def bound_checkpoint(self) -> dict[Path | str, int]:
        """The checkpoint the run starts from (another run's, which that run may still be
        rewriting; or the folder a recipe's model starts from, ``started_from``), opened now one
        name at a time below the workspace, following no link; the sandbox shows what was opened,
        so a link put in its place after the server chose it shows nothing of the host. One that
        is gone or a link now fails the run unstarted."""
        source, workspace = self.record.resumed_from or self.record.started_from, self.record.workspace
        if source is None or not workspace or not Path(source.path).is_relative_to(workspace):
            return {}
        fd = open_beneath(workspace, Path(source.path).relative_to(workspace))
        if fd is None:
            raise ValueError(f"the checkpoint it starts from ({source.run_id} step {source.step}) is gone or "
                             "a link now")
        return {source.path: fd}

    def run(self) -> int:
        signal.signal(signal.SIGTERM, lambda *_: self.request_stop("stopped by request"))
        signal.signal(signal.SIGINT, lambda *_: self.request_stop("interrupted"))
        try:
            command, containment = self.contain()
        except ValueError as e:
            self.record_fields(pid=os.getpid(), status=rd.FAILED, error=f"the run was not started: {e}",
                               ended_at=rd.utc_now())
            return 1
        print(f"[trainwright] run {self.record.id}: {code_description(self.record)}", flush=True)
        limits = self.limits
        try:
            program = self.record.command[0]
            if shutil.which(program) is None:  # inside the sandbox bwrap would only exit 1
                raise FileNotFoundError(errno.ENOENT, "no such executable", program)
            self.child = subprocess.Popen(
                command,
                cwd=self.working_dir(),
                stdin=subprocess.DEVNULL,
                # A script's output is read here (its JSON lines are its metrics); the engine
                # writes its own metrics.
                stdout=subprocess.PIPE if self.script_run else sys.stdout,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=lambda: apply_limits(limits),
                pass_fds=self.bound_fds,
            )
            for fd in self.bound_fds:  # the sandbox has bound them
                os.close(fd)
            if self.script_run:
                self.start_reading_output()
        except (OSError, subprocess.SubprocessError) as e:
            self.record_fields(pid=os.getpid(), **containment, status=rd.FAILED,
                               error=f"the engine could not be started: {e}", ended_at=rd.utc_now())
            return 1
        stamp = rd.utc_now()
        self.record_fields(
            pid=os.getpid(), child_pgid=self.child.pid, status=rd.RUNNING,
            supervisor_started_at=stamp, **containment,
            **({"started_at": stamp} if self.script_run else {}),  # the engine records its own start
        )
        if self.stop_reason is not None:  # a stop that arrived before the child existed
            self.terminate()

        wall = limits.wall_time_s
        grace = limits.stop_grace_s
        started = time.monotonic()
        term_sent_at: float | None = None
        # The event files are the run's: read on a thread of their own, so that no amount of them
        # delays the limits enforced here.
        events_done = threading.Event()
        events_reader = self.start_reading_events(events_done)
        while True:
            try:
                code = self.child.wait(timeout=0.5)
                break
            except subprocess.TimeoutExpired:
                pass
            now = time.monotonic()
            if wall and now - started > wall and self.stop_reason is None:
                print(f"[trainwright] wall-time limit of {_seconds(wall)} s reached: stopping the run", flush=True)
                self.request_stop(f"wall-time limit of {_seconds(wall)} s reached")
            if self.stop_reason is not None:
                term_sent_at = term_sent_at or now
                if now - term_sent_at > grace:
                    kill_group(self.child.pid, signal.SIGKILL)
                    end_processes(self.leftovers(), grace_s=0)
        self.end_leftovers(grace)
        if self.output_reader is not None:
            self.output_reader.join(timeout=10)  # every writer of the pipe is gone by now
        events_done.set()
        if events_reader is not None:
            events_reader.join(timeout=EVENT_FILES_EVERY_S * 5)
        if self.event_scalars is not None and (events_reader is None or not events_reader.is_alive()):
            self.event_scalars.poll(final=True)  # one more bounded look, and the last step's record
        return self.finish(code)

    def start_reading_events(self, done: threading.Event) -> threading.Thread | None:
        """A thread that reads a script's TensorBoard event files every ``EVENT_FILES_EVERY_S``."""
        scalars = self.event_scalars
        if scalars is None:
            return None

        def read() -> None:
            while not done.wait(EVENT_FILES_EVERY_S):
                scalars.poll()

        reader = threading.Thread(target=read, name="event-files", daemon=True)
        reader.start()
        return reader

    @property
    def script_run(self) -> bool:
        return self.record.kind == rd.SCRIPT

    def working_dir(self) -> str | None:
        """A script runs in its run directory (it may write there; the workspace is read-only),
        the engine in the workspace."""
        return str(self.run_dir) if self.script_run else self.record.workspace or None

    def start_reading_output(self) -> None:
        """A thread that copies the script's output to the console and its metrics lines to
        metrics.jsonl (:mod:`runner.scripts`: bounded, numbers only)."""
        assert self.child is not None and self.child.stdout is not None
        metrics_file = open_metrics_for_append(self.run_dir / rd.METRICS_JSONL)
        if metrics_file is None:
            print(f"[trainwright] {rd.METRICS_JSONL} in the run directory is not a regular file: the script's "
                  "metrics are not recorded", flush=True)
        metrics = ScriptMetrics(metrics_file) if metrics_file is not None else None
        if metrics is not None:
            self.event_scalars = EventScalars(self.run_dir, metrics)
        self.output_reader = threading.Thread(
            target=copy_output, args=(self.child.stdout, sys.stdout.buffer, metrics), daemon=True)
        self.output_reader.start()

    def record_fields(self, **fields) -> sr.ServerRecord:
        """Record ``fields`` in the server's record (what decisions read), then copy them into
        the run's run.json (the run's own information; never read back). The process that leads
        the engine's group is recorded with its identity, so that a stop signals it and nothing
        else."""
        server_fields = dict(fields)
        if fields.get("child_pgid"):
            server_fields["engine_group"] = sr.identify(fields["child_pgid"])
        if fields.get("pid") == os.getpid():
            server_fields["supervisor"] = sr.identify(os.getpid())
        record = sr.update_record(self.record_dir, **server_fields)
        sr.mirror_to_report(self.run_dir, **fields)
        return record

    def leftovers(self) -> set[int]:
        """Processes of the run still alive: descendants (we are their subreaper) and marked ones."""
        pids = descendants(os.getpid())
        if self.record.id:
            pids |= marked(self.record.id)
        pids.discard(os.getpid())
        return pids

    def end_leftovers(self, grace: float) -> None:
        """The engine is gone; make sure none of its workers or helpers linger."""
        if self.child is not None:
            # A group that is gone is not signalled. In the sandbox, bwrap is gone once the
            # engine's main process has exited, and its init (which the kernel then kills) takes
            # every process of the sandbox with it.
            kill_group(self.child.pid, signal.SIGTERM)
        left = self.leftovers()
        if left:
            stuck = end_processes(left, grace_s=min(grace, 2.0))
            if stuck:
                print(f"[trainwright] processes {sorted(stuck)} did not end", flush=True)

    def finish(self, code: int) -> int:
        record = sr.read_record(self.record_dir)
        fields: dict = {"exit_code": code, "ended_at": rd.utc_now()}
        if self.stop_reason is not None or record.stop_requested:
            fields.update(status=rd.STOPPED, reason=self.stop_reason or "stopped by request")
        elif code == 0:
            fields["status"] = rd.COMPLETED
        else:
            fields["status"] = rd.FAILED
            # The engine's own message (the run wrote it: text to show, bounded, nothing more).
            fields["error"] = failure_error(_reported_error(self.run_dir), code, self.run_dir)
            if record.nnodes > 1:  # the usual cause is elsewhere: say where to look
                fields["error"] = (
                    f"node {record.node_rank} of a run over {record.nnodes} nodes failed; a run over several nodes "
                    f"fails when any node fails or leaves (rendezvous {record.rdzv_id} at {record.rdzv_endpoint}): "
                    f"{fields['error']}"
                )[:MAX_ERROR_CHARS]
        record = self.record_fields(**fields)
        print(f"[trainwright] run {record.id} {record.status} (exit code {code})", flush=True)
        self.write_git_note(record)
        return code

    def write_git_note(self, record: sr.ServerRecord) -> None:
        """Record the outcome on the commit whose code the run executed: the server's record
        says which commit, workspace, id and recipe (the run wrote none of it)."""
        if not record.git_commit or not record.workspace:
            return
        shown = sr.merge(record, sr.report(self.run_dir))  # the data it counted, from its report
        add_note(Path(record.workspace), record.git_commit,
                 run_note(shown, run_metrics.latest_metrics(self.run_dir / rd.METRICS_JSONL),
                          run_metrics.read_run_speed(self.run_dir, shown)))


def run_note(record: rd.RunRecord, latest: dict | None, speed: run_metrics.RunSpeed | None = None) -> str:
    """One line per run on its commit: outcome, speed (:func:`engine.run_metrics.run_speed`), code,
    config, data."""
    parts = [f"run {record.id}: {record.status}"]
    if latest:
        parts.append(f"step {latest.get('step')}/{record.max_steps or '?'}")
        loss = latest.get("loss")
        if run_metrics.finite_number(loss) is not None:
            parts.append(f"loss {run_metrics.finite_number(loss):.4f}")
        elif isinstance(loss, str):  # metrics.jsonl writes non-finite losses as "nan" / "inf"
            parts.append(f"loss {loss[:20]} (not finite)")
    if speed is not None and speed.describe():
        parts.append(speed.describe())
    parts.append(f"{record.kind} {record.recipe}, {record.world_size or record.nproc} process(es)")
    parts.append(code_description(record))
    for model in record.hub_models[:4]:
        parts.append(f"model {model.repo_id}@{model.commit[:12]}")
    if record.overrides:
        parts.append("overrides " + ", ".join(f"{k}={json.dumps(v)}" for k, v in list(record.overrides.items())[:10]))
    if record.data is not None:
        data = record.data
        parts.append(f"data {data.source}: streamed, {data.files or 0:,} files" if data.streaming else
                     f"data {data.source}: {data.documents:,} documents, {data.tokens:,} tokens")
    if record.error and record.status != rd.COMPLETED:
        parts.append(f"error: {record.error[:200]}")
    # The run wrote most of this (run.json, metrics.jsonl): each part stays one short line.
    return "; ".join(_CONTROL.sub(" ", part)[:MAX_NOTE_PART_CHARS] for part in parts)


MAX_NOTE_PART_CHARS = 300
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def _reported_error(run_dir: Path) -> str | None:
    """The error the engine reported in run.json (one bounded line of text), if any."""
    try:
        error = rd.read_run(run_dir).error
    except (OSError, ValueError):
        return None
    return _CONTROL.sub(" ", error)[:MAX_ERROR_CHARS] if error else None


def failure_error(reported: str | None, code: int, run_dir: Path, free: int | None = None) -> str:
    """Why a run failed: what the engine reported, else its exit, named as a full disk where the
    run directory's disk is (nearly) full (the engine may not have been able to say so)."""
    if reported:
        return reported
    free = rd.free_bytes(run_dir) if free is None else free
    if free is not None and free < rd.LOW_SPACE_BYTES:
        return rd.no_space_message(run_dir, _describe_exit(code), free)
    return _describe_exit(code)


def _seconds(value: float) -> str:
    """``100`` for 100.0 s, ``2.5`` for 2.5 s."""
    return f"{value:.0f}" if float(value).is_integer() else str(value)


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"the run's main process exited with status {code}; see console.log"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m runner.supervise RECORD_DIR", file=sys.stderr)
        return 2
    return Supervisor(Path(argv[0])).run()


if __name__ == "__main__":
    sys.exit(main())
