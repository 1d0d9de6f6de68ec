"""A CPU run's step time, CPU seconds and peak resident set with glibc's mmap threshold fixed
(``TRAINWRIGHT_MMAP_THRESHOLD``: engine/memory.py ``follow_live_memory``) against glibc's dynamic
default (the engine's default).

The same run of the causal_lm template (its default model, or ``--set`` sizes) twice per round,
once with ``TRAINWRIGHT_MMAP_THRESHOLD=--threshold`` (256 KiB unless given) and once without it,
the order reversed every round, one thread each. Prints every round's median step time (after
the first ``--warmup`` steps), the CPU seconds of the whole process (start-up included; on a
loaded machine they move less than the wall time) and the peak resident set for both, then the
median over rounds of the ratios fixed / default. A fixed threshold would be the default if the
step time and CPU seconds stayed within noise of 1.00 (≤ 1.03) with the peak lower.

    python bench/malloc_threshold.py [--rounds 4] [--steps 30] [--warmup 5] [--threshold BYTES] [--set KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from engine import run_dir as rd  # noqa: E402
from engine import run_metrics  # noqa: E402
from engine.memory import MMAP_THRESHOLD_VARIABLE  # noqa: E402

QUIET = ("checkpoint.every=0", "checkpoint.at_end=false", "metrics.tensorboard=false", "train.log_every=1")
ARMS = {"fixed": str(256 * 1024), "default": None}


def one_run(arm: str, settings: list[str], root: Path) -> tuple[float, float, float]:
    """The run's median step time after the warm-up, its largest peak_mem_mb and the CPU seconds
    (user + system) its process took, start-up included."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("MALLOC_MMAP_THRESHOLD_", None)
    env.pop(MMAP_THRESHOLD_VARIABLE, None)
    if ARMS[arm] is not None:
        env[MMAP_THRESHOLD_VARIABLE] = ARMS[arm]
    runs = root / "runs"
    before = set(os.listdir(runs)) if runs.is_dir() else set()
    command = [sys.executable, "-m", "engine.launch", str(REPO / "recipes_template" / "causal_lm"),
               *(a for s in settings for a in ("--set", s))]
    before_cpu = resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=1800)
    after_cpu = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_s = (after_cpu.ru_utime + after_cpu.ru_stime) - (before_cpu.ru_utime + before_cpu.ru_stime)
    if done.returncode:
        raise SystemExit(f"{arm} run failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    (run,) = set(os.listdir(runs)) - before
    records = [r for r in run_metrics.read_all_metrics(runs / run / rd.METRICS_JSONL) if "step_time_s" in r]
    timed = [r["step_time_s"] for r in records if r["step"] > WARMUP] or [r["step_time_s"] for r in records]
    return statistics.median(timed), max(r["peak_mem_mb"] for r in records), cpu_s


WARMUP = 5


def main() -> None:
    global WARMUP
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--threshold", type=int, default=256 * 1024, help="the fixed arm's threshold in bytes")
    parser.add_argument("--set", action="append", default=[], dest="overrides", metavar="KEY=VALUE")
    args = parser.parse_args()
    WARMUP = args.warmup
    ARMS["fixed"] = str(args.threshold)
    settings = [*QUIET, f"train.max_steps={args.steps}", *args.overrides]
    print(f"causal_lm template, {args.steps} steps ({args.warmup} not timed), one thread; fixed = "
          f"{args.threshold:,} B threshold, default = glibc's dynamic one; settings {args.overrides or 'the template'}")
    ratios: dict[str, list[float]] = {"step": [], "peak": [], "cpu": []}
    with tempfile.TemporaryDirectory(prefix="trainwright-malloc-") as scratch:
        root = Path(scratch)
        for round_ in range(args.rounds):
            order = list(ARMS) if round_ % 2 == 0 else list(reversed(ARMS))
            figures = {arm: one_run(arm, settings, root) for arm in order}
            (fixed_step, fixed_peak, fixed_cpu), (default_step, default_peak, default_cpu) = figures["fixed"], figures["default"]
            ratios["step"].append(fixed_step / default_step)
            ratios["peak"].append(fixed_peak / default_peak)
            ratios["cpu"].append(fixed_cpu / default_cpu)
            print(f"round {round_ + 1} ({' then '.join(order)}), load {os.getloadavg()[0]:.2f}: step "
                  f"{fixed_step * 1000:,.1f} vs {default_step * 1000:,.1f} ms ({ratios['step'][-1]:.3f}×), CPU "
                  f"{fixed_cpu:,.1f} vs {default_cpu:,.1f} s ({ratios['cpu'][-1]:.3f}×), peak "
                  f"{fixed_peak:,.0f} vs {default_peak:,.0f} MB ({ratios['peak'][-1]:.3f}×)", flush=True)
    print(f"median over {args.rounds} rounds, fixed / default: step time {statistics.median(ratios['step']):.3f}×, "
          f"CPU seconds {statistics.median(ratios['cpu']):.3f}×, peak RSS {statistics.median(ratios['peak']):.3f}×")


if __name__ == "__main__":
    main()
