"""SFT throughput: the ``sft`` template (padded, and with the ``sequence-packing`` skill) against
TRL's ``SFTTrainer``.

All peers fine-tune the same model (the template's tiny Llama, built from one seed) with the
same byte-level chat tokenizer on the same built-in conversations (loss on the assistant's tokens
only: the template's chat-template mask; ``assistant_only_loss=True`` for TRL), with the same
sequence length, batch, fp32, AdamW and clipping at 1.0, one process. TRL pads each batch to
its longest conversation (its default, no packing). Each peer runs in a fresh subprocess with the
same thread count, in interleaved rounds; the first ``--warmup`` steps are not timed.

    python bench/sft_throughput.py [--steps 40] [--warmup 5] [--rounds 3]

Prints supervised (assistant) tokens/s of each peer in every round, and the ratios. Goals:
the template at >= 1.0x TRL, and >= 1.3x with packing.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TEMPLATE = REPO / "recipes_template" / "sft"
PEERS = ("template", "template+packing", "trl")
SETTINGS = {"seq_len": 256, "batch_size": 16, "lr": 1e-3, "conversations": 2000}
MODEL = {"hidden_size": 256, "intermediate_size": 688, "num_layers": 4}  # the template's default model


def engine_tokens_per_s(recipe_dir: Path, steps: int, warmup: int) -> float:
    import torch

    from engine.config import build_config
    from engine.distributed import DistInfo
    from engine.launch import load_recipe_class

    recipe_class = load_recipe_class(recipe_dir)
    overrides = [f"model.{k}={v}" for k, v in MODEL.items()] + [
        f"data.seq_len={SETTINGS['seq_len']}", f"data.batch_size={SETTINGS['batch_size']}",
        f"data.builtin_conversations={SETTINGS['conversations']}", f"optim.lr={SETTINGS['lr']}",
        "optim.weight_decay=0.0", "optim.warmup_steps=0", "optim.min_lr_ratio=1.0",
        f"train.max_steps={steps + warmup}", "checkpoint.every=0", "metrics.tensorboard=false",
    ]
    engine = recipe_class(build_config(recipe_class.config_class, None, overrides), DistInfo(0, 1, 0, torch.device("cpu"), None))
    engine.before_train()
    engine.model.train()
    for _ in range(warmup):
        engine.train_step()
    start, tokens = time.perf_counter(), 0
    for _ in range(steps):
        tokens += engine.train_step().num_tokens
    return tokens / (time.perf_counter() - start)


def trl_tokens_per_s(steps: int, warmup: int) -> float:
    import datasets
    import torch
    import trl
    from transformers import TrainerCallback

    sys.path.insert(0, str(REPO))
    from recipes_template.sft import recipe

    tokenizer = recipe.byte_chat_tokenizer()
    torch.manual_seed(0)
    model = recipe.build_model(recipe.ModelConfig(**MODEL), len(tokenizer), SETTINGS["seq_len"])
    conversations = [{"messages": m} for _, m in recipe.builtin_conversations(SETTINGS["conversations"], 3)]

    class Clock(TrainerCallback):
        start = end = 0.0

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == warmup:
                Clock.start = time.perf_counter()
            Clock.end = time.perf_counter()

    class CountingTrainer(trl.SFTTrainer):
        supervised = 0

        def compute_loss(self, model, inputs, *args, **kwargs):
            if self.state.global_step >= warmup:
                CountingTrainer.supervised += int((inputs["labels"][:, 1:] != -100).sum())
            return super().compute_loss(model, inputs, *args, **kwargs)

    args = trl.SFTConfig(
        output_dir=tempfile.mkdtemp(), max_steps=steps + warmup, per_device_train_batch_size=SETTINGS["batch_size"],
        learning_rate=SETTINGS["lr"], weight_decay=0.0, lr_scheduler_type="constant", warmup_steps=0,
        adam_beta2=0.95, max_grad_norm=1.0, max_length=SETTINGS["seq_len"], assistant_only_loss=True,
        packing=False, report_to=[], use_cpu=True, save_strategy="no", logging_strategy="no",
        dataloader_num_workers=0, dataset_num_proc=None, gradient_checkpointing=False,  # TRL's default is True
    )
    trainer = CountingTrainer(
        model=model, args=args, processing_class=tokenizer, train_dataset=datasets.Dataset.from_list(conversations),
        callbacks=[Clock()],
    )
    trainer.train()
    return CountingTrainer.supervised / (Clock.end - Clock.start)


def run_peer(peer: str, steps: int, warmup: int, threads: int, packed_dir: Path) -> float:
    code = (
        f"import sys; sys.path.insert(0, {str(REPO)!r}); sys.argv = ['bench']; "
        f"import bench.sft_throughput as b, pathlib; b.MODEL.update({MODEL!r}); "
        + (
            f"print(b.trl_tokens_per_s({steps}, {warmup}))" if peer == "trl"
            else f"print(b.engine_tokens_per_s(pathlib.Path({str(packed_dir if peer == 'template+packing' else TEMPLATE)!r}), {steps}, {warmup}))"
        )
    )
    env = {"OMP_NUM_THREADS": str(threads), "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO)
    if result.returncode != 0:
        raise SystemExit(f"{peer} failed:\n{result.stderr[-3000:]}")
    return float(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--small", action="store_true", help="hidden 128, 2 layers (a loaded machine)")
    args = parser.parse_args()
    if args.small:
        MODEL.update(hidden_size=128, intermediate_size=344, num_layers=2)
    scratch = Path(tempfile.mkdtemp(prefix="sft-bench-"))
    packed_dir = scratch / "sft_packed"
    shutil.copytree(TEMPLATE, packed_dir, ignore=shutil.ignore_patterns("__pycache__"))
    sys.path.insert(0, str(REPO))
    from skills import apply_skill

    apply_skill("sequence-packing", packed_dir)
    results: dict[str, list[float]] = {peer: [] for peer in PEERS}
    for round_index in range(args.rounds):
        order = PEERS if round_index % 2 == 0 else tuple(reversed(PEERS))
        for peer in order:
            results[peer].append(run_peer(peer, args.steps, args.warmup, args.threads, packed_dir))
        line = ", ".join(f"{peer} {results[peer][-1]:,.0f}" for peer in PEERS)
        print(f"round {round_index + 1}: supervised tokens/s: {line}; template/trl "
              f"{results['template'][-1] / results['trl'][-1]:.2f}x, packed/trl "
              f"{results['template+packing'][-1] / results['trl'][-1]:.2f}x", flush=True)
    medians = {peer: statistics.median(values) for peer, values in results.items()}
    print(json.dumps({
        "tokens_per_s_median": {k: round(v) for k, v in medians.items()},
        "template_vs_trl": round(medians["template"] / medians["trl"], 3),
        "packed_vs_trl": round(medians["template+packing"] / medians["trl"], 3),
        "settings": {**SETTINGS, **MODEL, "steps": args.steps, "warmup": args.warmup, "threads": args.threads},
    }))
    shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
