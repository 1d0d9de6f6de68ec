"""The supervisor of one run: ``python -m sandbox.supervise RUN_DIR``.

Started in a session of its own by :func:`sandbox.runs.start_run`, it outlives whoever started
it. It moves itself into a network namespace with only loopback (where the platform allows and
``limits.network`` is ``isolated``), becomes a child subreaper, and spawns the engine command
recorded in ``run.json`` in a new process group with the resource limits of ``limits``. It
writes the engine's output to ``console.log`` (its own stdout), enforces the wall-time limit,
and when the engine exits records the outcome: ``completed``, ``failed`` (with the exit code
and the engine's error) or ``stopped``. Whatever the outcome, no process of the run is left
behind: every descendant and every process marked with the run's id is ended.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

from engine import run_dir as rd
from sandbox.git import add_note
from sandbox.network import LOOPBACK_ENV, isolate_network
from sandbox.processes import become_subreaper, descendants, end_processes, marked
from sandbox.provenance import code_description
from sandbox.runs import group_alive, kill_group


def _set_limit(which: int, value: int) -> None:
    try:
        resource.setrlimit(which, (value, value))
    except (ValueError, OSError):  # above the hard limit and not root: the most we may
        _, hard = resource.getrlimit(which)
        if hard != resource.RLIM_INFINITY:
            resource.setrlimit(which, (min(value, hard), hard))


def _apply_limits(limits: dict) -> None:
    """Runs in the child between fork and exec (the supervisor has a single thread)."""
    if limits.get("max_open_files"):
        _set_limit(resource.RLIMIT_NOFILE, int(limits["max_open_files"]))
    if limits.get("max_processes"):
        _set_limit(resource.RLIMIT_NPROC, int(limits["max_processes"]))
    if limits.get("max_memory_bytes"):
        _set_limit(resource.RLIMIT_AS, int(limits["max_memory_bytes"]))


class Supervisor:
    def __init__(self, run_dir: Path):
        self.run_dir = Path(run_dir)
        self.record = rd.read_run(self.run_dir)
        self.limits = self.record.limits
        self.stop_reason: str | None = None
        self.child: subprocess.Popen | None = None

    def request_stop(self, reason: str) -> None:
        if self.stop_reason is None:
            self.stop_reason = reason
            if self.child is not None:
                kill_group(self.child.pid, signal.SIGTERM)

    def contain(self) -> dict:
        """Network namespace and subreaper; returns what was achieved, for run.json."""
        become_subreaper()
        if self.limits.get("network", "isolated") == "isolated":
            isolated, note = isolate_network()
        else:
            isolated, note = False, "runs.network is 'shared' in .trainwright/config.yaml"
        if isolated:
            for key, value in LOOPBACK_ENV.items():
                os.environ.setdefault(key, value)
        return {"network_isolated": isolated, "network_note": note}

    def run(self) -> int:
        signal.signal(signal.SIGTERM, lambda *_: self.request_stop("stopped by request"))
        signal.signal(signal.SIGINT, lambda *_: self.request_stop("interrupted"))
        containment = self.contain()
        print(f"[trainwright] run {self.record.id}: {code_description(self.record)}", flush=True)
        limits = self.limits
        try:
            self.child = subprocess.Popen(
                self.record.command,
                cwd=self.record.workspace or None,
                stdin=subprocess.DEVNULL,
                stdout=sys.stdout,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=lambda: _apply_limits(limits),
            )
        except (OSError, subprocess.SubprocessError) as e:
            rd.update_run(self.run_dir, pid=os.getpid(), **containment, status=rd.FAILED,
                          error=f"the engine could not be started: {e}", ended_at=rd.utc_now())
            return 1
        rd.update_run(
            self.run_dir, pid=os.getpid(), child_pgid=self.child.pid, status=rd.RUNNING,
            supervisor_started_at=rd.utc_now(), **containment,
        )
        if self.stop_reason is not None:  # a stop that arrived before the child existed
            kill_group(self.child.pid, signal.SIGTERM)

        wall = limits.get("wall_time_s")
        grace = float(limits.get("stop_grace_s") or 10.0)
        started = time.monotonic()
        term_sent_at: float | None = None
        while True:
            try:
                code = self.child.wait(timeout=0.5)
                break
            except subprocess.TimeoutExpired:
                pass
            now = time.monotonic()
            if wall and now - started > float(wall) and self.stop_reason is None:
                print(f"[trainwright] wall-time limit of {wall} s reached: stopping the run", flush=True)
                self.request_stop(f"wall-time limit of {wall} s reached")
            if self.stop_reason is not None:
                term_sent_at = term_sent_at or now
                if now - term_sent_at > grace:
                    kill_group(self.child.pid, signal.SIGKILL)
                    end_processes(self.leftovers(), grace_s=0)
        self.end_leftovers(grace)
        return self.finish(code)

    def leftovers(self) -> set[int]:
        """Processes of the run still alive: descendants (we are their subreaper) and marked ones."""
        pids = descendants(os.getpid())
        if self.record.id:
            pids |= marked(self.record.id)
        pids.discard(os.getpid())
        return pids

    def end_leftovers(self, grace: float) -> None:
        """The engine is gone; make sure none of its workers or helpers linger."""
        if self.child is not None and group_alive(self.child.pid):
            kill_group(self.child.pid, signal.SIGTERM)
        left = self.leftovers()
        if left:
            stuck = end_processes(left, grace_s=min(grace, 2.0))
            if stuck:
                print(f"[trainwright] processes {sorted(stuck)} did not end", flush=True)

    def finish(self, code: int) -> int:
        record = rd.read_run(self.run_dir)
        fields = {"exit_code": code, "ended_at": rd.utc_now()}
        if self.stop_reason is not None or record.stop_requested:
            fields.update(status=rd.STOPPED, reason=self.stop_reason or "stopped by request")
        elif code == 0:
            fields["status"] = rd.COMPLETED
        else:
            fields["status"] = rd.FAILED
            if not record.error:
                fields["error"] = _describe_exit(code)
        record = rd.update_run(self.run_dir, **fields)
        print(f"[trainwright] run {record.id} {record.status} (exit code {code})", flush=True)
        self.write_git_note(record)
        return code

    def write_git_note(self, record: rd.RunRecord) -> None:
        """Record the outcome on the commit whose code the run executed."""
        if not record.git_commit or not record.workspace:
            return
        latest, _ = rd.read_metrics_tail(self.run_dir / rd.METRICS_JSONL, 1)
        add_note(Path(record.workspace), record.git_commit, run_note(record, latest[-1] if latest else None))


def run_note(record: rd.RunRecord, latest: dict | None) -> str:
    """One line per run on its commit: outcome, code, config, data."""
    parts = [f"run {record.id}: {record.status}"]
    if latest:
        parts.append(f"step {latest.get('step')}/{record.max_steps or '?'}")
        loss = latest.get("loss")
        if rd.finite_number(loss) is not None:
            parts.append(f"loss {rd.finite_number(loss):.4f}")
        elif isinstance(loss, str):  # metrics.jsonl writes non-finite losses as "nan" / "inf"
            parts.append(f"loss {loss[:20]} (not finite)")
        tokens_per_s = rd.finite_number(latest.get("tokens_per_s"))
        if tokens_per_s is not None:
            parts.append(f"{tokens_per_s:,.0f} tokens/s")
    parts.append(f"recipe {record.recipe}, {record.world_size or record.nproc} process(es)")
    parts.append(code_description(record))
    if record.overrides:
        parts.append("overrides " + ", ".join(f"{k}={json.dumps(v)}" for k, v in list(record.overrides.items())[:10]))
    if record.data is not None:
        data = record.data
        parts.append(f"data {data.source}: {data.documents:,} documents, {data.tokens:,} tokens")
    if record.error and record.status != rd.COMPLETED:
        parts.append(f"error: {record.error[:200]}")
    return "; ".join(parts)


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"the engine exited with status {code}; see console.log"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m sandbox.supervise RUN_DIR", file=sys.stderr)
        return 2
    return Supervisor(Path(argv[0])).run()


if __name__ == "__main__":
    sys.exit(main())
