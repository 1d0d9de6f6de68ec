"""mixed-precision, proven by a run: the recipe trains with bfloat16 autocast, close to float32."""

from __future__ import annotations

import math
import types
from pathlib import Path

import torch

from tests.skills.skill_helpers import (
    initial_template_model,
    load_recipe_module,
    on_documents,
    template_with,
    train,
)

STEPS = ("train.max_steps=6",)


def test_mixed_precision_trains_close_to_float32(tmp_path: Path, documents: Path, capsys):
    data = on_documents(documents)
    full = train(template_with([], tmp_path / "fp32"), tmp_path / "run-fp32", *STEPS, *data)
    mixed = train(template_with(["mixed-precision"], tmp_path / "bf16"), tmp_path / "run-bf16", *STEPS, *data)

    losses = [r["loss"] for r in mixed]
    gap = max(abs(a["loss"] - b["loss"]) for a, b in zip(full, mixed))
    with capsys.disabled():
        print(f"\n[mixed-precision] loss {losses[0]:.4f} -> {losses[-1]:.4f}; max |bf16 - fp32| {gap:.1e}")
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0] - 0.3
    assert 0 < gap < 5e-2  # bfloat16 changes the numbers a little, not the training


def test_the_written_forward_runs_in_bfloat16(tmp_path: Path):
    recipe = template_with(["mixed-precision"], tmp_path / "bf16")
    module = load_recipe_module(recipe)
    model = initial_template_model(recipe)
    seen = []
    model.lm_head.register_forward_hook(lambda mod, args, out: seen.append(out.dtype))
    fake_engine = types.SimpleNamespace(model=model, device=torch.device("cpu"))
    pieces = [torch.arange(17) % 256, torch.arange(9) % 256]
    batch = module.collate(pieces, 16, 257)

    loss = module.CausalLM.compute_loss(fake_engine, batch)

    assert seen == [torch.bfloat16]
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    assert next(model.parameters()).dtype == torch.float32  # master weights stay float32
