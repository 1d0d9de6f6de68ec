"""liger-kernel, flash-attention and muon: code that already holds the pattern (written by hand)
counts as applied; code they cannot serve is refused with one line that names what they looked
for and where; the cases in between (no optimizer of the recipe's own, a loss they cannot route)
are handled as SKILL.md says."""

from __future__ import annotations

from pathlib import Path

import pytest

from skills import apply_skill
from tests.skills.skill_helpers import copy_recipe, load_recipe_module, target_file
from tests.skills.test_skill_hand_written_and_refusals import (
    HF_MODEL,
    assert_counts_as_applied,
    assert_refuses,
    edited,
)

NANO_ADAMW = "optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, weight_decay=0.1)\n"
HF_ADAMW = "        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr, weight_decay=0.0)\n"

HAND_WRITTEN = [
    pytest.param(
        "muon", "nanogpt_style",
        [(NANO_ADAMW, "optimizer = torch.optim.Muon([p for p in model.parameters() if p.ndim == 2], lr=0.02)\n")],
        "Muon at nanogpt_style.py:{torch.optim.Muon}",
        id="muon-torch-optim-muon",
    ),
    pytest.param(
        "liger-kernel", "hf_trainer_style",
        [("from transformers import LlamaConfig, LlamaForCausalLM\n",
          "from liger_kernel.transformers import apply_liger_kernel_to_llama\n"
          "from transformers import LlamaConfig, LlamaForCausalLM\n"),
         ("        torch.manual_seed(cfg.seed)\n", "        torch.manual_seed(cfg.seed)\n        apply_liger_kernel_to_llama()\n")],
        "Liger kernels at hf_trainer_style.py:{apply_liger_kernel_to_llama()}",
        id="liger-apply-to-llama",
    ),
    pytest.param(
        "flash-attention", "hf_trainer_style",
        [('            attn_implementation="sdpa",\n', '            attn_implementation="flash_attention_2",\n')],
        "FlashAttention 2 at hf_trainer_style.py:{config = LlamaConfig(}",
        id="flash-attn-implementation",
    ),
    pytest.param(
        "flash-attention", "hf_trainer_style",
        [(HF_MODEL, HF_MODEL + '        self.model.set_attn_implementation("flash_attention_2")\n')],
        "FlashAttention 2 at hf_trainer_style.py:{set_attn_implementation}",
        id="flash-set-attn-implementation",
    ),
]


@pytest.mark.parametrize("skill,style,replacements,reason", HAND_WRITTEN)
def test_hand_written_pattern_counts_as_applied(skill, style, replacements, reason, tmp_path: Path):
    assert_counts_as_applied(skill, edited(style, tmp_path, *replacements), reason)


REFUSALS = [
    pytest.param(
        "muon", "hf_trainer_style", [(HF_ADAMW, HF_ADAMW.replace("torch.optim.AdamW", "torch.optim.SGD"))],
        "muon: looked for the torch.optim.AdamW (or Adam) constructor that Muon replaces, or an Engine subclass "
        "that keeps the engine's default AdamW, in hf_trainer_style.py; found torch.optim.SGD at "
        "hf_trainer_style.py:{torch.optim.SGD}",
        id="muon-sgd",
    ),
    pytest.param(
        "muon", "nanogpt_style",
        [(NANO_ADAMW, 'groups = [{"params": list(model.parameters())}]\n'
                      "optimizer = torch.optim.AdamW(groups, lr=learning_rate, weight_decay=0.1)\n")],
        "muon: the optimizer at nanogpt_style.py:{optimizer = torch.optim} gets `groups`; Muon needs the model "
        "itself to tell the blocks' matrices from embeddings, head and norms",
        id="muon-param-groups",
    ),
    pytest.param(
        "muon", "nanogpt_style",
        [(NANO_ADAMW, "optimizer = torch.optim.Adam(model.parameters(), lr=learning_rate, weight_decay=0.1)\n")],
        "muon: the optimizer at nanogpt_style.py:{optimizer = torch.optim} is torch.optim.Adam with weight_decay",
        id="muon-adam-l2",
    ),
    pytest.param(
        "muon", "nanogpt_style",
        [(NANO_ADAMW, "optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, amsgrad=True)\n")],
        "muon: the optimizer at nanogpt_style.py:{optimizer = torch.optim} sets `amsgrad=`, which MuonWithAdamW "
        "does not take",
        id="muon-amsgrad",
    ),
    pytest.param(
        "liger-kernel", "hf_trainer_style", [(HF_MODEL, '        self.model = torch.load("model.pt", weights_only=False)\n')],
        "liger-kernel: looked for the model construction",
        id="liger-no-model",
    ),
]


@pytest.mark.parametrize("skill,style,replacements,message", REFUSALS)
def test_skill_refuses_with_a_clear_reason(skill, style, replacements, message, tmp_path: Path):
    assert_refuses(skill, edited(style, tmp_path, *replacements), message)


def test_muon_gives_an_engine_recipe_without_its_own_optimizer_a_prepare_optimizer(tmp_path: Path):
    start = "    def prepare_optimizer(self, model: torch.nn.Module) -> torch.optim.Optimizer:\n"
    recipe = copy_recipe("template", tmp_path)
    path = target_file(recipe)
    text = path.read_text()
    begin = text.index(start)
    end = text.index("    @classmethod\n    def summarize_data")
    path.write_text(text[:begin] + text[end:])

    result = apply_skill("muon", recipe)

    assert result.changed
    module = load_recipe_module(recipe)
    assert module.CausalLM.prepare_optimizer.__doc__ == "Muon for the hidden matrices, AdamW for the rest (the muon skill)."
    assert "return MuonWithAdamW(\n            model,\n            lr=optim.lr," in path.read_text()


def test_muon_keeps_adam_without_weight_decay_as_adamw_without_it(tmp_path: Path):
    recipe = edited("nanogpt_style", tmp_path, (NANO_ADAMW, "optimizer = torch.optim.Adam(model.parameters(), lr=learning_rate)\n"))

    apply_skill("muon", recipe)

    assert "MuonWithAdamW(\n    model,\n    lr=learning_rate,\n    weight_decay=0.0,\n    momentum=0.95," in target_file(recipe).read_text()


def test_liger_keeps_the_logits_loss_it_cannot_route_and_says_so(tmp_path: Path):
    recipe = edited("template", tmp_path, ('            reduction="sum",\n', '            reduction="mean",\n'))

    result = apply_skill("liger-kernel", recipe)

    text = target_file(recipe).read_text()
    assert "fused linear cross-entropy stays off" in result.message
    assert "fused_linear_cross_entropy=False" in text and "shift_labels" not in text.split("def compute_loss")[1]


def test_liger_in_a_script_whose_model_takes_the_labels_leaves_the_loss_to_the_model(tmp_path: Path):
    recipe = copy_recipe("hf_trainer_style", tmp_path)

    apply_skill("liger-kernel", recipe)

    text = target_file(recipe).read_text()
    assert "fused_linear_cross_entropy=True," in text
    assert "shift_labels" not in text.split("class Trainer")[1]  # the forward's labels= does it


def test_flash_attention_checks_the_autocast_dtype_when_the_forwards_run_under_autocast(tmp_path: Path):
    from tests.skills.skill_helpers import template_with

    with_autocast = template_with(["mixed-precision", "flash-attention"], tmp_path / "a")
    without = template_with(["flash-attention"], tmp_path / "b")

    assert "compute_dtype=torch.bfloat16," in (with_autocast / "recipe.py").read_text()
    assert "compute_dtype=self.compute_dtype," in (without / "recipe.py").read_text()
