"""The ranks of a one-node run, started without torch: ``python -m runner.local_ranks
--nproc-per-node N PYTHON_ARGS...`` runs ``python PYTHON_ARGS...`` N times, as ``torchrun
--standalone`` would, in a process that stays small.

torchrun's agent imports torch (about 0.16 GB of memory beside each rank's own) to offer what a
run on one machine does not use: restarts, elastic membership, a rendezvous of agents. What the
engine relies on is kept here:

- each rank's environment: ``RANK`` = ``LOCAL_RANK``, ``WORLD_SIZE`` = ``LOCAL_WORLD_SIZE`` = N,
  ``MASTER_ADDR`` = 127.0.0.1 and ``MASTER_PORT`` the port of a loopback socket this launcher
  binds and listens on, handed to rank 0 as descriptor :data:`STORE_FD_VARIABLE`: rank 0 serves
  the store the others join on it (``engine.distributed``), so no other process can take the
  port between its choice and its use (a port probed free and released can be, by a run or a
  connection started meanwhile);
- a rank that fails ends the run: the others get SIGTERM, then SIGKILL after
  :data:`ENDING_GRACE_S`, and the launcher exits with the failed rank's status (128 + the
  signal for a rank killed by one), after a line on stderr that names the rank;
- SIGTERM, SIGINT and SIGHUP to the launcher reach every rank (the ranks are also in its
  process group, so a signal to the group reaches them directly), and it exits when they have.

Runs over several nodes, SLURM jobs and users' own scripts keep torchrun (:mod:`runner.nodes`).
Standard library only (and :mod:`engine.rank_store`): importing torch here would cost what this
module saves.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

from engine.rank_store import STORE_FD_VARIABLE

ENDING_GRACE_S = 30.0  # torchrun's too: from SIGTERM to SIGKILL of the ranks left when the run ends
POLL_S = 0.1  # torchrun's default monitor interval
FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
USAGE = "usage: python -m runner.local_ranks --nproc-per-node N PYTHON_ARGS..."


def launcher_command(nproc: int) -> list[str]:
    """What comes before the Python arguments of each rank (``-m engine.launch ...``)."""
    return [sys.executable, "-m", "runner.local_ranks", "--nproc-per-node", str(nproc)]


def store_socket(host: str = "127.0.0.1") -> socket.socket:
    """A socket listening on a port of ``host`` the kernel chose, kept open until rank 0 has it."""
    listening = socket.socket()
    listening.bind((host, 0))
    listening.listen(128)
    return listening


def rank_environments(nproc: int, port: int, base: dict[str, str] | None = None,
                      store_fd: int | None = None) -> list[dict[str, str]]:
    """Each rank's environment: ``base`` (default this process's) with torchrun's variables, and
    where the store's listening socket is handed down its descriptor for rank 0 (empty for the
    others: they join the store by its address)."""
    base = {k: v for k, v in (os.environ if base is None else base).items() if k != STORE_FD_VARIABLE}
    shared = {"WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc), "GROUP_RANK": "0",
              "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    environments = [{**base, **shared, "RANK": str(rank), "LOCAL_RANK": str(rank)} for rank in range(nproc)]
    if store_fd is not None:
        for env in environments:
            env[STORE_FD_VARIABLE] = str(store_fd) if env["RANK"] == "0" else ""
    return environments


def exit_status(returncode: int) -> int:
    """A process's status as a shell reports it: 128 + the signal for one killed by a signal."""
    return 128 - returncode if returncode < 0 else returncode


class Ranks:
    """The rank processes, followed until every one has exited or one has failed."""

    def __init__(self) -> None:
        self.processes: list[subprocess.Popen] = []
        self.ending_since: float | None = None

    def start(self, python_args: list[str], nproc: int) -> None:
        """``python PYTHON_ARGS`` once per rank (none once the run is ending: a signal came first)."""
        with store_socket() as listening:  # rank 0 inherits it; this copy closes once the ranks started
            fd = listening.fileno()
            for rank, env in enumerate(rank_environments(nproc, listening.getsockname()[1], store_fd=fd)):
                if self.ending_since is None:
                    self.processes.append(subprocess.Popen([sys.executable, *python_args], env=env,
                                                           stdin=subprocess.DEVNULL,
                                                           pass_fds=(fd,) if rank == 0 else ()))

    def signal_live(self, sig: int) -> None:
        for process in self.processes:
            if process.poll() is None:
                try:
                    process.send_signal(sig)
                except ProcessLookupError:
                    pass

    def forward(self, sig: int, _frame=None) -> None:
        """A signal to the launcher: to every rank, and the run ends."""
        self.signal_live(sig)
        self.ending_since = self.ending_since or time.monotonic()

    def wait(self) -> int:
        """The first failed rank's status (ending the others), else 0 once every rank has exited."""
        failed: int | None = None
        while True:
            codes = [process.poll() for process in self.processes]
            first = next((rank for rank, code in enumerate(codes) if code is not None and code != 0), None)
            if failed is None and first is not None:
                failed = exit_status(codes[first] or 0)
                if self.ending_since is None:  # not the end a signal asked for: say which rank ended the run
                    left = codes.count(None)
                    print(f"[trainwright] rank {first} (pid {self.processes[first].pid}) exited with status {failed}"
                          + (f"; ending the other {left} rank(s)" if left else ""), file=sys.stderr, flush=True)
                    self.forward(signal.SIGTERM)
            if None not in codes:
                return failed or 0
            if self.ending_since is not None and time.monotonic() - self.ending_since > ENDING_GRACE_S:
                self.signal_live(signal.SIGKILL)
            time.sleep(POLL_S)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) < 3 or argv[0] != "--nproc-per-node" or not argv[1].isdigit() or int(argv[1]) < 1:
        print(USAGE, file=sys.stderr)
        return 2
    ranks = Ranks()
    for sig in FORWARDED_SIGNALS:
        signal.signal(sig, ranks.forward)
    try:
        ranks.start(argv[2:], int(argv[1]))
    except OSError as error:  # no process to spare (the run's limits): end those started
        print(f"[trainwright] the ranks could not be started: {error}", file=sys.stderr, flush=True)
        ranks.forward(signal.SIGTERM)
        ranks.wait()
        return 1
    return ranks.wait()


if __name__ == "__main__":
    sys.exit(main())
