"""Run the vlm template with skills applied, many variants in ONE process, for 2 steps each.

``python -m tests.skills.vlm_template_runs WORKDIR`` copies ``recipes_template/vlm`` once per
variant, applies its skills, trains it in this process (``engine.launch.main`` under
``effect_probe.run_script``'s hooks) and prints one JSON object: per variant, what apply_skill
said, the step records of metrics.jsonl, run.json's warnings, and the probe's effects (forward
counts per module class, frozen and trained parameters, checkpointed and compiled modules,
autocast). test_vlm_template_skills.py asserts on it.
"""

from __future__ import annotations

import json
import os
import time
import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TEMPLATE = REPO / "recipes_template" / "vlm"

# A tiny run: 2 layers a tower, 60 generated images, rows of 64 tokens (16 image tokens). Every
# part trains (a frozen vision tower has no backward to recompute, nothing to adapt).
SMALL = (
    "model.train_vision_tower=true",
    "model.num_layers=2",
    "model.vision_layers=2",
    "data.image_size=32",
    "model.patch_size=8",
    "data.builtin_images=60",
    "data.batch_size=8",
    "train.max_steps=2",
    "train.log_every=1",
    "train.eval_every=0",
    "checkpoint.every=0",
    "checkpoint.at_end=false",
    "metrics.tensorboard=false",
)

# Captions of 1 to 16 words (the built-in ones are all about as long): what packing is for.
FILES = ("data.paths=[data/captions.jsonl]", "data.seq_len=128")

# name → ([(skill, params)], extra settings).
VARIANTS: dict[str, tuple[list[tuple[str, dict | None]], list[str]]] = {
    "plain": ([], []),
    "gradient-checkpointing": ([("gradient-checkpointing", None)], []),
    "freeze": ([("freeze", {"parts": ["projector"]})], []),
    # The template's own stage policy freezes the vision tower already: freezing it again is no change.
    "freeze-frozen": ([("freeze", {"parts": ["vision_tower"]})], ["model.train_vision_tower=false"]),
    "lora": ([("lora", None)], []),
    "qlora": ([("qlora", None)], []),
    "plain-files": ([], list(FILES)),
    "sequence-packing": ([("sequence-packing", None)], list(FILES)),
    "mixed-precision": ([("mixed-precision", None)], []),
    "torch-compile": ([("torch-compile", None)], []),
    "muon": ([("muon", None)], []),
    # On CPU the GPU kernels stay off with a warning and the guard passes every step: losses as plain.
    "guards": ([("liger-kernel", None), ("flash-attention", None), ("loss-guard", None)], []),
}

RUNNER = """
import engine.engine
from engine.launch import main

captured = []
_run = engine.engine.Engine.run


def run(self):
    captured.append(self)
    return _run(self)


engine.engine.Engine.run = run
code = main(ARGV)
engine.engine.Engine.run = _run
model = captured[0].model if captured else None
"""


def write_captions(folder: Path, count: int = 48) -> None:
    """``data/captions.jsonl`` and its pictures: a square of one colour, captions of varied length."""
    import random

    from PIL import Image

    rng = random.Random(0)
    (folder / "data").mkdir(parents=True)
    with open(folder / "data" / "captions.jsonl", "w") as f:
        for i in range(count):
            colour = rng.choice(["red", "green", "blue"])
            Image.new("RGB", (32, 32), colour).save(folder / "data" / f"{i}.png")
            caption = " ".join([colour] + ["square"] * rng.randint(0, 15))
            f.write(json.dumps({"image": f"{i}.png", "caption": caption}) + "\n")


def run_variant(name: str, workdir: Path) -> dict:
    from engine import run_dir as rd
    from engine import run_metrics
    from skills import apply_skill
    from tests.skills.effect_probe import run_script

    started = time.perf_counter()
    skills, settings = VARIANTS[name]
    folder = workdir / name
    recipe = folder / "recipe"
    shutil.copytree(TEMPLATE, recipe, ignore=shutil.ignore_patterns("__pycache__", "runs"))
    if FILES[0] in settings:
        write_captions(folder)
    applied = []
    for skill, params in skills:
        result = apply_skill(skill, recipe, params=params)
        applied.append({"skill": skill, "changed": result.changed, "acts_on": result.acts_on, "message": result.message})
    sets = [a for s in (*SMALL, *settings) for a in ("--set", s)]
    runner = folder / "run.py"
    runner.write_text(RUNNER.replace("ARGV", repr([str(recipe), *sets])))
    os.chdir(folder)
    for key in ("MASTER_ADDR", "MASTER_PORT"):  # each run starts its own process group
        os.environ.pop(key, None)
    effects = run_script(runner)
    runs = sorted((folder / "runs").iterdir())
    records = [r for r in run_metrics.read_all_metrics(runs[-1] / rd.METRICS_JSONL) if "loss" in r]
    record = json.loads((runs[-1] / "run.json").read_text())
    engine = effects.globals["captured"][0]
    optimizer = engine.optimizer
    muon = [p for g in optimizer.param_groups if g.get("algorithm") == "muon" for p in g["params"]]
    model = engine.model
    inner = model.model
    sizes = {
        "vision_tower": sum(p.numel() for p in inner.vision_tower.parameters()),
        "projector": sum(p.numel() for p in inner.multi_modal_projector.parameters()),
        "language_model": sum(p.numel() for p in inner.language_model.parameters()) + model.lm_head.weight.numel(),
        "total": sum(p.numel() for p in model.parameters()),
    }
    return {
        "sizes": sizes,
        "seconds": round(time.perf_counter() - started, 1),
        "guard_good_steps": engine.loss_guard.good_steps if hasattr(type(engine), "loss_guard") else None,
        "optimizer": type(optimizer).__name__,
        "muon_matrices_stepped": sum(bool(optimizer.state[p]) for p in muon),
        "applied": applied,
        "exit": effects.globals.get("code"),
        "records": records,
        "warnings": record.get("warnings") or [],
        "printed": effects.printed[-4000:],
        "forwards": dict(effects.forwards),
        "checkpointed": effects.checkpointed,
        "compiled": effects.compiled,
        "graphs": effects.graphs,
        "autocast_forwards": effects.autocast_forwards,
        "bfloat16_outputs": effects.bfloat16_outputs,
        "lora_layers": effects.lora_layers,
        "trainable": effects.trainable,
        "frozen": effects.frozen,
        "frozen_changed": effects.frozen_changed,
        "trainable_changed": effects.trainable_changed,
    }


def main(argv: list[str]) -> int:
    workdir = Path(argv[0]).resolve()
    names = argv[1:] or list(VARIANTS)
    results = {}
    for name in names:
        try:
            results[name] = run_variant(name, workdir)
        except Exception as e:  # reported per variant; the test shows it
            results[name] = {"error": f"{type(e).__name__}: {e}"}
    sys.stdout.write("\n" + json.dumps(results) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
