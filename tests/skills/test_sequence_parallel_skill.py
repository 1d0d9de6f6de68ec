"""sequence-parallel: where the change lands among the other skills, hand-written code, and the
refusals (one line naming what was found and where; nothing changed on disk)."""

from __future__ import annotations

from pathlib import Path

import pytest

from skills import SkillRefused, apply_skill
from tests.skills.skill_helpers import copy_recipe, target_file, template_with

SKILL = "sequence-parallel"
# The skills that change prepare_model or the Engine subclass's body, as this one does.
NEIGHBOURS = ("flash-attention", "freeze", "gradient-checkpointing", "liger-kernel", "lora", "loss-guard",
              "sequence-packing", "tensor-parallel", "torch-compile")


def edited_template(tmp_path: Path, *replacements: tuple[str, str]) -> Path:
    recipe = copy_recipe("template", tmp_path)
    path = target_file(recipe)
    text = path.read_text()
    for old, new in replacements:
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    path.write_text(text)
    return recipe


def prepare_model_lines(recipe: Path) -> list[str]:
    lines = [line.strip() for line in target_file(recipe).read_text().splitlines()]
    start = lines.index("def prepare_model(self) -> torch.nn.Module:")
    return lines[start + 1 : lines.index("return model", start)]


@pytest.mark.parametrize("other", NEIGHBOURS)
def test_applies_with_every_other_template_skill_in_both_orders(other: str, tmp_path: Path):
    for order in ((SKILL, other), (other, SKILL)):
        recipe = template_with(order, tmp_path / "-".join(order))
        text = target_file(recipe).read_text()
        compile(text, "recipe.py", "exec")
        assert text.count('apply_sequence_parallel(model, self.dist.mesh["sp"])') == 1
        assert text.count("def to_device(") == 1
        lines = prepare_model_lines(recipe)
        sp = lines.index('apply_sequence_parallel(model, self.dist.mesh["sp"])')
        # After the attention swaps of the kernel skills, before wrappers and FSDP2.
        later = [i for i, line in enumerate(lines) if line.startswith(("checkpoint_blocks(", "compile_blocks(",
                                                                        "freeze_parameters(", "model = apply_fsdp("))]
        earlier = [i for i, line in enumerate(lines) if line.startswith(("use_flash_attention(", "apply_liger_kernels(",
                                                                          "apply_lora(", "apply_tensor_parallel("))]
        assert all(i > sp for i in later) and all(i < sp for i in earlier), (order, lines)


def test_written_by_hand_is_already_applied(tmp_path: Path):
    recipe = edited_template(
        tmp_path,
        ("from engine.fsdp import apply_fsdp\n",
         "from engine.fsdp import apply_fsdp\nfrom engine.sequence_parallel import shard_sequences\n"),
        ("        model = model.to(self.device)\n",
         '        model = model.to(self.device)\n        shard_sequences({}, self.dist.mesh["sp"])\n'),
    )
    before = target_file(recipe).read_text()

    result = apply_skill(SKILL, recipe)

    assert result.already_applied and not result.changed
    assert "sequence parallelism at recipe.py:" in result.message
    assert target_file(recipe).read_text() == before


# compute_loss's forward call (its indentation tells it from task_metrics' call)
FORWARD = '\n            input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False'
REFUSALS = {
    "attention-mask": (
        [(FORWARD, '\n            input_ids=batch["input_ids"], attention_mask=batch["labels"], use_cache=False')],
        "passes attention_mask, which cannot be split with the sequence; pass position_ids instead",
    ),
    "labels": (
        [(FORWARD, FORWARD + ', labels=batch["labels"]')],
        "passes labels=, so the model shifts them inside each rank's part of the sequence",
    ),
    "to-device": (
        [("    def flops_per_token(self) -> float:\n",
          "    def to_device(self, batch):\n        return batch\n\n    def flops_per_token(self) -> float:\n")],
        "CausalLM already overrides to_device (recipe.py:",
    ),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_refuses_what_it_cannot_split(case: str, tmp_path: Path):
    replacements, message = REFUSALS[case]
    recipe = edited_template(tmp_path, *replacements)
    before = target_file(recipe).read_text()

    with pytest.raises(SkillRefused) as refusal:
        apply_skill(SKILL, recipe)

    assert message in str(refusal.value) and "\n" not in str(refusal.value)
    assert str(refusal.value).startswith(f"{SKILL}: ")
    assert target_file(recipe).read_text() == before
