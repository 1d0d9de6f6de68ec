"""Does the vlm template learn to caption? Held-out caption accuracy before and after, against chance.

The ``vlm`` template's tiny LLaVA-style model trains on its built-in set of rendered shapes
(``a <colour> <shape> at the <position>``); ``task_metrics()`` scores greedy captions of
held-out images: ``caption_accuracy`` (shape, colour and position all right) and each
attribute's accuracy. Two schedules of the same number of steps, from the same random weights:

- finetune: projector and language model train from the start (``model.stage=finetune``);
- align → finetune: ``model.stage=align`` (the projector alone) for ``--align-steps``, then the
  align run's saved model starts a finetune run (``model.pretrained_path``), as a user chains
  two runs.

    python bench/vlm_quality.py [--steps 600] [--align-steps 150] [--finetune-only] [--threads 1]

Runs in this process on the CPU (``--threads``); prints each figure and each stage's wall time.
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

TEMPLATE = REPO / "recipes_template" / "vlm"
QUIET = ["checkpoint.every=0", "checkpoint.at_end=false", "metrics.tensorboard=false", "train.log_every=50",
         "train.eval_every=0", "data.eval_prompts=200", "optim.warmup_steps=10"]


def engine(overrides: list[str]):
    recipe_class = load_recipe_class(TEMPLATE)
    config = build_config(recipe_class.config_class, TEMPLATE / "config.yaml", [*QUIET, *overrides])
    return recipe_class(config, DistInfo(0, 1, 0, torch.device("cpu"), None))


def train(overrides: list[str]) -> tuple[object, dict[str, float], dict[str, float], float]:
    """(the engine, metrics before, metrics after, training seconds)."""
    run = engine(overrides)
    run.before_train()
    before = run.task_metrics()
    start = time.perf_counter()
    run.do_train()
    seconds = time.perf_counter() - start
    return run, before, run.task_metrics(), seconds


def show(name: str, before: dict[str, float], after: dict[str, float], seconds: float) -> None:
    parts = [f"{key.removesuffix('_accuracy')} {before[key]:.2f} -> {after[key]:.2f}" for key in after]
    print(f"{name} ({seconds:.0f} s of training): " + "; ".join(parts), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=600, help="optimizer steps of each schedule, in all")
    parser.add_argument("--align-steps", type=int, default=150)
    parser.add_argument("--finetune-only", action="store_true")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: steadiest on a shared machine)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    recipe = sys.modules[load_recipe_class(TEMPLATE).__module__]
    chance = {"caption": recipe.CHANCE, **{name: 1 / len(values) for name, values in recipe.ATTRIBUTES.items()}}
    print("chance (guessing each word uniformly): " + "; ".join(f"{k} {v:.3f}" for k, v in chance.items()), flush=True)
    wall = time.perf_counter()

    _, before, after, seconds = train([f"train.max_steps={args.steps}", "model.stage=finetune"])
    show(f"finetune {args.steps} steps", before, after, seconds)
    if not args.finetune_only:
        aligned, before, middle, first = train([f"train.max_steps={args.align_steps}", "model.stage=align"])
        show(f"align {args.align_steps} steps", before, middle, first)
        scratch = Path(tempfile.mkdtemp(prefix="vlm-quality-"))
        aligned.hf_model().save_pretrained(scratch)
        aligned.hf_processing().save_pretrained(scratch)
        rest = args.steps - args.align_steps
        _, _, after, second = train([f"train.max_steps={rest}", "model.stage=finetune", f"model.pretrained_path={scratch}"])
        show(f"align {args.align_steps} -> finetune {rest} steps", before, after, first + second)
        shutil.rmtree(scratch, ignore_errors=True)
    print(f"wall {time.perf_counter() - wall:.0f} s", flush=True)


if __name__ == "__main__":
    main()
