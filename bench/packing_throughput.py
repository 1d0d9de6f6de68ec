"""Useful tokens/s on variable-length documents: the template with sequence-packing and
torch-compile (alone and together) against the HF ``Trainer`` (padded, compiled, and with its
own packing).

The workload packing is for: ``--documents`` short documents of 4-45 words (about 20-250 bytes),
the template's byte tokenizer, rows of 256 positions, 8 rows a step, fp32, fused AdamW,
clipping at 1.0, one process each. Every peer trains on the same documents (the template's
pieces, in the template's order) with the same model (the template's default, built from one
seed) and the same next-token loss:

- ``template``: the template as it is: each batch ends at its last label (its longest
  document), as the Trainer's default collator pads (``data.pad_to_longest`` unset, eager);
- ``template+full-rows``: the template with ``data.pad_to_longest=false``: each document
  right-padded to 256 positions (the template's default before batches ended at their last label);
- ``template+packing``, ``template+compile``, ``template+packing+compile``: the template with
  the sequence-packing and torch-compile skills applied (compiled blocks; compiled, the template
  keeps rows of 256 unless told otherwise);
- ``template+compile+longest``: compiled blocks with ``data.pad_to_longest=true`` (a width per
  batch: what its recompilations cost);
- ``trainer``: ``Trainer`` with each batch padded to its longest document (the usual collator);
- ``trainer+compile``: the same with ``torch_compile=True``;
- ``trainer+packing``: ``Trainer`` with its own padding-free packing
  (``DataCollatorWithFlattening``: a batch is one row of its documents, position ids restart).

Useful tokens are the tokens the loss learns from (not padding). Each peer runs in a fresh
subprocess with the same thread count and OpenMP wait policy (a run's: ``engine/openmp.py``),
in interleaved rounds (the order reverses every round); the first ``--warmup`` steps
(compilation) are not timed. Each round prints, per peer, useful tokens/s over the timed steps,
the median step, the slowest step over the median (a recompilation shows there), dynamo's
recompilations over the whole run (``TORCH_LOGS=recompiles`` is set for every peer; warm-up
included), the positions computed per timed step (padding included: a peer that pads less
computes fewer), and the ratio against the Trainer's best peer of the same round.

    python bench/packing_throughput.py [--steps 40] [--warmup 10] [--rounds 3] [--threads 2]
    python bench/packing_throughput.py --cpu-time --peers template template+full-rows trainer

``--cpu-time`` (one thread unless ``--threads``) adds, per round and peer, the useful tokens per
CPU second of the peer's process over its timed steps (``time.process_time`` as each step ends:
the template's ``Engine.train_step``, the Trainer's ``on_step_end``) and the ratio to the
Trainer's default collator (``trainer``) of the same round: wall-clock ratios on a machine other
processes load measure the load, the CPU a step costs does not move with it.

Goals: template+packing+compile faster than template+packing and template+compile, and at
≥ 1.25× the Trainer's best useful tokens/s, with its slowest timed step ≤ 2× its median step;
the plain template (which pads as the Trainer's default collator pads) ≥ 1.0× it.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TEMPLATE = REPO / "recipes_template" / "causal_lm"
SKILLS = {
    "template": [],
    "template+full-rows": [],
    "template+packing": ["sequence-packing"],
    "template+compile": ["torch-compile"],
    "template+packing+compile": ["sequence-packing", "torch-compile"],
    "template+compile+longest": ["torch-compile"],
}
SETTINGS = {"template+full-rows": ["data.pad_to_longest=false"],  # beside data_settings()
            "template+compile+longest": ["data.pad_to_longest=true"]}
TRAINERS = ("trainer", "trainer+compile", "trainer+packing")
PEERS = (*SKILLS, *TRAINERS)
SEQ_LEN, BATCH = 256, 8
WORDS = "the quick brown fox jumps over a lazy dog while small cats sleep under warm blankets".split()


def write_documents(path: Path, count: int, source: str = "words") -> None:
    """``count`` documents, one JSON record a line (always the same ones). ``words``: 4-45 words
    of a fixed list; ``stdlib``: top-level definitions of the Python standard library of 32 to
    1,024 bytes (documents this benchmark did not shape: their lengths are the library's), taken
    in the order of their files."""
    if source == "stdlib":
        texts = stdlib_definitions(count)
    else:
        rng = random.Random(0)
        texts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 45))) for _ in range(count)]
    with open(path, "w") as f:
        for text in texts:
            f.write(json.dumps({"text": text}) + "\n")


def stdlib_definitions(count: int, low: int = 32, high: int = 1024) -> list[str]:
    """The first ``count`` top-level functions and classes of the standard library (its .py
    files in sorted order, tests left out) whose source is ``low`` to ``high`` bytes."""
    import ast
    import sysconfig

    root = Path(sysconfig.get_paths()["stdlib"])
    found: list[str] = []
    for path in sorted(root.rglob("*.py")):
        if {"test", "tests", "idle_test", "site-packages"} & set(path.relative_to(root).parts):
            continue
        try:
            source = path.read_text()
            tree = ast.parse(source)
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                text = ast.get_source_segment(source, node) or ""
                if low <= len(text.encode()) <= high:
                    found.append(text)
                    if len(found) == count:
                        return found
    return found


def prepare(workspace: Path, documents: int, source: str = "words") -> None:
    """The documents and one copy of the template per skill set, in ``workspace``."""
    sys.path.insert(0, str(REPO))
    from skills import apply_skill

    write_documents(workspace / "docs.jsonl", documents, source)
    for peer, skills in SKILLS.items():
        recipe = workspace / peer
        shutil.copytree(TEMPLATE, recipe, ignore=shutil.ignore_patterns("__pycache__", "runs"))
        for skill in skills:
            apply_skill(skill, recipe)


def data_settings() -> list[str]:
    return ["data.source=files", "data.paths=[docs.jsonl]", f"data.seq_len={SEQ_LEN}",
            f"data.batch_size={BATCH}"]


# ---------------------------------------------------------------------------------------------
# Peers (each runs in its own subprocess and prints one JSON line: useful tokens and seconds of
# each timed step)
# ---------------------------------------------------------------------------------------------


def run_template(workspace: Path, peer: str, steps: int, warmup: int) -> dict:
    """The template through ``engine.launch`` in this process (the worker is a fresh one, its
    OpenMP policy a run's), the process's CPU seconds noted as each step ends."""
    from bench.cpu_time import engine_step_ends, run_engine_here, timed_cpu_seconds
    from engine import run_dir as rd
    from engine import run_metrics

    sets = [*data_settings(), *SETTINGS.get(peer, []), f"train.max_steps={steps}", "train.log_every=1",
            "checkpoint.every=0", "checkpoint.at_end=false", "metrics.tensorboard=false", "train.eval_every=0"]
    runs = workspace / rd.RUNS_DIRNAME
    before = set(runs.glob("*"))
    os.chdir(workspace)  # data.paths are relative to the workspace
    with engine_step_ends() as step_ends:
        code = run_engine_here(workspace / peer, sets)
    if code != 0:
        raise SystemExit(f"{peer} failed with exit code {code}")
    (run,) = set(runs.glob("*")) - before
    records = run_metrics.read_all_metrics(run / rd.METRICS_JSONL)
    shutil.rmtree(run)
    timed = [r for r in records if r["step"] > warmup]
    return {"tokens": [r["loss_tokens_per_s"] * r["step_time_s"] for r in timed],
            "seconds": [r["step_time_s"] for r in timed],
            "cpu_seconds": timed_cpu_seconds(step_ends, warmup),
            "positions": [r["tokens_per_s"] * r["step_time_s"] / (1 - (r.get("padding_frac") or 0)) for r in timed]}


def template_pieces(workspace: Path, steps: int):
    """The plain template's model and its first ``steps`` batches of pieces (in its order)."""
    import importlib.util

    import torch

    spec = importlib.util.spec_from_file_location("causal_lm_recipe", TEMPLATE / "recipe.py")
    recipe = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = recipe
    spec.loader.exec_module(recipe)
    os.chdir(workspace)  # data.paths are relative to the workspace
    config = recipe.CausalLMConfig(data={"source": "files", "paths": ["docs.jsonl"], "seq_len": SEQ_LEN,
                                         "batch_size": BATCH})
    tokenizer = recipe.ByteTokenizer()
    texts = [text for name, text in recipe.load_documents(config.data)
             if not recipe.is_eval_document(name, config.data.eval_fraction)]
    pieces = recipe.tokenize_documents(texts, tokenizer, SEQ_LEN)
    stream = recipe.BatchStream(pieces, SEQ_LEN, tokenizer.pad_token_id, seed=config.train.seed,
                                micro_batch=BATCH, dp_rank=0, dp_size=1)
    ordered = [stream._piece_at(i) for i in range(steps * BATCH)]
    torch.manual_seed(config.train.seed)
    model = recipe.build_model(config.model, tokenizer.vocab_size, SEQ_LEN)
    return config, tokenizer, model, ordered


def run_trainer(workspace: Path, peer: str, steps: int, warmup: int) -> dict:
    import torch
    import torch.nn.functional as F
    from transformers import DataCollatorWithFlattening, Trainer, TrainerCallback, TrainingArguments

    from bench.cpu_time import timed_cpu_seconds

    config, tokenizer, model, pieces = template_pieces(workspace, steps)
    rows = [{"input_ids": piece[:-1].tolist(), "labels": piece[1:].tolist()} for piece in pieces]
    useful: list[int] = []
    positions: list[int] = []
    step_ends: list[float] = []
    cpu_ends: list[float] = []

    def pad_to_longest(items):
        longest = max(len(item["input_ids"]) for item in items)
        input_ids = torch.full((len(items), longest), tokenizer.pad_token_id, dtype=torch.int64)
        labels = torch.full((len(items), longest), -100, dtype=torch.int64)
        for row, item in enumerate(items):
            input_ids[row, : len(item["input_ids"])] = torch.tensor(item["input_ids"])
            labels[row, : len(item["labels"])] = torch.tensor(item["labels"])
        return {"input_ids": input_ids, "labels": labels, "attention_mask": input_ids != tokenizer.pad_token_id}

    flatten = DataCollatorWithFlattening(return_position_ids=True, separator_id=-100)

    def counted(collate):
        def collate_and_count(items):
            batch = collate(items)
            useful.append(int((batch["labels"] != -100).sum()))
            positions.append(batch["labels"].numel())
            return batch
        return collate_and_count

    class Timer(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            step_ends.append(time.perf_counter())
            cpu_ends.append(time.process_time())

    class SameLossTrainer(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            labels = inputs.pop("labels")
            logits = model(**inputs, use_cache=False).logits
            return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100)

    optim = config.optim
    with tempfile.TemporaryDirectory() as tmp:
        args = TrainingArguments(
            output_dir=tmp, max_steps=steps, per_device_train_batch_size=BATCH,
            learning_rate=optim.lr, weight_decay=optim.weight_decay, adam_beta1=optim.beta1,
            adam_beta2=optim.beta2, adam_epsilon=optim.eps, warmup_steps=optim.warmup_steps,
            lr_scheduler_type="cosine_with_min_lr", lr_scheduler_kwargs={"min_lr_rate": optim.min_lr_ratio},
            max_grad_norm=1.0, logging_steps=warmup, report_to=[], save_strategy="no",
            dataloader_num_workers=0, use_cpu=True, seed=config.train.seed, disable_tqdm=True,
            train_sampling_strategy="sequential", torch_compile=peer == "trainer+compile",
            remove_unused_columns=False,
        )
        collate = flatten if peer == "trainer+packing" else pad_to_longest
        trainer = SameLossTrainer(model=model, args=args, train_dataset=rows, callbacks=[Timer()],
                                  data_collator=counted(collate))
        trainer.train()
    # Step k's batch is collated before step k runs; the seconds of step k end at step_ends[k].
    seconds = [b - a for a, b in zip(step_ends[warmup - 1 : -1], step_ends[warmup:])]
    return {"tokens": useful[warmup:steps], "seconds": seconds, "cpu_seconds": timed_cpu_seconds(cpu_ends, warmup),
            "positions": positions[warmup:steps]}


def measure(workspace: Path, peer: str, steps: int, warmup: int, threads: int) -> dict:
    sys.path.insert(0, str(REPO))
    from engine.openmp import prepare_wait_policy

    env = dict(os.environ, OMP_NUM_THREADS=str(threads), TORCH_LOGS="recompiles")
    prepare_wait_policy(env)  # every peer starts with a run's OpenMP wait policy (the engine sets its own)
    out = subprocess.run(
        [sys.executable, __file__, "--worker", peer, "--workspace", str(workspace), "--steps", str(steps),
         "--warmup", str(warmup)],
        capture_output=True, text=True, cwd=REPO, env=env,
    )
    if out.returncode != 0:
        raise SystemExit(f"{peer} failed:\n{out.stderr[-3000:]}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    median_step = statistics.median(result["seconds"])
    return {"tokens_per_s": sum(result["tokens"]) / sum(result["seconds"]), "median_step_s": median_step,
            "tokens_per_cpu_s": sum(result["tokens"]) / sum(result["cpu_seconds"]),
            "median_step_cpu_s": statistics.median(result["cpu_seconds"]),
            "slowest_over_median": max(result["seconds"]) / median_step,
            "positions_per_step": statistics.mean(result["positions"]),
            "recompilations": out.stderr.count("Recompiling function")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, help="OpenMP threads of each peer (default 2; 1 with --cpu-time)")
    parser.add_argument("--cpu-time", action="store_true",
                        help="also each peer's useful tokens per CPU second of its process (timed steps) and its "
                             "ratio to the Trainer's default collator: a comparison that holds on a loaded machine")
    parser.add_argument("--documents", type=int, default=4000)
    parser.add_argument("--source", choices=("words", "stdlib"), default="words",
                        help="words: 4-45 words of a fixed list; stdlib: the standard library's "
                             "top-level definitions of 32-1,024 bytes")
    parser.add_argument("--peers", nargs="+", choices=PEERS, default=list(PEERS))
    parser.add_argument("--worker", choices=PEERS, help=argparse.SUPPRESS)
    parser.add_argument("--workspace", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.threads = args.threads or (1 if args.cpu_time else 2)
    if args.worker:
        sys.path.insert(0, str(REPO))
        runner = run_template if args.worker in SKILLS else run_trainer
        print(json.dumps(runner(args.workspace, args.worker, args.steps, args.warmup)))
        return

    peers = args.peers
    results: dict[str, list[dict]] = {peer: [] for peer in peers}
    with tempfile.TemporaryDirectory() as tmp:
        workspace = Path(tmp)
        prepare(workspace, args.documents, args.source)
        what = "of 4-45 words" if args.source == "words" else "of the standard library (32-1,024 bytes)"
        print(f"{args.documents} documents {what}, rows of {SEQ_LEN}, batch {BATCH}, "
              f"{args.steps} steps ({args.warmup} untimed), {args.threads} threads; "
              f"load average at start: {os.getloadavg()[0]:.2f}", flush=True)
        for round_index in range(args.rounds):
            this_round = {}
            for peer in (peers if round_index % 2 == 0 else peers[::-1]):
                load = os.getloadavg()[0]
                this_round[peer] = result = measure(workspace, peer, args.steps, args.warmup, args.threads)
                results[peer].append(result)
                print(f"round {round_index + 1}: {peer:<26} {result['tokens_per_s']:>8,.0f} useful tokens/s  "
                      f"median step {result['median_step_s']:.3f} s  slowest/median "
                      f"{result['slowest_over_median']:.2f}  positions/step {result['positions_per_step']:,.0f}  "
                      f"recompilations {result['recompilations']}  "
                      f"(load {load:.1f})", flush=True)
            if args.cpu_time:
                print_cpu_round(round_index, this_round)
            trainers = [p for p in peers if p in TRAINERS]
            if trainers:
                best = max(trainers, key=lambda p: this_round[p]["tokens_per_s"])
                ratios = ", ".join(f"{p} {this_round[p]['tokens_per_s'] / this_round[best]['tokens_per_s']:.2f}x"
                                   for p in peers if p in SKILLS)
                print(f"round {round_index + 1} against the Trainer's best ({best}): {ratios}", flush=True)

    median = {peer: statistics.median(r["tokens_per_s"] for r in rs) for peer, rs in results.items()}
    print(f"\n{'peer':<28}{'useful tokens/s':>16}{'rounds (min-max)':>22}{'slowest/median step':>22}")
    for peer in peers:
        values = [r["tokens_per_s"] for r in results[peer]]
        worst = max(r["slowest_over_median"] for r in results[peer])
        print(f"{peer:<28}{median[peer]:>16,.0f}{f'{min(values):,.0f}-{max(values):,.0f}':>22}{worst:>22.2f}")
    trainers = [p for p in peers if p in TRAINERS]
    if trainers:
        best = max(trainers, key=median.get)
        print(f"\nthe Trainer's best (median over rounds): {best}")
        for peer in peers:
            if peer in SKILLS:
                goal = "  (goal ≥ 1.25)" if peer == "template+packing+compile" else ""
                print(f"{peer} / {best}: {median[peer] / median[best]:.2f}{goal}")
    if args.cpu_time:
        print_cpu_summary(results)
    print(f"load average at end: {os.getloadavg()[0]:.2f}")


def print_cpu_round(round_index: int, this_round: dict[str, dict]) -> None:
    """A round's CPU figures: useful tokens per CPU second of each peer's process, its median
    step's CPU milliseconds, and the ratio to the Trainer's default collator (``trainer``)."""
    reference = this_round.get("trainer")
    for peer, result in this_round.items():
        ratio = f"  {result['tokens_per_cpu_s'] / reference['tokens_per_cpu_s']:.3f}x trainer" if reference else ""
        print(f"round {round_index + 1} CPU: {peer:<26} {result['tokens_per_cpu_s']:>8,.0f} useful tokens/CPU s  "
              f"median step {1000 * result['median_step_cpu_s']:.1f} CPU ms{ratio}", flush=True)


def print_cpu_summary(results: dict[str, list[dict]]) -> None:
    """Each peer's useful tokens per CPU second over the rounds and, against the Trainer's default
    collator, the ratio of each round (the rounds pair the peers run beside each other)."""
    print(f"\n{'peer':<28}{'useful tokens/CPU s (median)':>30}   ratio to trainer, each round")
    for peer, rounds in results.items():
        median = statistics.median(r["tokens_per_cpu_s"] for r in rounds)
        ratios = ""
        if "trainer" in results:
            ratios = ", ".join(f"{r['tokens_per_cpu_s'] / t['tokens_per_cpu_s']:.3f}x"
                               for r, t in zip(rounds, results["trainer"]))
        print(f"{peer:<28}{median:>30,.0f}   {ratios}")


if __name__ == "__main__":
    main()
