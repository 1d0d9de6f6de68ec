"""The workspace's caps on concurrent runs and training processes, checked before a launch.

A run counts while the supervisor the server started for it lives (its server record,
:func:`runner.server_record.ServerRecord.effective_status`), whatever its run directory says;
a SLURM job runs on the cluster's nodes and does not count. :func:`capacity_lock` is held
while a launch counts and creates its run, so two launches at once cannot both take the last
place.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path
from typing import Iterator

from engine import run_dir as rd
from engine.errors import LaunchRefused
from runner import server_record as sr
from workspace.settings import RunLimits, capacity


@contextlib.contextmanager
def capacity_lock(runs_root: Path) -> Iterator[None]:
    """An exclusive lock on the runs folder, held while a launch counts and creates its run."""
    fd = os.open(runs_root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def running_runs(records: Path) -> list[sr.ServerRecord]:
    """The server's records of the workspace's runs that are starting or running here
    (``records``: :func:`workspace.workspace.records_root`). A run counts while the supervisor
    the server started lives, whatever its run directory says."""
    found = []
    try:
        names = sorted(os.listdir(records))
    except OSError:
        return []
    for name in names:
        try:
            record = sr.read_record(Path(records) / name)
        except (OSError, ValueError):
            continue
        if record.target != "local":  # a SLURM job runs on the cluster's nodes
            continue
        if record.effective_status() in (rd.STARTING, rd.RUNNING):
            found.append(record)
    return found


def check_capacity(records: Path, nproc: int, limits: RunLimits) -> None:
    """Refuse a launch of ``nproc`` processes that would exceed the workspace's caps
    (``runs.max_concurrent_runs``, ``runs.max_total_processes``); ``records``: the server's
    records of the workspace's runs."""
    running = running_runs(records)
    max_runs, max_processes = capacity(limits)
    busy = sum(r.nproc for r in running)
    names = ", ".join(f"{r.id} ({r.nproc} process(es))" for r in running[:20])
    if len(running) >= max_runs:
        raise LaunchRefused(
            f"{len(running)} runs are already running in this workspace and runs.max_concurrent_runs "
            f"is {max_runs}: {names}; stop one (stop_run) or wait for one to end"
        )
    if busy + nproc > max_processes:
        raise LaunchRefused(
            f"this launch would bring the workspace to {busy + nproc} training processes and "
            f"runs.max_total_processes is {max_processes}; running: {names or 'none'}; "
            "stop a run (stop_run), wait, or launch with fewer processes"
        )
