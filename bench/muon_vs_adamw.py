"""Muon against AdamW on the causal_lm template, each at its best learning rate.

Both optimizers train the template's model on its data (the CPython standard library, bytes) for
the same steps with the same seed and schedule; the muon copy of the template is made by the
product itself (``skills.apply_skill("muon", ...)``), and every run is a real
``python -m engine.launch``. A small learning-rate sweep per optimizer picks the best by the
evaluation loss at the end (8 held-out batches).

    python bench/muon_vs_adamw.py [--steps 150] [--jobs 2] [--set key=value ...]

Prints every run, then the best final training loss (mean of the last 10 steps) and evaluation
loss of each optimizer, and Muon's ratio to AdamW. Runs ``--jobs`` processes at a time, one
thread each.
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
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from engine import run_dir as rd  # noqa: E402  (torch-free)
from engine import run_metrics  # noqa: E402
from skills import apply_skill  # noqa: E402

TEMPLATE = REPO / "recipes_template" / "causal_lm"
ADAMW_LRS = (3e-4, 1e-3, 3e-3, 1e-2)
MUON_LRS = (3e-3, 1e-2, 3e-2)


def run(recipe: Path, workdir: Path, steps: int, lr: float, extra: list[str]) -> dict:
    settings = [
        f"train.max_steps={steps}", "train.log_every=1", f"train.eval_every={steps}", "train.eval_batches=8",
        f"optim.lr={lr}", "optim.warmup_steps=10", "checkpoint.every=0", "checkpoint.at_end=false",
        "metrics.tensorboard=false", *extra,
    ]
    workdir.mkdir(parents=True)
    command = [sys.executable, "-m", "engine.launch", str(recipe)] + [a for s in settings for a in ("--set", s)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    result = subprocess.run(command, cwd=workdir, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{recipe.name} lr {lr} failed:\n{result.stderr[-2000:]}")
    (run_path,) = (workdir / rd.RUNS_DIRNAME).iterdir()
    records = run_metrics.read_all_metrics(run_path / rd.METRICS_JSONL)
    losses = [r["loss"] for r in records if "loss" in r]
    evals = [r["eval_loss"] for r in records if "eval_loss" in r]
    return {"lr": lr, "final_loss": statistics.mean(losses[-10:]), "eval_loss": evals[-1],
            "step_time_s": statistics.median(r["step_time_s"] for r in records if "step_time_s" in r)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--jobs", type=int, default=2, help="runs at a time (one thread each)")
    parser.add_argument("--adamw-lrs", type=float, nargs="+", default=ADAMW_LRS)
    parser.add_argument("--muon-lrs", type=float, nargs="+", default=MUON_LRS)
    parser.add_argument("--set", dest="extra", action="append", default=[], metavar="KEY=VALUE",
                        help="more config overrides for every run (e.g. model.num_layers=2)")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        recipes = {}
        for name, skills in (("adamw", []), ("muon", ["muon"])):
            recipes[name] = Path(tmp) / name
            shutil.copytree(TEMPLATE, recipes[name], ignore=shutil.ignore_patterns("__pycache__", "runs"))
            for skill in skills:
                apply_skill(skill, recipes[name])
        jobs = [(name, lr) for name, lrs in (("adamw", args.adamw_lrs), ("muon", args.muon_lrs)) for lr in lrs]
        print(f"{len(jobs)} runs of {args.steps} steps, {args.jobs} at a time; overrides: {args.extra or 'none'}",
              flush=True)
        with ThreadPoolExecutor(args.jobs) as pool:
            futures = {job: pool.submit(run, recipes[job[0]], Path(tmp) / f"{job[0]}-{job[1]}", args.steps,
                                        job[1], args.extra) for job in jobs}
            results = {}
            for (name, lr), future in futures.items():
                results[(name, lr)] = record = future.result()
                print(f"{name:<6} lr {lr:<7g} final loss {record['final_loss']:.4f}  eval loss "
                      f"{record['eval_loss']:.4f}  step {record['step_time_s'] * 1e3:.0f} ms", flush=True)

    best = {}
    for name in ("adamw", "muon"):
        best[name] = min((r for (n, _), r in results.items() if n == name), key=lambda r: r["eval_loss"])
    print()
    print(f"{'':<8}{'best lr':>9}{'final loss':>12}{'eval loss':>11}")
    for name, record in best.items():
        print(f"{name:<8}{record['lr']:>9g}{record['final_loss']:>12.4f}{record['eval_loss']:>11.4f}")
    ratio_final = best["muon"]["final_loss"] / best["adamw"]["final_loss"]
    ratio_eval = best["muon"]["eval_loss"] / best["adamw"]["eval_loss"]
    print(f"muon / adamw: final loss {ratio_final:.3f}x, eval loss {ratio_eval:.3f}x")
    print(json.dumps({"best": best, "ratio_final": ratio_final, "ratio_eval": ratio_eval}))
    return 0 if ratio_eval < 1 else 1


if __name__ == "__main__":
    sys.exit(main())
