"""Code that already holds a pattern (written by hand) is reported as applied, not changed; code
a skill cannot serve is refused with one line that names what it looked for and where."""

from __future__ import annotations

from pathlib import Path

import pytest

from skills import SkillRefused, apply_skill
from tests.skills.skill_helpers import copy_recipe, target_file


def line_of(recipe: Path, fragment: str) -> int:
    """The 1-based line of the first line of ``recipe`` that contains ``fragment``."""
    lines = target_file(recipe).read_text().splitlines()
    return next(number for number, line in enumerate(lines, 1) if fragment in line)


def edited(style: str, tmp_path: Path, *replacements: tuple[str, str]) -> Path:
    """A copy of a recipe with exact text replacements (each old text must occur once)."""
    recipe = copy_recipe(style, tmp_path)
    path = target_file(recipe)
    text = path.read_text()
    for old, new in replacements:
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    path.write_text(text)
    return recipe


HF_MODEL = "        self.model = LlamaForCausalLM(config)\n"
NANO_MODEL = "model = GPT(GPTConfig(block_size, 256, n_layer, n_head, n_embd))\n"

HAND_WRITTEN = {
    "gradient-checkpointing": (
        "hf_trainer_style",
        [(HF_MODEL, HF_MODEL + "        self.model.gradient_checkpointing_enable()\n")],
        "activation checkpointing at hf_trainer_style.py:{gradient_checkpointing_enable}",
    ),
    "tensor-parallel": (
        "hf_trainer_style",
        [
            ("from torch.utils.data import DataLoader\n",
             "from torch.distributed.tensor.parallel import parallelize_module\nfrom torch.utils.data import DataLoader\n"),
            (HF_MODEL, HF_MODEL + '        parallelize_module(self.model, self.mesh["tp"], {})\n'),
        ],
        "tensor parallelism at hf_trainer_style.py:{parallelize_module(self.model}",
    ),
    "freeze": (
        "nanogpt_style",
        [(NANO_MODEL, NANO_MODEL + "model.transformer.wpe.weight.requires_grad = False\n")],
        "parameters are frozen at nanogpt_style.py:{requires_grad = False}",
    ),
    "sequence-packing": (
        "hf_trainer_style",
        [("def collate(", "def pack_and_pad("), ("partial(collate,", "partial(pack_and_pad,")],
        "the batches are collated by pack_and_pad()",
    ),
    "loss-guard": (
        "nanogpt_style",
        [("    optimizer.step()\n", "    if torch.isfinite(loss):\n        optimizer.step()\n")],
        "the optimizer step at nanogpt_style.py:{optimizer.step()} is already guarded",
    ),
    "mixed-precision": (
        "nanogpt_style",
        [("    logits, loss = model(x, y)\n",
          '    with torch.autocast("cpu", dtype=torch.bfloat16):\n        logits, loss = model(x, y)\n')],
        "autocast at nanogpt_style.py:{torch.autocast}",
    ),
    "torch-compile": (
        "nanogpt_style",
        [(NANO_MODEL, NANO_MODEL + "model = torch.compile(model)\n")],
        "torch.compile at nanogpt_style.py:{torch.compile}",
    ),
    "lora": (
        "hf_trainer_style",
        [
            ("from torch.utils.data import DataLoader\n",
             "from peft import LoraConfig, get_peft_model\nfrom torch.utils.data import DataLoader\n"),
            (HF_MODEL, HF_MODEL + "        self.model = get_peft_model(self.model, LoraConfig(r=4))\n"),
        ],
        "LoRA at",
    ),
}


def with_lines(message: str, recipe: Path) -> str:
    """``"...:{fragment}"`` → ``"...:<line of fragment>"``."""
    import re

    return re.sub(r"\{([^{}]+)\}", lambda m: str(line_of(recipe, m.group(1))), message)


def assert_counts_as_applied(skill: str, recipe: Path, reason: str) -> None:
    """``skill`` finds its pattern already in ``recipe``: no change, a message that names where
    (``reason`` with line numbers filled in by ``with_lines``), the file as it was."""
    before = target_file(recipe).read_text()

    result = apply_skill(skill, recipe)

    assert (result.changed, result.already_applied, result.diff) == (False, True, "")
    assert with_lines(reason, recipe) in result.message
    assert target_file(recipe).read_text() == before


def assert_refuses(skill: str, recipe: Path, message: str) -> None:
    """``skill`` refuses ``recipe`` with one line that starts with ``message`` (line numbers
    filled in by ``with_lines``) and leaves the file as it was."""
    before = target_file(recipe).read_text()

    with pytest.raises(SkillRefused) as refusal:
        apply_skill(skill, recipe)

    assert str(refusal.value).startswith(with_lines(message, recipe))
    assert "\n" not in str(refusal.value)
    assert target_file(recipe).read_text() == before


@pytest.mark.parametrize("skill", sorted(HAND_WRITTEN))
def test_hand_written_pattern_counts_as_applied(skill: str, tmp_path: Path):
    style, replacements, reason = HAND_WRITTEN[skill]
    assert_counts_as_applied(skill, edited(style, tmp_path, *replacements), reason)


REFUSALS = [
    pytest.param(
        "gradient-checkpointing", "nanogpt_style", [(NANO_MODEL, 'model = torch.load("gpt.pt", weights_only=False)\n')],
        "gradient-checkpointing: looked for the model construction (an assignment such as "
        "`model = LlamaForCausalLM(...)`, `model = build_model(...)` or `model = GPT(...)` with GPT "
        "an nn.Module subclass) in nanogpt_style.py; found none",
        id="no-model-construction",
    ),
    pytest.param(
        "tensor-parallel", "hf_trainer_style",
        [("(world_size // cfg.tp, cfg.tp), mesh_dim_names=(\"dp\", \"tp\")", "(world_size,), mesh_dim_names=(\"dp\",)")],
        "tensor-parallel: looked for a device mesh with a 'tp' dimension",
        id="tp-without-tp-mesh",
    ),
    pytest.param(
        "freeze", "nanogpt_style",
        [("optimizer = torch.optim.AdamW(model.parameters(),",
          'groups = [{"params": list(model.parameters())}]\noptimizer = torch.optim.AdamW(groups,')],
        "freeze: the optimizer at nanogpt_style.py:{optimizer = torch.optim} gets `groups`, which the codemod cannot filter",
        id="freeze-unfilterable-optimizer",
    ),
    pytest.param(
        "sequence-packing", "hf_trainer_style",
        [("collate_fn=partial(collate, seq_len=cfg.seq_len, pad_id=PAD_ID)", "collate_fn=collate")],
        "sequence-packing: looked for an Engine.prepare_data that returns a stream",
        id="packing-without-known-data-path",
    ),
    pytest.param(
        "loss-guard", "template",
        [("    def flops_per_token(self) -> float:\n",
          "    def before_optimizer_step(self, ctx) -> bool:\n        return ctx.step > 2\n\n"
          "    def flops_per_token(self) -> float:\n")],
        "loss-guard: CausalLM already overrides before_optimizer_step (recipe.py:{def before_optimizer_step}); add "
        "`LossGuard(...).check(ctx.loss, ctx.grad_norm)` to it by hand",
        id="loss-guard-own-hook",
    ),
    pytest.param(
        "loss-guard", "hf_trainer_style", [("        self.optimizer.step()\n", "")],
        "loss-guard: looked for an Engine subclass (its before_optimizer_step hook), an optimizer step "
        "(`optimizer.step()`, `self._optimizer.step()`, `scaler.step(optimizer)`) or a Lightning "
        "training_step in hf_trainer_style.py; found none",
        id="loss-guard-no-step",
    ),
    pytest.param(
        "torch-compile", "nanogpt_style",
        [(NANO_MODEL, NANO_MODEL + "teacher = GPT(GPTConfig(block_size, 256, 1, 1, 32))\n"),
         ("torch.optim.AdamW(model.parameters(),", "torch.optim.AdamW([*model.parameters(), *teacher.parameters()],")],
        "torch-compile: found several model constructions (`model` at nanogpt_style.py:{model = GPT} "
        "(`GPT(GPTConfig(block_size, 256, n_laye...`), `teacher` at nanogpt_style.py:{teacher = GPT} "
        "(`GPT(GPTConfig(block_size, 256, 1, 1, ...`)) and cannot tell which one is trained; name the one "
        "to change with `target` (e.g. target=\"model\" or target=\"nanogpt_style.py:{model = GPT}\")",
        id="two-models",
    ),
]


@pytest.mark.parametrize("skill,style,replacements,message", REFUSALS)
def test_skill_refuses_with_a_clear_reason(skill, style, replacements, message, tmp_path: Path):
    assert_refuses(skill, edited(style, tmp_path, *replacements), message)


def test_lora_and_tensor_parallel_refuse_each_other(tmp_path: Path):
    with_lora = copy_recipe("template", tmp_path / "a")
    apply_skill("lora", with_lora)
    with pytest.raises(SkillRefused, match=r"^tensor-parallel: the recipe applies LoRA \(recipe.py:\d+\); peft's"):
        apply_skill("tensor-parallel", with_lora)

    with_tp = copy_recipe("template", tmp_path / "b")
    apply_skill("tensor-parallel", with_tp)
    with pytest.raises(SkillRefused, match=r"^lora: the recipe applies tensor parallelism \(recipe.py:\d+\)"):
        apply_skill("lora", with_tp)


def test_tensor_parallel_refuses_stock_gradient_clipping_outside_the_engine(tmp_path: Path):
    recipe = edited(
        "hf_trainer_style", tmp_path,
        ("        loss.backward()\n", "        loss.backward()\n        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)\n"),
    )
    with pytest.raises(SkillRefused, match=r"clip_grad_norm_ at hf_trainer_style.py:\d+ fails once some gradients"):
        apply_skill("tensor-parallel", recipe)


def test_tensor_parallel_refuses_a_mesh_created_after_the_model(tmp_path: Path):
    mesh_line = '        self.mesh = init_device_mesh("cpu", (world_size // cfg.tp, cfg.tp), mesh_dim_names=("dp", "tp"))\n'
    recipe = edited("hf_trainer_style", tmp_path, (mesh_line, ""), (HF_MODEL, HF_MODEL + mesh_line))
    with pytest.raises(SkillRefused, match=r"the device mesh \(hf_trainer_style.py:\d+\) is created after the model"):
        apply_skill("tensor-parallel", recipe)
