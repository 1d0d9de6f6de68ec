"""The skills on Qwen3-VL through the vlm_chat template, by its own module names: the vision tower
``model.visual`` (its deep-stack mergers with it), the projector ``model.visual.merger`` inside
it, the language model ``model.language_model`` with ``lm_head``. freeze and gradient
checkpointing applied to the template and two steps trained in this process; the
vlm-freeze-policy stages as the skill writes them. (LoRA: test_vlm_chat_lora.py; the run that
learns and its export: test_vlm_chat_runs.py; estimate_run: test_vlm_chat_estimate.py.)"""

from __future__ import annotations

import shutil

import pytest

from tests.templates.test_vlm_chat import TEMPLATE, picture, vlm
from tests.vlm_families import missing, tiny_vlm_folder

pytestmark = pytest.mark.skipif(missing("qwen3_vl") is not None, reason=missing("qwen3_vl") or "")

# Which part a parameter belongs to, by the longest of these prefixes.
PARTS = {"model.visual": "vision_tower", "model.visual.merger": "projector", "model.language_model": "language_model",
         "lm_head": "language_model"}


@pytest.fixture(scope="module")
def qwen3_vl(tmp_path_factory):
    return tiny_vlm_folder(tmp_path_factory.mktemp("qwen3_vl") / "model", "qwen3_vl")


def part_of(name: str) -> str:
    return PARTS[max((p for p in PARTS if name == p or name.startswith(p + ".")), key=len)]


def values(model, part: str) -> int:
    return sum(p.numel() for n, p in model.named_parameters() if part_of(n) == part)


def trainable_parts(model) -> set[str]:
    return {part_of(n) for n, p in model.named_parameters() if p.requires_grad}


@pytest.fixture(scope="module")
def frozen_and_checkpointed(qwen3_vl, tmp_path_factory) -> dict:
    from engine import model_io
    from engine import run_dir as rd
    from skills import apply_skill
    from tests.templates.test_vlm_chat_lora import train_here

    root = tmp_path_factory.mktemp("freeze_checkpointing")
    recipe = shutil.copytree(TEMPLATE, root / "vlm_chat", ignore=shutil.ignore_patterns("__pycache__"))
    applied = [apply_skill("freeze", recipe, {"parts": ["vision_tower", "projector"]}),
               apply_skill("gradient-checkpointing", recipe, {})]
    run, printed = train_here(root, recipe, f"model.pretrained_path={qwen3_vl}", "train.max_steps=2", "train.log_every=1",
                              "train.eval_every=0", "checkpoint.every=0", "checkpoint.at_end=true",
                              "data.builtin_images=16", "data.eval_fraction=0", "data.batch_size=4",
                              "metrics.tensorboard=false")
    shutil.copytree(recipe, run / rd.SNAPSHOT_DIRNAME)
    return {"applied": applied, "printed": printed, "model": model_io.load_engine(run, 2).model}


def test_freeze_and_checkpointing_act_on_qwen3_vls_parts_and_a_step_runs(frozen_and_checkpointed, qwen3_vl):
    done = frozen_and_checkpointed
    assert [a.changed for a in done["applied"]] == [True, True]
    model = done["model"]
    assert trainable_parts(model) == {"language_model"}
    # The stage froze the tower (deep-stack mergers included); the skill newly froze the merger.
    assert f"freeze: froze {values(model, 'projector'):,} of {sum(p.numel() for p in model.parameters()):,} " \
        "parameter values" in done["printed"]
    assert "step 2/2 | loss" in done["printed"]
    # The model's own switch, on in each layer of both towers.
    layers = [n for n, m in model.named_modules() if type(m).__name__ in ("Qwen3VLVisionBlock", "Qwen3VLTextDecoderLayer")]
    assert len(layers) == 4 and all(model.get_submodule(n).gradient_checkpointing is True for n in layers)


@pytest.mark.parametrize("stage, parts", [("align", {"projector"}), ("finetune", {"projector", "language_model"})])
def test_the_vlm_freeze_policy_stages_train_qwen3_vls_parts_and_a_step_runs(qwen3_vl, stage, parts):
    """vlm_chat has its own stage policy (model.train_*), so the skill's helper is run here on the
    model as the skill writes it into a recipe that has none."""
    import torch

    from engine import vision_language
    from skills.registry import skill

    helper = {"torch": torch, **vars(vision_language)}
    exec(skill("vlm-freeze-policy").codemod.HELPER, helper)
    model = vlm.load_model(vlm.ModelConfig(pretrained_path=str(qwen3_vl)))
    helper["apply_vlm_stage"](model, stage)
    assert trainable_parts(model) == parts
    processor = vlm.load_processor(str(qwen3_vl))
    piece = vlm.encode(processor, [vlm.user_turn([vlm.QUESTION], 1), vlm.assistant_turn("red")], [picture()], 512, "row")
    batch = vlm.collate([piece], processor)
    loss = model(**{k: v for k, v in batch.items() if k != "labels"}).logits.float().square().mean()
    loss.backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    assert all(p.grad is None for p in model.parameters() if not p.requires_grad)
