"""Helpers shared by the test suites: launching the engine and reading what a run wrote."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from engine import run_dir as rd
from engine import run_metrics
from runner.local_ranks import launcher_command

REPO = Path(__file__).resolve().parent.parent
TEMPLATE = REPO / "recipes_template" / "causal_lm"

# A small model and data shape that keep each step in the tens of milliseconds on CPU.
TINY = (
    "model.hidden_size=64",
    "model.intermediate_size=160",
    "model.num_layers=2",
    "model.num_heads=4",
    "model.num_kv_heads=2",
    "data.seq_len=64",
    "data.batch_size=4",
    "train.log_every=1",
    "optim.warmup_steps=2",
    "optim.lr=3e-3",
)


def copy_template(dest: Path, name: str = "lm") -> Path:
    recipe = dest / name
    shutil.copytree(TEMPLATE, recipe, ignore=shutil.ignore_patterns("__pycache__"))
    return recipe


def engine_command(recipe: Path, *overrides: str, nproc: int = 1, resume_from: Path | None = None,
                   run_dir: Path | None = None) -> list[str]:
    if nproc > 1:  # the ranks of one node, as a run starts them (runner.local_ranks: no torchrun)
        command = [*launcher_command(nproc), "-m", "engine.launch", str(recipe)]
    else:
        command = [sys.executable, "-m", "engine.launch", str(recipe)]
    for item in overrides:
        command += ["--set", item]
    if resume_from is not None:
        command += ["--resume-from", str(resume_from)]
    if run_dir is not None:
        command += ["--run-dir", str(run_dir)]
    return command


def engine_env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")  # the same thread count in every run: bit-identical maths
    env["PYTHONUNBUFFERED"] = "1"
    return env


def new_run_dirs(cwd: Path, before: set[str]) -> list[Path]:
    runs = cwd / rd.RUNS_DIRNAME
    return sorted(p for p in runs.iterdir() if p.name not in before) if runs.is_dir() else []


def existing_runs(cwd: Path) -> set[str]:
    runs = cwd / rd.RUNS_DIRNAME
    return {p.name for p in runs.iterdir()} if runs.is_dir() else set()


def run_engine(cwd: Path, recipe: Path, *overrides: str, nproc: int = 1,
               resume_from: Path | None = None, timeout: float = 600) -> Path:
    """Run the engine to completion in ``cwd``; return the new run directory."""
    before = existing_runs(cwd)
    result = subprocess.run(
        engine_command(recipe, *overrides, nproc=nproc, resume_from=resume_from),
        cwd=cwd, env=engine_env(), capture_output=True, text=True, timeout=timeout,
    )
    if result.returncode != 0:
        raise AssertionError(f"engine failed ({result.returncode}):\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    (run,) = new_run_dirs(cwd, before)
    return run


def start_engine(cwd: Path, recipe: Path, *overrides: str, nproc: int = 1) -> tuple[subprocess.Popen, Path]:
    """Start the engine in its own process group and wait until its run directory exists."""
    before = existing_runs(cwd)
    process = subprocess.Popen(
        engine_command(recipe, *overrides, nproc=nproc), cwd=cwd, env=engine_env(),
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        runs = new_run_dirs(cwd, before)
        if runs:
            return process, runs[0]
        if process.poll() is not None:
            raise AssertionError(f"engine exited with {process.returncode} before creating its run")
        time.sleep(0.05)
    raise AssertionError("the engine created no run directory")


def kill_group(process: subprocess.Popen) -> None:
    """SIGKILL ``process``'s group and every process below it: torchrun's workers may sit in
    groups of their own, and once their parent is dead they could no longer be found."""
    from runner.processes import descendants

    below = descendants(process.pid)
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for pid in below:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    process.wait()


def losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in run_metrics.read_all_metrics(run_dir / rd.METRICS_JSONL) if "loss" in r}


def untimed(record: dict, derived_step_time: bool = True) -> dict:
    """A metrics record without the timing a run stamps on it, which differs between runs: every
    record's ``elapsed_s`` and, for a script's record (``derived_step_time``), the ``step_time_s``
    derived from it when the script logs none. Every other key is kept."""
    dropped = {"elapsed_s", "step_time_s"} if derived_step_time else {"elapsed_s"}
    return {key: value for key, value in record.items() if key not in dropped}


def wait_for(predicate, timeout: float = 300, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError("timed out waiting")


def finished_run(ws, run_id: str, timeout_s: float = 300) -> str:
    """``run_id`` once the server's run of it completed (an AssertionError with its console's end
    when it failed or ``timeout_s`` passed)."""
    from mcp_server.operations import runs as run_ops

    deadline = time.monotonic() + timeout_s
    while (status := run_ops.get_run(ws, run_id).status) not in rd.FINAL_STATUSES:
        assert time.monotonic() < deadline, f"run {run_id} still {status}"
        time.sleep(0.5)
    assert status == rd.COMPLETED, run_ops.get_run(ws, run_id).console_tail
    return run_id
