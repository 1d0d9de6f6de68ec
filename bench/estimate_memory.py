"""estimate_run's peak memory (and step time) against what a real run measures, on a CPU.

For the causal_lm, sft and vlm templates at three sizes, each without and with the
gradient-checkpointing skill: the estimate (``python -m engine.launch RECIPE --check --estimate
cpu``: the model on the meta device, engine/estimate.py) and the largest ``peak_mem_mb`` of a real
run of the same config (``python -m engine.launch``, a few steps, no checkpoints). Prints both
per case, their ratio, the estimated and the measured median step time, and what checkpointing
changed in each.

``--models``: the models users bring. The sft template with ``model.pretrained_path`` = a random
model folder of two families (``tests/model_families.py``: llama at hidden 512, 4 layers; qwen2 at
hidden 384, 6 layers; the vocabulary their tokenizer gives) and the same model as a Hub id
(``org/<family>-tiny``, served on 127.0.0.1 by ``tests/fake_hub.py`` into a Hugging Face cache the
bench writes, resolved as the server resolves it: the estimate with ``weights=False``, its
config and tokenizer only, the run with its weights; by default only the plain variant, the
other variants load the same files), at two ``data.seq_len`` (conversations
longer than both, so every row is that long), plain, +gradient-checkpointing, +lora and +qlora.
Per case: estimate, measured peak, ratio, and the cases outside 0.85–1.15; per family and
variant, the estimate's growth from the short to the long rows against the measured growth;
the Hub id's estimate against the folder's. On a CPU the measured peak is the resident set's, which
with glibc's default allocator keeps freed activations in the heap; ``--malloc-mmap-threshold
262144`` fixes the threshold in every check and run (``TRAINWRIGHT_MMAP_THRESHOLD``,
engine/memory.py), so that freed tensors go back at once and the resident set follows the live
bytes the estimate counts (as ``max_memory_allocated`` does on a GPU).

``--vlm``: the vlm_chat template with a model folder of Qwen2-VL and LLaVA 1.5
(``tests/vlm_families.py``, the language model at hidden 512, 4 layers; the vision towers tiny),
every part training, over LLaVA records of one image each (``--image-sizes``: Qwen's grid gives 1
token for 28 pixels, 4 for 56; LLaVA's CLIP always 16) and answers longer than ``data.seq_len``.
``--vlm-variants lora``: the lora skill applied (adapters in the language model alone), measured
against two estimates: the check's of the recipe with the skill applied, and the LoRA change
estimate_run offers for the recipe as it is (``estimate_memory(..., adapters="lora")`` on its
measured shape, in a process of its own as the check is). ``--vision-sized``: vision towers as
wide and deep as the language model (:data:`VLM_VISION`), so that the tower's share shows.

    python bench/estimate_memory.py [--steps 3] [--templates causal_lm sft vlm] [--sizes small medium large]
    python bench/estimate_memory.py --models [--steps 2] [--families llama qwen2] [--seq-lens 256 1024]
        [--variants plain ckpt lora qlora] [--sources folder hub] [--hub-variants plain]
        [--malloc-mmap-threshold 65536]
    python bench/estimate_memory.py --vlm [--steps 2] [--vlm-families qwen2_vl llava] [--image-sizes 28 56]
        [--seq-lens 256 1024] [--vlm-variants plain lora] [--vision-sized]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from engine import run_dir as rd  # noqa: E402
from engine import run_metrics  # noqa: E402
from engine.memory import MMAP_THRESHOLD_VARIABLE  # noqa: E402

QUIET = ("checkpoint.every=0", "checkpoint.at_end=false", "metrics.tensorboard=false", "train.log_every=1")
SIZES = {
    "small": ("model.hidden_size=64", "model.intermediate_size=160", "model.num_layers=2"),
    "medium": ("model.hidden_size=256", "model.intermediate_size=688", "model.num_layers=4"),
    "large": ("model.hidden_size=512", "model.intermediate_size=1376", "model.num_layers=8"),
}
SHAPES = {  # activations that matter beside the weights
    "causal_lm": ("data.seq_len=256", "data.batch_size=8"),
    "sft": ("data.seq_len=256", "data.batch_size=8"),
    "vlm": ("data.seq_len=64", "data.batch_size=16"),
}


def recipe(template: str, checkpointing: bool, root: Path) -> Path:
    folder = root / f"{template}{'-ckpt' if checkpointing else ''}"
    if not folder.exists():
        shutil.copytree(REPO / "recipes_template" / template, folder, ignore=shutil.ignore_patterns("__pycache__"))
        if checkpointing:
            from skills import apply_skill

            apply_skill("gradient-checkpointing", folder)
    return folder


MALLOC_THRESHOLD: int | None = None  # --malloc-mmap-threshold


def environment() -> dict[str, str]:
    allocator = {MMAP_THRESHOLD_VARIABLE: str(MALLOC_THRESHOLD)} if MALLOC_THRESHOLD else {}
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **allocator}


def estimated(folder: Path, settings: list[str], cwd: Path) -> dict:
    command = [sys.executable, "-m", "engine.launch", str(folder), "--check", "--estimate", "cpu",
               *(f"--set={s}" for s in settings)]
    done = subprocess.run(command, cwd=cwd, env=environment(), capture_output=True, text=True, timeout=600)
    for line in reversed(done.stdout.splitlines()):
        if line.startswith("{"):
            verdict = json.loads(line)
            if not verdict.get("ok"):
                raise SystemExit(f"check failed: {verdict.get('error')}")
            return verdict["estimate"]
    raise SystemExit(f"no verdict:\n{done.stderr[-2000:]}")


def measured_run(folder: Path, settings: list[str], cwd: Path) -> tuple[float, float]:
    """The run's largest peak_mem_mb and its median step time after the first window."""
    before = set(os.listdir(cwd / "runs")) if (cwd / "runs").is_dir() else set()
    command = [sys.executable, "-m", "engine.launch", str(folder), *(a for s in settings for a in ("--set", s))]
    done = subprocess.run(command, cwd=cwd, env=environment(), capture_output=True, text=True, timeout=1200)
    if done.returncode:
        raise SystemExit(f"run failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    (run,) = set(os.listdir(cwd / "runs")) - before
    records = [r for r in run_metrics.read_all_metrics(cwd / "runs" / run / rd.METRICS_JSONL) if "peak_mem_mb" in r]
    return max(r["peak_mem_mb"] for r in records), statistics.median(r["step_time_s"] for r in records[1:] or records)


# --models: the sft template with a model folder or Hub id of two families (tests/model_families.py).
FAMILIES = {  # sized so that weights and activations stand out above the process's floor
    "llama": {"hidden_size": 512, "intermediate_size": 1376, "num_hidden_layers": 4, "num_attention_heads": 8,
              "num_key_value_heads": 4},
    "qwen2": {"hidden_size": 384, "intermediate_size": 1024, "num_hidden_layers": 6, "num_attention_heads": 6,
              "num_key_value_heads": 2},
}
VARIANTS = {"plain": None, "ckpt": "gradient-checkpointing", "lora": "lora", "qlora": "qlora"}
MODEL_RUN = ("data.paths=[\"data/long.jsonl\"]", "data.batch_size=2", "optim.warmup_steps=0")
GOAL = (0.85, 1.15)


def long_conversations(path: Path, count: int = 24) -> Path:
    """Conversations whose assistant turn is longer than any data.seq_len measured: every row
    the run trains on is data.seq_len tokens long, as the estimate assumes."""
    from tests.model_families import CORPUS

    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for index in range(count):
            answer = " ".join(CORPUS[(index + k) % 4] for k in range(120))
            f.write(json.dumps({"messages": [{"role": "user", "content": f"Tell me story {index}."},
                                             {"role": "assistant", "content": answer}]}) + "\n")
    return path


def model_folder(family: str, root: Path, longest: int) -> Path:
    from transformers import AutoTokenizer

    from tests.model_families import tiny_model_folder

    folder = tiny_model_folder(root / "models" / family, family, max_position_embeddings=2 * longest,
                               **FAMILIES[family])
    data = json.loads((root / "data" / "long.jsonl").read_text().splitlines()[0])
    tokens = AutoTokenizer.from_pretrained(folder).apply_chat_template(data["messages"], tokenize=True)
    length = len(tokens["input_ids"] if hasattr(tokens, "keys") else tokens)
    if length <= longest + 1:
        raise SystemExit(f"the conversations are {length} tokens with {family}'s tokenizer: not longer than {longest}")
    return folder


def model_recipe(variant: str, root: Path) -> Path:
    folder = root / "recipes" / variant
    if not folder.exists():
        shutil.copytree(REPO / "recipes_template" / "sft", folder, ignore=shutil.ignore_patterns("__pycache__"))
        if VARIANTS[variant]:
            from skills import apply_skill

            apply_skill(VARIANTS[variant], folder)
    return folder


def bound(root: Path, hub_id: str, weights: bool) -> dict[str, str]:
    """The environment a run of ``hub_id`` gets from the server: the snapshot resolved (with or
    without its weights) and mapped, offline."""
    from runner import hub

    binding = hub.bind(root, hub_id, weights=weights)
    (model,) = binding.models
    held = sorted(p.name for p in Path(model.path).glob("*.safetensors"))
    if bool(held) != weights:
        raise SystemExit(f"{hub_id} resolved with weights={weights} holds {held or 'no weights'}")
    return binding.env()


def models_main(args: argparse.Namespace) -> None:
    from engine.data_files import WORKSPACE_VARIABLE
    from tests.fake_hub import FakeHub

    print(f"load average {os.getloadavg()[0]:.2f}; one thread per run; sft template, {args.steps} steps, "
          f"batch 2; goal {GOAL[0]}–{GOAL[1]}; glibc mmap threshold "
          f"{f'{MALLOC_THRESHOLD:,} B ({MMAP_THRESHOLD_VARIABLE})' if MALLOC_THRESHOLD else 'dynamic (the default)'}")
    print(f"{'case':<30}{'estimate MB':>12}{'measured MB':>12}{'ratio':>7}   estimate: floor / weights+grads+"
          "optimizer / activations MB")
    rows: dict[tuple[str, str, int, str], tuple[float, float]] = {}
    estimates: dict[tuple[str, str, int, str], dict] = {}
    with tempfile.TemporaryDirectory(prefix="trainwright-estimate-models-") as scratch:
        root = Path(scratch)
        long_conversations(root / "data" / "long.jsonl")
        server = FakeHub()
        saved = {k: os.environ.get(k) for k in ("HF_ENDPOINT", "HF_HUB_CACHE", "HF_HUB_OFFLINE", "HF_TOKEN")}
        os.environ.update(HF_ENDPOINT=server.start(), HF_HUB_CACHE=str(root / "hf-cache"), HF_HUB_DISABLE_TELEMETRY="1")
        os.environ.pop("HF_HUB_OFFLINE", None), os.environ.pop("HF_TOKEN", None)
        try:
            for family in args.families:
                folder = model_folder(family, root, max(args.seq_lens))
                hub_id = f"org/{family}-tiny"
                server.add(hub_id, folder)
                names = {"folder": str(folder.relative_to(root)), "hub": hub_id}
                cases = [(source, seq, variant) for seq in args.seq_lens for variant in args.variants
                         for source in args.sources if source == "folder" or variant in args.hub_variants]
                # Every estimate first: the Hub id's from its config and tokenizer, the weights not downloaded yet.
                extra = {"folder": {}, "hub": bound(root, hub_id, weights=False) if "hub" in args.sources else {}}
                for source, seq, variant in cases:
                    settings = [*QUIET, *MODEL_RUN, f"model.pretrained_path={names[source]}", f"data.seq_len={seq}",
                                f"train.max_steps={args.steps}"]
                    os.environ.update(extra[source], **{WORKSPACE_VARIABLE: str(root)})
                    estimates[family, source, seq, variant] = estimated(model_recipe(variant, root), settings, root)
                    for key in extra[source]:
                        os.environ.pop(key)
                extra["hub"] = bound(root, hub_id, weights=True) if "hub" in args.sources else {}
                for source, seq, variant in cases:
                    settings = [*QUIET, *MODEL_RUN, f"model.pretrained_path={names[source]}", f"data.seq_len={seq}",
                                f"train.max_steps={args.steps}"]
                    os.environ.update(extra[source], **{WORKSPACE_VARIABLE: str(root)})
                    measured, _ = measured_run(model_recipe(variant, root), settings, root)
                    for key in extra[source]:
                        os.environ.pop(key)
                    memory = estimates[family, source, seq, variant]["memory_gib"]
                    estimate = memory["peak_gib"] * 1024
                    rows[family, source, seq, variant] = (estimate, measured)
                    state = sum(memory[k] for k in ("params", "grads", "optimizer", "gathered")) * 1024
                    name = f"{family} {source} {seq} {variant}"
                    flag = "" if GOAL[0] <= estimate / measured <= GOAL[1] else "  MISS"
                    print(f"{name:<30}{estimate:>12,.0f}{measured:>12,.0f}{estimate / measured:>7.2f}   "
                          f"{memory['floor'] * 1024:,.0f} / {state:,.0f} / {memory['activations'] * 1024:,.0f}{flag}",
                          flush=True)
        finally:
            server.stop()
            for key, value in saved.items():
                os.environ.pop(key, None) if value is None else os.environ.__setitem__(key, value)
            os.environ.pop(WORKSPACE_VARIABLE, None)
    summarise(rows, estimates, args)


# --vlm: the vlm_chat template with a model folder of two image-text-to-text families
# (tests/vlm_families.py), its language model sized as --models' llama, every part training.
VLM_FAMILIES = ("qwen2_vl", "llava")
VLM_TEXT = {"hidden_size": 512, "intermediate_size": 1376, "num_hidden_layers": 4, "num_attention_heads": 8,
            "num_key_value_heads": 4}
# --vision-sized: each family's vision tower as wide and deep as that language model, so that
# what it saves (or, frozen, does not) shows beside the language model's activations.
VLM_VISION = {"llava": {"hidden_size": 512, "intermediate_size": 2048, "num_hidden_layers": 4, "num_attention_heads": 8},
              "qwen2_vl": {"embed_dim": 512, "mlp_ratio": 4, "depth": 4, "num_heads": 8}}
VLM_RUN = ("data.paths=[\"data/vlm.json\"]", "data.batch_size=4", "data.eval_fraction=0", "optim.warmup_steps=0",
           "model.train_vision_tower=true", "train.eval_every=0")


def vlm_data(path: Path, side: int, count: int = 16) -> Path:
    """LLaVA records, an image of ``side`` pixels each, whose answers are longer than any
    data.seq_len measured: every row is data.seq_len tokens long, as the estimate assumes."""
    from PIL import Image

    from tests.model_families import CORPUS

    path.parent.mkdir(parents=True, exist_ok=True)
    records = []
    for index in range(count):
        Image.new("RGB", (side, side), (40 * (index % 6), 90, 200)).save(path.parent / f"{side}-{index}.png")
        answer = " ".join(CORPUS[(index + k) % 4] for k in range(120))
        records.append({"image": f"{side}-{index}.png", "conversations": [
            {"from": "human", "value": "<image>\nDescribe the picture."}, {"from": "gpt", "value": answer}]})
    path.write_text(json.dumps(records))
    return path


def lora_change(folder: Path, settings: list[str], cwd: Path) -> dict:
    """estimate_run's ``apply_skill lora`` change for the recipe at ``folder`` as it is, its
    ``memory_gib`` estimated alone (the check lists it only beside other changes), in a process of
    its own."""
    command = [sys.executable, str(Path(__file__).resolve()), "--lora-change-of", str(folder), *settings]
    done = subprocess.run(command, cwd=cwd, env=environment(), capture_output=True, text=True, timeout=600)
    if done.returncode:
        raise SystemExit(f"the LoRA change's estimate failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.splitlines()[-1])


def print_lora_change(folder: str, settings: list[str]) -> None:
    from engine.estimate import estimate_memory, measure_shape
    from engine.launch import load_recipe_class, resolve_config
    from engine.memory import follow_live_memory

    follow_live_memory()  # as the check does before its estimate
    recipe_class = load_recipe_class(Path(folder))
    config = resolve_config(recipe_class, Path(folder), settings, None)
    shape = measure_shape(recipe_class, config, 1)
    print(json.dumps(estimate_memory(shape, 1, config.parallel, "cpu", adapters="lora")))


def vlm_recipe(variant: str, root: Path) -> Path:
    folder = root / "recipes" / f"vlm_chat-{variant}"
    if not folder.exists():
        shutil.copytree(REPO / "recipes_template" / "vlm_chat", folder, ignore=shutil.ignore_patterns("__pycache__"))
        if variant == "lora":
            from skills import apply_skill

            apply_skill("lora", folder)
    return folder


def vlm_main(args: argparse.Namespace) -> None:
    from engine.data_files import WORKSPACE_VARIABLE
    from tests.vlm_families import tiny_vlm_folder

    print(f"load average {os.getloadavg()[0]:.2f}; one thread per run; vlm_chat template, {args.steps} steps, "
          f"batch 4, every part training; goal {GOAL[0]}–{GOAL[1]}")
    print(f"{'case':<30}{'estimate MB':>12}{'measured MB':>12}{'ratio':>7}   estimate: floor / weights+grads+"
          "optimizer / activations MB")
    rows = {}
    with tempfile.TemporaryDirectory(prefix="trainwright-estimate-vlm-") as scratch:
        root = Path(scratch)
        os.environ[WORKSPACE_VARIABLE] = str(root)
        try:
            for family in args.vlm_families:
                model = tiny_vlm_folder(root / "models" / family, family, text=VLM_TEXT,
                                        vision=VLM_VISION[family] if args.vision_sized else None)
                for side in args.image_sizes:
                    for seq, variant in ((seq, variant) for seq in args.seq_lens for variant in args.vlm_variants):
                        vlm_data(root / "data" / "vlm.json", side)
                        settings = [*QUIET, *VLM_RUN, f"model.pretrained_path={model}", f"data.seq_len={seq}",
                                    f"train.max_steps={args.steps}"]
                        folder = vlm_recipe(variant, root)
                        memory = estimated(folder, settings, root)["memory_gib"]
                        measured, _ = measured_run(folder, settings, root)
                        estimate = memory["peak_gib"] * 1024
                        rows[family, side, seq, variant] = (estimate, measured)
                        state = sum(memory[k] for k in ("params", "grads", "optimizer", "gathered")) * 1024
                        flag = "" if GOAL[0] <= estimate / measured <= GOAL[1] else "  MISS"
                        print(f"{f'{family} {side}px {seq} {variant}':<30}{estimate:>12,.0f}{measured:>12,.0f}"
                              f"{estimate / measured:>7.2f}   {memory['floor'] * 1024:,.0f} / {state:,.0f} / "
                              f"{memory['activations'] * 1024:,.0f}{flag}", flush=True)
                        if variant == "lora":
                            memory = lora_change(vlm_recipe("plain", root), settings, root)
                            change = memory["peak_gib"] * 1024
                            rows[family, side, seq, "lora change"] = (change, measured)
                            state = sum(memory[k] for k in ("params", "grads", "optimizer", "gathered")) * 1024
                            flag = "" if GOAL[0] <= change / measured <= GOAL[1] else "  MISS"
                            print(f"{f'{family} {side}px {seq} lora change':<30}{change:>12,.0f}{measured:>12,.0f}"
                                  f"{change / measured:>7.2f}   {memory['floor'] * 1024:,.0f} / {state:,.0f} / "
                                  f"{memory['activations'] * 1024:,.1f} (estimate_run's apply_skill lora row for the "
                                  f"plain recipe){flag}", flush=True)
        finally:
            os.environ.pop(WORKSPACE_VARIABLE, None)
    ratios = [e / m for e, m in rows.values()]
    print(f"ratio {min(ratios):.2f}–{max(ratios):.2f} over {len(rows)} cases")


def summarise(rows: dict, estimates: dict, args: argparse.Namespace) -> None:
    misses = [f"{' '.join(map(str, key))} ({e / m:.2f})" for key, (e, m) in rows.items() if not GOAL[0] <= e / m <= GOAL[1]]
    ratios = [e / m for e, m in rows.values()]
    print(f"ratio {min(ratios):.2f}–{max(ratios):.2f} over {len(rows)} cases; outside {GOAL[0]}–{GOAL[1]}: "
          f"{', '.join(misses) or 'none'}")
    short, long = min(args.seq_lens), max(args.seq_lens)
    if short != long:
        print(f"growth from data.seq_len {short} to {long}, estimate vs measured:")
        for (family, source, seq, variant), (estimate, measured) in rows.items():
            if seq == long and (family, source, short, variant) in rows:
                e0, m0 = rows[family, source, short, variant]
                print(f"  {family} {source} {variant:<6} {estimate - e0:+,.0f} vs {measured - m0:+,.0f} MB")
    if "hub" in args.sources and "folder" in args.sources:
        print("Hub id vs folder, the estimate without the floor (the same config: equal) and the floor (the resident "
              "set of each check process):")
        for (family, source, seq, variant), figures in estimates.items():
            if source == "hub" and (family, "folder", seq, variant) in estimates:
                hub_memory, folder_memory = figures["memory_gib"], estimates[family, "folder", seq, variant]["memory_gib"]
                rest = [(m["peak_gib"] - m["floor"]) * 1024 for m in (hub_memory, folder_memory)]
                print(f"  {family} {seq} {variant:<6} {rest[0]:,.1f} vs {rest[1]:,.1f} MB; floor "
                      f"{hub_memory['floor'] * 1024:,.0f} vs {folder_memory['floor'] * 1024:,.0f} MB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--templates", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--models", action="store_true", help="the sft template with model folders and Hub ids")
    parser.add_argument("--families", nargs="+", default=list(FAMILIES), choices=list(FAMILIES))
    parser.add_argument("--seq-lens", nargs="+", type=int, default=[256, 1024])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--sources", nargs="+", default=["folder", "hub"], choices=["folder", "hub"])
    parser.add_argument("--hub-variants", nargs="+", default=["plain"], choices=list(VARIANTS),
                        help="the variants also run by Hub id (the same files as the folder's)")
    parser.add_argument("--malloc-mmap-threshold", type=int, metavar="BYTES",
                        help="glibc's mmap threshold, fixed in every check and run (TRAINWRIGHT_MMAP_THRESHOLD, "
                             "engine/memory.py): larger blocks are mapped and given back when freed (by default "
                             "the threshold rises with the blocks freed, and freed activations stay in the heap)")
    parser.add_argument("--vlm", action="store_true", help="the vlm_chat template with model folders of two families")
    parser.add_argument("--vlm-families", nargs="+", default=list(VLM_FAMILIES), choices=list(VLM_FAMILIES))
    parser.add_argument("--image-sizes", nargs="+", type=int, default=[28, 56], help="--vlm: the images' side")
    parser.add_argument("--vlm-variants", nargs="+", default=["plain"], choices=["plain", "lora"],
                        help="--vlm: the recipe as it is, or with the lora skill (and estimate_run's LoRA change)")
    parser.add_argument("--vision-sized", action="store_true",
                        help="--vlm: vision towers as wide and deep as the language model (VLM_VISION), not tiny")
    parser.add_argument("--lora-change-of", metavar="RECIPE", help=argparse.SUPPRESS)  # lora_change's own process
    args, settings = parser.parse_known_args()
    if args.lora_change_of:
        return print_lora_change(args.lora_change_of, settings)
    if settings:
        parser.error(f"unrecognized arguments: {' '.join(settings)}")
    global MALLOC_THRESHOLD
    MALLOC_THRESHOLD = args.malloc_mmap_threshold
    if args.models:
        return models_main(args)
    if args.vlm:
        return vlm_main(args)
    print(f"load average {os.getloadavg()[0]:.2f}; one thread per run")
    print(f"{'case':<26}{'estimate MB':>12}{'measured MB':>12}{'ratio':>7}{'step s est/meas':>17}"
          "   checkpointing: estimate vs measured change")
    with tempfile.TemporaryDirectory(prefix="trainwright-estimate-") as scratch:
        root = Path(scratch)
        for template in args.templates:
            for size in args.sizes:
                settings = [*QUIET, *SIZES[size], *SHAPES[template], f"train.max_steps={args.steps}"]
                row = {}
                for checkpointing in (False, True):
                    folder = recipe(template, checkpointing, root)
                    figures = estimated(folder, settings, root)
                    estimate = figures["memory_gib"]["peak_gib"] * 1024
                    measured, step_s = measured_run(folder, settings, root)
                    row[checkpointing] = (estimate, measured)
                    name = f"{template} {size}{' +ckpt' if checkpointing else ''}"
                    steps = f"{figures['step_time_s'] or 0:.3f}/{step_s:.3f}"
                    print(f"{name:<26}{estimate:>12,.0f}{measured:>12,.0f}{estimate / measured:>7.2f}{steps:>17}", end="")
                    if checkpointing:
                        (e0, m0), (e1, m1) = row[False], row[True]
                        print(f"   {e1 - e0:+,.0f} MB vs {m1 - m0:+,.0f} MB", end="")
                    print(flush=True)
    print(f"load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
