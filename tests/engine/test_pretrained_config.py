"""With model.pretrained_path, config_changes and describe_recipe show the model that is built:
its keys come from the pretrained folder's config.json, and the recipe's sizes say they are unused."""

from __future__ import annotations

import json

import pytest

from engine.config import build_config, config_changes, describe_fields
from tests.support import REPO

PRETRAINED = {"architectures": ["LlamaForCausalLM"], "hidden_size": 256, "intermediate_size": 688,
              "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512,
              "rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"}}


@pytest.mark.parametrize("template", ["sft", "dpo", "causal_lm"])
def test_the_model_keys_are_the_pretrained_models_and_the_recipes_sizes_are_marked_unused(tmp_path, template,
                                                                                           monkeypatch):
    from engine.launch import load_recipe_class

    monkeypatch.delenv("TRAINWRIGHT_WORKSPACE", raising=False)
    pretrained = tmp_path / "exports" / "base"
    pretrained.mkdir(parents=True)
    (pretrained / "config.json").write_text(json.dumps(PRETRAINED))
    recipe_class = load_recipe_class(REPO / "recipes_template" / template)
    config = build_config(recipe_class.config_class, None, {
        "model.hidden_size": 128, "model.num_layers": 2, "model.pretrained_path": str(pretrained)})

    changes = config_changes(config)
    assert changes["model.num_layers"] == 6 and changes["model.rope_theta"] == 500000.0
    assert "model.hidden_size" not in changes  # 256 is the code default, and what is built
    assert changes["model.pretrained_path"] == str(pretrained)

    fields = {f["key"]: f for f in describe_fields(config)}
    assert fields["model.hidden_size"]["value"] == 256 and fields["model.num_layers"]["value"] == 6
    assert fields["model.num_layers"]["description"].startswith(
        "unused: model.pretrained_path is set, so the model's config.json gives 6 (the recipe's 2 is not applied).")
    assert not fields["model.pretrained_path"]["description"].startswith("unused")


def test_without_a_config_json_the_recipes_keys_stand(tmp_path, monkeypatch):
    from engine.launch import load_recipe_class

    monkeypatch.delenv("TRAINWRIGHT_WORKSPACE", raising=False)
    recipe_class = load_recipe_class(REPO / "recipes_template" / "sft")
    config = build_config(recipe_class.config_class, None, {"model.num_layers": 2,
                                                            "model.pretrained_path": str(tmp_path / "nothing")})
    assert config_changes(config)["model.num_layers"] == 2
    assert not any(f["description"].startswith("unused") for f in describe_fields(config))


def test_a_config_json_outside_the_workspace_is_not_read(tmp_path, monkeypatch):
    from engine.launch import load_recipe_class

    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "config.json").write_text(json.dumps(PRETRAINED))
    (tmp_path / "ws").mkdir()
    monkeypatch.setenv("TRAINWRIGHT_WORKSPACE", str(tmp_path / "ws"))
    recipe_class = load_recipe_class(REPO / "recipes_template" / "sft")
    config = build_config(recipe_class.config_class, None, {"model.num_layers": 2,
                                                            "model.pretrained_path": str(outside)})
    assert config_changes(config)["model.num_layers"] == 2


def test_a_hub_id_the_server_bound_shows_the_models_keys_as_a_folder_does(tmp_path, monkeypatch):
    """With model.pretrained_path a Hub id, run.json recorded the template's sizes (128 / 344)
    while the model trained was 64 / 160."""
    from engine.data_files import HUB_MODELS_VARIABLE
    from engine.launch import load_recipe_class

    monkeypatch.delenv("TRAINWRIGHT_WORKSPACE", raising=False)
    snapshot = tmp_path / "hf" / "hub" / "models--org--tiny" / "snapshots" / ("a" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps({**PRETRAINED, "hidden_size": 64, "intermediate_size": 160}))
    monkeypatch.setenv(HUB_MODELS_VARIABLE, json.dumps({"org/tiny": str(snapshot)}))
    recipe_class = load_recipe_class(REPO / "recipes_template" / "sft")
    config = build_config(recipe_class.config_class, None, {"model.pretrained_path": "org/tiny"})
    changes = config_changes(config)
    assert (changes["model.hidden_size"], changes["model.intermediate_size"]) == (64, 160)
    fields = {f["key"]: f for f in describe_fields(config)}
    assert fields["model.hidden_size"]["description"].startswith(
        "unused: model.pretrained_path is set, so the model's config.json gives 64")
    monkeypatch.delenv(HUB_MODELS_VARIABLE)  # not bound: nothing to read, the recipe's keys stand
    assert "model.intermediate_size" not in config_changes(config) or \
        config_changes(config)["model.intermediate_size"] != 160
