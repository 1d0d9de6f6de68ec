"""GRPO throughput: the ``grpo`` template against TRL's ``GRPOTrainer``.

Both peers train the same tiny Llama (the template's, built from one seed) with the same byte
chat tokenizer on the same built-in prompts ("What is 3 + 4?"), with the same G
(``num_generations``), completions per step, completion length, sampling (temperature 1, top-p
1, no top-k), rewards (the template's ``correct_answer`` and ``digits_only``, called by both),
loss (``dapo``, beta 0, one iteration), AdamW at a constant lr and clipping at 1.0, fp32 (TRL's
``bf16`` default is turned off, as is its gradient checkpointing), one process each.

Fairness on a shared machine: the peers live at once, each in its own subprocess with the same
thread count, and take their steps in turn (the order alternates every step), so load from other
work falls on both alike. The first ``--warmup`` steps are not timed. A step is timed from its
start to the end of its optimizer step, generation included; each peer also reports the seconds
its generation and its reward functions took (the template: its rollout's clocks; TRL:
``_generate_and_score_completions`` less ``_calculate_rewards``); training is the rest of the step.

    python bench/grpo_throughput.py [--steps 10] [--warmup 2] [--rounds 3] [--threads 1]

Prints, for every round, each peer's completions/s and training tokens/s (prompt + completion
tokens of the step / the step's seconds; medians over the round's steps), both ratios and each
peer's time split (generation, reward, training: medians of the seconds per step). Goal: the
template at >= 1.3x TRL in every round.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TEMPLATE = REPO / "recipes_template" / "grpo"
PEERS = ("template", "trl")
SETTINGS = {"completions": 32, "num_generations": 8, "max_completion_length": 16, "lr": 1e-3, "prompts": 2000}
MODEL = {"hidden_size": 128, "intermediate_size": 344, "num_layers": 2}


def report_step(completions: int, tokens: int, seconds: float, generation_s: float, reward_s: float) -> None:
    print(f"@@ {completions} {tokens} {seconds} {generation_s} {reward_s}", flush=True)


def wait_for_turn() -> None:
    if not sys.stdin.readline():
        raise SystemExit(0)  # the coordinator is gone


def engine_worker(total_steps: int) -> None:
    import torch

    from engine.config import build_config
    from engine.distributed import DistInfo
    from engine.launch import load_recipe_class

    recipe_class = load_recipe_class(TEMPLATE)
    metrics = sys.modules[recipe_class.__module__].ROLLOUT_METRICS  # the rollouts' sums, with their clocks
    clocks = [metrics.index("generation_s"), metrics.index("reward_s")]
    overrides = [f"model.{k}={v}" for k, v in MODEL.items()] + [
        f"data.builtin_prompts={SETTINGS['prompts']}", f"data.batch_size={SETTINGS['completions']}",
        f"grpo.num_generations={SETTINGS['num_generations']}", f"grpo.max_completion_length={SETTINGS['max_completion_length']}",
        "grpo.loss_type=dapo", "grpo.reward_functions=[correct_answer,digits_only]", "grpo.reward_weights=null", f"optim.lr={SETTINGS['lr']}", "optim.weight_decay=0.0", "optim.warmup_steps=0",
        "optim.min_lr_ratio=1.0", f"train.max_steps={total_steps}", "checkpoint.every=0", "metrics.tensorboard=false",
    ]
    engine = recipe_class(build_config(recipe_class.config_class, None, overrides), DistInfo(0, 1, 0, torch.device("cpu"), None))
    engine.before_train()
    engine.model.train()
    print("@@ready", flush=True)
    for _ in range(total_steps):
        wait_for_turn()
        before = engine.rollout_sums[clocks].tolist()
        start = time.perf_counter()
        ctx = engine.train_step()
        seconds = time.perf_counter() - start
        generation_s, reward_s = (after - b for after, b in zip(engine.rollout_sums[clocks].tolist(), before))
        report_step(SETTINGS["completions"], ctx.num_tokens, seconds, generation_s, reward_s)


def trl_worker(total_steps: int) -> None:
    import datasets
    import torch
    import trl
    from transformers import TrainerCallback

    sys.path.insert(0, str(REPO))
    from recipes_template.grpo import recipe

    tokenizer = recipe.byte_chat_tokenizer()
    torch.manual_seed(0)
    model = recipe.build_model(recipe.ModelConfig(**MODEL), len(tokenizer), 96)
    prompts = [{"prompt": [{"role": "user", "content": r["prompt"]}], "answer": r["answer"]}
               for _, r in recipe.builtin_prompts(SETTINGS["prompts"])]

    class Clock(TrainerCallback):
        start = 0.0

        def on_train_begin(self, args, state, control, **kwargs):
            print("@@ready", flush=True)

        def on_step_begin(self, args, state, control, **kwargs):
            wait_for_turn()
            Clock.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            report_step(SETTINGS["completions"], TimedTrainer.tokens, time.perf_counter() - Clock.start,
                        TimedTrainer.generation_s - TimedTrainer.reward_s, TimedTrainer.reward_s)

    class TimedTrainer(trl.GRPOTrainer):
        tokens, generation_s, reward_s = 0, 0.0, 0.0

        def _calculate_rewards(self, *args, **kwargs):
            start = time.perf_counter()
            rewards = super()._calculate_rewards(*args, **kwargs)
            TimedTrainer.reward_s = time.perf_counter() - start
            return rewards

        def _generate_and_score_completions(self, inputs):
            start = time.perf_counter()
            output = super()._generate_and_score_completions(inputs)
            TimedTrainer.generation_s = time.perf_counter() - start
            TimedTrainer.tokens = int(output["prompt_mask"].sum() + output["completion_mask"].sum())
            return output

    args = trl.GRPOConfig(
        output_dir=tempfile.mkdtemp(), max_steps=total_steps, per_device_train_batch_size=SETTINGS["completions"],
        num_generations=SETTINGS["num_generations"], max_completion_length=SETTINGS["max_completion_length"],
        temperature=1.0, top_p=1.0, top_k=0, loss_type="dapo", beta=0.0, num_iterations=1,
        learning_rate=SETTINGS["lr"], weight_decay=0.0, lr_scheduler_type="constant", warmup_steps=0,
        adam_beta2=0.95, max_grad_norm=1.0, report_to=[], use_cpu=True, save_strategy="no", logging_strategy="no",
        bf16=False, gradient_checkpointing=False, dataloader_num_workers=0,
    )
    trainer = TimedTrainer(
        model=model, reward_funcs=[recipe.correct_answer, recipe.digits_only], args=args, processing_class=tokenizer,
        train_dataset=datasets.Dataset.from_list(prompts), callbacks=[Clock()],
    )
    trainer.train()


def start_worker(peer: str, total_steps: int, threads: int) -> subprocess.Popen:
    call = f"b.trl_worker({total_steps})" if peer == "trl" else f"b.engine_worker({total_steps})"
    code = (
        f"import sys, torch; torch.set_num_threads({threads}); sys.path.insert(0, {str(REPO)!r}); sys.argv = ['bench']; "
        f"import bench.grpo_throughput as b; b.MODEL.update({MODEL!r}); b.SETTINGS.update({SETTINGS!r}); {call}"
    )
    env = {"OMP_NUM_THREADS": str(threads), "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"}
    return subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, env=env, cwd=REPO)


def read_report(peer: str, worker: subprocess.Popen) -> list[str]:
    for line in worker.stdout:
        if line.startswith("@@"):
            return line.split()[1:]
    raise SystemExit(f"{peer} ended early (exit {worker.wait()})")


def lockstep(steps: int, warmup: int, rounds: int, threads: int) -> dict[str, list[list[tuple[float, ...]]]]:
    """Each peer's steps of each round as (completions, tokens, seconds, generation seconds, reward seconds)."""
    total = warmup + steps * rounds
    workers = {peer: start_worker(peer, total, threads) for peer in PEERS}
    try:
        for peer, worker in workers.items():
            read_report(peer, worker)
        timed: dict[str, list[list[tuple[float, ...]]]] = {peer: [[] for _ in range(rounds)] for peer in PEERS}
        for step in range(total):
            for peer in (PEERS if step % 2 == 0 else PEERS[::-1]):
                workers[peer].stdin.write("go\n")
                workers[peer].stdin.flush()
                report = tuple(float(x) for x in read_report(peer, workers[peer]))
                if step >= warmup:
                    timed[peer][(step - warmup) // steps].append(report)
        return timed
    finally:
        for worker in workers.values():
            worker.kill()
            worker.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10, help="timed steps per round and peer")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    print(f"load average before: {os.getloadavg()[0]:.2f}", flush=True)
    timed = lockstep(args.steps, args.warmup, args.rounds, args.threads)
    summary: dict[str, list[dict[str, float]]] = {peer: [] for peer in PEERS}
    for round_index in range(args.rounds):
        for peer in PEERS:
            steps = timed[peer][round_index]
            summary[peer].append({
                "completions_per_s": statistics.median(c / s for c, _, s, _, _ in steps),
                "tokens_per_s": statistics.median(t / s for _, t, s, _, _ in steps),
                "generation_s": statistics.median(g for _, _, _, g, _ in steps),
                "reward_s": statistics.median(r for _, _, _, _, r in steps),
                "training_s": statistics.median(s - g - r for _, _, s, g, r in steps),
                "step_s": statistics.median(s for _, _, s, _, _ in steps),
            })
        ours, theirs = summary["template"][round_index], summary["trl"][round_index]
        print(f"round {round_index + 1}: completions/s template {ours['completions_per_s']:.1f}, trl "
              f"{theirs['completions_per_s']:.1f} ({ours['completions_per_s'] / theirs['completions_per_s']:.2f}x); "
              f"training tokens/s template {ours['tokens_per_s']:,.0f}, trl {theirs['tokens_per_s']:,.0f} "
              f"({ours['tokens_per_s'] / theirs['tokens_per_s']:.2f}x)", flush=True)
        for peer, split in (("template", ours), ("trl", theirs)):
            print(f"  {peer:8} step {split['step_s'] * 1000:.1f} ms: generation {split['generation_s'] * 1000:.1f}, reward "
                  f"{split['reward_s'] * 1000:.1f}, training {split['training_s'] * 1000:.1f} ms", flush=True)
    print(f"load average after: {os.getloadavg()[0]:.2f}", flush=True)
    ratios = {key: [round(ours[key] / theirs[key], 3) for ours, theirs in zip(summary["template"], summary["trl"])]
              for key in ("completions_per_s", "tokens_per_s")}
    print(json.dumps({"completions_per_s_ratio_by_round": ratios["completions_per_s"],
                      "tokens_per_s_ratio_by_round": ratios["tokens_per_s"],
                      "settings": {**SETTINGS, **MODEL, "steps": args.steps, "warmup": args.warmup, "threads": args.threads}}))

if __name__ == "__main__":
    main()
