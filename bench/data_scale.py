"""Data larger than memory: a run's peak memory and time to its first step as the corpus grows,
and the token store's tokenization throughput against ``datasets.map``.

For each corpus size (MB of JSONL records of Python sources, ``text`` column) this writes the
corpus, then launches the ``causal_lm`` template (a tiny model, 3 steps) directly with
``python -m engine.launch`` (two ranks under ``runner.local_ranks``, as a run starts them)
twice over an empty data cache: the first launch tokenizes into the store, the second maps it.
Measured from outside the run's processes: the peak of the summed resident memory of every process of the run (sampled every
20 ms through /proc; RSS, and PSS, which counts a page shared by several processes once in
all), and the seconds from the start to the first metrics record. Then the store
is built once more in this process (a fresh cache) and timed against
``datasets.load_dataset("json") + Dataset.map(batched=True, num_proc=cores)`` with the same
(byte-level, fast) tokenizer, each over the same file.

Before the launches, the launch check (``--check``, what ``launch_run`` waits for) is timed
over an empty cache: it tokenizes data up to ``data.tokenize_in_check_mb`` and only reads the
head of larger data, which the run tokenizes as its first phase.

Every run is printed, then the goals' ratios:

- peak memory at each size / the peak at the smallest (goal <= 1.25, +0.3 GB);
- two ranks / one rank at the smallest (goal <= 2);
- second launch's time to step 1 / the first's (goal <= 0.5);
- store tokenization bytes/s / ``datasets.map``'s (goal >= 0.9).

With ``--sft`` the ``sft`` template's preparation alone is timed, in ``--rounds`` interleaved
rounds, each round printed: a corpus of chat records (``messages``: a question and an answer cut
from the standard library's sources, ``--sizes`` MB in :data:`SHARDS` JSONL files) is encoded into
a fresh store with 1 and with 2 workers (``engine.store_parts.build_workers``), and by
``datasets.load_dataset("json") + Dataset.map(batched=True, num_proc=2)`` doing the same chat
template rendering and tokenization (``apply_chat_template`` with the assistant mask, the same
fast byte tokenizer) into a fresh Arrow cache. Each round also prints the load average and what
it leaves of the cores (a plain Python loop's throughput in 2 processes against 1: near 2 on an
idle machine, near 1 on a saturated one), and each peer's CPU seconds (its own and its
processes', which the load does not inflate much). Then the medians' bytes/s and ratios (goal:
2 workers / datasets.map >= 0.9). With ``--saved`` the same records are a ``save_to_disk`` folder
(:data:`SHARDS` Arrow files) instead: the store reads its rows apart, the peer maps
``datasets.load_from_disk``'s data set; bytes/s are of the JSONL records, for both.

With ``--streaming`` each size and rank count is launched once with ``data.streaming=true``
(``--steps`` steps: the stream reads ``steps × batch_size`` pieces, tokenized by a background
thread) and the rows say its peak, its time to step 1 and that the data cache stayed empty; then
the peak at each size / the peak at the smallest, which does not grow with the corpus.

    python bench/data_scale.py [--sizes 25 100 400] [--ranks 1 2] [--map]
    python bench/data_scale.py --streaming [--sizes 25 400] [--ranks 1 2] [--steps 50]
    python bench/data_scale.py --sft [--sizes 8] [--rounds 3] [--saved]
    python bench/data_scale.py --grpo [--sizes 4 16]
    python bench/data_scale.py --vlm [--sizes 2 8]

With ``--grpo`` the ``grpo`` template's prompts are measured in this process, per size (MB of
JSONL prompt records in :data:`SHARDS` files, each with an ``answer`` and a ``context`` column
of a few KB of standard library source that the reward functions would read): the store's build
(1 and 2 workers, fresh caches; wall seconds and CPU seconds of this process and its workers),
then the Python memory a rank holds for its prompts (tracemalloc: the allocations left once
they are ready, and their peak) — the store's ``GRPO.prompts`` with one rollout's prompts read
from it, against its peer, the list of every ``(record, prompt tokens)`` the template held
before its store — and the ratio, which grows with the corpus. tracemalloc's bytes do not
depend on the machine's load; the seconds do (printed with the load average).

With ``--vlm`` the ``vlm`` template's examples are measured in this process, per size
(``--sizes``: thousands of 64 × 64 noise PNGs and their captions): the store's build, then a
second launch's summary, which maps it (wall and CPU seconds; in this process, which keeps each
file's digest while its stat is unchanged: a new launch hashes every file again), then the resident memory a rank adds for its examples (RSS, since torch's tensors
are not Python allocations): the store's stream with one batch read, against its peer, the
template's earlier list of every resized image and ``(tokens, pixel values)`` piece; then the
CPU time a batch takes from each (the store's pixel values are made as the batch is).
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
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from engine import run_metrics  # noqa: E402
from engine.run_dir import METRICS_JSONL  # noqa: E402
from engine.data_files import DATA_CACHE_VARIABLE, DataListing  # noqa: E402
from engine.token_store import TOKENIZE_IN_CHECK_MB  # noqa: E402
from tests.support import copy_template, engine_command, engine_env, existing_runs, new_run_dirs  # noqa: E402

TINY = ("model.hidden_size=64", "model.intermediate_size=128", "model.num_layers=2", "model.num_heads=2",
        "model.num_kv_heads=1", "data.seq_len=256", "data.batch_size=4", "train.max_steps=3", "train.log_every=1",
        "train.eval_every=0", "checkpoint.every=0", "metrics.tensorboard=false")


SFT_SEQ_LEN = 4096  # --sft: every chat record fits whole (none is cut or left out)
SHARDS = 4  # the corpus is this many JSONL files, as corpora come (the store tokenizes a file per core)


def write_corpus(folder: Path, megabytes: float) -> None:
    """JSONL of the standard library's sources (numbered copies), ``megabytes`` × 10^6 bytes in
    :data:`SHARDS` files of ``folder``."""
    sources = sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py"))
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir()
    target, written, copy = int(megabytes * 1e6 / SHARDS), 0, 0
    for shard in range(SHARDS):
        written = 0
        with open(folder / f"shard-{shard}.jsonl", "w") as f:
            while written < target:
                for source in sources:
                    line = json.dumps({"text": f"# copy {copy}\n" + source.read_text(errors="replace")}) + "\n"
                    f.write(line)
                    written += len(line.encode())
                    if written >= target:
                        break
                copy += 1


def launcher(command: bytes) -> bool:
    """Whether a process's command line is a launcher of ranks (torchrun's, or runner.local_ranks)."""
    return b"torch.distributed.run" in command or b"runner.local_ranks" in command


def tree_memory(root_pid: int, by_role: dict[str, int] | None = None) -> tuple[int, int]:
    """The summed resident bytes of ``root_pid`` and every process under it, and their summed
    proportional set size (what the machine holds: a page shared by n processes counts 1/n in
    each, such as torch's libraries mapped by every rank and the launcher). ``by_role`` keeps
    each role's largest PSS so far: the ranks' launcher, a rank, a tokenizer worker (a rank's fork)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parent = int(f.read().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
            children.setdefault(parent, []).append(int(entry))
    rss = pss = 0
    stack = [(root_pid, b"")]
    while stack:
        pid, parent_command = stack.pop()
        try:
            with open(f"/proc/{pid}/smaps_rollup") as f:
                sizes = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f if line.startswith(("Rss:", "Pss:"))}
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                command = f.read()
        except OSError:
            continue
        stack += [(child, command) for child in children.get(pid, [])]
        rss, pss = rss + sizes.get("Rss", 0), pss + sizes.get("Pss", 0)
        if by_role is not None:
            role = ("launcher" if launcher(command)
                    else "tokenizer worker" if b"engine.launch" in parent_command and not launcher(parent_command)
                    else "rank" if b"engine.launch" in command else "other")
            by_role[role] = max(by_role.get(role, 0), sizes.get("Pss", 0))
    return rss, pss


def launch(workspace: Path, recipe: Path, nproc: int, cache: Path, *more: str) -> tuple[float, float, float]:
    """(peak GB of the run's processes' summed RSS, and of their summed PSS, seconds to the first
    metrics record); ``more``: settings beside the bench's."""
    before = existing_runs(workspace)
    env = {**engine_env(), DATA_CACHE_VARIABLE: str(cache)}
    start = time.monotonic()
    process = subprocess.Popen(engine_command(recipe, *TINY, "data.paths=[corpus]", *more, nproc=nproc),
                               cwd=workspace, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    peak, peak_pss, first_step, by_role = 0, 0, None, {}
    while process.poll() is None:
        rss, pss = tree_memory(process.pid, by_role)
        peak, peak_pss = max(peak, rss), max(peak_pss, pss)
        if first_step is None:
            runs = new_run_dirs(workspace, before)
            if runs and (runs[0] / METRICS_JSONL).is_file() and run_metrics.latest_metrics(runs[0] / METRICS_JSONL):
                first_step = time.monotonic() - start
        time.sleep(0.02)
    if process.returncode != 0:
        raise SystemExit(f"the run failed ({process.returncode}): {process.stderr.read()[-2000:]}")
    if first_step is None:
        first_step = time.monotonic() - start
    print(f"  peak PSS by process: {', '.join(f'{role} {size / 1e9:.2f} GB' for role, size in sorted(by_role.items()))}",
          flush=True)
    return peak / 1e9, peak_pss / 1e9, first_step


def check_data_seconds(corpus: Path, cache: Path) -> float:
    """Seconds of the launch check's data part (``summarize_data`` under ``launch_check``, the
    recipe imported already) over an empty cache: what grows with the data."""
    from engine.token_store import launch_check
    from recipes_template.causal_lm.recipe import CausalLM, CausalLMConfig

    shutil.rmtree(cache, ignore_errors=True)
    cache.mkdir()
    os.environ[DATA_CACHE_VARIABLE] = str(cache)
    config = CausalLMConfig.model_validate({"data": {"paths": [str(corpus)]}})
    start = time.perf_counter()
    with launch_check():
        CausalLM.summarize_data(config)
    seconds = time.perf_counter() - start
    shutil.rmtree(cache, ignore_errors=True)
    return seconds


def check_seconds(workspace: Path, recipe: Path, cache: Path) -> float:
    """Seconds of the launch check (what ``launch_run`` waits for) over an empty data cache."""
    shutil.rmtree(cache, ignore_errors=True)
    start = time.monotonic()
    subprocess.run([sys.executable, "-m", "engine.launch", str(recipe), "--check", "--set", "data.paths=[corpus]",
                    *(item for key in TINY for item in ("--set", key))], cwd=workspace, check=True,
                   env={**engine_env(), DATA_CACHE_VARIABLE: str(cache)}, stdout=subprocess.DEVNULL)
    seconds = time.monotonic() - start
    shutil.rmtree(cache, ignore_errors=True)
    return seconds


def store_throughput(corpus: Path, cache: Path) -> float:
    """Bytes/s of building the causal_lm store of ``corpus`` (byte tokenizer)."""
    from recipes_template.causal_lm import recipe

    shutil.rmtree(cache, ignore_errors=True)
    cache.mkdir()
    os.environ[DATA_CACHE_VARIABLE] = str(cache)
    cfg = recipe.CausalLMDataConfig(paths=[str(corpus)], seq_len=256)
    start = time.perf_counter()
    recipe.token_store(cfg, recipe.ByteTokenizer(), DataListing())
    return corpus_bytes(corpus) / (time.perf_counter() - start)


def corpus_bytes(corpus: Path) -> int:
    return sum(p.stat().st_size for p in corpus.iterdir())


def datasets_map_throughput(corpus: Path, cache: Path) -> float:
    """Bytes/s of ``datasets`` reading the JSONL and tokenizing it with ``map`` on every core."""
    import datasets

    from recipes_template.causal_lm import recipe

    tokenizer = recipe.ByteTokenizer().to_hf()
    shutil.rmtree(cache, ignore_errors=True)
    start = time.perf_counter()
    dataset = datasets.load_dataset("json", data_files=sorted(map(str, corpus.iterdir())), split="train",
                                    cache_dir=str(cache))
    dataset.map(lambda batch: tokenizer(batch["text"]), batched=True, num_proc=os.cpu_count(),
                remove_columns=["text"])
    return corpus_bytes(corpus) / (time.perf_counter() - start)


def write_chats(folder: Path, megabytes: float) -> None:
    """JSONL chat records (``messages``: a user's question and the assistant's answer, each a
    piece of a standard library source), ``megabytes`` × 10^6 bytes in :data:`SHARDS` files."""
    sources = sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py"))
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir()
    target, copy = int(megabytes * 1e6 / SHARDS), 0
    for shard in range(SHARDS):
        written = 0
        with open(folder / f"shard-{shard}.jsonl", "w") as f:
            while written < target:
                text = sources[copy % len(sources)].read_text(errors="replace")[:3000]
                cut = len(text) // 3
                line = json.dumps({"messages": [
                    {"role": "user", "content": f"What does this code do? ({copy})\n{text[:cut]}"},
                    {"role": "assistant", "content": text[cut:]}]}) + "\n"
                f.write(line)
                written, copy = written + len(line.encode()), copy + 1


def sft_store_seconds(corpus: Path, cache: Path, workers: int) -> float:
    """Seconds of building the sft store of ``corpus`` on ``workers`` workers (fresh cache)."""
    from engine import store_parts
    from recipes_template.sft import recipe

    shutil.rmtree(cache, ignore_errors=True)
    cache.mkdir()
    os.environ[DATA_CACHE_VARIABLE] = str(cache)
    cores, store_parts.build_workers = store_parts.build_workers, lambda: workers
    try:
        tokenizer = recipe.load_tokenizer(None, None)
        start = time.perf_counter()
        recipe.token_store(recipe.SFTDataConfig(paths=[str(corpus)], seq_len=SFT_SEQ_LEN), tokenizer, DataListing())
        return time.perf_counter() - start
    finally:
        store_parts.build_workers = cores
        shutil.rmtree(cache, ignore_errors=True)


def save_chats(corpus: Path, saved: Path, cache: Path) -> None:
    """The chat JSONL of ``corpus`` as a ``save_to_disk`` folder of :data:`SHARDS` Arrow files."""
    import datasets

    shutil.rmtree(saved, ignore_errors=True)
    try:
        datasets.load_dataset("json", data_files=sorted(map(str, corpus.iterdir())), split="train",
                              cache_dir=str(cache)).save_to_disk(str(saved), num_shards=SHARDS)
    finally:
        shutil.rmtree(cache, ignore_errors=True)


def sft_map_seconds(corpus: Path, cache: Path, workers: int) -> float:
    """Seconds of ``datasets`` reading the chat JSONL (or ``save_to_disk`` folder) and rendering and
    tokenizing it with ``map(batched=True, num_proc=workers)`` as sft encodes it (the chat template,
    the assistant mask)."""
    import datasets

    from recipes_template.sft import recipe

    tokenizer = recipe.load_tokenizer(None, None)
    shutil.rmtree(cache, ignore_errors=True)
    try:
        start = time.perf_counter()
        if (corpus / "state.json").is_file():  # a save_to_disk folder: its map's Arrow cache goes to ``cache``
            dataset, written = datasets.load_from_disk(str(corpus)), {"cache_file_name": str(cache / "map.arrow")}
            cache.mkdir()
        else:
            dataset, written = datasets.load_dataset("json", data_files=sorted(map(str, corpus.iterdir())),
                                                     split="train", cache_dir=str(cache)), {}
        dataset.map(lambda batch: tokenizer.apply_chat_template(batch["messages"], tokenize=True, return_dict=True,
                                                                return_assistant_tokens_mask=True),
                    batched=True, num_proc=workers, remove_columns=["messages"], **written)
        return time.perf_counter() - start
    finally:
        shutil.rmtree(cache, ignore_errors=True)


def count_up(n: int) -> int:
    total = 0
    for i in range(n):
        total += i
    return total


def cores_at_hand(processes: int = 2, n: int = 5_000_000) -> float:
    """How much faster ``processes`` forked processes run a plain Python loop than one: what the
    machine's load leaves of its cores now (``processes`` on an idle machine, 1 on a saturated one)."""
    import multiprocessing

    seconds = []
    for count in (1, processes):
        start = time.perf_counter()
        with multiprocessing.get_context("fork").Pool(count) as pool:
            pool.map(count_up, [n] * count)
        seconds.append(time.perf_counter() - start)
    return processes * seconds[0] / seconds[1]


def cpu_seconds() -> float:
    """CPU seconds of this process and of its children waited for (a build's workers, map's)."""
    times = os.times()
    return times.user + times.system + times.children_user + times.children_system


def sft_preparation(sizes: list[float], rounds: int, saved: bool = False) -> None:
    """sft's store on 1 and 2 workers against datasets.map(num_proc=2), interleaved rounds (of a
    ``save_to_disk`` folder of the records: ``saved``)."""
    import statistics

    import datasets

    datasets.disable_progress_bars()
    with tempfile.TemporaryDirectory(prefix="data-scale-") as tmp:
        root = Path(tmp)
        for size in sizes:
            write_chats(root / "chats", size)
            size_bytes, data = corpus_bytes(root / "chats"), root / "chats"
            if saved:
                save_chats(root / "chats", root / "saved", root / "hf-cache")
                data = root / "saved"
            peers = {"sft store, 1 worker": lambda: sft_store_seconds(data, root / "cache", 1),
                     "sft store, 2 workers": lambda: sft_store_seconds(data, root / "cache", 2),
                     "datasets.map(num_proc=2)": lambda: sft_map_seconds(data, root / "hf-cache", 2)}
            rates: dict[str, list[float]] = {name: [] for name in peers}
            cpu: dict[str, list[float]] = {name: [] for name in peers}  # CPU seconds, this process's and its children's
            for round_ in range(rounds):
                names = list(peers)[round_ % len(peers):] + list(peers)[:round_ % len(peers)]  # each goes first in turn
                for name in names:
                    before = cpu_seconds()
                    rates[name].append(size_bytes / peers[name]())
                    cpu[name].append(cpu_seconds() - before)
                print(f"{size:g} MB, round {round_ + 1}: " + ", ".join(f"{name} {rates[name][-1] / 1e6:.2f} MB/s "
                                                                      f"({cpu[name][-1]:.1f} CPU s)" for name in peers)
                      + f" (load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; a plain loop's "
                        f"throughput, 2 processes / 1: {cores_at_hand():.2f})", flush=True)
            median = {name: statistics.median(values) for name, values in rates.items()}
            one, two, theirs = median.values()
            print(f"{size:g} MB{' saved' if saved else ''}, medians of {rounds}: 2 workers / datasets.map {two / theirs:.2f} (goal >= 0.9), "
                  f"1 worker / datasets.map {one / theirs:.2f}, 2 workers / 1 worker {two / one:.2f}; CPU seconds, "
                  + ", ".join(f"{name} {statistics.median(cpu[name]):.1f}" for name in peers), flush=True)


def write_prompts(folder: Path, megabytes: float) -> int:
    """JSONL prompt records (``prompt``, ``answer``, ``context``: a piece of a standard library
    source), ``megabytes`` × 10^6 bytes in :data:`SHARDS` files; the number of records."""
    sources = sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py"))
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir()
    target, count = int(megabytes * 1e6 / SHARDS), 0
    for shard in range(SHARDS):
        written = 0
        with open(folder / f"shard-{shard}.jsonl", "w") as f:
            while written < target:
                a, b = count % 97, count % 89
                context = sources[count % len(sources)].read_text(errors="replace")[:4000]
                line = json.dumps({"prompt": f"What is {a} + {b}?", "answer": a + b, "context": context}) + "\n"
                f.write(line)
                written, count = written + len(line.encode()), count + 1
    return count


def grpo_store_seconds(corpus: Path, cache: Path, workers: int) -> tuple[float, float]:
    """``(wall, CPU)`` seconds of building the grpo prompt store of ``corpus`` on ``workers``
    workers (fresh cache); CPU counts this process's and its workers' (:func:`cpu_seconds`)."""
    from engine import store_parts
    from engine.config import build_config
    from recipes_template.grpo import recipe

    shutil.rmtree(cache, ignore_errors=True)
    cache.mkdir()
    os.environ[DATA_CACHE_VARIABLE] = str(cache)
    cores, store_parts.build_workers = store_parts.build_workers, lambda: workers
    try:
        config = build_config(recipe.GRPOConfig, None, [f"data.paths=[{corpus}]"])
        tokenizer = recipe.load_chat_tokenizer(None, None)

        start, start_cpu = time.perf_counter(), cpu_seconds()
        recipe.prompt_store(config, tokenizer, DataListing())
        return time.perf_counter() - start, cpu_seconds() - start_cpu
    finally:
        store_parts.build_workers = cores


def held_bytes(make) -> tuple[int, int, Any]:
    """``(bytes held, peak bytes, what make() returned)`` of Python allocations (tracemalloc)."""
    import gc
    import tracemalloc

    gc.collect()
    tracemalloc.start()
    try:
        made = make()
        gc.collect()
        held, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return held, peak, made


def grpo_memory(sizes: list[float]) -> None:
    """grpo's store: its build on 1 and 2 workers, and a rank's memory for its prompts against
    the list of every record the template held before."""
    import torch

    from engine.config import build_config
    from engine.distributed import DistInfo
    from recipes_template.grpo import recipe

    with tempfile.TemporaryDirectory(prefix="data-scale-") as tmp:
        root = Path(tmp)
        for size in sizes:
            records = write_prompts(root / "prompts", size)
            times = {workers: grpo_store_seconds(root / "prompts", root / "cache", workers) for workers in (1, 2)}
            print(f"{size:g} MB ({records:,} prompts): store built in " + ", ".join(
                f"{wall:.1f} s wall / {cpu:.1f} s CPU on {workers} worker(s)" for workers, (wall, cpu) in times.items())
                + f" (load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)", flush=True)
            config = build_config(recipe.GRPOConfig, None, [f"data.paths=[{root / 'prompts'}]"])
            engine = recipe.GRPO(config, DistInfo(0, 1, 0, torch.device("cpu"), None))

            def from_store():
                train, held_out = engine.prompts
                return train, [train[i] for i in range(0, len(train), max(1, len(train) // 8))][:8]

            def every_record():
                tokenizer = engine.tokenizer
                return [(record, recipe.prompt_tokens(tokenizer, record, where))
                        for where, record in recipe.read_prompts(config.data)]

            store_held, store_peak, _ = held_bytes(from_store)
            list_held, list_peak, _ = held_bytes(every_record)
            print(f"{size:g} MB: a rank's prompts hold {store_held / 1e6:.2f} MB (peak {store_peak / 1e6:.2f}) from the "
                  f"store, {list_held / 1e6:.2f} MB (peak {list_peak / 1e6:.2f}) as a list of every record: "
                  f"list / store {list_held / max(1, store_held):.0f}x held, {list_peak / max(1, store_peak):.0f}x peak",
                  flush=True)
            shutil.rmtree(root / "cache", ignore_errors=True)


def write_images(folder: Path, count: int, side: int = 64) -> None:
    """``count`` PNGs of noise, ``side`` pixels square (the template resizes them), and a
    captions .jsonl naming them."""
    import numpy as np
    from PIL import Image

    (folder / "images").mkdir(parents=True, exist_ok=True)
    with open(folder / "data.jsonl", "w") as f:
        for i in range(count):
            pixels = np.random.default_rng(i).integers(0, 255, (side, side, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(folder / "images" / f"{i}.png", compress_level=1)
            f.write(json.dumps({"image": f"images/{i}.png", "caption": f"noise number {i}"}) + "\n")


def resident_bytes() -> int:
    """This process's resident memory (/proc/self/statm)."""
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def held_resident(make) -> tuple[int, Any]:
    """``(resident bytes added, what make() returned)``: torch's tensors are not Python
    allocations, so tracemalloc does not see them; the resident memory does."""
    import gc

    gc.collect()
    before = resident_bytes()
    made = make()
    gc.collect()
    return resident_bytes() - before, made


def vlm_memory(sizes: list[float]) -> None:
    """vlm's store: its build (CPU seconds), a second launch's summary that maps it, and a rank's
    memory for its examples (one batch read from the store) against the list of every
    ``(tokens, pixel values)`` and resized image the template held before its store."""
    import torch

    from engine.config import build_config
    from engine.distributed import DistInfo
    from recipes_template.vlm import recipe

    with tempfile.TemporaryDirectory(prefix="data-scale-") as tmp:
        root = Path(tmp)
        for size in sizes:
            count = int(size * 1000)
            write_images(root / "images", count)
            os.environ[DATA_CACHE_VARIABLE] = str(root / "cache")
            config = build_config(recipe.VLMConfig, None, [f"data.paths=[{root / 'images' / 'data.jsonl'}]"])
            timed = []
            for _ in range(2):  # the first launch builds the store, the second maps it
                start, start_cpu = time.perf_counter(), cpu_seconds()
                recipe.VLM.summarize_data(config)
                timed.append((time.perf_counter() - start, cpu_seconds() - start_cpu))
            print(f"{count:,} images: store built in {timed[0][0]:.1f} s wall / {timed[0][1]:.1f} s CPU, a second "
                  f"launch's summary {timed[1][0]:.2f} s wall / {timed[1][1]:.2f} s CPU (second / first CPU "
                  f"{timed[1][1] / timed[0][1]:.2f}; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)",
                  flush=True)
            engine = recipe.VLM(config, DistInfo(0, 1, 0, torch.device("cpu"), None))

            def from_store():
                stream = engine.prepare_data()
                return stream, next(stream)

            def every_example():
                train = [e for e in recipe.load_examples(config.data) if not recipe.is_eval_document(e[0], 0.05)]
                return train, recipe.make_pieces(train, engine.processor, config.data.seq_len)

            store_held, (stream, _) = held_resident(from_store)
            list_held, (_, pieces) = held_resident(every_example)
            print(f"{count:,} images: a rank's examples hold {store_held / 1e6:.1f} MB resident from the store, "
                  f"{list_held / 1e6:.1f} MB as a list of every piece (list / store "
                  f"{list_held / max(1, store_held):.0f}x)", flush=True)
            listed = recipe.BatchStream(pieces, config.data.seq_len, engine.processor.tokenizer.pad_token_id,
                                        config.train.seed, stream.micro_batch, 0, 1)
            seconds = {}
            for name, batches in (("store", stream), ("list", listed), ("store", stream), ("list", listed)):
                start_cpu = time.process_time()
                for _ in range(50):
                    next(batches)
                seconds[name] = min(seconds.get(name, float("inf")), (time.process_time() - start_cpu) / 50)
            print(f"{count:,} images: a batch of {stream.micro_batch} made in {seconds['store'] * 1e3:.1f} ms CPU from "
                  f"the store (pixel values made from its bytes), {seconds['list'] * 1e3:.1f} ms from the list "
                  f"(store / list {seconds['store'] / seconds['list']:.1f}x)", flush=True)
            shutil.rmtree(root / "cache", ignore_errors=True)
            shutil.rmtree(root / "images", ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=float, nargs="+", default=[25, 100, 400], help="corpus sizes in MB")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--map", action="store_true", help="also time datasets.map (slow at large sizes)")
    parser.add_argument("--streaming", action="store_true", help="launch once per size with data.streaming=true")
    parser.add_argument("--steps", type=int, default=50, help="--streaming: steps of each run")
    parser.add_argument("--sft", action="store_true", help="time sft's store on 1 and 2 workers against datasets.map")
    parser.add_argument("--rounds", type=int, default=3, help="--sft: interleaved rounds")
    parser.add_argument("--grpo", action="store_true", help="grpo's prompt store: its build, and a rank's memory against a list")
    parser.add_argument("--saved", action="store_true", help="--sft: the records as a save_to_disk folder")
    parser.add_argument("--vlm", action="store_true", help="vlm's store (--sizes: thousands of images): build, reuse, memory")
    args = parser.parse_args()
    if args.vlm:
        vlm_memory(args.sizes)
        return
    if args.grpo:
        grpo_memory(args.sizes)
        return
    if args.sft:
        sft_preparation(args.sizes, args.rounds, args.saved)
        return
    if args.streaming:
        streaming(args.sizes, args.ranks, args.steps)
        return
    peaks: dict[tuple[float, int], float] = {}
    shares: dict[tuple[float, int], float] = {}  # the same peaks as PSS
    with tempfile.TemporaryDirectory(prefix="data-scale-") as tmp:
        root = Path(tmp)
        recipe = copy_template(root / "ws", "lm")
        for size in args.sizes:
            write_corpus(root / "ws" / "corpus", size)
            print(f"{size:g} MB: launch check {check_seconds(root / 'ws', recipe, root / 'cache-check'):.1f} s, "
                  f"its data part {check_data_seconds(root / 'ws' / 'corpus', root / 'cache-check'):.2f} s "
                  f"(tokenizes data up to data.tokenize_in_check_mb, default {TOKENIZE_IN_CHECK_MB:g} MB)", flush=True)
            for nproc in args.ranks:
                cache = root / f"cache-{size}-{nproc}"
                first_peak, first_pss, first_time = launch(root / "ws", recipe, nproc, cache)
                second_peak, second_pss, second_time = launch(root / "ws", recipe, nproc, cache)
                peaks[(size, nproc)] = max(first_peak, second_peak)
                shares[(size, nproc)] = max(first_pss, second_pss)
                print(f"{size:g} MB, {nproc} rank(s): first launch peak {first_peak:.2f} GB (PSS {first_pss:.2f}), "
                      f"step 1 at {first_time:.1f} s; second launch peak {second_peak:.2f} GB (PSS {second_pss:.2f}), "
                      f"step 1 at {second_time:.1f} s (second/first {second_time / first_time:.2f}, goal <= 0.5)",
                      flush=True)
                shutil.rmtree(cache, ignore_errors=True)
            ours = store_throughput(root / "ws" / "corpus", root / "cache-throughput")
            line = f"{size:g} MB: store tokenization {ours / 1e6:.1f} MB/s"
            if args.map:
                theirs = datasets_map_throughput(root / "ws" / "corpus", root / "hf-cache")
                line += f", datasets.map(num_proc={os.cpu_count()}) {theirs / 1e6:.1f} MB/s " \
                        f"(ratio {ours / theirs:.2f}, goal >= 0.9)"
            print(line, flush=True)
        smallest = min(args.sizes)
        for (size, nproc), peak in sorted(peaks.items()):
            base, share, base_share = peaks[(smallest, nproc)], shares[(size, nproc)], shares[(smallest, nproc)]
            print(f"peak at {size:g} MB / at {smallest:g} MB, {nproc} rank(s): {peak / base:.2f} RSS, "
                  f"{share / base_share:.2f} PSS (goal <= 1.25 + 0.3 GB: {share <= 1.25 * base_share + 0.3})")
        if (smallest, 1) in peaks and (smallest, 2) in peaks:
            print(f"two ranks / one rank at {smallest:g} MB: {peaks[(smallest, 2)] / peaks[(smallest, 1)]:.2f} RSS, "
                  f"{shares[(smallest, 2)] / shares[(smallest, 1)]:.2f} PSS (goal <= 2)")


def streaming(sizes: list[float], ranks: list[int], steps: int) -> None:
    """One data.streaming launch per size and rank count: peak memory, time to step 1, the cache
    left empty; then each peak against the smallest size's."""
    peaks: dict[tuple[float, int], float] = {}
    with tempfile.TemporaryDirectory(prefix="data-scale-") as tmp:
        root = Path(tmp)
        recipe = copy_template(root / "ws", "lm")
        for size in sizes:
            write_corpus(root / "ws" / "corpus", size)
            for nproc in ranks:
                cache = root / f"cache-{size}-{nproc}"
                _, peak, first = launch(root / "ws", recipe, nproc, cache, "data.streaming=true", f"train.max_steps={steps}")
                peaks[(size, nproc)] = peak
                cached = sorted(p.name for p in cache.iterdir()) if cache.is_dir() else []
                print(f"streaming, {size:g} MB, {nproc} rank(s), {steps} steps: peak {peak:.2f} GB (PSS), step 1 at "
                      f"{first:.1f} s, data cache {cached or 'empty'}", flush=True)
        smallest = min(sizes)
        for (size, nproc), peak in sorted(peaks.items()):
            print(f"streaming peak at {size:g} MB / at {smallest:g} MB, {nproc} rank(s): "
                  f"{peak / peaks[(smallest, nproc)]:.2f} (goal <= 1.25 + 0.3 GB: {peak <= 1.25 * peaks[(smallest, nproc)] + 0.3})")


if __name__ == "__main__":
    main()
