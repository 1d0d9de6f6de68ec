"""Does post-training work? SFT's answer accuracy, and DPO's preferred-answer rate, before and after.

SFT: the ``sft`` template (with the ``sequence-packing`` skill applied) trains the tiny model
on its built-in instruction set; ``task_metrics()`` scores greedy answers to held-out prompts
(exact match) before training (the base model), after, and against guessing (chance).
DPO: the ``dpo`` template, started from the SFT model's weights, trains on its built-in
preference set; the held-out preferred-answer rate (the model ranks the correct answer above
the near miss; chance 0.5) and the greedy answer's accuracy, before and after.

    python bench/post_training_quality.py [--sft-steps 300] [--dpo-steps 60]
    python bench/post_training_quality.py --dpo-only [--dpo-steps 60]   # DPO from the tiny model's random weights

Runs in this process, one thread per core; prints each figure and the wall time of each stage.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from engine.config import build_config  # noqa: E402
from engine.distributed import DistInfo  # noqa: E402
from engine.launch import load_recipe_class  # noqa: E402
from skills import apply_skill  # noqa: E402

MODEL = ["model.hidden_size=128", "model.intermediate_size=344", "model.num_layers=2"]
QUIET = ["checkpoint.every=0", "checkpoint.at_end=false", "metrics.tensorboard=false", "train.log_every=50"]


def engine(recipe_dir: Path, overrides: list[str]):
    recipe_class = load_recipe_class(recipe_dir)
    config = build_config(recipe_class.config_class, None, overrides)
    return recipe_class(config, DistInfo(0, 1, 0, torch.device("cpu"), None))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sft-steps", type=int, default=300)
    parser.add_argument("--dpo-steps", type=int, default=60)
    parser.add_argument("--dpo-only", action="store_true", help="DPO alone, from the built-in tiny model")
    args = parser.parse_args()
    if args.dpo_only:
        return align(REPO / "recipes_template" / "dpo", [*MODEL, "optim.lr=1e-3", "optim.warmup_steps=10"],
                     args.dpo_steps, "the tiny model's random weights")
    scratch = Path(tempfile.mkdtemp(prefix="post-training-"))
    sft_dir = scratch / "sft"
    shutil.copytree(REPO / "recipes_template" / "sft", sft_dir)
    apply_skill("sequence-packing", sft_dir)

    sft = engine(sft_dir, [*MODEL, *QUIET, f"train.max_steps={args.sft_steps}", "data.batch_size=32",
                           "optim.lr=3e-3", "optim.warmup_steps=20"])
    chance = sys.modules[type(sft).__module__].chance_accuracy()
    sft.before_train()
    base = sft.task_metrics()["answer_accuracy"]
    start = time.perf_counter()
    sft.do_train()
    sft_seconds = time.perf_counter() - start
    tuned = sft.task_metrics()["answer_accuracy"]
    print(f"SFT {args.sft_steps} steps ({sft_seconds:.0f} s): held-out answer accuracy "
          f"{base:.2f} (base model) -> {tuned:.2f}; chance {chance:.2f}", flush=True)

    exported = scratch / "sft-model"
    sft.hf_model().save_pretrained(exported)
    sft.hf_processing().save_pretrained(exported)
    align(REPO / "recipes_template" / "dpo", [f"model.pretrained_path={exported}", "optim.lr=1e-4", "optim.warmup_steps=5"],
          args.dpo_steps, "the SFT model")
    shutil.rmtree(scratch, ignore_errors=True)


def align(recipe_dir: Path, overrides: list[str], steps: int, start_from: str) -> None:
    dpo = engine(recipe_dir, [*QUIET, *overrides, f"train.max_steps={steps}", "data.batch_size=16",
                              "dpo.beta=0.1", "data.eval_prompts=195"])
    dpo.before_train()
    before = dpo.task_metrics()
    start = time.perf_counter()
    dpo.do_train()
    seconds = time.perf_counter() - start
    after = dpo.task_metrics()
    print(f"DPO {steps} steps ({seconds:.0f} s) from {start_from}: held-out preferred-answer rate "
          f"{before['preferred_rate']:.2f} -> {after['preferred_rate']:.2f} (chance 0.50); greedy answer "
          f"accuracy {before['chosen_answer_rate']:.2f} -> {after['chosen_answer_rate']:.2f}", flush=True)


if __name__ == "__main__":
    main()
