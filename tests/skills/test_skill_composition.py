"""Skills compose: any subset in any order gives the same order of model stages
(tensor parallel → freeze → activation checkpointing → compile → FSDP2), and code that runs."""

from __future__ import annotations

import itertools
import math
import re
from pathlib import Path

import pytest

from skills import SkillRefused, apply_skill
from tests.skills.skill_helpers import (
    copy_recipe,
    on_documents,
    run_script,
    target_file,
    template_with,
    traced_not_generated,
    train,
)

WRAPPING = ("tensor-parallel", "freeze", "gradient-checkpointing", "torch-compile")


def model_statements(text: str, first: str, last: str) -> list[str]:
    """The statements from the model construction (``first``) to ``last``, one per line."""
    lines = [line.strip() for line in text.splitlines()]
    start = next(i for i, line in enumerate(lines) if line.startswith(first))
    end = next(i for i in range(start, len(lines)) if lines[i].startswith(last))
    return [line for line in lines[start : end + 1] if line and not line.startswith("#")]


@pytest.mark.parametrize("order", list(itertools.permutations(WRAPPING)), ids="-".join)
def test_template_model_stages_land_in_the_same_order_whatever_the_application_order(order, tmp_path: Path):
    recipe = template_with(order, tmp_path)

    stages = model_statements((recipe / "recipe.py").read_text(), "model = build_model(", "return model")

    assert stages == [
        "model = build_model(self.config.model, self.tokenizer.vocab_size, self.config.data.seq_len)",
        "model = model.to(self.device)",
        'apply_tensor_parallel(model, self.dist.mesh["tp"], warn=self.warn)',
        "freeze_parameters(model, embeddings=True, first_blocks=0, patterns=[])",
        'model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})',
        'compile_blocks(model, mode="default", warn=self.warn)',
        "model = apply_fsdp(model, self.dist, self.config.parallel)",
        "return model",
    ]


@pytest.mark.parametrize("order", list(itertools.permutations(("lora", "freeze", "gradient-checkpointing", "torch-compile"))), ids="-".join)
def test_hf_trainer_stages_stay_before_fsdp_and_the_optimizer(order, tmp_path: Path):
    script = copy_recipe("hf_trainer_style", tmp_path)
    for skill in order:
        apply_skill(skill, script)

    stages = model_statements(script.read_text(), "self.model = LlamaForCausalLM(", "self.optimizer =")

    assert stages[:5] == [
        "self.model = LlamaForCausalLM(config)",
        "apply_lora(self.model, rank=8, alpha=16, dropout=0.0, target_modules=None)",
        "freeze_parameters(self.model, embeddings=True, first_blocks=0, patterns=[])",
        'self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})',
        'compile_blocks(self.model, mode="default")',
    ]
    assert stages[5].startswith("for layer in self.model.model.layers:")  # FSDP2 comes after


def test_every_pair_of_skills_applies_in_both_orders_or_refuses_clearly(tmp_path: Path):
    names = ["gradient-checkpointing", "tensor-parallel", "freeze", "sequence-packing", "loss-guard",
             "mixed-precision", "torch-compile", "lora"]
    for index, (first, second) in enumerate(itertools.permutations(names, 2)):
        recipe = template_with([first], tmp_path / str(index))
        try:
            result = apply_skill(second, recipe)
        except SkillRefused as refusal:
            assert {first, second} == {"lora", "tensor-parallel"}, str(refusal)
            assert "do not combine" in str(refusal)
            continue
        assert result.changed, (first, second)
        compile((recipe / "recipe.py").read_text(), "recipe.py", "exec")


ALL_BUT_TENSOR_PARALLEL = ("sequence-packing", "torch-compile", "loss-guard", "lora", "gradient-checkpointing",
                           "freeze", "mixed-precision")


@pytest.mark.slow
def test_template_with_every_skill_but_tensor_parallel_trains(tmp_path: Path, documents: Path, monkeypatch):
    recipe = template_with(ALL_BUT_TENSOR_PARALLEL, tmp_path / "recipe")
    traced_not_generated(monkeypatch)

    records = train(recipe, tmp_path / "run", "train.max_steps=3", "optim.lr=1e-2", *on_documents(documents))

    assert len(records) == 3 and all(math.isfinite(r["loss"]) for r in records)
    assert records[-1]["loss"] < records[0]["loss"]
    assert records[0]["padding_frac"] < 0.05


@pytest.mark.multiprocess
def test_template_with_tensor_parallel_and_friends_trains_on_two_processes(tmp_path: Path, documents: Path):
    skills = ("gradient-checkpointing", "loss-guard", "mixed-precision", "freeze", "tensor-parallel", "sequence-packing")
    recipe = template_with(skills, tmp_path / "recipe")

    records = train(recipe, tmp_path / "run", "train.max_steps=3", "parallel.tp=2", *on_documents(documents), nproc=2)

    assert len(records) == 3 and all(math.isfinite(r["loss"]) for r in records)


@pytest.mark.slow
@pytest.mark.parametrize(
    "style,skills,args",
    [
        ("nanogpt_style", ("loss-guard", "mixed-precision", "lora", "freeze", "gradient-checkpointing"), ["max_iters=4"]),
        ("hf_trainer_style", ("loss-guard", "mixed-precision", "tensor-parallel", "freeze", "gradient-checkpointing",
                              "sequence-packing"), ["--steps", "4"]),
        ("hf_trainer_style", ("lora", "sequence-packing", "mixed-precision"), ["--steps", "4"]),
    ],
    ids=["nanogpt-5-skills", "hf-trainer-6-skills", "hf-trainer-lora"],
)
def test_scripts_with_several_skills_still_train(style, skills, args, tmp_path: Path):
    script = copy_recipe(style, tmp_path)
    for skill in skills:
        assert apply_skill(skill, script).changed

    losses = run_script(script, *args)

    assert len(losses) == 4 and all(math.isfinite(x) for x in losses)


def test_helpers_are_written_once_and_shared(tmp_path: Path):
    script = copy_recipe("nanogpt_style", tmp_path)
    for skill in ("gradient-checkpointing", "freeze", "lora", "torch-compile"):
        apply_skill(skill, script)
    text = target_file(script).read_text()
    assert len(re.findall(r"^def find_blocks\(", text, flags=re.MULTILINE)) == 1
