"""freeze, proven by a run: frozen parameters are bit-unchanged and absent from the optimizer."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.skills.skill_helpers import final_checkpoint, initial_template_model, on_documents, template_with, train

SETTINGS = ("train.max_steps=3", "checkpoint.at_end=true")
FROZEN = {"model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.down_proj.weight"}


def test_frozen_parameters_do_not_change_and_are_not_in_the_optimizer(tmp_path: Path, documents: Path):
    params = {"freeze": {"embeddings": True, "first_blocks": 1, "patterns": ["lm_head.*"]}}
    recipe = template_with(["freeze"], tmp_path / "recipe", params)

    records = train(recipe, tmp_path / "run", *SETTINGS, *on_documents(documents))

    state = final_checkpoint(tmp_path / "run", tmp_path)["model_optim"]
    initial = dict(initial_template_model(recipe, *SETTINGS).named_parameters())
    weights, optimizer = state["model"], state["optim"]
    frozen = {n for n in initial if n.startswith(("model.embed_tokens.", "model.layers.0.", "lm_head."))}
    trainable = set(initial) - frozen
    assert FROZEN <= frozen and trainable
    for name in frozen:
        assert torch.equal(weights[name], initial[name].detach()), f"{name} changed"
    assert all(not torch.equal(weights[n], initial[n].detach()) for n in trainable if "norm" not in n)
    in_optimizer = {n for group in optimizer["param_groups"] for n in group["params"]}
    assert in_optimizer == trainable
    assert set(optimizer["state"]) == trainable
    assert records[-1]["loss"] < records[0]["loss"]


def test_freeze_writes_find_blocks_only_when_it_freezes_blocks(tmp_path: Path):
    embeddings_only = (template_with(["freeze"], tmp_path / "embeddings") / "recipe.py").read_text()
    with_blocks = (template_with(["freeze"], tmp_path / "blocks", {"freeze": {"first_blocks": 1}}) / "recipe.py").read_text()

    assert "def find_blocks(" not in embeddings_only and "find_blocks(" not in embeddings_only
    assert with_blocks.count("def find_blocks(") == 1
    assert 'found_blocks=find_blocks(model, "freeze", warn=self.warn)' in with_blocks
