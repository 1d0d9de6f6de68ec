"""Data larger than memory: a run's peak memory and time to its first step as the corpus grows,
and the token store's tokenization throughput against ``datasets.map``.

For each corpus size (MB of JSONL records of Python sources, ``text`` column) this writes the
corpus, then launches the ``causal_lm`` template (a tiny model, 3 steps) directly with
``python -m engine.launch`` (``torchrun`` for two ranks) twice over an empty data cache: the
first launch tokenizes into the store, the second maps it. Measured from outside the run's
processes: the peak of the summed resident memory of every process of the run (sampled every
20 ms through /proc), and the seconds from the start to the first metrics record. Then the store
is built once more in this process (a fresh cache) and timed against
``datasets.load_dataset("json") + Dataset.map(batched=True, num_proc=cores)`` with the same
(byte-level, fast) tokenizer, each over the same file.

Every run is printed, then the goals' ratios:

- peak memory at each size / the peak at the smallest (goal <= 1.25, +0.3 GB);
- two ranks / one rank at the smallest (goal <= 2);
- second launch's time to step 1 / the first's (goal <= 0.5);
- store tokenization bytes/s / ``datasets.map``'s (goal >= 0.9).

With ``--streaming`` each size and rank count is launched once with ``data.streaming=true``
(``--steps`` steps: the stream reads ``steps × batch_size`` pieces, tokenized by a background
thread) and the rows say its peak, its time to step 1 and that the data cache stayed empty; then
the peak at each size / the peak at the smallest, which does not grow with the corpus.

    python bench/data_scale.py [--sizes 25 100 400] [--ranks 1 2] [--map]
    python bench/data_scale.py --streaming [--sizes 25 400] [--ranks 1 2] [--steps 50]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from engine import run_metrics  # noqa: E402
from engine.run_dir import METRICS_JSONL  # noqa: E402
from engine.data_files import DATA_CACHE_VARIABLE, DataListing  # noqa: E402
from tests.support import copy_template, engine_command, engine_env, existing_runs, new_run_dirs  # noqa: E402

TINY = ("model.hidden_size=64", "model.intermediate_size=128", "model.num_layers=2", "model.num_heads=2",
        "model.num_kv_heads=1", "data.seq_len=256", "data.batch_size=4", "train.max_steps=3", "train.log_every=1",
        "train.eval_every=0", "checkpoint.every=0", "metrics.tensorboard=false")


def write_corpus(path: Path, megabytes: float) -> None:
    """JSONL of the standard library's sources (numbered copies), ``megabytes`` × 10^6 bytes."""
    sources = sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py"))
    target, written, copy = int(megabytes * 1e6), 0, 0
    with open(path, "w") as f:
        while written < target:
            for source in sources:
                line = json.dumps({"text": f"# copy {copy}\n" + source.read_text(errors="replace")}) + "\n"
                f.write(line)
                written += len(line.encode())
                if written >= target:
                    break
            copy += 1


def tree_rss(root_pid: int) -> int:
    """The summed resident bytes of ``root_pid`` and every process under it."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parent = int(f.read().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
            children.setdefault(parent, []).append(int(entry))
    total, stack = 0, [root_pid]
    while stack:
        pid = stack.pop()
        stack += children.get(pid, [])
        try:
            with open(f"/proc/{pid}/statm") as f:
                total += int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except OSError:
            pass
    return total


def launch(workspace: Path, recipe: Path, nproc: int, cache: Path, *more: str) -> tuple[float, float]:
    """(peak GB of the run's processes, seconds to the first metrics record)."""
    before = existing_runs(workspace)
    env = {**engine_env(), DATA_CACHE_VARIABLE: str(cache)}
    start = time.monotonic()
    process = subprocess.Popen(engine_command(recipe, *TINY, "data.paths=[corpus.jsonl]", *more, nproc=nproc),
                               cwd=workspace, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    peak, first_step = 0, None
    while process.poll() is None:
        peak = max(peak, tree_rss(process.pid))
        if first_step is None:
            runs = new_run_dirs(workspace, before)
            if runs and (runs[0] / METRICS_JSONL).is_file() and run_metrics.latest_metrics(runs[0] / METRICS_JSONL):
                first_step = time.monotonic() - start
        time.sleep(0.02)
    if process.returncode != 0:
        raise SystemExit(f"the run failed ({process.returncode}): {process.stderr.read()[-2000:]}")
    if first_step is None:
        first_step = time.monotonic() - start
    return peak / 1e9, first_step


def store_throughput(corpus: Path, cache: Path) -> float:
    """Bytes/s of building the causal_lm store of ``corpus`` (byte tokenizer)."""
    from recipes_template.causal_lm import recipe

    shutil.rmtree(cache, ignore_errors=True)
    cache.mkdir()
    os.environ[DATA_CACHE_VARIABLE] = str(cache)
    cfg = recipe.CausalLMDataConfig(paths=[str(corpus)], seq_len=256)
    start = time.perf_counter()
    recipe.token_store(cfg, recipe.ByteTokenizer(), DataListing())
    return corpus.stat().st_size / (time.perf_counter() - start)


def datasets_map_throughput(corpus: Path, cache: Path) -> float:
    """Bytes/s of ``datasets`` reading the JSONL and tokenizing it with ``map`` on every core."""
    import datasets

    from recipes_template.causal_lm import recipe

    tokenizer = recipe.ByteTokenizer().to_hf()
    shutil.rmtree(cache, ignore_errors=True)
    start = time.perf_counter()
    dataset = datasets.load_dataset("json", data_files=str(corpus), split="train", cache_dir=str(cache))
    dataset.map(lambda batch: tokenizer(batch["text"]), batched=True, num_proc=os.cpu_count(),
                remove_columns=["text"])
    return corpus.stat().st_size / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=float, nargs="+", default=[25, 100, 400], help="corpus sizes in MB")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--map", action="store_true", help="also time datasets.map (slow at large sizes)")
    parser.add_argument("--streaming", action="store_true", help="launch once per size with data.streaming=true")
    parser.add_argument("--steps", type=int, default=50, help="--streaming: steps of each run")
    args = parser.parse_args()
    if args.streaming:
        streaming(args.sizes, args.ranks, args.steps)
        return
    peaks: dict[tuple[float, int], float] = {}
    with tempfile.TemporaryDirectory(prefix="data-scale-") as tmp:
        root = Path(tmp)
        recipe = copy_template(root / "ws", "lm")
        for size in args.sizes:
            write_corpus(root / "ws" / "corpus.jsonl", size)
            for nproc in args.ranks:
                cache = root / f"cache-{size}-{nproc}"
                first_peak, first_time = launch(root / "ws", recipe, nproc, cache)
                second_peak, second_time = launch(root / "ws", recipe, nproc, cache)
                peaks[(size, nproc)] = max(first_peak, second_peak)
                print(f"{size:g} MB, {nproc} rank(s): first launch peak {first_peak:.2f} GB, step 1 at "
                      f"{first_time:.1f} s; second launch peak {second_peak:.2f} GB, step 1 at {second_time:.1f} s "
                      f"(second/first {second_time / first_time:.2f}, goal <= 0.5)", flush=True)
                shutil.rmtree(cache, ignore_errors=True)
            ours = store_throughput(root / "ws" / "corpus.jsonl", root / "cache-throughput")
            line = f"{size:g} MB: store tokenization {ours / 1e6:.1f} MB/s"
            if args.map:
                theirs = datasets_map_throughput(root / "ws" / "corpus.jsonl", root / "hf-cache")
                line += f", datasets.map(num_proc={os.cpu_count()}) {theirs / 1e6:.1f} MB/s " \
                        f"(ratio {ours / theirs:.2f}, goal >= 0.9)"
            print(line, flush=True)
        smallest = min(args.sizes)
        for (size, nproc), peak in sorted(peaks.items()):
            base = peaks[(smallest, nproc)]
            print(f"peak at {size:g} MB / at {smallest:g} MB, {nproc} rank(s): {peak / base:.2f} "
                  f"(goal <= 1.25 + 0.3 GB: {peak <= 1.25 * base + 0.3})")
        if (smallest, 1) in peaks and (smallest, 2) in peaks:
            print(f"two ranks / one rank at {smallest:g} MB: {peaks[(smallest, 2)] / peaks[(smallest, 1)]:.2f} (goal <= 2)")


def streaming(sizes: list[float], ranks: list[int], steps: int) -> None:
    """One data.streaming launch per size and rank count: peak memory, time to step 1, the cache
    left empty; then each peak against the smallest size's."""
    peaks: dict[tuple[float, int], float] = {}
    with tempfile.TemporaryDirectory(prefix="data-scale-") as tmp:
        root = Path(tmp)
        recipe = copy_template(root / "ws", "lm")
        for size in sizes:
            write_corpus(root / "ws" / "corpus.jsonl", size)
            for nproc in ranks:
                cache = root / f"cache-{size}-{nproc}"
                peak, first = launch(root / "ws", recipe, nproc, cache, "data.streaming=true", f"train.max_steps={steps}")
                peaks[(size, nproc)] = peak
                cached = sorted(p.name for p in cache.iterdir()) if cache.is_dir() else []
                print(f"streaming, {size:g} MB, {nproc} rank(s), {steps} steps: peak {peak:.2f} GB, step 1 at "
                      f"{first:.1f} s, data cache {cached or 'empty'}", flush=True)
        smallest = min(sizes)
        for (size, nproc), peak in sorted(peaks.items()):
            print(f"streaming peak at {size:g} MB / at {smallest:g} MB, {nproc} rank(s): "
                  f"{peak / peaks[(smallest, nproc)]:.2f} (goal <= 1.25 + 0.3 GB: {peak <= 1.25 * peaks[(smallest, nproc)] + 0.3})")


if __name__ == "__main__":
    main()
