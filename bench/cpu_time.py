"""The CPU a training step costs: the seconds of its process (``time.process_time``: every thread,
user and system), which a machine other processes load does not change the way it changes
wall-clock seconds. What the throughput benchmarks' ``--cpu-time`` reports read."""

from __future__ import annotations

import contextlib
import sys
import time
from pathlib import Path
from typing import Iterator

REPO = Path(__file__).resolve().parent.parent


@contextlib.contextmanager
def engine_step_ends() -> Iterator[list[float]]:
    """Within it, each ``Engine.train_step`` of this process appends the process's CPU seconds as
    the step ends (the engine then logs, evaluates or saves before the next step starts)."""
    sys.path.insert(0, str(REPO))
    from engine.engine import Engine

    ends: list[float] = []
    train_step = Engine.train_step

    def noted(engine):
        ctx = train_step(engine)
        ends.append(time.process_time())
        return ctx

    Engine.train_step = noted  # type: ignore[method-assign]
    try:
        yield ends
    finally:
        Engine.train_step = train_step  # type: ignore[method-assign]


def timed_cpu_seconds(step_ends: list[float], warmup: int) -> list[float]:
    """The CPU seconds of each step after the first ``warmup``: from the end of the step before
    to its own end, so a step's share of data loading and logging is in it."""
    return [b - a for a, b in zip(step_ends[warmup - 1 : -1], step_ends[warmup:])]


def run_engine_here(recipe_dir: Path, settings: list[str]) -> int:
    """``python -m engine.launch RECIPE_DIR --set ...`` in this process (a worker started with a
    run's OpenMP policy), its console lines on stderr; the exit code."""
    sys.path.insert(0, str(REPO))
    from engine import launch

    argv = [str(recipe_dir)] + [arg for item in settings for arg in ("--set", item)]
    with contextlib.redirect_stdout(sys.stderr):  # stdout is the worker's result
        return launch.main(argv)
