"""Training throughput: the engine against a hand-written PyTorch loop and the HF ``Trainer``.

All three train the template's default model (Llama-style, hidden 256, 4 layers, byte-level
vocabulary) on the same batches (the template's data pipeline: CPython stdlib sources,
sequence length 256, batch 8), fp32, fused AdamW with the same hyper-parameters (the
Trainer's default optimizer is fused AdamW too), gradient clipping at 1.0, one process. Each
peer runs in a fresh subprocess with the same thread count and OpenMP wait policy (a run's:
``engine/openmp.py``), in interleaved rounds (the order reverses every round); the first
``--warmup`` steps of each run are not timed.

Each peer also runs with checkpoints (``+ckpt``: a save every ``--warmup`` steps, model,
optimizer and scheduler; the engine's DCP checkpoint, ``torch.save`` in the hand-written loop,
``save_strategy="steps"`` in the Trainer); the time a save takes is not training time and is
left out, so a peer must be as fast with checkpoints as without (a run used to train at a
fifth of its speed until its first save).

    python bench/throughput.py [--steps 60] [--warmup 10] [--rounds 2] [--checkpoints both|off|on] [--cpu-time]

Prints supervised tokens/s of each peer in every round with the load average, the median over
rounds and the ratios. ``--cpu-time`` runs each peer at one thread and adds its supervised tokens
per CPU second of its process over the timed steps (``time.process_time`` as each step ends,
``bench/cpu_time.py``) and the engine's ratios to the others, each round's too: on a machine other
processes load, wall-clock ratios measure the load. Goal: the engine at ≥ 0.97× the hand-written loop and faster than
``Trainer``; each peer with checkpoints within 10% of itself without.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TEMPLATE = REPO / "recipes_template" / "causal_lm"
PEERS = ("engine", "hand", "trainer")
CKPT = "+ckpt"


def load_template():
    spec = importlib.util.spec_from_file_location("causal_lm_recipe", TEMPLATE / "recipe.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def batches_and_model(steps: int):
    """The template's model and first ``steps`` batches, built exactly as the engine does."""
    import torch

    recipe = load_template()
    config = recipe.CausalLMConfig()
    tokenizer = recipe.ByteTokenizer()
    documents = recipe.load_documents(config.data)
    train = [text for name, text in documents if not recipe.is_eval_document(name, config.data.eval_fraction)]
    pieces = recipe.tokenize_documents(train, tokenizer, config.data.seq_len)
    # The batches an eager run of the template makes: data.pad_to_longest unset ends each at its last label.
    stream = recipe.BatchStream(pieces, config.data.seq_len, tokenizer.pad_token_id, seed=config.train.seed,
                                micro_batch=config.data.batch_size, dp_rank=0, dp_size=1,
                                pad_to_longest=config.data.pad_to_longest is not False)
    batches = [next(stream) for _ in range(steps)]
    torch.manual_seed(config.train.seed)
    model = recipe.build_model(config.model, tokenizer.vocab_size, config.data.seq_len)
    return config, model, batches


def tokens(batch) -> int:
    return int((batch["labels"] != -100).sum())


# ---------------------------------------------------------------------------------------------
# Peers (each runs in its own subprocess and prints one JSON line)
# ---------------------------------------------------------------------------------------------


def run_engine(steps: int, warmup: int, checkpoints: bool) -> dict:
    """The template through ``engine.launch`` in this process (a fresh worker with a run's OpenMP
    policy), the process's CPU seconds noted as each step ends."""
    from bench.cpu_time import engine_step_ends, run_engine_here, timed_cpu_seconds
    from engine import run_dir as rd
    from engine import run_metrics

    with tempfile.TemporaryDirectory() as tmp:
        sets = [f"train.max_steps={steps}", f"train.log_every={warmup}",
                f"checkpoint.every={warmup if checkpoints else 0}",
                "checkpoint.at_end=false", "metrics.tensorboard=false", "train.eval_every=0"]
        os.chdir(tmp)
        with engine_step_ends() as step_ends:
            code = run_engine_here(TEMPLATE, sets)
        os.chdir(REPO)
        if code != 0:
            raise SystemExit(f"engine failed with exit code {code}")
        (run,) = (Path(tmp) / rd.RUNS_DIRNAME).iterdir()
        records = run_metrics.read_all_metrics(run / rd.METRICS_JSONL)
    timed = [r for r in records if r["step"] > warmup]
    seconds = sum(r["step_time_s"] * warmup for r in timed)
    # The tokens the loss is over, as the other peers count them (labels != -100).
    total_tokens = sum(r["loss_tokens_per_s"] * r["step_time_s"] * warmup for r in timed)
    return {"tokens_per_s": total_tokens / seconds, "final_loss": records[-1]["loss"],
            "tokens_per_cpu_s": total_tokens / sum(timed_cpu_seconds(step_ends, warmup))}


def run_hand(steps: int, warmup: int, checkpoints: bool) -> dict:
    import math

    import torch
    import torch.nn.functional as F

    from bench.cpu_time import timed_cpu_seconds

    config, model, batches = batches_and_model(steps)
    optim = config.optim
    optimizer = torch.optim.AdamW(model.parameters(), lr=optim.lr, betas=(optim.beta1, optim.beta2),
                                  eps=optim.eps, weight_decay=optim.weight_decay, fused=True)

    def lr_factor(step: int) -> float:
        if step < optim.warmup_steps:
            return (step + 1) / (optim.warmup_steps + 1)
        progress = min(1.0, (step - optim.warmup_steps) / max(1, steps - optim.warmup_steps))
        return optim.min_lr_ratio + (1 - optim.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
    model.train()
    timed_tokens, start, saving_s = 0, None, 0.0
    step_ends: list[float] = []  # CPU seconds of the process as each step ends
    checkpoint_dir = tempfile.TemporaryDirectory()
    for step, batch in enumerate(batches, 1):
        if step == warmup + 1:
            start = time.perf_counter()
        n = tokens(batch)
        logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
        loss = F.cross_entropy(logits.flatten(0, 1).float(), batch["labels"].flatten(), ignore_index=-100,
                               reduction="sum") / n
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        if step > warmup:
            timed_tokens += n
        step_ends.append(time.process_time())
        if checkpoints and step % warmup == 0:
            float(loss)  # the step is done before the save's time is taken
            saving = time.perf_counter()
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(), "step": step},
                       Path(checkpoint_dir.name) / f"step-{step}.pt")
            if step > warmup:
                saving_s += time.perf_counter() - saving
    final_loss = float(loss)
    elapsed = time.perf_counter() - start - saving_s
    checkpoint_dir.cleanup()
    return {"tokens_per_s": timed_tokens / elapsed, "final_loss": final_loss,
            "tokens_per_cpu_s": timed_tokens / sum(timed_cpu_seconds(step_ends, warmup))}


def run_trainer(steps: int, warmup: int, checkpoints: bool) -> dict:
    import torch
    import torch.nn.functional as F
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from bench.cpu_time import timed_cpu_seconds

    config, model, batches = batches_and_model(steps)
    rows = [{k: v[i] for k, v in batch.items()} for batch in batches for i in range(len(batch["input_ids"]))]
    step_times: list[float] = []
    step_ends: list[float] = []  # CPU seconds of the process as each step ends
    saving_s: list[float] = []

    class Timer(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            step_times.append(time.perf_counter())
            step_ends.append(time.process_time())

        def on_save(self, args, state, control, **kwargs):  # called when the save is done
            if len(step_times) > warmup:
                saving_s.append(time.perf_counter() - step_times[-1])

    class SameLossTrainer(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            labels = inputs.pop("labels")
            logits = model(**inputs, use_cache=False).logits
            return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100)

    optim = config.optim
    with tempfile.TemporaryDirectory() as tmp:
        args = TrainingArguments(
            output_dir=tmp, max_steps=steps, per_device_train_batch_size=config.data.batch_size,
            learning_rate=optim.lr, weight_decay=optim.weight_decay, adam_beta1=optim.beta1,
            adam_beta2=optim.beta2, adam_epsilon=optim.eps, warmup_steps=optim.warmup_steps,
            lr_scheduler_type="cosine_with_min_lr", lr_scheduler_kwargs={"min_lr_rate": optim.min_lr_ratio},
            max_grad_norm=1.0, logging_steps=warmup, report_to=[],
            save_strategy="steps" if checkpoints else "no", save_steps=warmup,
            dataloader_num_workers=0, use_cpu=True, seed=config.train.seed, disable_tqdm=True,
            train_sampling_strategy="sequential",  # the same batches in the same order as the others
        )
        trainer = SameLossTrainer(model=model, args=args, train_dataset=rows, callbacks=[Timer()],
                                  data_collator=lambda items: {k: torch.stack([x[k] for x in items]) for k in items[0]})
        trainer.train()
    timed = sum(tokens(b) for b in batches[warmup:])
    return {"tokens_per_s": timed / (step_times[-1] - step_times[warmup - 1] - sum(saving_s)),
            "final_loss": trainer.state.log_history[-2].get("loss") if len(trainer.state.log_history) > 1 else None,
            "tokens_per_cpu_s": timed / sum(timed_cpu_seconds(step_ends, warmup))}


def measure(peer: str, steps: int, warmup: int, cpu_time: bool = False) -> dict:
    sys.path.insert(0, str(REPO))
    from engine.openmp import prepare_wait_policy

    env = dict(os.environ, OMP_NUM_THREADS="1") if cpu_time else dict(os.environ)
    prepare_wait_policy(env)  # every peer starts with a run's OpenMP wait policy (the engine sets its own)
    out = subprocess.run(
        [sys.executable, __file__, "--worker", peer, "--steps", str(steps), "--warmup", str(warmup)],
        capture_output=True, text=True, cwd=REPO, env=env,
    )
    if out.returncode != 0:
        raise SystemExit(f"{peer} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--checkpoints", choices=("both", "off", "on"), default="both",
                        help="run each peer without checkpoints, with them, or both (default)")
    parser.add_argument("--cpu-time", action="store_true",
                        help="each peer at one thread, and also its tokens per CPU second of its process over the "
                             "timed steps (saves included) and the ratios of those: they hold on a loaded machine")
    parser.add_argument("--worker", choices=[p + c for p in PEERS for c in ("", CKPT)], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.steps % args.warmup:
        parser.error("--steps must be a multiple of --warmup (the engine logs every --warmup steps)")
    if args.worker:
        sys.path.insert(0, str(REPO))
        name = args.worker.removesuffix(CKPT)
        runner = {"engine": run_engine, "hand": run_hand, "trainer": run_trainer}[name]
        print(json.dumps(runner(args.steps, args.warmup, args.worker.endswith(CKPT))))
        return

    suffixes = {"both": ("", CKPT), "off": ("",), "on": (CKPT,)}[args.checkpoints]
    peers = [peer + suffix for peer in PEERS for suffix in suffixes]
    results: dict[str, list[float]] = {peer: [] for peer in peers}
    per_cpu: dict[str, list[float]] = {peer: [] for peer in peers}
    print(f"load average at start: {os.getloadavg()[0]:.2f}")
    for round_index in range(args.rounds):
        for peer in (peers if round_index % 2 == 0 else peers[::-1]):
            load = os.getloadavg()[0]
            result = measure(peer, args.steps, args.warmup, args.cpu_time)
            results[peer].append(result["tokens_per_s"])
            per_cpu[peer].append(result["tokens_per_cpu_s"])
            cpu = f"{result['tokens_per_cpu_s']:>7,.0f} tokens/CPU s " if args.cpu_time else ""
            print(f"round {round_index + 1}: {peer:<13} {result['tokens_per_s']:>9,.0f} tokens/s {cpu}"
                  f"(final loss {result['final_loss']}; load {load:.1f})", flush=True)
    median = {peer: statistics.median(values) for peer, values in results.items()}
    print(f"\n{'peer':<15}{'tokens/s (median)':>20}")
    for peer in peers:
        print(f"{peer:<15}{median[peer]:>20,.0f}")
    for suffix in suffixes:
        what = "with checkpoints" if suffix else "without checkpoints"
        engine, hand, trainer = (median[p + suffix] for p in PEERS)
        print(f"\n{what}: engine / hand-written loop: {engine / hand:.3f}  (goal ≥ 0.97)")
        print(f"{what}: engine / HF Trainer:        {engine / trainer:.3f}  (goal > 1)")
    if len(suffixes) == 2:
        print()
        for peer in PEERS:
            print(f"{peer}: with / without checkpoints: {median[peer + CKPT] / median[peer]:.3f}  (goal ≥ 0.90)")
    if args.cpu_time:
        print()
        for suffix in suffixes:
            engine, hand, trainer = (per_cpu[p + suffix] for p in PEERS)
            for name, peer in (("hand-written loop", hand), ("HF Trainer", trainer)):
                rounds = ", ".join(f"{e / o:.3f}" for e, o in zip(engine, peer))
                print(f"tokens per CPU second{suffix}: engine / {name}: {statistics.median(engine) / statistics.median(peer):.3f} "
                      f"(medians; rounds {rounds})")
    print(f"load average at end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
