"""It learns: the ``grpo`` template on its built-in sums, from a random tiny model, on a CPU.

Trains the template (hidden 128, 2 layers, completions of at most 3 tokens, its default rewards
``correct_answer`` + 0.5 × ``near_answer``) for ``--steps`` steps, then scores greedy answers to
the held-out prompts with ``evaluate`` (``engine.model_io``) on the final checkpoint, and the
same prompts with the untrained model (the run's seed, before step 1). Prints the held-out mean
reward per function with the prompt count at step 0 and at the end, and the training curve
(reward, exact answers, completion length against step).

    python bench/grpo_learns.py [--steps 150] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TEMPLATE = REPO / "recipes_template" / "grpo"
OVERRIDES = ["model.hidden_size=128", "model.intermediate_size=344", "model.num_layers=2", "grpo.max_completion_length=3",
             "train.log_every=10", "metrics.tensorboard=false", "checkpoint.every=0"]


def untrained_metrics(recipe: Path, overrides: list[str]) -> dict[str, float]:
    import torch

    from engine.config import build_config
    from engine.distributed import DistInfo
    from engine.launch import load_recipe_class

    recipe_class = load_recipe_class(recipe)
    engine = recipe_class(build_config(recipe_class.config_class, None, overrides), DistInfo(0, 1, 0, torch.device("cpu"), None))
    torch.manual_seed(engine.config.train.seed)  # as before_train: the weights the run starts from
    engine.model = engine.prepare_model()
    engine.model.eval()
    with torch.no_grad():
        return engine.task_metrics()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    from engine import model_io
    from engine import run_dir as rd
    from engine import run_metrics

    workspace = Path(tempfile.mkdtemp(prefix="grpo-learns-"))
    recipe = workspace / "grpo"
    shutil.copytree(TEMPLATE, recipe, ignore=shutil.ignore_patterns("__pycache__"))
    overrides = [*OVERRIDES, f"train.max_steps={args.steps}"]
    command = [sys.executable, "-m", "engine.launch", str(recipe)] + [a for o in overrides for a in ("--set", o)]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "PYTHONPATH": str(REPO)}
    subprocess.run(command, cwd=workspace, env=env, check=True, stdout=subprocess.DEVNULL)
    (run,) = (workspace / rd.RUNS_DIRNAME).iterdir()
    shutil.copytree(recipe, run / rd.SNAPSHOT_DIRNAME, dirs_exist_ok=True)  # the code snapshot evaluate loads
    before = untrained_metrics(recipe, overrides)
    after = model_io.evaluate(run, args.steps).metrics
    print(f"held-out greedy answers ({int(after['prompts'])} prompts): step 0 -> step {args.steps}")
    for key in after:
        if key != "prompts":
            print(f"  {key}: {before[key]:.3f} -> {after[key]:.3f}")
    print("curve (training samples): step, reward, reward_correct_answer, completion_length")
    for record in run_metrics.read_all_metrics(run / rd.METRICS_JSONL):
        if "reward" in record:
            print(f"  {record['step']:4d} {record['reward']:.3f} {record['reward_correct_answer']:.3f} "
                  f"{record['completion_length']:.2f}")
    print(json.dumps({"before": before, "after": after, "steps": args.steps, "overrides": OVERRIDES}))
    shutil.rmtree(workspace, ignore_errors=True)


if __name__ == "__main__":
    main()
