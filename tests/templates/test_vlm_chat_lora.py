"""The lora skill on the vlm_chat template: the adapters sit in the language model's layers alone
(LLaVA's and Qwen3-VL's ``model.language_model``, Idefics3's ``model.text_model``), never in the
vision tower or the projector, whose layers have the same names (``q_proj``, ``fc1`` of CLIP and
SigLIP, ``linear_fc1`` of Qwen3-VL's tower and its mergers); a run
trains them and its merged export changes the language model's weights and nothing else."""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import sys

import pytest
import torch

from tests.templates.test_vlm_chat import TEMPLATE, vlm
from tests.vlm_families import available, each, tiny_vlm_folder

# family → where its language model is, and its class.
LANGUAGE_MODEL = {"llava": ("model.language_model", "LlavaForConditionalGeneration"),
                  "idefics3": ("model.text_model", "Idefics3ForConditionalGeneration"),
                  "qwen3_vl": ("model.language_model", "Qwen3VLForConditionalGeneration")}
SETTINGS = ("train.max_steps=3", "train.log_every=1", "train.eval_every=0", "checkpoint.every=0",
            "checkpoint.at_end=true", "data.builtin_images=24", "data.eval_fraction=0.2", "data.batch_size=4",
            "optim.lr=1e-2", "optim.warmup_steps=0", "metrics.tensorboard=false")


def train_here(folder, recipe, *overrides: str) -> tuple:
    """``engine.launch.main`` in this process (a fresh interpreter costs ~10 s); the run
    directory and what the run printed."""
    from engine.launch import main

    argv = [str(recipe)] + [a for item in overrides for a in ("--set", item)]
    printed, cwd, path = io.StringIO(), os.getcwd(), list(sys.path)
    for key in ("MASTER_ADDR", "MASTER_PORT"):  # the run starts its own process group
        os.environ.pop(key, None)
    try:
        os.chdir(folder)
        with contextlib.redirect_stdout(printed):
            code = main(argv)
    finally:
        os.chdir(cwd)
        sys.path[:] = path
    assert code == 0, printed.getvalue()[-3000:]
    (run,) = sorted((folder / "runs").iterdir())
    return run, printed.getvalue()


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    from engine import run_dir as rd
    from skills import apply_skill

    out = {}
    for family in available(tuple(LANGUAGE_MODEL)):
        folder = tmp_path_factory.mktemp(family)
        model = tiny_vlm_folder(folder / "model", family)
        recipe = shutil.copytree(TEMPLATE, folder / "vlm_chat", ignore=shutil.ignore_patterns("__pycache__"))
        applied = apply_skill("lora", recipe)
        run, printed = train_here(folder, recipe, f"model.pretrained_path={model}", *SETTINGS)
        shutil.copytree(recipe, run / rd.SNAPSHOT_DIRNAME)
        out[family] = {"model": model, "applied": applied, "run": run, "printed": printed}
    return out


@pytest.mark.parametrize("family", each(sorted(LANGUAGE_MODEL)))
def test_lora_adapts_the_language_model_alone_and_its_export_changes_nothing_else(family, runs, tmp_path):
    from transformers import AutoModelForImageTextToText

    from engine import model_io

    where, name = LANGUAGE_MODEL[family]
    done = runs[family]
    applied = done["applied"]
    assert applied.acts_on == ("adapts every nn.Linear in the layers of the language model of AutoModelForImageTextToText "
                               "(named at run time), not the vision tower's or the projector's")
    assert "within=language_model" in applied.diff
    # Llama's 7 linear layers in each of the 2 decoder layers; none of the vision tower's 2 layers.
    assert (f"lora: adapted 14 linear layers (down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj) of "
            f"`{where}` of {name}") in done["printed"]

    engine = model_io.load_engine(done["run"], 3)
    adapted = [n for n, m in engine.model.named_modules() if hasattr(m, "lora_A")]
    assert len(adapted) == 14 and all(n.startswith(where + ".layers.") for n in adapted), adapted
    trainable = [n for n, p in engine.model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)

    model_io.export(done["run"], 3, tmp_path / "exported")
    exported = AutoModelForImageTextToText.from_pretrained(tmp_path / "exported").state_dict()
    original = AutoModelForImageTextToText.from_pretrained(done["model"]).state_dict()
    assert set(exported) == set(original)  # merged: no adapter left
    changed = sorted(k for k in original if not torch.equal(exported[k], original[k]))
    # The adapters' updates are merged into the language model's linear layers; nothing else moved.
    assert changed and all(k.startswith(where + ".layers.") and k.endswith("_proj.weight") for k in changed), changed
    processor = vlm.load_processor(str(tmp_path / "exported"))
    assert type(processor).__name__ == type(vlm.load_processor(str(done["model"]))).__name__


@pytest.mark.parametrize("family", each(sorted(LANGUAGE_MODEL)))
def test_estimate_runs_lora_change_counts_the_adapters_the_applied_skill_trains(family, runs):
    """estimate_run's ``apply_skill lora`` row is estimated with the trainable values the skill
    gives this model (the language model's layers), not those of both towers' blocks (qlora's)."""
    import re

    from engine.estimate import adaptable_linears

    model = vlm.load_model(vlm.ModelConfig(pretrained_path=str(runs[family]["model"])))
    _, lora_values, qlora_values = adaptable_linears(model)
    (trained,) = re.findall(r"; ([\d,]+) trainable values", runs[family]["printed"])
    assert lora_values == int(trained.replace(",", ""))
    # LLaVA's and Qwen3-VL's blocks (their _no_split_modules) are their vision towers' layers too,
    # whose linear layers qlora adapts; Idefics3 names no vision layer there, so its blocks are the
    # language model's.
    assert qlora_values > lora_values if family != "idefics3" else qlora_values == lora_values


@pytest.mark.parametrize("family", ["llava", "qwen2_vl"])
def test_the_lora_changes_estimate_makes_trainable_exactly_the_layers_peft_wraps_in_the_recipe(family, tmp_path, monkeypatch):
    """estimate_run measures the LoRA change's saved activations with the layers the lora skill
    adapts trainable: the language model's, not the vision tower's (CLIP's q/k/v/out_proj and
    fc1/fc2, Qwen2-VL's qkv/proj/fc1/fc2), which a frozen tower never saves inputs for."""
    from engine import estimate
    from engine.config import build_config
    from engine.distributed import DistInfo
    from engine.launch import load_recipe_class
    from skills import apply_skill

    model = tiny_vlm_folder(tmp_path / "model", family)
    overrides = [f"model.pretrained_path={model}", "data.builtin_images=10", "data.batch_size=2", "data.seq_len=128",
                 "data.eval_fraction=0"]
    trainable_in_each_forward = []
    measure = estimate.measure_saved_bytes

    def recording(engine, batch):
        counted = measure(engine, batch)
        trainable_in_each_forward.append({n.removesuffix(".weight") for n, p in engine.model.named_parameters()
                                          if p.requires_grad})
        return counted

    monkeypatch.setattr(estimate, "measure_saved_bytes", recording)
    plain = load_recipe_class(TEMPLATE)
    shape = estimate.measure_shape(plain, build_config(plain.config_class, None, overrides), 1)
    assert shape.adapter_saved is not None and len(trainable_in_each_forward) >= 2
    estimated = trainable_in_each_forward[1]  # the forward after the run's own: the LoRA change's

    recipe = shutil.copytree(TEMPLATE, tmp_path / "vlm_chat", ignore=shutil.ignore_patterns("__pycache__"))
    apply_skill("lora", recipe)
    skilled = load_recipe_class(recipe)
    engine = skilled(build_config(skilled.config_class, None, overrides), DistInfo(0, 1, 0, torch.device("cpu"), None))
    wrapped = {n for n, m in engine.prepare_model().named_modules() if hasattr(m, "lora_A")}
    assert len(wrapped) == 14 and all(".language_model.layers." in n for n in wrapped), wrapped
    assert estimated == wrapped


@pytest.mark.parametrize("family", ["llava", "qwen2_vl"])
def test_the_lora_changes_saved_activations_are_those_of_the_recipe_with_the_skill_applied(family, tmp_path, monkeypatch):
    """What the LoRA change counts a forward to save, measured on the recipe as it is, is what the
    forward of the recipe with the lora skill applied saves, to the byte: the inputs of the
    language model's linear layers and each adapter's rank-8 product. (The vision tower's layers
    counted as adapted and no products: 3-4% more here; the language model's without products: 8% less.)"""
    from engine.config import build_config
    from engine.data_files import WORKSPACE_VARIABLE
    from engine.estimate import measure_shape
    from engine.launch import load_recipe_class
    from skills import apply_skill

    monkeypatch.setenv(WORKSPACE_VARIABLE, str(tmp_path))
    model = tiny_vlm_folder(tmp_path / "model", family)
    overrides = [f"model.pretrained_path={model}", "data.builtin_images=10", "data.batch_size=2", "data.seq_len=128",
                 "data.eval_fraction=0"]
    recipe = shutil.copytree(TEMPLATE, tmp_path / "vlm_chat", ignore=shutil.ignore_patterns("__pycache__"))
    apply_skill("lora", recipe)
    shapes = {}
    for name, folder in (("plain", TEMPLATE), ("lora", recipe)):
        recipe_class = load_recipe_class(folder)
        shapes[name] = measure_shape(recipe_class, build_config(recipe_class.config_class, None, overrides), 1)
    assert shapes["plain"].adapter_saved is not None
    change, applied = shapes["plain"].adapter_saved[0], shapes["lora"].saved_bytes
    print(f"\n{family}: the LoRA change saves {change:,} bytes, the recipe with the skill {applied:,}")
    assert change == applied
