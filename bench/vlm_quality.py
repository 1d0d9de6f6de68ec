"""Does the vlm template learn to caption? Held-out caption accuracy before and after, against chance.

The ``vlm`` template's tiny LLaVA-style model trains on its built-in set of rendered shapes
(``a <colour> <shape> at the <position>``); ``task_metrics()`` scores greedy captions of
held-out images: ``caption_accuracy`` (shape, colour and position all right) and each
attribute's accuracy. Two schedules of the same number of steps, from the same random weights:

- finetune: projector and language model train from the start (``model.stage=finetune``);
- align → finetune: ``model.stage=align`` (the projector alone) for ``--align-steps``, then the
  align run's saved model starts a finetune run (``model.pretrained_path``), as a user chains
  two runs; and, as a control, finetune → finetune with the same split (two warm-ups and
  learning-rate cycles, no align).
- ``--language-model STEPS``: LLaVA's own order: first the ``causal_lm`` template learns the
  captions' language (the training captions as text, ``STEPS`` steps), then it is the frozen
  language model of an align run (``model.language_model_path``; only the projector learns to
  steer it with the image), then finetune.

    python bench/vlm_quality.py [--steps 600] [--align-steps 150] [--finetune-only] [--threads 1]
    python bench/vlm_quality.py --language-model 200 [--align-steps 150]

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


def engine(overrides: list[str], template: Path = TEMPLATE):
    recipe_class = load_recipe_class(template)
    quiet = QUIET if template == TEMPLATE else [o for o in QUIET if not o.startswith("data.")]
    config = build_config(recipe_class.config_class, template / "config.yaml", [*quiet, *overrides])
    return recipe_class(config, DistInfo(0, 1, 0, torch.device("cpu"), None))


def train(overrides: list[str], template: Path = TEMPLATE) -> tuple[object, dict[str, float], dict[str, float], float]:
    """(the engine, metrics before, metrics after, training seconds)."""
    run = engine(overrides, template)
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
    parser.add_argument("--language-model", type=int, metavar="STEPS", help="causal_lm on the captions, then align")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    recipe = sys.modules[load_recipe_class(TEMPLATE).__module__]
    chance = {"caption": recipe.CHANCE, **{name: 1 / len(values) for name, values in recipe.ATTRIBUTES.items()}}
    print("chance (guessing each word uniformly): " + "; ".join(f"{k} {v:.3f}" for k, v in chance.items()), flush=True)
    wall = time.perf_counter()
    if args.language_model:
        return language_model_first(recipe, args, wall)

    _, before, after, seconds = train([f"train.max_steps={args.steps}", "model.stage=finetune"])
    show(f"finetune {args.steps} steps", before, after, seconds)
    if not args.finetune_only:
        # The second schedule restarts warm-up and learning rate: the control does the same without align.
        for stage in ("align", "finetune"):
            first_run, before, middle, first = train([f"train.max_steps={args.align_steps}", f"model.stage={stage}"])
            show(f"{stage} {args.align_steps} steps", before, middle, first)
            scratch = Path(tempfile.mkdtemp(prefix="vlm-quality-"))
            rest = args.steps - args.align_steps
            _, _, after, second = train([f"train.max_steps={rest}", "model.stage=finetune",
                                         f"model.pretrained_path={save(first_run, scratch)}"])
            show(f"{stage} {args.align_steps} -> finetune {rest} steps", before, after, first + second)
            shutil.rmtree(scratch, ignore_errors=True)
    print(f"wall {time.perf_counter() - wall:.0f} s", flush=True)


def save(run, folder: Path) -> Path:
    run.hf_model().save_pretrained(folder)
    run.hf_processing().save_pretrained(folder)
    return folder


def language_model_first(recipe, args, wall: float) -> None:
    import json

    scratch = Path(tempfile.mkdtemp(prefix="vlm-quality-"))
    captions = scratch / "captions.jsonl"
    examples = recipe.builtin_examples(4000, 32)
    with open(captions, "w") as f:
        for name, _, text in examples:
            if not recipe.is_eval_document(name, 0.05):  # the held-out images' captions stay unseen
                f.write(json.dumps({"text": text}) + "\n")
    lm_overrides = [f"data.paths=[{captions}]", f"train.max_steps={args.language_model}", "data.seq_len=64",
                    "data.batch_size=32", "model.hidden_size=128", "model.intermediate_size=344", "model.num_layers=2",
                    "model.num_kv_heads=2", "optim.lr=3e-3", "data.eval_fraction=0"]
    start = time.perf_counter()
    lm = engine(lm_overrides, REPO / "recipes_template" / "causal_lm")
    lm.run()
    print(f"causal_lm {args.language_model} steps on the training captions ({time.perf_counter() - start:.0f} s)",
          flush=True)
    language = save(lm, scratch / "language")
    aligned, before, middle, first = train([f"train.max_steps={args.align_steps}", "model.stage=align",
                                            f"model.language_model_path={language}"])
    show(f"align {args.align_steps} steps, frozen causal_lm language model", before, middle, first)
    rest = args.steps - args.align_steps
    _, _, after, second = train([f"train.max_steps={rest}", "model.stage=finetune",
                                 f"model.pretrained_path={save(aligned, scratch / 'aligned')}"])
    show(f"then finetune {rest} steps", middle, after, second)
    shutil.rmtree(scratch, ignore_errors=True)
    print(f"wall {time.perf_counter() - wall:.0f} s", flush=True)


if __name__ == "__main__":
    main()
