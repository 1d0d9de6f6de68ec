"""liger-kernel, flash-attention and muon compose with every skill, in either order: the kernels
land right after the model is built (Liger, then FlashAttention) whatever the application order,
Muon's optimizer stays the one that the other skills find, and the results still run."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import pytest

from skills import SkillRefused, apply_skill, list_skills
from tests.skills.skill_helpers import copy_recipe, run_script, target_file, template_with
from tests.skills.test_skill_composition import model_statements

NEW = ("liger-kernel", "flash-attention", "muon")


@pytest.mark.parametrize("order", list(itertools.permutations(("liger-kernel", "flash-attention", "freeze",
                                                               "gradient-checkpointing"))), ids="-".join)
def test_template_kernels_land_first_whatever_the_application_order(order, tmp_path: Path):
    recipe = template_with(order, tmp_path)

    stages = model_statements((recipe / "recipe.py").read_text(), "model = build_model(", "return model")

    assert [s.split("(")[0] for s in stages] == [
        "model = build_model",
        "model = model.to",
        "self.fused_linear_cross_entropy = apply_liger_kernels",
        "model,", "rope=True,", "swiglu=True,", "rms_norm=True,", "fused_linear_cross_entropy=True,", "warn=self.warn,",
        ")",
        "use_flash_attention",
        "model,", "compute_dtype=self.compute_dtype,", "packed_sequences=True,", "warn=self.warn,",
        ")",
        "freeze_parameters",
        "model.gradient_checkpointing_enable",
        "model = apply_fsdp",
        "return model",
    ]


def test_every_pair_with_a_new_skill_applies_in_both_orders(tmp_path: Path):
    names = [s.name for s in list_skills() if s.name != "vlm-freeze-policy"]  # text template: refused
    pairs = [(a, b) for a, b in itertools.permutations(names, 2) if a in NEW or b in NEW]
    for index, (first, second) in enumerate(pairs):
        recipe = template_with([first], tmp_path / str(index))
        try:
            result = apply_skill(second, recipe)
        except SkillRefused as refusal:  # pragma: no cover - a failure names the pair
            pytest.fail(f"{first} then {second}: {refusal}")
        assert result.changed, (first, second)
        compile((recipe / "recipe.py").read_text(), "recipe.py", "exec")


def test_loss_guard_and_freeze_find_muons_optimizer(tmp_path: Path):
    script = copy_recipe("nanogpt_style", tmp_path)
    for skill in ("muon", "loss-guard", "freeze"):
        assert apply_skill(skill, script).changed, skill

    text = target_file(script).read_text()
    assert "loss_guard = LossGuard(" in text and "if loss_guard.check(loss, grad_norm):" in text
    assert "freeze_parameters(model, embeddings=True" in text
    assert "MuonWithAdamW(\n    model," in text  # it keeps only trainable parameters itself


def test_muon_after_freeze_takes_the_model_from_the_filtered_parameters(tmp_path: Path):
    recipe = template_with(["freeze", "muon"], tmp_path)

    text = (recipe / "recipe.py").read_text()

    assert "return MuonWithAdamW(\n            model,\n" in text


@pytest.mark.slow
@pytest.mark.parametrize(
    "style,skills,args",
    [
        ("nanogpt_style", ("muon", "loss-guard", "freeze", "gradient-checkpointing", "mixed-precision"), ["max_iters=4"]),
        ("hf_trainer_style", ("liger-kernel", "flash-attention", "muon", "sequence-packing", "lora", "loss-guard"),
         ["--steps", "4"]),
    ],
    ids=["nanogpt-muon-and-friends", "hf-trainer-gpu-skills-and-friends"],
)
def test_scripts_with_the_new_skills_still_train(style, skills, args, tmp_path: Path):
    script = copy_recipe(style, tmp_path)
    for skill in skills:
        assert apply_skill(skill, script).changed, skill

    losses = run_script(script, *args)

    assert len(losses) == 4 and all(math.isfinite(x) for x in losses)


@pytest.mark.multiprocess
def test_hf_trainer_with_muon_and_tensor_parallel_on_two_processes_matches_one(tmp_path: Path):
    script = copy_recipe("hf_trainer_style", tmp_path)
    for skill in ("muon", "tensor-parallel"):
        assert apply_skill(skill, script).changed, skill

    one = run_script(script, "--steps", "4")
    two = run_script(script, "--steps", "4", "--tp", "2", nproc=2)

    assert max(abs(a - b) for a, b in zip(one, two)) < 1e-3
