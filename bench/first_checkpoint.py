"""Tokens/s of every logging window, before and after a run's first checkpoint.

A run's speed must not depend on whether it has saved a checkpoint yet, nor on how it was
started. For each template (``causal_lm``, ``sft``) this runs, interleaved over rounds:

- ``sandbox every=K``: launched as the server launches (``runner.lifecycle.start_run``: the
  supervisor, the allow-listed environment, bubblewrap), saving every ``K`` steps;
- ``sandbox every=0``: the same, without checkpoints;
- ``direct every=K`` and ``direct every=0``: ``python -m engine.launch`` in a subprocess with
  this process's environment, no supervisor, no sandbox.

Every window's tokens/s is printed (``|`` marks the first save), with the load average and,
for a direct run, the user CPU seconds of its process (start-up included: the work it cost,
which load does not change unless threads spin), then per run the ratio of the windows before
the first save to those after it, and per template the medians over rounds of each
peer's windows after the first (warm-up) one. Goals: windows before the first save within 10%
of those after it; no-checkpoint runs as fast as checkpointed ones and as the direct launch.

    python bench/first_checkpoint.py [--rounds 2] [--steps 30] [--log-every 5] [--every 10]
                                     [--templates causal_lm sft] [--set KEY=VALUE ...]

``GOMP_SPINCOUNT=300000 python bench/first_checkpoint.py`` measures libgomp's default spin count
without the engine's governor (``engine/openmp.py``): a spin count the user sets is kept and not
governed.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from engine import run_dir as rd  # noqa: E402
from engine import run_metrics  # noqa: E402
from engine.config import overrides_to_dict  # noqa: E402
from sandbox import bwrap  # noqa: E402
from workspace import git as workspace_git  # noqa: E402
from runner import lifecycle as run_lifecycle  # noqa: E402
from workspace.settings import RunLimits  # noqa: E402
from runner.provenance import CodeOrigin  # noqa: E402
from tests.support import wait_for  # noqa: E402

PEER_GOAL = 0.90
CPU_SECONDS: list[float] = []  # user CPU of each direct run (a sandboxed run is not our child)


def workspace(root: Path, templates: list[str]) -> Path:
    paths = []
    for name in templates:
        recipe = root / "recipes" / name
        shutil.copytree(REPO / "recipes_template" / name, recipe, ignore=shutil.ignore_patterns("__pycache__"))
        paths.append(recipe)
    workspace_git.commit_paths(workspace_git.ensure_repo(root), paths, "add recipes", [])
    return root


def sandboxed(root: Path, template: str, overrides: list[str], threads: int) -> Path:
    limits = RunLimits(threads_per_process=threads)
    recipe = root / "recipes" / template
    verdict = run_lifecycle.check_launch(root, recipe, 1, overrides, limits=limits)
    plan = run_lifecycle.LaunchPlan(recipe, f"recipes/{template}", 1, CodeOrigin(git_commit=None, recipe_dirty=None),
                                    overrides_to_dict(overrides), verdict, limits=limits)
    record = run_lifecycle.start_run(root, root / "runs", plan)
    run_dir = root / "runs" / record.id
    final = wait_for(lambda: (r := rd.read_run(run_dir)).status in rd.FINAL_STATUSES
                     and not rd.pid_alive(r.pid) and r, 1800, 0.2)
    if final.status != rd.COMPLETED:
        raise SystemExit(f"{template}: run {final.id} {final.status}: {final.error}")
    return run_dir


def direct(root: Path, template: str, overrides: list[str], threads: int) -> Path:
    """The run folder of ``python -m engine.launch``; the process's user CPU seconds in
    ``CPU_SECONDS`` (start-up included)."""
    cwd = root / "direct"
    cwd.mkdir(exist_ok=True)
    before = set(os.listdir(cwd / rd.RUNS_DIRNAME)) if (cwd / rd.RUNS_DIRNAME).is_dir() else set()
    command = [sys.executable, "-m", "engine.launch", str(root / "recipes" / template)]
    for item in overrides:
        command += ["--set", item]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(REPO)}
    before_cpu = resource.getrusage(resource.RUSAGE_CHILDREN).ru_utime
    out = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True)
    CPU_SECONDS.append(resource.getrusage(resource.RUSAGE_CHILDREN).ru_utime - before_cpu)
    if out.returncode != 0:
        raise SystemExit(f"{template} direct failed:\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
    (name,) = set(os.listdir(cwd / rd.RUNS_DIRNAME)) - before
    return cwd / rd.RUNS_DIRNAME / name


def windows(run_dir: Path) -> list[tuple[int, float]]:
    return [(m["step"], m["tokens_per_s"]) for m in run_metrics.read_all_metrics(run_dir / rd.METRICS_JSONL)
            if m.get("tokens_per_s") is not None]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--log-every", type=int, default=5)
    parser.add_argument("--every", type=int, default=10, help="checkpoint.every of the checkpointed peers")
    parser.add_argument("--templates", nargs="+", default=["causal_lm", "sft"])
    parser.add_argument("--modes", nargs="+", default=["sandbox", "direct"], choices=["sandbox", "direct"])
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    if "sandbox" in args.modes and (reason := bwrap.probe(bwrap.find_bwrap())) is not None:
        print(f"bubblewrap cannot run here ({reason}): the sandboxed peers fall back", file=sys.stderr)
    threads = len(os.sched_getaffinity(0))
    base = [f"train.max_steps={args.steps}", f"train.log_every={args.log_every}", "checkpoint.at_end=false",
            "train.eval_every=0", "metrics.tensorboard=false", *args.overrides]
    peers = [(mode, every) for mode in args.modes for every in (args.every, 0)]
    print(f"load average at start: {os.getloadavg()[0]:.2f}; {threads} thread(s); {args.steps} steps, "
          f"a window every {args.log_every}, checkpoint.every {args.every} or 0")
    after: dict[tuple[str, str, int], list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="trainwright-bench-") as scratch:
        root = workspace(Path(scratch) / "ws", args.templates)
        for round_ in range(args.rounds):
            for template in args.templates:
                order = peers if round_ % 2 == 0 else peers[::-1]
                for mode, every in order:
                    overrides = [*base, f"checkpoint.every={every}"]
                    load = os.getloadavg()[0]
                    started = time.perf_counter()
                    run_dir = (sandboxed if mode == "sandbox" else direct)(root, template, overrides, threads)
                    wall = time.perf_counter() - started
                    speeds = windows(run_dir)
                    cells = []
                    for step, speed in speeds:
                        cells.append(f"{speed:>7,.0f}")
                        if every and step == every:
                            cells.append("|")
                    timed = speeds[1:]
                    after.setdefault((template, mode, every), []).extend(s for _, s in timed)
                    cpu = f"cpu {CPU_SECONDS[-1]:5.1f}s" if mode == "direct" else " " * 10
                    line = (f"round {round_ + 1} {template:<9} {mode:<7} every={every:<2} load {load:4.1f} "
                            f"wall {wall:5.1f}s {cpu}: {' '.join(cells)}")
                    if every:
                        pre = [s for step, s in timed if step <= every]
                        post = [s for step, s in timed if step > every]
                        if pre and post:
                            ratio = statistics.mean(pre) / statistics.mean(post)
                            line += f"  before/after first save {ratio:.2f}"
                    print(line, flush=True)
    print("\nmedian tokens/s of the windows after the first (warm-up) one")
    verdicts = []
    for template in args.templates:
        row = {peer: statistics.median(after[(template, *peer)]) for peer in peers if after.get((template, *peer))}
        print(f"{template:<10}" + "  ".join(f"{mode} every={every}: {speed:,.0f}" for (mode, every), speed in row.items()))
        for mode in args.modes:
            ratio = row[(mode, 0)] / row[(mode, args.every)]
            verdicts.append(ratio >= PEER_GOAL)
            print(f"  {mode}: every=0 / every={args.every}: {ratio:.2f}")
        if len(args.modes) == 2:
            ratio = row[("sandbox", 0)] / row[("direct", 0)]
            verdicts.append(ratio >= PEER_GOAL)
            print(f"  every=0: sandbox / direct: {ratio:.2f}")
    print(f"\ngoal (each ratio >= {PEER_GOAL}): {'met' if all(verdicts) else 'NOT met'}; load average at end "
          f"{os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
