"""Shared helpers of the skills tests: recipe copies, template runs, checkpoints."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TEMPLATE = REPO / "recipes_template" / "causal_lm"
VLM_TEMPLATE = REPO / "recipes_template" / "vlm"
FIXTURES = Path(__file__).resolve().parent / "recipes"
EXPECTED = Path(__file__).resolve().parent / "expected"
PYTHON = sys.executable

# The three recipe styles every skill is tested on.
STYLES = ("template", "nanogpt_style", "hf_trainer_style")

# A small model and short documents: template runs take a few seconds on 2 CPU cores.
SMALL_RUN = (
    "model.num_layers=2",
    "data.seq_len=128",
    "data.batch_size=8",
    "train.log_every=1",
    "checkpoint.every=0",
    "checkpoint.at_end=false",
    "metrics.tensorboard=false",
)


def copy_recipe(style: str, destination: Path) -> Path:
    """A fresh copy of a recipe in ``destination``: the template's folder, or a fixture script."""
    destination.mkdir(parents=True, exist_ok=True)
    if style in ("template", "vlm"):
        target = destination / "recipe"
        source = TEMPLATE if style == "template" else VLM_TEMPLATE
        shutil.copytree(source, target, ignore=shutil.ignore_patterns("__pycache__", "runs"))
        return target
    target = destination / f"{style}.py"
    shutil.copy(FIXTURES / f"{style}.py", target)
    return target


def target_file(recipe: Path) -> Path:
    return recipe / "recipe.py" if recipe.is_dir() else recipe


def write_documents(path: Path, count: int, min_words: int, max_words: int, seed: int = 0) -> Path:
    """A .jsonl corpus of documents of varied length (words of a small vocabulary)."""
    rng = random.Random(seed)
    words = "the quick brown fox jumps over a lazy dog while small cats sleep under warm blankets".split()
    with open(path, "w") as f:
        for _ in range(count):
            n = rng.randint(min_words, max_words)
            f.write(json.dumps({"text": " ".join(rng.choice(words) for _ in range(n))}) + "\n")
    return path


@pytest.fixture
def documents(tmp_path: Path) -> Path:
    """400 short documents (≈ 25-300 bytes): most padded rows are mostly padding."""
    return write_documents(tmp_path / "docs.jsonl", 400, 5, 60)


def launch(
    recipe: Path, cwd: Path, *settings: str, nproc: int = 1, timeout: float = 600, threads: int | None = None
) -> subprocess.CompletedProcess:
    """``python -m engine.launch RECIPE --set ...`` (or under torchrun) with ``cwd`` as the
    workspace: the run lands in ``cwd/runs/<id>/``."""
    sets = [a for s in settings for a in ("--set", s)]
    if nproc == 1:
        command = [PYTHON, "-m", "engine.launch", str(recipe), *sets]
    else:
        command = [PYTHON, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                   "-m", "engine.launch", str(recipe), *sets]
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    if threads is not None:  # fewer threads: timings suffer less from other work on the machine
        env["OMP_NUM_THREADS"] = str(threads)
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def traced_not_generated(monkeypatch) -> None:
    """Runs launched after this compile with ``aot_eager``: dynamo traces and AOTAutograd
    differentiates the compiled blocks (through checkpointing, LoRA and autocast) without
    inductor's C++ code generation, 40 of a 56 s every-skill template run on 2 cores with a cold
    cache. Inductor itself is proven by tests/skills/test_effect_torch_compile.py."""
    monkeypatch.setenv("TORCH_COMPILE_OVERRIDE_BACKENDS", ">=0:aot_eager")


def run_metrics(cwd: Path, result: subprocess.CompletedProcess | None = None) -> list[dict]:
    """The metrics records of the only run under ``cwd/runs``."""
    from engine import run_dir as rd
    from engine import run_metrics

    runs = sorted((cwd / "runs").iterdir())
    assert len(runs) == 1, f"expected one run, found {[r.name for r in runs]}"
    return [r for r in run_metrics.read_all_metrics(runs[0] / rd.METRICS_JSONL) if "loss" in r]


def run_dir(cwd: Path) -> Path:
    runs = sorted((cwd / "runs").iterdir())
    assert len(runs) == 1
    return runs[0]


def template_with(skills: list[str] | tuple[str, ...], destination: Path, params: dict | None = None) -> Path:
    """A copy of the template with ``skills`` applied in order (``params``: skill → params)."""
    from skills import apply_skill

    recipe = copy_recipe("template", destination)
    for name in skills:
        apply_skill(name, recipe, params=(params or {}).get(name))
    return recipe


def on_documents(path: Path) -> tuple[str, str]:
    return ("data.source=files", f"data.paths=[{path}]")


def train(recipe: Path, cwd: Path, *settings: str, nproc: int = 1, threads: int | None = None) -> list[dict]:
    """Launch, require success, return the logged step records."""
    cwd.mkdir(parents=True, exist_ok=True)
    result = launch(recipe, cwd, *SMALL_RUN, *settings, nproc=nproc, threads=threads)
    assert result.returncode == 0, f"run failed ({result.returncode}):\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return run_metrics(cwd)


def load_checkpoint(path: Path, tmp: Path) -> dict:
    """A DCP checkpoint as plain nested dicts of tensors."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = tmp / f"{path.name}.pt"
    dcp_to_torch_save(str(path), str(out))
    return torch.load(out, weights_only=False)


def run_script(script: Path, *args: str, nproc: int = 1, timeout: float = 600) -> list[float]:
    """Run a fixture script; return the losses it printed (``step N loss X``)."""
    if nproc == 1:
        command = [PYTHON, str(script), *args]
    else:
        command = [PYTHON, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", str(script), *args]
    result = subprocess.run(command, cwd=script.parent, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"{script.name} failed:\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
    return [float(line.split()[3]) for line in result.stdout.splitlines() if line.startswith("step ")]


def load_recipe_module(recipe: Path):
    """Import a (skill-applied) recipe file as a module, for in-process checks of its code."""
    import importlib.util

    path = target_file(recipe)
    name = f"recipe_under_test_{abs(hash(str(path)))}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def final_checkpoint(cwd: Path, tmp: Path) -> dict:
    """The last complete checkpoint of the only run under ``cwd``, as nested dicts."""
    from engine import run_checkpoints

    step, path = run_checkpoints.latest_checkpoint(run_dir(cwd))
    return load_checkpoint(path, tmp)


def initial_template_model(recipe: Path, *settings: str):
    """The template's model exactly as the engine builds it before the first step (same seed,
    same config), without the skills' wrapping: the reference for "unchanged" weights."""
    import torch

    from engine.config import build_config
    from engine.launch import load_recipe_class

    recipe_class = load_recipe_class(recipe)
    module = sys.modules[recipe_class.__module__]
    config = build_config(recipe_class.config_class, recipe / "config.yaml", [*SMALL_RUN, *settings])
    torch.manual_seed(config.train.seed)
    return module.build_model(config.model, module.ByteTokenizer.vocab_size, config.data.seq_len)
