"""list_templates and scaffold_recipe through a real MCP client (in memory and over stdio)."""

from __future__ import annotations

import json

import pytest
import yaml

from tests.mcp.conftest import git, head, tiny_config


def test_list_templates_describes_the_causal_lm_template(client):
    templates = {t["name"]: t["description"] for t in client.ok("list_templates")["templates"]}
    assert "causal_lm" in templates and templates["causal_lm"]
    assert templates["sft"].startswith("Supervised fine-tuning") and templates["dpo"].startswith("Preference alignment")
    assert templates["vlm"].startswith("Vision-language model")


def test_scaffold_recipe_commits_the_recipe_then_one_commit_per_skill(client, workspace):
    config = tiny_config(**{"train.max_steps": 12})
    progress = []

    result = client.ok(
        "scaffold_recipe", progress, template="causal_lm", name="scaffolded", config=config,
        skills=["gradient-checkpointing"],
    )

    assert result["path"] == "recipes/scaffolded"
    assert result["config"] == config
    (applied,) = result["skills"]
    assert applied["skill"] == "gradient-checkpointing" and applied["changed"] is True
    assert applied["commit"] == head(workspace)
    assert git(workspace, "log", "-2", "--format=%H %s").splitlines() == [
        f"{applied['commit']} skill(gradient-checkpointing): apply to recipes/scaffolded",
        f"{result['commit']} recipe(scaffolded): scaffold from template causal_lm",
    ]
    trailers = git(workspace, "log", "-1", "--format=%(trailers:only,unfold)", result["commit"])
    assert "Trainwright-Tool: scaffold_recipe" in trailers and "Scaffolded-From: causal_lm" in trailers
    written = yaml.safe_load((workspace / "recipes/scaffolded/config.yaml").read_text())
    assert written["train"]["max_steps"] == 12 and written["model"]["hidden_size"] == 64
    assert git(workspace, "status", "--porcelain", "--", "recipes") == ""
    # It takes seconds (the engine checks the config): the client hears how it goes.
    assert progress == [(0, 2, "checking the config and skills"), (2, 2, "scaffolded")]


@pytest.mark.parametrize(
    "arguments, expected",
    [
        ({"config": {"train.max_stpes": 3}}, "unknown config key 'train.max_stpes' (did you mean 'train.max_steps'?)"),
        ({"skills": ["gradient-checkpoint"]}, "no skill named 'gradient-checkpoint'"),
        ({"skills": [{"name": "lora", "params": "r=8"}]}, "params of skill 'lora' must be a mapping"),
        ({"skills": [3]}, "skills.0.str\n  Input should be a valid string"),  # the schema: names or objects
        ({"template": "seq2seq"}, "unknown template 'seq2seq'; templates: causal_lm, dpo, grpo, sft, vlm, vlm_chat"),
        ({"name": "../escape"}, "recipe name '../escape' is not a plain name"),
        ({"config": {"data.paths": ["/etc/passwd"]}}, "resolves outside the workspace"),
        ({"config": "train.max_steps=3"}, "config\n  Input should be a valid dictionary"),
    ],
)
def test_a_bad_scaffold_request_is_a_tool_error_and_writes_nothing(client, workspace, arguments, expected):
    before, recipes = head(workspace), sorted(p.name for p in (workspace / "recipes").glob("*"))
    message = client.error("scaffold_recipe", **{"template": "causal_lm", "name": "rejected", **arguments})
    assert expected in message
    assert not (workspace / "recipes" / "rejected").exists()
    assert not (workspace / "recipes" / "escape").exists() and not (workspace / "escape").exists()
    assert head(workspace) == before
    assert sorted(p.name for p in (workspace / "recipes").glob("*")) == recipes


def test_scaffolding_over_an_existing_recipe_is_refused(client, workspace):
    before = (workspace / "recipes/scaffolded/config.yaml").read_text()
    message = client.error("scaffold_recipe", template="causal_lm", name="scaffolded")
    assert "recipes/scaffolded already exists; choose another name" in message
    assert (workspace / "recipes/scaffolded/config.yaml").read_text() == before


def test_every_call_is_in_the_audit_log(client, workspace):
    entries = [json.loads(line) for line in (workspace / ".trainwright/audit.jsonl").read_text().splitlines()]
    scaffolds = [e for e in entries if e["tool"] == "scaffold_recipe"]
    assert scaffolds[0]["outcome"] == "ok" and scaffolds[0]["commit"]
    assert any(e["outcome"] == "error" and "unknown template 'seq2seq'" in e["error"] for e in scaffolds)
