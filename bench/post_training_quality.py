"""Does post-training work? SFT's answer accuracy, and DPO's preferred-answer rate, before and after.

SFT: the ``sft`` template (with the ``sequence-packing`` skill applied) trains the tiny model
on its built-in instruction set; ``task_metrics()`` scores greedy answers to held-out prompts
(exact match) before training (the base model), after, and against guessing (chance).
DPO: the ``dpo`` template, started from the SFT model's weights, trains on its built-in
preference set (the correct result with a full stop, over the bare result or a near miss); the
held-out preferred-answer rate (the model gives the chosen answer the higher log-probability;
chance 0.5), split by the kind of rejected answer, and how often the greedy answer is the chosen
one, before and after.

    python bench/post_training_quality.py [--sft-steps N] [--dpo-steps N] [--sft-set KEY=VALUE ...] [--dpo-set ...]
    python bench/post_training_quality.py --dpo-only [--dpo-steps 60]   # DPO from the tiny model's random weights
    python bench/post_training_quality.py --sft-model DIR   # keeps the SFT model in DIR; once it exists, DPO only

Each template runs with its own config.yaml (what ``trainwright run`` does), changed only by the
options. Runs in this process (``--threads``, default one per core); prints each figure, the wall and CPU time of
SFT (the CPU time says what it costs on a machine shared with other work) and the load average.
"""

from __future__ import annotations

import argparse
import os
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

MODEL = ["model.hidden_size=128", "model.intermediate_size=344", "model.num_layers=2"]  # --dpo-only
QUIET = ["checkpoint.every=0", "checkpoint.at_end=false", "metrics.tensorboard=false", "train.log_every=50"]


def engine(recipe_dir: Path, overrides: list[str]):
    recipe_class = load_recipe_class(recipe_dir)
    config = build_config(recipe_class.config_class, recipe_dir / "config.yaml", overrides)
    return recipe_class(config, DistInfo(0, 1, 0, torch.device("cpu"), None))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sft-steps", type=int, help="default: the sft template's train.max_steps")
    parser.add_argument("--dpo-steps", type=int, help="default: the dpo template's train.max_steps")
    parser.add_argument("--sft-set", action="append", default=[], metavar="KEY=VALUE", help="an sft override")
    parser.add_argument("--dpo-set", action="append", default=[], metavar="KEY=VALUE", help="a dpo override")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                        help="torch threads (default: one per core; 1 on a machine shared with other work)")
    parser.add_argument("--dpo-only", action="store_true", help="DPO alone, from the built-in tiny model")
    parser.add_argument("--sft-model", type=Path, help="a folder: keep the SFT model there; if it exists, DPO from it")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.dpo_only:
        return align(REPO / "recipes_template" / "dpo", [*MODEL, "optim.lr=1e-3", "optim.warmup_steps=10", *args.dpo_set],
                     args.dpo_steps, "the tiny model's random weights")
    if args.sft_model is not None and args.sft_model.is_dir():
        return align(REPO / "recipes_template" / "dpo", [f"model.pretrained_path={args.sft_model.resolve()}", *args.dpo_set],
                     args.dpo_steps, f"the SFT model in {args.sft_model}")
    scratch = Path(tempfile.mkdtemp(prefix="post-training-"))
    sft_dir = scratch / "sft"
    shutil.copytree(REPO / "recipes_template" / "sft", sft_dir)
    apply_skill("sequence-packing", sft_dir)

    sft = engine(sft_dir, [*QUIET, *steps(args.sft_steps), *args.sft_set])
    chance = sys.modules[type(sft).__module__].chance_accuracy()
    sft.before_train()
    base = sft.task_metrics()["answer_accuracy"]
    start, cpu_start = time.perf_counter(), time.process_time()
    sft.do_train()
    sft_seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    tuned = sft.task_metrics()["answer_accuracy"]
    print(f"SFT {sft.state.step} steps ({describe(sft)}; {sft_seconds:.0f} s wall, {cpu_seconds:.0f} s CPU "
          f"over {torch.get_num_threads()} threads, load average {os.getloadavg()[0]:.1f}): held-out answer "
          f"accuracy {base:.2f} (base model) -> {tuned:.2f}; chance {chance:.2f}", flush=True)

    exported = (args.sft_model or scratch / "sft-model").resolve()
    sft.hf_model().save_pretrained(exported)
    sft.hf_processing().save_pretrained(exported)
    align(REPO / "recipes_template" / "dpo", [f"model.pretrained_path={exported}", *args.dpo_set],
          args.dpo_steps, "the SFT model")
    shutil.rmtree(scratch, ignore_errors=True)


@torch.no_grad()
def preferred_by_kind(dpo) -> dict[str, float]:
    """The held-out preferred-answer rate over each kind of rejected answer: the bare result
    (a style preference) and a near miss (correctness)."""
    module = sys.modules[type(dpo).__module__]
    cfg = dpo.config.data
    records = dpo.held_out_records
    rates = {}
    for kind, chosen in (("over the bare result", [r for r in records if not r["rejected"].endswith(".")]),
                         ("over a near miss", [r for r in records if r["rejected"].endswith(".")])):
        pieces = [module.tokenize_pair(dpo.tokenizer, r, cfg.seq_len) for r in chosen]
        logps, _ = module.answer_logps(dpo.model, module.collate(pieces, cfg.seq_len, dpo.tokenizer.pad_token_id))
        good, bad = logps.chunk(2)
        rates[f"{kind} ({len(chosen)})"] = float((good > bad).double().mean())
    return rates


def steps(count: int | None) -> list[str]:
    return [] if count is None else [f"train.max_steps={count}"]


def describe(run) -> str:
    cfg = run.config
    return (f"hidden {cfg.model.hidden_size}, {cfg.model.num_layers} layers, batch {cfg.data.batch_size} x "
            f"{cfg.data.seq_len}, lr {cfg.optim.lr:g}")


def align(recipe_dir: Path, overrides: list[str], count: int | None, start_from: str) -> None:
    dpo = engine(recipe_dir, [*QUIET, *overrides, *steps(count), "data.eval_prompts=195"])
    dpo.before_train()
    dpo.model.eval()
    before, before_kinds = dpo.task_metrics(), preferred_by_kind(dpo)
    start = time.perf_counter()
    dpo.do_train()
    seconds = time.perf_counter() - start
    dpo.model.eval()
    after, after_kinds = dpo.task_metrics(), preferred_by_kind(dpo)
    kinds = ", ".join(f"{k} {before_kinds[k]:.2f} -> {after_kinds[k]:.2f}" for k in before_kinds)
    print(f"DPO {dpo.state.step} steps ({seconds:.0f} s; lr {dpo.config.optim.lr:g}, beta {dpo.config.dpo.beta:g}, "
          f"batch {dpo.config.data.batch_size}) from {start_from}: held-out preferred-answer rate "
          f"{before['preferred_rate']:.2f} -> {after['preferred_rate']:.2f} (chance 0.50; {kinds}); greedy answer "
          f"is the preferred one {before['chosen_answer_rate']:.2f} -> {after['chosen_answer_rate']:.2f}", flush=True)


if __name__ == "__main__":
    main()
