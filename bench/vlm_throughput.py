"""VLM SFT throughput: the ``vlm_chat`` template against TRL's ``SFTTrainer`` on a tiny Qwen2-VL.

Both peers fine-tune the same random-weight Qwen2-VL folder (``tests/vlm_families.py``, built here
offline; its processor without the video processor, as ``vlm_chat`` loads it where torchvision is
missing) on the same built-in colour questions (one 56 × 56 image each, 4 image tokens), with the
same batch, fp32 (TRL's ``bf16`` default is turned off), constant learning rate, AdamW, clipping at
1.0, the vision tower frozen in both (``freeze_parts``), one process each.

Useful tokens are the assistant's tokens (the template's loss tokens). TRL's vision collator learns
every text token (``assistant_only_loss`` needs ``{% generation %}`` markers, which Qwen2-VL's
template lacks), so its useful tokens of a step are its batch's examples times the data's mean
assistant tokens an example (the same examples: the ratio is one of examples/s).

The packed variant: the template with ``data.packing=true``, rows of 256 tokens holding 4 questions
each (each example's 3-D positions its own, attention kept to it), 4 rows a step (the others' 16
questions). TRL 1.16 refuses both of its own ways for vision data ("Packing is not supported for
vision datasets", "Padding-free training is yet not supported for vision datasets"), so the
packed variant is measured against TRL's padded batches, its only way. The built-in questions are
all 54-56 tokens long: packing removes almost no padding here, so this row shows what packing
costs or saves on the model's work, not a padding gain. Rows are kept short because on a CPU the
attention of a packed row is sdpa's with a dense mask over the whole row: rows of 512 (9 questions,
2 rows a step) ran at 0.79x, 0.83x, 0.78x TRL in a run of this bench.

Fairness on a shared machine: the peers live at once in their own subprocesses with the same
thread count and take their steps in turn (the order rotates every step); the first
``--warmup`` steps are not timed; a step is timed from its batch in hand to the end of the
optimizer step (TRL's collation of each batch, 60 ms of its step here, is left out as the
template's is). A round's figure is the median over its steps; the spread is the quartiles of
the ratios of the steps taken one after the other; the load is the machine's 1-minute average.

    python bench/vlm_throughput.py [--steps 30] [--warmup 5] [--rounds 3]

Prints useful tokens/s of each peer in every round and the ratios. Goal: the template, and its
packed variant, >= 1.0x TRL in every round.
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
TEMPLATE = REPO / "recipes_template" / "vlm_chat"
PEERS = ("template", "packed", "trl")
SETTINGS = {"batch_size": 16, "lr": 3e-3, "examples": 512}
PACKED = ["data.packing=true", "data.seq_len=256", "data.batch_size=4"]  # 4 rows of 4 questions


def report_step(tokens: float, seconds: float) -> None:
    print(f"@@ {tokens} {seconds}", flush=True)


def wait_for_turn() -> None:
    if not sys.stdin.readline():
        raise SystemExit(0)  # the coordinator is gone


def recipe_module():
    from engine.launch import load_recipe_class

    return sys.modules[load_recipe_class(TEMPLATE).__module__]


def engine_worker(folder: str, total_steps: int, packed: bool = False) -> None:
    import torch

    from engine.config import build_config
    from engine.distributed import DistInfo
    from engine.launch import load_recipe_class

    recipe_class = load_recipe_class(TEMPLATE)
    overrides = [f"model.pretrained_path={folder}", f"data.builtin_images={SETTINGS['examples']}",
                 f"data.batch_size={SETTINGS['batch_size']}", f"optim.lr={SETTINGS['lr']}", "optim.weight_decay=0.0",
                 "optim.warmup_steps=0", "optim.min_lr_ratio=1.0", "data.eval_fraction=0",
                 f"train.max_steps={total_steps}", "checkpoint.every=0", "metrics.tensorboard=false"]
    overrides += PACKED if packed else []
    engine = recipe_class(build_config(recipe_class.config_class, None, overrides),
                          DistInfo(0, 1, 0, torch.device("cpu"), None))
    engine.before_train()
    engine.model.train()
    print("@@ready", flush=True)
    for _ in range(total_steps):
        wait_for_turn()
        start = time.perf_counter()
        ctx = engine.train_step()
        report_step(ctx.num_loss_tokens, time.perf_counter() - start - ctx.timings["data_s"])


def trl_worker(folder: str, total_steps: int) -> None:
    import datasets
    import torch
    import trl
    from transformers import AutoModelForImageTextToText, TrainerCallback

    vlm = recipe_module()
    processor = vlm.load_processor(folder)
    examples = vlm.builtin_examples(SETTINGS["examples"], 56)
    useful = statistics.fmean(vlm.loss_tokens(vlm.encode(processor, m, i, 512, w)) for w, m, i in examples)
    model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32)
    vlm.freeze_parts(model, vlm.ModelConfig())
    rows = datasets.Dataset.from_list([{"messages": m, "images": i} for _, m, i in examples])

    class Clock(TrainerCallback):
        start = 0.0

        def on_train_begin(self, args, state, control, **kwargs):
            print("@@ready", flush=True)

        def on_step_begin(self, args, state, control, **kwargs):
            wait_for_turn()
            Clock.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            report_step(SETTINGS["batch_size"] * useful, time.perf_counter() - Clock.start)

    args = trl.SFTConfig(
        output_dir=tempfile.mkdtemp(), max_steps=total_steps, per_device_train_batch_size=SETTINGS["batch_size"],
        learning_rate=SETTINGS["lr"], weight_decay=0.0, lr_scheduler_type="constant", warmup_steps=0,
        max_grad_norm=1.0, max_length=None, packing=False, report_to=[], use_cpu=True, save_strategy="no",
        logging_strategy="no", bf16=False, dataloader_num_workers=0, gradient_checkpointing=False,
    )
    trl.SFTTrainer(model=model, args=args, processing_class=processor, train_dataset=rows, callbacks=[Clock()]).train()


def start_worker(peer: str, folder: Path, total_steps: int, threads: int) -> subprocess.Popen:
    call = (f"b.trl_worker({str(folder)!r}, {total_steps})" if peer == "trl"
            else f"b.engine_worker({str(folder)!r}, {total_steps}, packed={peer == 'packed'})")
    code = (f"import sys, torch; torch.set_num_threads({threads}); sys.path.insert(0, {str(REPO)!r}); "
            f"sys.argv = ['bench']; import bench.vlm_throughput as b; {call}")
    env = {"OMP_NUM_THREADS": str(threads), "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"}
    return subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, env=env, cwd=REPO)


def read_report(peer: str, worker: subprocess.Popen) -> list[str]:
    for line in worker.stdout:
        if line.startswith("@@"):
            return line.split()[1:]
    raise SystemExit(f"{peer} ended early (exit {worker.wait()})")


def lockstep(folder: Path, steps: int, warmup: int, rounds: int, threads: int) -> tuple[dict[str, list[list[float]]], list[float]]:
    """Each peer's rate at every timed step, by round, and the machine's load (1-minute average) at each round's end."""
    total = warmup + steps * rounds
    workers = {peer: start_worker(peer, folder, total, threads) for peer in PEERS}
    try:
        for peer, worker in workers.items():
            read_report(peer, worker)  # ready: model built, data loaded
        rates: dict[str, list[list[float]]] = {peer: [[] for _ in range(rounds)] for peer in PEERS}
        loads = []
        for step in range(total):
            shift = step % len(PEERS)
            for peer in PEERS[shift:] + PEERS[:shift]:
                workers[peer].stdin.write("go\n")
                workers[peer].stdin.flush()
                tokens, seconds = read_report(peer, workers[peer])
                if step >= warmup:
                    rates[peer][(step - warmup) // steps].append(float(tokens) / float(seconds))
            if step >= warmup and (step - warmup + 1) % steps == 0:
                loads.append(os.getloadavg()[0])
        return rates, loads
    finally:
        for worker in workers.values():
            worker.kill()
            worker.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30, help="timed steps per round and peer")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    from tests.vlm_families import tiny_vlm_folder

    folder = tiny_vlm_folder(Path(tempfile.mkdtemp(prefix="vlm-bench-")) / "qwen2_vl", "qwen2_vl")
    rates, loads = lockstep(folder, args.steps, args.warmup, args.rounds, args.threads)
    results = {peer: [statistics.median(r) for r in rounds] for peer, rounds in rates.items()}
    for index in range(args.rounds):
        ratios = []
        for peer in ("template", "packed"):
            # The spread: the ratio of the two peers' rates at each step (taken one after the other), its quartiles.
            paired = statistics.quantiles([t / r for t, r in zip(rates[peer][index], rates["trl"][index])], n=4)
            ratios.append(f"{peer}/trl {results[peer][index] / results['trl'][index]:.2f}x "
                          f"(steps' ratios, quartiles {paired[0]:.2f}-{paired[2]:.2f}x)")
        print(f"round {index + 1}: useful (assistant) tokens/s, median step: template {results['template'][index]:,.0f}, "
              f"packed {results['packed'][index]:,.0f}, trl {results['trl'][index]:,.0f}; {'; '.join(ratios)}; "
              f"load {loads[index]:.1f} on {os.cpu_count()} cores", flush=True)
    medians = {peer: statistics.median(values) for peer, values in results.items()}
    print(json.dumps({"tokens_per_s_median": {k: round(v) for k, v in medians.items()},
                      "template_vs_trl": round(medians["template"] / medians["trl"], 3),
                      "packed_vs_trl": round(medians["packed"] / medians["trl"], 3),
                      "settings": {**SETTINGS, "steps": args.steps, "warmup": args.warmup, "threads": args.threads,
                                   "packed": PACKED}}))


if __name__ == "__main__":
    main()
