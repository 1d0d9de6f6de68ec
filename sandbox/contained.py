"""A command of recipe code run to its end in the sandbox, outside any run (a launch check, a
model process).

:func:`run_in_sandbox` starts the command in the bubblewrap sandbox (:mod:`sandbox.bwrap`; where
there is none, in a loopback-only network namespace when the network is ``isolated``:
:mod:`sandbox.network`), in a session of its own, reads its stdout and stderr from pipes as
they come, keeping the last :data:`MAX_OUTPUT_BYTES` of each (a recipe that prints without end
costs bounded memory and no disk; a helper that keeps the pipes open cannot hold the caller),
and hands the process to the caller's ``end`` when it exits or times out.

Standard library only: what a caller knows and the sandbox does not (its resource limits, how
to find and end every process the command started) comes in as functions.
"""

from __future__ import annotations

import os
import select
import subprocess
import sys
import threading
from pathlib import Path
from typing import Callable, Mapping

from sandbox import bwrap
from sandbox.network import LOOPBACK_ENV

MAX_OUTPUT_BYTES = 4 * 2**20


def run_in_sandbox(
    command: list[str],
    cwd: Path,
    read_only: list[Path],
    writable: list[Path],
    env: dict[str, str],
    *,
    hidden: list[Path],
    network: str,
    timeout_s: float,
    set_limits: Callable[[], None],
    end: Callable[[subprocess.Popen], None],
    bound_fds: Mapping[Path | str, int] | None = None,
) -> tuple[str, str]:
    """Run ``command`` in the sandbox seeing ``read_only`` and ``writable`` (``hidden`` folders
    inside them shown empty), where possible without network (``network``: ``isolated`` or
    ``shared``), with the environment ``env``, in a session of its own; ``set_limits`` runs in
    the child between fork and exec (it may call only what takes no lock: ``setrlimit``). When
    the command exits (or ``timeout_s`` passes: ``subprocess.TimeoutExpired``) ``end`` gets its
    process, to end it and everything it started. Returns the ends of its stdout and stderr
    (:class:`OutputTail`). ``bound_fds``: read-only paths shown from descriptors
    (:func:`sandbox.bwrap.wrap`)."""
    bound_fds = bound_fds or {}
    wrapped = bwrap.wrap(command, read_only, writable, network=network, cwd=cwd, environ=env,
                         hidden=hidden, bound_fds=bound_fds)
    command = wrapped.command
    if wrapped.sandboxed and network == "isolated":
        env.update(LOOPBACK_ENV)
    elif not wrapped.sandboxed and network == "isolated":
        command = [sys.executable, "-m", "sandbox.network", "--", *command]
    out, err = OutputTail(), OutputTail()
    try:
        try:
            process = subprocess.Popen(
                command, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=out.write_end,
                stderr=err.write_end, start_new_session=True, preexec_fn=set_limits,
                pass_fds=tuple(bound_fds.values()) if wrapped.sandboxed else (),
            )
        finally:
            out.close_write_end()
            err.close_write_end()
        try:
            process.wait(timeout=timeout_s)
        finally:
            end(process)
    finally:
        out.finish()
        err.finish()
    return out.text(), err.text()


class OutputTail:
    """The last ``MAX_OUTPUT_BYTES`` a process writes to a pipe, read by a thread as it comes.
    ``finish`` stops reading once the process and everything it started are ended (a
    descendant that kept the pipe open cannot hold the caller)."""

    def __init__(self) -> None:
        self.read_end, self.write_end = os.pipe()
        os.set_blocking(self.read_end, False)
        self._kept = bytearray()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._drain, daemon=True)
        self._thread.start()

    def close_write_end(self) -> None:
        os.close(self.write_end)

    def _drain(self) -> None:
        while not self._stop.is_set():
            if not select.select([self.read_end], [], [], 0.2)[0]:
                continue
            try:
                chunk = os.read(self.read_end, 1 << 16)
            except BlockingIOError:
                continue
            if not chunk:
                return
            self._kept += chunk
            if len(self._kept) > 2 * MAX_OUTPUT_BYTES:
                del self._kept[:-MAX_OUTPUT_BYTES]

    def finish(self) -> None:
        self._thread.join(timeout=5)  # the end of the output: every writer is gone
        self._stop.set()
        self._thread.join()
        os.close(self.read_end)

    def text(self) -> str:
        return bytes(self._kept[-MAX_OUTPUT_BYTES:]).decode("utf-8", errors="replace")
