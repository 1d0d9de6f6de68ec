"""Run processes: check, spawn detached under a supervisor, stop.

A run is started in three moves, so that a bad request leaves nothing behind:

1. ``check_launch`` runs ``python -m engine.launch RECIPE --check`` (the engine validates the
   config and the world size) and raises :class:`LaunchRefused` with the engine's message;
2. ``start_run`` creates ``runs/<id>/run.json`` and spawns ``python -m sandbox.supervise`` in
   its own session, which starts the engine (``torchrun`` when ``nproc > 1``) in a process
   group of its own, writes its output to ``console.log`` and records the outcome;
3. the caller gets the run id at once: nothing waits for the run.

``stop_run`` asks the supervisor to end the run's whole process group and record ``stopped``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from engine import run_dir as rd
from sandbox.environment import run_environment

CHECK_TIMEOUT_S = 180


class LaunchRefused(ValueError):
    """The engine refused the launch (bad config, bad recipe); nothing was written."""


@dataclass(frozen=True)
class RunLimits:
    """Limits the supervisor enforces on a run's process group."""

    wall_time_s: float | None = None  # stop the run after this long
    max_open_files: int | None = 4096
    max_processes: int | None = None  # RLIMIT_NPROC (ignored for root by the kernel)
    max_memory_bytes: int | None = None  # RLIMIT_AS per process; CUDA needs a lot of address space
    stop_grace_s: float = 10.0  # SIGTERM, then SIGKILL after this long


def engine_command(
    recipe_dir: Path,
    run_dir: Path,
    nproc: int,
    overrides: list[str],
    resume_from: Path | None = None,
    config_json: Path | None = None,
) -> list[str]:
    if nproc > 1:
        command = [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc-per-node", str(nproc), "-m", "engine.launch",
        ]
    else:
        command = [sys.executable, "-m", "engine.launch"]
    command += [str(recipe_dir), "--run-dir", str(run_dir)]
    if resume_from is not None:
        command += ["--resume-from", str(resume_from)]
    if config_json is not None:
        command += ["--config-json", str(config_json)]
    for override in overrides:
        command += ["--set", override]
    return command


def check_launch(
    workspace: Path,
    recipe_dir: Path,
    nproc: int,
    overrides: list[str],
    config_json: Path | None = None,
) -> dict[str, Any]:
    """Validate a launch with the engine itself; return the resolved config."""
    command = [sys.executable, "-m", "engine.launch", str(recipe_dir), "--check", "--nproc", str(nproc)]
    if config_json is not None:
        command += ["--config-json", str(config_json)]
    for override in overrides:
        command += ["--set", override]
    try:
        result = subprocess.run(
            command, cwd=workspace, env=run_environment(), capture_output=True, text=True,
            timeout=CHECK_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        raise LaunchRefused(f"checking the recipe took over {CHECK_TIMEOUT_S} s") from None
    for line in reversed(result.stdout.strip().splitlines()):
        try:
            verdict = json.loads(line)
        except ValueError:
            continue
        if isinstance(verdict, dict) and "ok" in verdict:
            if not verdict["ok"]:
                raise LaunchRefused(verdict["error"])
            return verdict["config"]
    last = (result.stderr.strip().splitlines() or ["no output"])[-1]
    raise LaunchRefused(f"the engine could not check the recipe: {last}")


def start_run(
    workspace: Path,
    runs_root: Path,
    recipe_dir: Path,
    recipe_label: str,
    nproc: int,
    overrides: list[str],
    git_commit: str | None,
    resumed_from: dict[str, Any] | None = None,
    config_json: Path | None = None,
    limits: RunLimits = RunLimits(),
    extra_record: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Create the run directory and spawn its supervisor; return the first run record."""
    run_id = rd.new_run_id(Path(recipe_label).name)
    run_dir = Path(runs_root) / run_id
    resume_path = Path(resumed_from["path"]) if resumed_from else None
    record = {
        "id": run_id,
        "recipe": recipe_label,
        "git_commit": git_commit,
        "overrides": list(overrides),
        "nproc": nproc,
        "world_size": nproc,
        "status": rd.STARTING,
        "created_at": rd.utc_now(),
        "resumed_from": resumed_from,
        "pid": None,
        "limits": asdict(limits),
        "command": engine_command(recipe_dir, run_dir, nproc, overrides, resume_path, config_json),
        "workspace": str(workspace),
        **(extra_record or {}),
    }
    rd.create_run(run_dir, record)
    with open(run_dir / rd.CONSOLE_LOG, "ab") as console:
        process = subprocess.Popen(
            [sys.executable, "-m", "sandbox.supervise", str(run_dir)],
            cwd=workspace,
            env=run_environment(),
            stdin=subprocess.DEVNULL,
            stdout=console,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # outlives the server; a server restart does not touch it
        )
    return rd.update_run(run_dir, pid=process.pid)


def stop_run(run_dir: Path, timeout_s: float = 30.0) -> dict[str, Any]:
    """End a run's whole process group and record ``stopped``. Returns the final record."""
    record = rd.read_run(run_dir)
    if record.get("status") in rd.FINAL_STATUSES:
        return record
    rd.update_run(run_dir, stop_requested=True)
    supervisor = record.get("pid")
    if rd.pid_alive(supervisor):
        os.kill(supervisor, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            record = rd.read_run(run_dir)
            if record.get("status") in rd.FINAL_STATUSES and not rd.pid_alive(supervisor):
                return record
            time.sleep(0.1)
    # No supervisor (it crashed or was killed): end the engine's group ourselves.
    kill_group(record.get("child_pgid"), signal.SIGKILL)
    return rd.update_run(
        run_dir, status=rd.STOPPED, ended_at=rd.utc_now(), reason="stopped by request"
    )


def kill_group(pgid: int | None, sig: int) -> bool:
    if not pgid:
        return False
    try:
        os.killpg(pgid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def group_alive(pgid: int | None) -> bool:
    if not pgid:
        return False
    try:
        os.killpg(pgid, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False
