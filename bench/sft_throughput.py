"""SFT throughput: the ``sft`` template (padded, and with the ``sequence-packing`` skill) against
TRL's ``SFTTrainer``.

All peers fine-tune the same model (the template's tiny Llama, built from one seed) with the
same byte-level chat tokenizer on the same built-in conversations (loss on the assistant's tokens
only: the template's chat-template mask; ``assistant_only_loss=True`` for TRL), with the same
sequence length, batch, fp32 (TRL's ``bf16`` default, autocast even on a CPU, is turned off),
AdamW and clipping at 1.0, one process each. TRL pads each batch to its longest conversation
(its default, no packing), as the template does unpacked.

Fairness on a shared machine: the three peers live at once, each in its own subprocess with the
same thread count (``OMP_NUM_THREADS`` and ``torch.set_num_threads``), and take their steps in
turn (the order rotates every step), so load from other work falls on all of them alike. The
first ``--warmup`` steps are not timed (allocator and kernel warm-up); a step is timed from its
batch in hand to the end of the optimizer step (TRL's Trainer takes the batch before
``on_step_begin``). A round's figure is the median over its steps of the step's supervised
tokens / the step's seconds.

    python bench/sft_throughput.py [--steps 40] [--warmup 5] [--rounds 3]
    python bench/sft_throughput.py --model qwen2    # a Qwen2-family model folder, as a user brings one

``--model qwen2`` fine-tunes a random-weight Qwen2 model of the same sizes, saved as a folder
with a byte-level BPE tokenizer trained here and a ChatML template without ``{% generation %}``
markers; both peers read the same conversations as prompt/completion records (the prompt: every
turn before the last answer) and learn the last answer only (the template's ``completion``
mask; TRL's ``completion_only_loss``).

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
USER_MODEL: dict[str, str] = {}  # --model qwen2: {"folder": ..., "data": ...}


def report_step(tokens: int, seconds: float) -> None:
    print(f"@@ {tokens} {seconds}", flush=True)


def wait_for_turn() -> None:
    """A worker takes each step when the coordinator says so (one line on stdin)."""
    if not sys.stdin.readline():
        raise SystemExit(0)  # the coordinator is gone


def engine_worker(recipe_dir: Path, total_steps: int) -> None:
    import torch

    from engine.config import build_config
    from engine.distributed import DistInfo
    from engine.launch import load_recipe_class

    recipe_class = load_recipe_class(recipe_dir)
    if USER_MODEL:
        given = [f"model.pretrained_path={USER_MODEL['folder']}", f"data.paths=[{USER_MODEL['data']}]"]
    else:
        given = [f"model.{k}={v}" for k, v in MODEL.items()] + [f"data.builtin_conversations={SETTINGS['conversations']}"]
    overrides = given + [
        f"data.seq_len={SETTINGS['seq_len']}", f"data.batch_size={SETTINGS['batch_size']}", f"optim.lr={SETTINGS['lr']}",
        "optim.weight_decay=0.0", "optim.warmup_steps=0", "optim.min_lr_ratio=1.0",
        f"train.max_steps={total_steps}", "checkpoint.every=0", "metrics.tensorboard=false",
    ]
    engine = recipe_class(build_config(recipe_class.config_class, None, overrides), DistInfo(0, 1, 0, torch.device("cpu"), None))
    engine.before_train()
    engine.model.train()
    print("@@ready", flush=True)
    for _ in range(total_steps):
        wait_for_turn()
        start = time.perf_counter()
        ctx = engine.train_step()
        # Without taking the batch: TRL's Trainer takes it before on_step_begin.
        report_step(ctx.num_loss_tokens, time.perf_counter() - start - ctx.timings["data_s"])


def trl_worker(total_steps: int) -> None:
    import datasets
    import torch
    import trl
    from transformers import TrainerCallback

    sys.path.insert(0, str(REPO))
    from recipes_template.sft import recipe

    if USER_MODEL:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(USER_MODEL["folder"])
        model = AutoModelForCausalLM.from_pretrained(USER_MODEL["folder"], dtype=torch.float32)
        conversations = [json.loads(line) for line in Path(USER_MODEL["data"]).read_text().splitlines()]
    else:
        tokenizer = recipe.byte_chat_tokenizer()
        torch.manual_seed(0)
        model = recipe.build_model(recipe.ModelConfig(**MODEL), len(tokenizer), SETTINGS["seq_len"])
        conversations = [{"messages": m} for _, m in recipe.builtin_conversations(SETTINGS["conversations"], 3)]

    class Clock(TrainerCallback):
        """Times each optimizer step from its batch's arrival to the end of the optimizer step."""

        start = 0.0

        def on_train_begin(self, args, state, control, **kwargs):
            print("@@ready", flush=True)

        def on_step_begin(self, args, state, control, **kwargs):
            wait_for_turn()
            Clock.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            report_step(CountingTrainer.supervised, time.perf_counter() - Clock.start)

    class CountingTrainer(trl.SFTTrainer):
        supervised = 0  # the supervised tokens of the current step

        def compute_loss(self, model, inputs, *args, **kwargs):
            CountingTrainer.supervised = int((inputs["labels"][:, 1:] != -100).sum())
            return super().compute_loss(model, inputs, *args, **kwargs)

    args = trl.SFTConfig(
        output_dir=tempfile.mkdtemp(), max_steps=total_steps, per_device_train_batch_size=SETTINGS["batch_size"],
        learning_rate=SETTINGS["lr"], weight_decay=0.0, lr_scheduler_type="constant", warmup_steps=0,
        adam_beta2=0.95, max_grad_norm=1.0, max_length=SETTINGS["seq_len"], assistant_only_loss=not USER_MODEL,
        packing=False, report_to=[], use_cpu=True, save_strategy="no", logging_strategy="no",
        bf16=False,  # TRL's default is bf16 autocast (even on CPU): the template's fp32 is the peer
        dataloader_num_workers=0, dataset_num_proc=None, gradient_checkpointing=False,  # TRL's default is True
    )
    trainer = CountingTrainer(
        model=model, args=args, processing_class=tokenizer, train_dataset=datasets.Dataset.from_list(conversations),
        callbacks=[Clock()],
    )
    trainer.train()


def user_model(scratch: Path) -> dict[str, str]:
    """A Qwen2 folder of the bench's sizes and the built-in conversations as prompt/completion."""
    sys.path.insert(0, str(REPO))
    from recipes_template.sft import recipe
    from tests.model_families import tiny_model_folder

    folder = tiny_model_folder(scratch / "qwen2", "qwen2", hidden_size=MODEL["hidden_size"],
                               intermediate_size=MODEL["intermediate_size"], num_hidden_layers=MODEL["num_layers"],
                               max_position_embeddings=SETTINGS["seq_len"] * 2)
    data = scratch / "conversations.jsonl"
    with open(data, "w") as f:
        for _, messages in recipe.builtin_conversations(SETTINGS["conversations"], 3):
            f.write(json.dumps({"prompt": messages[:-1], "completion": messages[-1:]}) + "\n")
    return {"folder": str(folder), "data": str(data)}


def start_worker(peer: str, total_steps: int, threads: int, packed_dir: Path) -> subprocess.Popen:
    call = (f"b.trl_worker({total_steps})" if peer == "trl" else
            f"b.engine_worker(pathlib.Path({str(packed_dir if peer == 'template+packing' else TEMPLATE)!r}), {total_steps})")
    code = (
        f"import sys, torch; torch.set_num_threads({threads}); sys.path.insert(0, {str(REPO)!r}); sys.argv = ['bench']; "
        f"import bench.sft_throughput as b, pathlib; b.MODEL.update({MODEL!r}); b.USER_MODEL.update({USER_MODEL!r}); "
        f"{call}"
    )
    env = {"OMP_NUM_THREADS": str(threads), "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"}
    return subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, env=env, cwd=REPO)


def read_report(peer: str, worker: subprocess.Popen) -> list[str]:
    for line in worker.stdout:
        if line.startswith("@@"):
            return line.split()[1:]
    raise SystemExit(f"{peer} ended early (exit {worker.wait()})")


def lockstep(steps: int, warmup: int, rounds: int, threads: int, packed_dir: Path) -> dict[str, list[list[float]]]:
    """All peers live at once and take their steps in turn (the order rotates every step), so a
    burst of load from other work on the machine falls on all of them alike. Returns each peer's
    per-step rates (supervised tokens / seconds) of each round, warm-up steps left out."""
    total = warmup + steps * rounds
    workers = {peer: start_worker(peer, total, threads, packed_dir) for peer in PEERS}
    try:
        for peer, worker in workers.items():
            read_report(peer, worker)  # ready: model built, data loaded
        rates: dict[str, list[list[float]]] = {peer: [[] for _ in range(rounds)] for peer in PEERS}
        for step in range(total):
            shift = step % len(PEERS)
            for peer in PEERS[shift:] + PEERS[:shift]:
                workers[peer].stdin.write("go\n")
                workers[peer].stdin.flush()
                tokens, seconds = read_report(peer, workers[peer])
                if step >= warmup:
                    rates[peer][(step - warmup) // steps].append(int(tokens) / float(seconds))
        return rates
    finally:
        for worker in workers.values():
            worker.kill()
            worker.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40, help="timed steps per round and peer")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--small", action="store_true", help="hidden 128, 2 layers (a loaded machine)")
    parser.add_argument("--model", choices=("template", "qwen2"), default="template",
                        help="qwen2: a Qwen2-family model folder with a ChatML template without markers")
    args = parser.parse_args()
    if args.small:
        MODEL.update(hidden_size=128, intermediate_size=344, num_layers=2)
    scratch = Path(tempfile.mkdtemp(prefix="sft-bench-"))
    if args.model == "qwen2":
        USER_MODEL.update(user_model(scratch))
    packed_dir = scratch / "sft_packed"
    shutil.copytree(TEMPLATE, packed_dir, ignore=shutil.ignore_patterns("__pycache__"))
    sys.path.insert(0, str(REPO))
    from skills import apply_skill

    apply_skill("sequence-packing", packed_dir)
    rates = lockstep(args.steps, args.warmup, args.rounds, args.threads, packed_dir)
    results = {peer: [statistics.median(r) for r in rounds] for peer, rounds in rates.items()}
    for round_index in range(args.rounds):
        line = ", ".join(f"{peer} {results[peer][round_index]:,.0f}" for peer in PEERS)
        print(f"round {round_index + 1}: supervised tokens/s (median step): {line}; template/trl "
              f"{results['template'][round_index] / results['trl'][round_index]:.2f}x, packed/trl "
              f"{results['template+packing'][round_index] / results['trl'][round_index]:.2f}x", flush=True)
    medians = {peer: statistics.median(values) for peer, values in results.items()}
    print(json.dumps({
        "tokens_per_s_median": {k: round(v) for k, v in medians.items()},
        "template_vs_trl": round(medians["template"] / medians["trl"], 3),
        "packed_vs_trl": round(medians["template+packing"] / medians["trl"], 3),
        "settings": {**SETTINGS, **MODEL, "model": args.model, "steps": args.steps, "warmup": args.warmup,
                     "threads": args.threads},
    }))
    shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
