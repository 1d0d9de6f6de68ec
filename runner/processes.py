"""The processes of a run, found however they were started, and ended together.

A run's processes are not always one process group: ``torchrun`` starts each worker in a
session of its own, and a recipe may start helpers that detach. Two marks find them all:

- every process of a run inherits ``TRAINWRIGHT_RUN_ID=<id>`` in its environment (a process
  would have to clear its environment on purpose to lose it);
- the supervisor is a child subreaper (``PR_SET_CHILD_SUBREAPER``), so a process that detaches
  is re-parented to the supervisor and stays its descendant.

:func:`end_processes` sends SIGTERM, waits, then SIGKILL to whatever is left; :func:`kill_group`
signals a process group the caller started. :func:`run_contained` runs recipe code outside a run
(the launch check, a model process) in the sandbox with a run's limits, and ends every process
it started. Whether a process lives is :func:`engine.run_dir.pid_alive`, the one definition.
"""

from __future__ import annotations

import ctypes
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Mapping

from engine import run_dir as rd
from sandbox.contained import run_in_sandbox
from workspace.settings import RunLimits

if TYPE_CHECKING:
    from runner.server_record import ServerRecord

RUN_ID_VARIABLE = rd.RUN_ID_VARIABLE
PR_SET_CHILD_SUBREAPER = 36
_PROC = Path("/proc")


def become_subreaper() -> bool:
    """Orphaned descendants of this process are re-parented to it (Linux); False elsewhere."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0


def _parent(pid: int) -> int | None:
    """The parent of a process, or None when it is gone."""
    try:
        text = (_PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    return int(text.rsplit(")", 1)[1].split()[1])


def _all_pids() -> list[int]:
    try:
        return [int(p.name) for p in _PROC.iterdir() if p.name.isdigit()]
    except OSError:
        return []


def children(pid: int) -> set[int]:
    """The live processes whose parent is ``pid``."""
    return {other for other in _all_pids() if _parent(other) == pid}


def descendants(pid: int) -> set[int]:
    """Every live process below ``pid`` in the process tree."""
    children: dict[int, list[int]] = {}
    for other in _all_pids():
        parent = _parent(other)
        if parent is not None:
            children.setdefault(parent, []).append(other)
    found: set[int] = set()
    stack = [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            if child not in found:
                found.add(child)
                stack.append(child)
    return found


def marked(run_id: str) -> set[int]:
    """Live processes whose environment carries ``TRAINWRIGHT_RUN_ID=<run_id>``."""
    needle = f"{RUN_ID_VARIABLE}={run_id}".encode()
    found = set()
    for pid in _all_pids():
        if pid == os.getpid():
            continue
        try:
            environ = (_PROC / str(pid) / "environ").read_bytes()
        except OSError:
            continue
        if needle in environ.split(b"\0"):
            found.add(pid)
    return found


def _reap(pids: Iterable[int]) -> None:
    """Collect the exit status of those of ``pids`` that are our children."""
    for pid in pids:
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass


def end_processes(pids: Iterable[int], grace_s: float = 5.0) -> set[int]:
    """SIGTERM ``pids``, wait up to ``grace_s``, SIGKILL the rest; return those still alive."""
    # Never 0, 1 or below: kill() would signal a group, init, or every process.
    pids = {p for p in pids if isinstance(p, int) and p > 1 and p != os.getpid() and rd.pid_alive(p)}
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        deadline = time.monotonic() + wait_s
        while True:
            _reap(pids)
            pids = {p for p in pids if rd.pid_alive(p)}
            if not pids or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        if not pids:
            break
    return pids


def _set_limit(which: int, value: int) -> None:
    try:
        resource.setrlimit(which, (value, value))
    except (ValueError, OSError):  # above the hard limit and not root: the most we may
        _, hard = resource.getrlimit(which)
        if hard != resource.RLIM_INFINITY:
            resource.setrlimit(which, (min(value, hard), hard))


def apply_limits(limits: RunLimits) -> None:
    """The resource limits of a run's ``limits`` on this process.

    Runs in a child between fork and exec; it calls only ``setrlimit``, which takes no lock.
    """
    if limits.max_open_files:
        _set_limit(resource.RLIMIT_NOFILE, limits.max_open_files)
    if limits.max_processes:
        _set_limit(resource.RLIMIT_NPROC, limits.max_processes)
    if limits.max_memory_bytes:
        _set_limit(resource.RLIMIT_AS, limits.max_memory_bytes)


def kill_group(pgid: int | None, sig: int) -> bool:
    """Signal the process group ``pgid``, which the caller started; False when there is no such
    group. Never 0, 1 or below (they name the caller's own group, init's, or every process)."""
    if not isinstance(pgid, int) or pgid <= 1:
        return False
    try:
        os.killpg(pgid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def run_processes(record: ServerRecord) -> set[int]:
    """The live processes of a run: those marked with its id, and its supervisor."""
    pids = marked(record.id) if record.id else set()
    if record.supervisor is not None and record.supervisor.alive():
        pids.add(record.supervisor.pid)
    return pids


def hidden_state(workspace: Path) -> list[Path]:
    """Folders of the workspace a run never sees: git's, trainwright's and the runs'."""
    return [Path(workspace) / name for name in (".git", ".trainwright", rd.RUNS_DIRNAME)]


def run_contained(
    command: list[str],
    workspace: Path,
    read_only: list[Path],
    writable: list[Path],
    env: dict[str, str],
    limits: RunLimits,
    timeout_s: float,
    mark: str,
    bound_fds: Mapping[Path | str, int] | None = None,
) -> tuple[str, str]:
    """Run ``command`` as recipe code runs outside a run (:func:`sandbox.contained.run_in_sandbox`):
    seeing ``read_only`` and ``writable`` (the workspace's state folders hidden), in the network
    and with the resource limits of ``limits``, with the environment ``env`` (which carries
    ``mark``); when it exits (or ``timeout_s`` passes: ``subprocess.TimeoutExpired``) every
    process it started or that carries ``mark`` is ended. Returns the ends of its stdout and
    stderr."""
    return run_in_sandbox(
        command, workspace, read_only, writable, env, hidden=hidden_state(workspace), network=limits.network,
        timeout_s=timeout_s, set_limits=lambda: apply_limits(limits), end=lambda process: _end_contained(process, mark),
        bound_fds=bound_fds,
    )


def _end_contained(process: subprocess.Popen, mark: str) -> None:
    """End the process group of a contained command (in the sandbox: bwrap, whose init takes
    every process of the sandbox with it) and whatever else carries its mark or descends from it."""
    left = descendants(process.pid) | marked(mark)
    kill_group(process.pid, signal.SIGKILL)
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass
    end_processes(left | marked(mark), grace_s=0)
