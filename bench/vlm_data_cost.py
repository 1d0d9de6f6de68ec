"""What a token store would save the ``vlm_chat`` template: where encoding an example's time goes,
and what a piece holds in memory.

``vlm_chat`` encodes every example before its first step (``encode``: the chat template rendered
turn by turn to find the assistant's spans, then the processor, which tokenizes the text and
decodes, resizes and normalises the images); a piece keeps its tokens and image references, and
keeps its image tensors while they fit in ``KEPT_IMAGE_BYTES``, beyond which each batch processes
its images again (``image_inputs``). A
token store (``engine/token_store.py``) keeps token rows and loss masks: on a second launch it
saves the rendering and the tokenizing, not the images' processing, which is needed for every
batch either way. This prints, per example of the template's built-in questions with images of
``--width`` × ``--height`` pixels, under LLaVA-1.5's image processing (shortest edge 336, centre
crop 336, 14-pixel patches: 576 image tokens; a tiny random LLaVA otherwise, built offline):

- the time of ``encode`` per example, of its template rendering, of tokenizing the rendered text,
  and the rest (the images' processing, offsets and masks), each round printed;
- the bytes of image tensors a batch makes per piece (what a piece kept before it kept
  references) and the time to make them, against its token row and targets as int32.

    python bench/vlm_data_cost.py [--examples 40] [--rounds 3]

With ``--memory``, what a run holds as its data grows: the template launched (``python -m
engine.launch``, one process, ``--steps`` steps of ``--batch`` questions) on LLaVA conversations
of 200 and 2,000 JPEG images of ``--width`` × ``--height`` (``--images``), under LLaVA-1.5's
image processing (a tiny random LLaVA whose CLIP tower takes 336 px in patches of 14, built
offline), by the template as it is ("after") and by its ``recipe.py`` at ``--before REV`` (the
code that kept every example's image tensors), interleaved in each round, every run printed:
the peak of the run's processes' summed RSS and PSS (sampled from /proc every 100 ms, as
``bench/data_scale.py``), seconds to the first step, and steady steps/s (the median of the
logging windows' ``step_time_s`` after the first). Then, per round, the peak at the largest size
over the smallest for each side and after/before at each size, and steps/s after/before.

    python bench/vlm_data_cost.py --memory [--images 200 2000] [--rounds 2] [--steps 30] [--before 4ce60db]

With ``--check``, the launch check's data summary (``summarize_data``) of LLaVA conversations of
``--images`` JPEGs (the first number given) under that LLaVA-1.5 processing: by ``recipe.py`` at
``--before REV`` ("before": the count from the images' sizes, nothing kept), by the template as it
is at a first launch ("first": every example encoded into the token store, each picture decoded)
and at a second ("second": the store reused), in a fresh data cache each round, interleaved: the
CPU seconds of this process each takes (the machine may be shared), the token counts checked
equal, and first/before and second/before.

    python bench/vlm_data_cost.py --check --images 300 [--rounds 3] [--before REV]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--width", type=int, default=640)
    parser.add_argument("--height", type=int, default=480)
    parser.add_argument("--memory", action="store_true", help="peak memory and steps/s of runs, before and after")
    parser.add_argument("--images", type=int, nargs="+", default=[200, 2000])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--before", default="4ce60db", help="the revision whose recipe.py is the 'before' side")
    parser.add_argument("--check", action="store_true", help="the launch check's data summary: before, at a first "
                                                              "launch (the store built) and a second (reused)")
    args = parser.parse_args()
    if args.memory:
        memory(args)
        return
    if args.check:
        check(args)
        return

    from PIL import Image
    from transformers import CLIPImageProcessorPil

    from engine.chat import assistant_spans
    from recipes_template.vlm_chat import recipe as vlm
    from tests.vlm_families import tiny_vlm_folder

    with tempfile.TemporaryDirectory() as scratch:
        processor = vlm.load_processor(str(tiny_vlm_folder(Path(scratch) / "llava", "llava")))
    processor.image_processor = CLIPImageProcessorPil(size={"shortest_edge": 336}, crop_size={"height": 336, "width": 336})
    processor.patch_size = 14
    rng = np.random.default_rng(0)
    examples = [(where, messages, [Image.fromarray(rng.integers(0, 255, (args.height, args.width, 3), dtype=np.uint8))
                                   for _ in images])
                for where, messages, images in vlm.builtin_examples(args.examples, 56)]
    shares = []
    for round_ in range(1, args.rounds + 1):
        rendering = tokenizing = encoding = batching = 0.0
        held = tokens = 0
        for where, messages, images in examples:
            start = time.perf_counter()
            text, _ = assistant_spans(processor, messages, where)
            rendered = time.perf_counter()
            processor.tokenizer(text)
            tokenized = time.perf_counter()
            piece = vlm.encode(processor, messages, images, 4096, where)
            encoding += time.perf_counter() - tokenized
            rendering += rendered - start
            tokenizing += tokenized - rendered
            drawn = time.perf_counter()
            beyond = vlm.keep_image_inputs([piece], 0)[0]  # a piece beyond the kept bytes: processed per batch
            held += sum(v.numel() * v.element_size() for v in vlm.image_inputs(processor, beyond).values())
            batching += time.perf_counter() - drawn
            tokens += len(piece["ids"])
        n = len(examples)
        shares.append((rendering + tokenizing) / encoding)
        print(f"round {round_}: encode {1000 * encoding / n:.1f} ms/example: template rendering "
              f"{1000 * rendering / n:.1f} ms, tokenizing {1000 * tokenizing / n:.2f} ms, the rest (images, offsets, "
              f"masks) {1000 * (encoding - rendering - tokenizing) / n:.1f} ms; per piece {held / n / 1e6:.2f} MB of batch "
              f"image tensors ({1000 * batching / n:.1f} ms to make), {8 * tokens / n / 1e3:.1f} KB of token row and targets "
              "(int32)", flush=True)
    print(f"what a store saves of encoding (rendering + tokenizing / encode), median of {len(shares)} rounds: "
          f"{sorted(shares)[len(shares) // 2]:.1%}")



def llava_336(folder: Path) -> Path:
    """A tiny random LLaVA 1.5 whose processor and CLIP tower are LLaVA-1.5's shape: shortest edge
    336, centre crop 336, patches of 14 (576 image tokens); the language model of tests/vlm_families.py."""
    from transformers import (CLIPImageProcessorPil, CLIPVisionConfig, LlamaConfig, LlavaConfig,
                              LlavaForConditionalGeneration, LlavaProcessor)

    from tests.model_families import bpe_tokenizer
    from tests.vlm_families import LLAVA_TEMPLATE, TEXT

    tokenizer = bpe_tokenizer(["<unk>", "<s>", "</s>", "<image>"], "</s>", LLAVA_TEMPLATE)
    tokenizer.pad_token = "<unk>"
    image_processor = CLIPImageProcessorPil(size={"shortest_edge": 336}, crop_size={"height": 336, "width": 336})
    processor = LlavaProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=14,
                               vision_feature_select_strategy="default", num_additional_image_tokens=1,
                               chat_template=LLAVA_TEMPLATE)
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                              image_size=336, patch_size=14, projection_dim=32)
    text = LlamaConfig(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                       bos_token_id=tokenizer.bos_token_id, **TEXT)
    config = LlavaConfig(vision_config=vision, text_config=text, image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
                         image_seq_length=576, vision_feature_select_strategy="default", vision_feature_layer=-2)
    import torch

    torch.manual_seed(0)
    LlavaForConditionalGeneration(config).save_pretrained(folder)
    processor.save_pretrained(folder)
    return folder


def write_images(folder: Path, count: int, width: int, height: int) -> Path:
    """``count`` JPEG photos-to-be (a coloured square on a noisy background) and their LLaVA JSONL."""
    from PIL import Image

    from recipes_template.vlm_chat import recipe as vlm

    (folder / "images").mkdir(parents=True, exist_ok=True)
    records = []
    for i in range(count):
        rng = np.random.default_rng(i)
        colour = list(vlm.COLOURS)[i % len(vlm.COLOURS)]
        image = rng.integers(0, 40, (height, width, 3)).astype(np.uint8)
        x, y = rng.integers(0, min(width, height) // 2, 2)
        image[y:y + height // 3, x:x + width // 3] = vlm.COLOURS[colour]
        Image.fromarray(image).save(folder / "images" / f"{i}.jpg", quality=90)
        records.append({"image": f"images/{i}.jpg", "conversations": [
            {"from": "human", "value": f"<image>\n{vlm.QUESTION}"}, {"from": "gpt", "value": colour}]})
    data = folder / f"data-{count}.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    return data


def measured_run(workspace: Path, recipe: Path, *overrides: str) -> tuple[float, float, float, float]:
    """(peak GB of the run's summed RSS, of its summed PSS, seconds to the first step, steady steps/s)."""
    from bench.data_scale import tree_memory
    from engine import run_metrics
    from engine.run_dir import METRICS_JSONL
    from tests.support import engine_command, engine_env, existing_runs, new_run_dirs

    before = existing_runs(workspace)
    start = time.monotonic()
    log = open(workspace / "run.log", "w+b")  # a file: a run's stderr could fill a pipe before it ends
    process = subprocess.Popen(engine_command(recipe, *overrides), cwd=workspace, env=engine_env(),
                               stdout=subprocess.DEVNULL, stderr=log)
    peak = peak_pss = 0
    first_step = None
    while process.poll() is None:
        rss, pss = tree_memory(process.pid)
        peak, peak_pss = max(peak, rss), max(peak_pss, pss)
        if first_step is None:
            runs = new_run_dirs(workspace, before)
            if runs and (runs[0] / METRICS_JSONL).is_file() and run_metrics.latest_metrics(runs[0] / METRICS_JSONL):
                first_step = time.monotonic() - start
        time.sleep(0.1)  # the peak is a plateau (the data held); sampling /proc costs the run CPU
    if process.returncode != 0:
        raise SystemExit(f"the run failed ({process.returncode}): {(workspace / 'run.log').read_text()[-3000:]}")
    log.close()
    records = [json.loads(line) for line in (new_run_dirs(workspace, before)[0] / METRICS_JSONL).read_text().splitlines()]
    windows = sorted(r["step_time_s"] for r in records[1:] if r.get("step_time_s"))
    return peak / 1e9, peak_pss / 1e9, first_step or time.monotonic() - start, 1 / windows[len(windows) // 2]


def memory(args) -> None:
    scratch = Path(tempfile.mkdtemp(prefix="vlm-data-memory-"))
    workspace = scratch / "workspace"
    workspace.mkdir()
    llava_336(workspace / "llava-336")
    recipes = {side: shutil.copytree(REPO / "recipes_template" / "vlm_chat", workspace / side,
                                     ignore=shutil.ignore_patterns("__pycache__")) for side in ("after", "before")}
    old = subprocess.run(["git", "-C", str(REPO), "show", f"{args.before}:recipes_template/vlm_chat/recipe.py"],
                         check=True, capture_output=True, text=True).stdout
    (recipes["before"] / "recipe.py").write_text(old)
    data = {count: write_images(workspace / "data", count, args.width, args.height) for count in args.images}
    settings = ("model.pretrained_path=llava-336", "data.seq_len=640", f"data.batch_size={args.batch}",
                "data.eval_fraction=0", f"train.max_steps={args.steps}", "train.log_every=5", "train.eval_every=0",
                "checkpoint.every=0", "metrics.tensorboard=false")
    print(f"{len(args.images)} sizes of {args.width} x {args.height} JPEG images, {args.steps} steps of {args.batch}; "
          f"before: recipe.py at {args.before}", flush=True)
    for round_ in range(1, args.rounds + 1):
        results = {}
        for count in args.images:
            for side in ("before", "after") if round_ % 2 else ("after", "before"):
                rss, pss, first, speed = measured_run(workspace, recipes[side], *settings,
                                                      f"data.paths=[{data[count].relative_to(workspace)}]")
                results[side, count] = (rss, pss, speed)
                print(f"round {round_}, {count} images, {side}: peak RSS {rss:.2f} GB, PSS {pss:.2f} GB, "
                      f"first step at {first:.1f} s, {speed:.2f} steps/s", flush=True)
        small, large = min(args.images), max(args.images)
        for side in ("before", "after") if large > small else ():
            print(f"round {round_}, {side}: peak PSS at {large} / at {small} images "
                  f"{results[side, large][1] / results[side, small][1]:.2f}", flush=True)
        for count in args.images:
            print(f"round {round_}, {count} images, after / before: peak PSS "
                  f"{results['after', count][1] / results['before', count][1]:.2f}, steps/s "
                  f"{results['after', count][2] / results['before', count][2]:.2f}", flush=True)
    shutil.rmtree(scratch, ignore_errors=True)


def check(args) -> None:
    import importlib.util

    from engine.data_files import WORKSPACE_VARIABLE
    from engine.token_store import CACHE_VARIABLE
    from recipes_template.vlm_chat import recipe as vlm

    scratch = Path(tempfile.mkdtemp(prefix="vlm-data-check-"))
    count = args.images[0]
    data = write_images(scratch, count, args.width, args.height)
    old_source = subprocess.run(["git", "-C", str(REPO), "show", f"{args.before}:recipes_template/vlm_chat/recipe.py"],
                                check=True, capture_output=True, text=True).stdout
    (scratch / "before_recipe.py").write_text(old_source)
    spec = importlib.util.spec_from_file_location("before_recipe", scratch / "before_recipe.py")
    before = importlib.util.module_from_spec(spec)
    sys.modules["before_recipe"] = before
    spec.loader.exec_module(before)
    model = str(llava_336(scratch / "llava-336"))
    configs = {side: module.VLMChatConfig(model=module.ModelConfig(pretrained_path=model),
                                          data=module.VLMChatDataConfig(paths=[str(data)], seq_len=640))
               for side, module in (("before", before), ("first", vlm), ("second", vlm))}
    os.environ[WORKSPACE_VARIABLE] = str(scratch)
    print(f"the data summary of {count} JPEG images of {args.width} x {args.height}, LLaVA-1.5's processing; "
          f"before: recipe.py at {args.before}", flush=True)
    for round_ in range(1, args.rounds + 1):
        os.environ[CACHE_VARIABLE] = str(scratch / f"cache-{round_}")  # each round's first launch builds its store
        seconds, summaries = {}, {}
        for side in ("before", "first", "second") if round_ % 2 else ("first", "second", "before"):
            module = before if side == "before" else vlm
            start = time.process_time()
            summaries[side] = module.VLMChat.summarize_data(configs[side])
            seconds[side] = time.process_time() - start
            print(f"round {round_}, {side}: {seconds[side]:.2f} CPU s, {summaries[side].tokens} tokens", flush=True)
        if not summaries["first"].tokens == summaries["second"].tokens == summaries["before"].tokens:
            raise SystemExit(f"the summaries differ: {summaries}")
        print(f"round {round_}: first launch / before {seconds['first'] / seconds['before']:.2f}, "
              f"second launch / before {seconds['second'] / seconds['before']:.2f}", flush=True)
    shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
