"""How the OpenMP threads of a training process wait for work: spinning while the cores are the
run's, near-sleeping while another process competes for them.

torch's CPU kernels run on an OpenMP team (libgomp in the CPU wheels) of ``OMP_NUM_THREADS``
threads. Between parallel regions libgomp's threads spin (300,000 iterations by default) before
they sleep. On cores the run has to itself that is what makes a step fast: a training step is
hundreds of short regions, and waking a sleeping thread for each costs more than the region.
Measured here (``bench/openmp_wait.py``), ``OMP_WAIT_POLICY=PASSIVE`` (sleep at once) trains
~17% slower on a quiet 2-core machine. But where another process computes on the same cores, a
spinning thread holds a core that its partner needs to finish the region, and steps run at a
fifth of their speed.

No fixed policy is right for both, and the math must not depend on the machine's load (a resumed
run is bit-identical only at the same thread count), so the run keeps its threads and changes how
they wait. libgomp spins only 1,000 times ("throttled") while it manages more OpenMP threads
than the process has CPUs (GCC's documentation of ``GOMP_SPINCOUNT``). A :class:`WaitGovernor`
thread watches how long the process's threads wait on the run queue (``/proc/self/task/*/
schedstat``: time runnable but not running, which is ~0 while the cores are the run's). While
that exceeds :data:`BUSY_ABOVE` of the threads' time, it keeps idle OpenMP teams of its own
alive (threads that only sleep), which makes libgomp throttle; once the wait stays below
:data:`QUIET_BELOW` for :data:`QUIET_WINDOWS` windows, it lets them go and the threads spin again.

A policy or spin count the user's environment sets (``OMP_WAIT_POLICY``, ``GOMP_SPINCOUNT``) is
kept and not governed. Where the run-queue times cannot be read (no ``/proc`` schedstat), a
process gets ``OMP_WAIT_POLICY=PASSIVE``. A user's own script (which trainwright cannot govern)
gets ``PASSIVE`` too (:func:`sleep_while_waiting`).

libgomp reads these variables once, when it is loaded: :func:`prepare_wait_policy` runs before
torch is imported (``engine.launch`` and ``engine.model_io`` call it first).
"""

from __future__ import annotations

import math
import os
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, MutableMapping

WAIT_POLICY_VARIABLE = "OMP_WAIT_POLICY"
SPIN_COUNT_VARIABLE = "GOMP_SPINCOUNT"
PASSIVE = "PASSIVE"

TASKS = Path("/proc/self/task")
INTERVAL_S = 0.5
BUSY_ABOVE = 0.10  # of the team's thread-time spent waiting on the run queue: another process competes
QUIET_BELOW = 0.03
PRINTED_CHANGES = 10  # console lines: a machine whose load comes and goes would fill console.log
QUIET_WINDOWS = 4  # windows in a row under QUIET_BELOW before the threads spin again (2 s)


def user_chose(environ: MutableMapping[str, str]) -> bool:
    return WAIT_POLICY_VARIABLE in environ or SPIN_COUNT_VARIABLE in environ


def sleep_while_waiting(environ: MutableMapping[str, str]) -> None:
    """``OMP_WAIT_POLICY=PASSIVE`` in ``environ`` unless the user chose how OpenMP threads wait."""
    if not user_chose(environ):
        environ[WAIT_POLICY_VARIABLE] = PASSIVE


def run_queue_wait_ns(tasks: Path = TASKS) -> int | None:
    """The nanoseconds this process's threads have spent runnable but not running (the second
    field of each thread's ``schedstat``), or None where the kernel does not say."""
    total = 0
    try:
        entries = list(tasks.iterdir())
    except OSError:
        return None
    for entry in entries:
        try:
            fields = (entry / "schedstat").read_text().split()
        except OSError:
            continue  # a thread that ended since the listing
        if len(fields) < 2 or not fields[1].isdigit():
            return None
        total += int(fields[1])
    return total


def prepare_wait_policy(environ: MutableMapping[str, str] | None = None) -> None:
    """Before torch loads: leave libgomp spinning where a :class:`WaitGovernor` can watch the run
    queue, else ``OMP_WAIT_POLICY=PASSIVE``; a choice in the environment is kept."""
    environ = os.environ if environ is None else environ
    if not user_chose(environ) and run_queue_wait_ns() is None:
        environ[WAIT_POLICY_VARIABLE] = PASSIVE


@dataclass
class WaitDecision:
    """Whether libgomp is throttled, from one window's share of time waited on the run queue."""

    throttled: bool = False
    quiet_windows: int = 0

    def observe(self, waited_share: float) -> bool:
        """Take one window's share; True when ``throttled`` changed."""
        if not self.throttled:
            if waited_share > BUSY_ABOVE:
                self.throttled, self.quiet_windows = True, 0
                return True
            return False
        self.quiet_windows = self.quiet_windows + 1 if waited_share < QUIET_BELOW else 0
        if self.quiet_windows >= QUIET_WINDOWS:
            self.throttled, self.quiet_windows = False, 0
            return True
        return False


def hold_team(release: threading.Event) -> None:
    """Run one parallel region on this thread, which gives it an OpenMP team of its own, then
    sleep until ``release``: the team's threads stay managed by libgomp, idle, until this
    thread ends."""
    import torch

    torch.ones(1 << 20).add_(1.0)
    release.wait()


class WaitGovernor:
    """Throttles libgomp's spinning while other processes compete for the cores (module docstring)."""

    def __init__(self, threads: int, cores: int, read_wait: Callable[[], int | None] = run_queue_wait_ns,
                 hold: Callable[[threading.Event], None] = hold_team, interval_s: float = INTERVAL_S):
        self.threads = threads
        # Enough idle teams that libgomp manages more threads than there are cores, even counting
        # only the `threads - 1` workers each team adds to the thread that leads it.
        self.teams = max(1, math.ceil((cores + 1) / max(1, threads - 1)))
        self.read_wait, self.hold, self.interval_s = read_wait, hold, interval_s
        self.decision = WaitDecision()
        self.changes = 0
        self._release: threading.Event | None = None
        self._thread = threading.Thread(target=self._watch, name="openmp-wait-governor", daemon=True)

    def start(self) -> WaitGovernor:
        self._thread.start()
        return self

    def _watch(self) -> None:
        last = self.read_wait(), time.monotonic()
        while last[0] is not None:
            time.sleep(self.interval_s)
            now = self.read_wait(), time.monotonic()
            if now[0] is None:
                return
            self.window(now[0] - last[0], now[1] - last[1])
            last = now

    def window(self, waited_ns: int, seconds: float) -> None:
        """One window: ``waited_ns`` on the run queue by all threads over ``seconds``."""
        share = waited_ns / max(1.0, seconds * 1e9 * self.threads)
        if not self.decision.observe(share):
            return
        self._set_throttled(self.decision.throttled)
        self.changes += 1
        if self.changes > PRINTED_CHANGES:
            return
        more = "; further changes are not printed" if self.changes == PRINTED_CHANGES else ""
        state = ("another process competes for the cores: OpenMP threads now sleep while they wait"
                 if self.decision.throttled else "the cores are free again: OpenMP threads spin while they wait")
        print(f"openmp: {state} ({share:.0%} of their time waited on the run queue){more}", file=sys.stderr, flush=True)

    def _set_throttled(self, throttled: bool) -> None:
        if throttled and self._release is None:
            self._release = threading.Event()
            for _ in range(self.teams):
                threading.Thread(target=self.hold, args=(self._release,), name="openmp-idle-team",
                                 daemon=True).start()
        elif not throttled and self._release is not None:
            self._release.set()
            self._release = None


def govern_waits(threads: int) -> WaitGovernor | None:
    """Start a :class:`WaitGovernor` for a CPU process computing with ``threads`` threads, where its
    waits are the governor's to decide; None where they are not (or a team of one never waits)."""
    if threads < 2 or user_chose(os.environ) or run_queue_wait_ns() is None:
        return None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or threads)
    return WaitGovernor(threads, cores).start()
