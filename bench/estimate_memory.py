"""estimate_run's peak memory (and step time) against what a real run measures, on a CPU.

For the causal_lm, sft and vlm templates at three sizes, each without and with the
gradient-checkpointing skill: the estimate (``python -m engine.launch RECIPE --check --estimate
cpu``: the model on the meta device, engine/estimate.py) and the largest ``peak_mem_mb`` of a real
run of the same config (``python -m engine.launch``, a few steps, no checkpoints). Prints both
per case, their ratio, the estimated and the measured median step time, and what checkpointing
changed in each.

    python bench/estimate_memory.py [--steps 3] [--templates causal_lm sft vlm] [--sizes small medium large]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from engine import run_dir as rd  # noqa: E402
from engine import run_metrics  # noqa: E402

QUIET = ("checkpoint.every=0", "checkpoint.at_end=false", "metrics.tensorboard=false", "train.log_every=1")
SIZES = {
    "small": ("model.hidden_size=64", "model.intermediate_size=160", "model.num_layers=2"),
    "medium": ("model.hidden_size=256", "model.intermediate_size=688", "model.num_layers=4"),
    "large": ("model.hidden_size=512", "model.intermediate_size=1376", "model.num_layers=8"),
}
SHAPES = {  # activations that matter beside the weights
    "causal_lm": ("data.seq_len=256", "data.batch_size=8"),
    "sft": ("data.seq_len=256", "data.batch_size=8"),
    "vlm": ("data.seq_len=64", "data.batch_size=16"),
}


def recipe(template: str, checkpointing: bool, root: Path) -> Path:
    folder = root / f"{template}{'-ckpt' if checkpointing else ''}"
    if not folder.exists():
        shutil.copytree(REPO / "recipes_template" / template, folder, ignore=shutil.ignore_patterns("__pycache__"))
        if checkpointing:
            from skills import apply_skill

            apply_skill("gradient-checkpointing", folder)
    return folder


def environment() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def estimated(folder: Path, settings: list[str], cwd: Path) -> dict:
    command = [sys.executable, "-m", "engine.launch", str(folder), "--check", "--estimate", "cpu",
               *(f"--set={s}" for s in settings)]
    done = subprocess.run(command, cwd=cwd, env=environment(), capture_output=True, text=True, timeout=600)
    for line in reversed(done.stdout.splitlines()):
        if line.startswith("{"):
            verdict = json.loads(line)
            if not verdict.get("ok"):
                raise SystemExit(f"check failed: {verdict.get('error')}")
            return verdict["estimate"]
    raise SystemExit(f"no verdict:\n{done.stderr[-2000:]}")


def measured_run(folder: Path, settings: list[str], cwd: Path) -> tuple[float, float]:
    """The run's largest peak_mem_mb and its median step time after the first window."""
    before = set(os.listdir(cwd / "runs")) if (cwd / "runs").is_dir() else set()
    command = [sys.executable, "-m", "engine.launch", str(folder), *(a for s in settings for a in ("--set", s))]
    done = subprocess.run(command, cwd=cwd, env=environment(), capture_output=True, text=True, timeout=1200)
    if done.returncode:
        raise SystemExit(f"run failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    (run,) = set(os.listdir(cwd / "runs")) - before
    records = [r for r in run_metrics.read_all_metrics(cwd / "runs" / run / rd.METRICS_JSONL) if "peak_mem_mb" in r]
    return max(r["peak_mem_mb"] for r in records), statistics.median(r["step_time_s"] for r in records[1:] or records)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--templates", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    args = parser.parse_args()
    print(f"load average {os.getloadavg()[0]:.2f}; one thread per run")
    print(f"{'case':<26}{'estimate MB':>12}{'measured MB':>12}{'ratio':>7}{'step s est/meas':>17}"
          "   checkpointing: estimate vs measured change")
    with tempfile.TemporaryDirectory(prefix="trainwright-estimate-") as scratch:
        root = Path(scratch)
        for template in args.templates:
            for size in args.sizes:
                settings = [*QUIET, *SIZES[size], *SHAPES[template], f"train.max_steps={args.steps}"]
                row = {}
                for checkpointing in (False, True):
                    folder = recipe(template, checkpointing, root)
                    figures = estimated(folder, settings, root)
                    estimate = figures["memory_gib"]["peak_gib"] * 1024
                    measured, step_s = measured_run(folder, settings, root)
                    row[checkpointing] = (estimate, measured)
                    name = f"{template} {size}{' +ckpt' if checkpointing else ''}"
                    steps = f"{figures['step_time_s'] or 0:.3f}/{step_s:.3f}"
                    print(f"{name:<26}{estimate:>12,.0f}{measured:>12,.0f}{estimate / measured:>7.2f}{steps:>17}", end="")
                    if checkpointing:
                        (e0, m0), (e1, m1) = row[False], row[True]
                        print(f"   {e1 - e0:+,.0f} MB vs {m1 - m0:+,.0f} MB", end="")
                    print(flush=True)
    print(f"load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
