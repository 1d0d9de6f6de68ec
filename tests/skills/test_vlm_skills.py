"""The skills on a hand-written LLaVA-style script (tests/skills/recipes/llava_style.py): freeze by
part, checkpointing of both towers, packing of image+text samples, and the stage policy of
vlm-freeze-policy; each change is run for 2 steps in this process (``effect_probe``) and its
effect asserted. The same skills on the vlm template: test_vlm_template_skills.py.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from skills import SkillRefused, apply_skill
from tests.skills.effect_probe import Effects, run_script
from tests.skills.skill_helpers import FIXTURES, copy_recipe, load_recipe_module

SCRIPT = "llava_style"


def _copy(tmp_path: Path) -> Path:
    target = tmp_path / f"{SCRIPT}.py"
    shutil.copy(FIXTURES / f"{SCRIPT}.py", target)
    return target


def _losses(effects: Effects) -> list[str]:
    return re.findall(r"^step \d+ loss (\S+)$", effects.printed, flags=re.MULTILINE)


def _part_sizes(model) -> dict[str, int]:
    inner = model.model
    return {
        "vision_tower": sum(p.numel() for p in inner.vision_tower.parameters()),
        "projector": sum(p.numel() for p in inner.multi_modal_projector.parameters()),
        "language_model": sum(p.numel() for p in inner.language_model.parameters())
        + model.lm_head.weight.numel(),
    }


@pytest.fixture(scope="module")
def plain(tmp_path_factory) -> Effects:
    """The script as it is: the reference losses and forward counts."""
    return run_script(_copy(tmp_path_factory.mktemp("plain")))


@pytest.mark.parametrize("parts", [["vision_tower", "projector"], ["language_model"]], ids="+".join)
def test_freeze_parts_keeps_exactly_those_parts_unchanged(parts, tmp_path: Path):
    path = _copy(tmp_path)
    result = apply_skill("freeze", path, {"parts": parts})
    effects = run_script(path)

    assert result.acts_on == f"freezes the {' and '.join(p.replace('_', ' ') for p in parts)} of LlavaForConditionalGeneration"
    sizes = _part_sizes(effects.globals["model"])
    assert effects.frozen == sum(sizes[p] for p in parts)  # embeddings=false: only the parts
    assert effects.frozen_changed == [] and effects.trainable_changed > 0
    assert f"freeze: froze {effects.frozen:,} of" in effects.printed


def test_gradient_checkpointing_recomputes_both_towers_with_the_same_losses(plain: Effects, tmp_path: Path):
    path = _copy(tmp_path)
    result = apply_skill("gradient-checkpointing", path)
    effects = run_script(path)

    assert "every layer of the vision tower and of the language model" in result.acts_on
    assert _losses(effects) == _losses(plain) and len(_losses(plain)) == 2
    for mlp in ("SiglipMLP", "LlamaMLP"):  # inside each checkpointed layer: run again by backward
        assert plain.forwards[mlp] == 2 * 2  # 2 steps × 2 layers
        assert effects.forwards[mlp] == 2 * plain.forwards[mlp], mlp


def assert_each_samples_loss_is_kept(functions: dict, model, pieces: list, seq_len: int, pad_id: int) -> None:
    """With the recipe's own functions: each sample's summed loss in a packed row equals its loss
    in a batch of its own (the recipe's ``collate``), and the pictures follow their image tokens
    (shifting them by one sample changes the losses)."""
    import torch
    import torch.nn.functional as F

    rows = functions["pack_pieces"](pieces, seq_len)
    assert len(rows) < len(pieces)

    def sample_losses(batch, spans):
        positions = {"position_ids": batch["position_ids"]} if "position_ids" in batch else {
            "attention_mask": batch["attention_mask"]}
        logits = model(
            input_ids=batch["input_ids"], pixel_values=batch["pixel_values"], use_cache=False, **positions
        ).logits
        ce = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100, reduction="none")
        ce = ce.view(batch["labels"].shape)
        return torch.stack([ce[row, start:end].sum() for row, start, end in spans])

    spans, order = [], []
    for r, row in enumerate(rows):
        start = 0
        for piece in row:
            n = piece[0].shape[-1] - 1
            spans.append((r, start, start + n))
            order.append(piece)
            start += n
    with torch.no_grad():
        packed = functions["collate_packed"](rows, seq_len, pad_id)
        alone = torch.stack([
            sample_losses(functions["collate"]([piece], seq_len, pad_id), [(0, 0, piece[0].shape[-1] - 1)])[0]
            for piece in order
        ])
        torch.testing.assert_close(sample_losses(packed, spans), alone, rtol=1e-5, atol=1e-4)
        shifted = dict(packed, pixel_values=packed["pixel_values"].roll(1, dims=0))
        assert not torch.allclose(sample_losses(shifted, spans), alone, rtol=1e-3)


def test_packing_keeps_each_samples_loss_and_its_picture(tmp_path: Path):
    path = _copy(tmp_path)
    apply_skill("sequence-packing", path)
    effects = run_script(path)
    assert len(_losses(effects)) == 2
    script = effects.globals
    pad_id = script["PAD_ID"]
    assert_each_samples_loss_is_kept(script, script["build_model"]().eval(), script["make_pieces"](12, seed=3), 128, pad_id)

    # Padding over the script's data, 4 rows a batch: padded to the longest of each batch, or packed.
    data = script["make_pieces"](64)
    real = sum(p[0].shape[-1] - 1 for p in data)
    unpacked = sum(script["collate"](data[i : i + 4], 128, pad_id)["input_ids"].numel() for i in range(0, 64, 4))
    packed_rows = script["pack_pieces"](data, 128)
    assert 1 - real / (len(packed_rows) * 128) < 0.05 < 0.15 < 1 - real / unpacked


def test_packing_on_the_vlm_template_keeps_each_samples_loss(tmp_path: Path):
    """The same, with the vlm template's own build_model, make_pieces and collate."""
    import torch

    from engine.config import build_config

    recipe = copy_recipe("vlm", tmp_path)
    apply_skill("sequence-packing", recipe)
    module = load_recipe_module(recipe)
    config = build_config(module.VLMConfig, recipe / "config.yaml", ["data.builtin_images=12", "data.seq_len=128"])
    processor = module.load_processor(config)
    torch.manual_seed(0)
    model = module.build_model(config.model, processor, 128).eval()
    pieces = module.make_pieces(module.load_examples(config.data), processor, 128)
    assert_each_samples_loss_is_kept(vars(module), model, pieces, 128, processor.tokenizer.pad_token_id)


@pytest.mark.parametrize(
    ("params", "trained"),
    [
        ({}, ["projector"]),
        ({"stage": "finetune", "unfreeze_vision": True}, ["projector", "language_model", "vision_tower"]),
    ],
    ids=["align", "finetune+vision"],
)
def test_vlm_freeze_policy_trains_what_the_stage_says(params, trained, tmp_path: Path):
    path = _copy(tmp_path)
    result = apply_skill("vlm-freeze-policy", path, params)
    effects = run_script(path)

    assert result.acts_on.startswith(f"stage {params.get('stage', 'align')}: trains the projector")
    sizes = _part_sizes(effects.globals["model"])
    assert effects.trainable == sum(sizes[p] for p in trained)
    assert effects.frozen == sum(sizes.values()) - effects.trainable
    assert effects.frozen_changed == [] and effects.trainable_changed > 0
    assert f"({effects.trainable:,} of {sum(sizes.values()):,} parameter values)" in effects.printed
    again = apply_skill("vlm-freeze-policy", path, params)
    assert again.already_applied and "the stage policy is applied at llava_style.py:" in again.message


@pytest.mark.parametrize(
    ("style", "skill", "params", "says"),
    [
        ("template", "vlm-freeze-policy", None, "AutoModelForCausalLM or LlamaForCausalLM (recipe.py:"),
        ("nanogpt_style", "vlm-freeze-policy", None, "GPT (nanogpt_style.py:122) has no vision_tower or projector"),
        ("hf_trainer_style", "freeze", {"parts": ["projector"]}, "is a text-only model: it has no projector part"),
        (SCRIPT, "sequence-parallel", None, "looked for a trainwright Engine subclass"),
        (SCRIPT, "tensor-parallel", None, "looked for a device mesh with a 'tp' dimension"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_what_does_not_apply_is_refused_with_what_was_seen(style, skill, params, says, tmp_path: Path):
    path = _copy(tmp_path) if style == SCRIPT else copy_recipe(style, tmp_path)
    target = path / "recipe.py" if path.is_dir() else path
    before = target.read_text()
    with pytest.raises(SkillRefused) as refused:
        apply_skill(skill, path, params)
    assert str(refused.value).startswith(f"{skill}: ") and says in str(refused.value)
    assert "\n" not in str(refused.value) and target.read_text() == before


def test_a_script_that_freezes_by_hand_is_refused_by_the_stage_policy(tmp_path: Path):
    path = _copy(tmp_path)
    text = path.read_text().replace(
        "optimizer = torch.optim.AdamW(model.parameters()",
        "model.model.vision_tower.requires_grad_(False)\noptimizer = torch.optim.AdamW(model.parameters()",
    )
    path.write_text(text)
    with pytest.raises(SkillRefused, match=r"already sets requires_grad at llava_style.py:\d+, and the stage policy"):
        apply_skill("vlm-freeze-policy", path)


def test_the_skills_with_a_vision_language_path_fit_an_agents_budget_whole():
    """SKILL.md and the parameter schema, as the MCP server returns them: under 8 KB of JSON,
    and the SKILL.md not cut to get there."""
    import json

    from mcp_server.limits import AGENT_BUDGET_CHARS
    from mcp_server.operations import skills as skill_ops

    for name in ("freeze", "gradient-checkpointing", "sequence-packing", "sequence-parallel", "vlm-freeze-policy"):
        detail = skill_ops.get_skill(name).model_dump(mode="json")
        assert len(json.dumps(detail, separators=(",", ":"))) <= AGENT_BUDGET_CHARS, name
        assert detail["truncated"] is False, name
