"""lora, proven by a run: only the adapters train; every base weight is bit-unchanged."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.skills.skill_helpers import (
    SMALL_RUN,
    final_checkpoint,
    initial_template_model,
    launch,
    on_documents,
    run_metrics,
    template_with,
)

SETTINGS = ("train.max_steps=4", "checkpoint.at_end=true", "optim.lr=1e-2", "optim.warmup_steps=0")


def test_lora_trains_only_the_adapters(tmp_path: Path, documents: Path, capsys):
    recipe = template_with(["lora"], tmp_path / "recipe", {"lora": {"rank": 4}})

    (tmp_path / "run").mkdir()
    run = launch(recipe, tmp_path / "run", *SMALL_RUN, *SETTINGS, *on_documents(documents))
    assert run.returncode == 0, run.stderr[-3000:]
    records = run_metrics(tmp_path / "run")
    # The helper says what it adapted: 7 linear layers in each of the 2 decoder layers.
    assert "lora: adapted 14 linear layers (down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj) of " \
        "LlamaForCausalLM; 36,992 trainable values" in run.stdout

    state = final_checkpoint(tmp_path / "run", tmp_path)["model_optim"]
    weights, optimizer = state["model"], state["optim"]
    initial = {n: p.detach() for n, p in initial_template_model(recipe, *SETTINGS).named_parameters()}
    adapters = {n for n in weights if ".lora_" in n}
    base = {n.replace(".base_layer", ""): w for n, w in weights.items() if n not in adapters}

    assert set(base) == set(initial)
    assert all(torch.equal(base[n], initial[n]) for n in initial), "a base weight changed"
    # Every linear layer of every block got an adapter; B starts at zero and has moved.
    assert len(adapters) == 2 * 7 * 2  # (A, B) × 7 linear layers × 2 blocks
    assert all(weights[n].abs().sum() > 0 for n in adapters if ".lora_B." in n)
    assert {n for g in optimizer["param_groups"] for n in g["params"]} == adapters
    assert set(optimizer["state"]) == adapters
    trainable = sum(weights[n].numel() for n in adapters)
    total = trainable + sum(w.numel() for w in base.values())
    with capsys.disabled():
        print(f"\n[lora] trainable {trainable:,} of {total:,} parameters ({trainable / total:.1%}); "
              f"loss {records[0]['loss']:.3f} -> {records[-1]['loss']:.3f}")
    assert records[-1]["loss"] < records[0]["loss"]
