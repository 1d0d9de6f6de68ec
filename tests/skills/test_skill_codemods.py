"""Before/after: what each skill writes into each recipe style.

The exact expected change of every (skill, recipe style) pair is a unified diff in
``tests/skills/expected/<skill>--<style>.diff``: read them to see what a skill does. To
regenerate them after an intended change: ``TRAINWRIGHT_UPDATE_EXPECTED=1 pytest tests/skills``.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from tests.skills.skill_helpers import EXPECTED, STYLES, copy_recipe, target_file

from skills import apply_skill
from skills.errors import SkillRefused

APPLIES_TO = {
    "gradient-checkpointing": STYLES,
    "tensor-parallel": ("template", "hf_trainer_style"),
    "freeze": STYLES,
    "sequence-packing": ("template", "hf_trainer_style"),
    "sequence-parallel": ("template",),
    "loss-guard": STYLES,
    "mixed-precision": STYLES,
    "torch-compile": STYLES,
    "lora": STYLES,
    "qlora": STYLES,
    "muon": STYLES,
    "liger-kernel": ("template", "hf_trainer_style"),
    "flash-attention": ("template", "hf_trainer_style"),
    "vlm-freeze-policy": (),
}
# The vlm template: every skill but these applies. The hand-written LLaVA script: the skills
# with a vision-language code path (the others: test_vlm_skills.py).
VLM_REFUSES = {
    ("sequence-parallel", "vlm"): "passes pixel_values: a vision-language model puts each image's features",
}
LLAVA_SCRIPT = ("gradient-checkpointing", "sequence-packing", "vlm-freeze-policy")
# Applied already: the vlm template has its own stage setting.
VLM_ALREADY = {("vlm-freeze-policy", "vlm"): "its own stage policy: the setting `model.stage` (recipe.py:"}
# (skill, style) → what the refusal must say.
REFUSES = {
    ("tensor-parallel", "nanogpt_style"): "the model is built by GPT(...) (nanogpt_style.py:122), a module defined in the file",
    ("sequence-packing", "nanogpt_style"): "looked for an Engine.prepare_data",
    ("sequence-parallel", "nanogpt_style"): "looked for a trainwright Engine subclass in nanogpt_style.py; found none",
    ("sequence-parallel", "hf_trainer_style"): "looked for a trainwright Engine subclass in hf_trainer_style.py; found none",
    ("liger-kernel", "nanogpt_style"): "the model is built by GPT(...) (nanogpt_style.py:122), a module defined in the file",
    ("flash-attention", "nanogpt_style"): "the model is built by GPT(...) (nanogpt_style.py:122), a module defined in the file",
    ("vlm-freeze-policy", "template"): "is a text-only model: it has no vision_tower or projector or language_model",
    ("vlm-freeze-policy", "nanogpt_style"): "GPT (nanogpt_style.py:122) has no vision_tower or projector or language_model",
    ("vlm-freeze-policy", "hf_trainer_style"): "is a text-only model: it has no vision_tower or projector or language_model",
    **VLM_REFUSES,
}
APPLYING = [(skill, style) for skill, styles in APPLIES_TO.items() for style in styles] + [
    (skill, "vlm") for skill in APPLIES_TO if (skill, "vlm") not in VLM_REFUSES and (skill, "vlm") not in VLM_ALREADY
] + [(skill, "llava_style") for skill in LLAVA_SCRIPT]


def assert_matches_expected(name: str, actual: str) -> None:
    path = EXPECTED / f"{name}.diff"
    if os.environ.get("TRAINWRIGHT_UPDATE_EXPECTED"):
        path.parent.mkdir(exist_ok=True)
        path.write_text(actual)
    assert path.is_file(), f"no expected diff {path}; run with TRAINWRIGHT_UPDATE_EXPECTED=1"
    assert actual == path.read_text(), f"the change differs from {path}"


@pytest.mark.parametrize("skill,style", APPLYING, ids=[f"{s}--{t}" for s, t in APPLYING])
def test_skill_writes_the_expected_change(skill: str, style: str, tmp_path: Path):
    recipe = copy_recipe(style, tmp_path)

    result = apply_skill(skill, recipe, diff_root=tmp_path)

    assert result.changed and not result.already_applied
    assert result.target == str(target_file(recipe))
    assert_matches_expected(f"{skill}--{style}", result.diff)


@pytest.mark.parametrize("skill,style", APPLYING, ids=[f"{s}--{t}" for s, t in APPLYING])
def test_applying_twice_changes_nothing_the_second_time(skill: str, style: str, tmp_path: Path):
    recipe = copy_recipe(style, tmp_path)
    apply_skill(skill, recipe)
    after_first = target_file(recipe).read_text()

    second = apply_skill(skill, recipe)

    assert (second.changed, second.already_applied, second.diff) == (False, True, "")
    assert "already applied" in second.message
    assert target_file(recipe).read_text() == after_first


@pytest.mark.parametrize("skill,style", list(REFUSES), ids=[f"{s}--{t}" for s, t in REFUSES])
def test_skill_refuses_a_style_it_cannot_serve(skill: str, style: str, tmp_path: Path):
    recipe = copy_recipe(style, tmp_path)
    before = target_file(recipe).read_text()

    with pytest.raises(SkillRefused) as refusal:
        apply_skill(skill, recipe)

    assert REFUSES[(skill, style)] in str(refusal.value)
    assert "\n" not in str(refusal.value)
    assert target_file(recipe).read_text() == before


def test_every_skill_and_style_pair_is_covered():
    from skills import list_skills

    names = {s.name for s in list_skills()}
    assert set(APPLIES_TO) == names
    for skill in names:
        covered = set(APPLIES_TO[skill]) | {style for (s, style) in REFUSES if s == skill}
        covered |= {style for (s, style) in APPLYING if s == skill} | {style for (s, style) in VLM_ALREADY if s == skill}
        assert covered - {"llava_style"} == set(STYLES) | {"vlm"}, skill


@pytest.mark.parametrize("skill,style", list(VLM_ALREADY), ids=[f"{s}--{t}" for s, t in VLM_ALREADY])
def test_a_recipe_with_its_own_stage_policy_says_so(skill: str, style: str, tmp_path: Path):
    recipe = copy_recipe(style, tmp_path)
    before = target_file(recipe).read_text()

    result = apply_skill(skill, recipe, params={"stage": "align", "unfreeze_vision": True})

    assert result.already_applied and not result.changed and VLM_ALREADY[(skill, style)] in result.message
    assert "--set model.stage=align --set model.train_vision_tower=true" in result.message
    assert target_file(recipe).read_text() == before
