"""list_skills, get_skill, apply_skill and skill:// resources through a real MCP client.

Every test runs twice: in memory and over stdio (see conftest.py).
"""

from __future__ import annotations

import json

import pytest

from tests.mcp.conftest import git, head, tiny_config

SKILL = "gradient-checkpointing"


@pytest.fixture(scope="module")
def recipe(client, workspace) -> str:
    """recipes/lm, scaffolded and committed; each test that dirties it cleans up after itself."""
    return client.ok("scaffold_recipe", template="causal_lm", name="lm", config=tiny_config())["path"]


@pytest.fixture(scope="module")
def skill_version(client) -> str:
    return next(s["version"] for s in client.ok("list_skills")["skills"] if s["name"] == SKILL)


def test_list_skills_names_each_skill_with_a_description_and_version(client):
    skills = {s["name"]: s for s in client.ok("list_skills")["skills"]}
    assert SKILL in skills
    assert skills[SKILL]["description"] and skills[SKILL]["version"]
    assert skills[SKILL]["requires_gpu"] is False


def test_get_skill_returns_the_skill_md_and_its_parameter_schema(client):
    skill = client.ok("get_skill", skill=SKILL)
    assert skill["name"] == SKILL
    assert skill["skill_md"].startswith("---\nname: gradient-checkpointing\n")
    assert skill["params_schema"]["type"] == "object"
    assert skill["truncated"] is False


def test_the_skill_resource_is_the_skill_md(client):
    assert f"skill://{SKILL}" in client.resources()
    assert client.read_text(f"skill://{SKILL}") == client.ok("get_skill", skill=SKILL)["skill_md"]


def test_an_unknown_skill_is_a_tool_error_that_lists_the_skills(client, recipe):
    for message in (
        client.error("get_skill", skill="gradient-checkpoint"),
        client.error("apply_skill", skill="gradient-checkpoint", recipe=recipe),
    ):
        assert "no skill named 'gradient-checkpoint'" in message
        assert f"valid skills: flash-attention, freeze, {SKILL}, " in message
    assert client.read_error("skill://gradient-checkpoint") == "Unknown resource: skill://gradient-checkpoint"


def test_a_dry_run_returns_the_diff_and_changes_nothing(client, workspace, recipe):
    before = head(workspace)
    source = (workspace / recipe / "recipe.py").read_text()

    result = client.ok("apply_skill", skill=SKILL, recipe=recipe, dry_run=True)

    assert result["changed"] is True and result["dry_run"] is True and result["commit"] is None
    assert f"+++ b/{recipe}/recipe.py" in result["diff"]
    assert "\n+" in result["diff"] and (
        '\n+        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})' in result["diff"])
    assert result["acts_on"].startswith("turns on AutoModelForCausalLM or LlamaForCausalLM's own activation checkpointing")
    assert (workspace / recipe / "recipe.py").read_text() == source
    assert head(workspace) == before


def test_apply_skill_makes_one_commit_with_the_skill_trailers_and_then_nothing(client, workspace, recipe,
                                                                            skill_version):
    before = head(workspace)

    result = client.ok("apply_skill", skill=SKILL, recipe=recipe)

    assert result["changed"] is True and result["already_applied"] is False
    assert result["commit"] == head(workspace)
    assert git(workspace, "rev-parse", f"{result['commit']}^") == before  # exactly one commit
    assert git(workspace, "log", "-1", "--format=%s") == f"skill({SKILL}): apply to {recipe}"
    trailers = git(workspace, "log", "-1", "--format=%(trailers:only,unfold)")
    assert f"Skill-Applied: {SKILL}@{skill_version}" in trailers
    assert f"Skill-Params: {json.dumps(result['params'], separators=(',', ':'))}" in trailers
    assert git(workspace, "show", "--format=", "--name-only", "HEAD") == f"{recipe}/recipe.py"
    assert git(workspace, "status", "--porcelain", "--", recipe) == ""

    again = client.ok("apply_skill", skill=SKILL, recipe=recipe)

    assert again["changed"] is False and again["already_applied"] is True
    assert again["commit"] is None and again["diff"] == ""
    assert head(workspace) == result["commit"]


def test_apply_skill_refuses_a_recipe_with_uncommitted_changes(client, workspace, recipe):
    config = workspace / recipe / "config.yaml"
    committed = config.read_text()
    before = head(workspace)
    config.write_text(committed + "# an edit the agent has not committed\n")
    try:
        message = client.error("apply_skill", skill="loss-guard", recipe=recipe)
        assert f"recipe {recipe} has uncommitted changes ({recipe}/config.yaml)" in message
        assert "commit or discard them first" in message
        assert head(workspace) == before
    finally:
        config.write_text(committed)


@pytest.mark.parametrize(
    "arguments, expected",
    [
        ({"params": {"every": "often"}}, "bad value for 'every' ('often')"),
        ({"params": {"evry": 2}}, "unknown param 'evry'; valid params: every"),
        ({"recipe": "recipes/nope"}, "not_found: no recipe 'recipes/nope' in the workspace"),
        ({"recipe": "/etc"}, "resolves outside the workspace"),
        ({"skill": "../lora"}, "skill '../lora' is not a plain name"),
        ({"dry_run": "perhaps"}, "dry_run\n  Input should be a valid boolean"),
    ],
)
def test_bad_apply_skill_arguments_are_tool_errors_that_change_nothing(client, workspace, recipe, arguments,
                                                                       expected):
    before = head(workspace)
    message = client.error("apply_skill", **{"skill": SKILL, "recipe": recipe, **arguments})
    assert expected in message
    assert head(workspace) == before
    assert git(workspace, "status", "--porcelain") == ""


def test_target_names_the_model_of_a_two_model_script(client, workspace):
    """A GAN builds two models: without target the refusal lists both; apply_skill's target
    puts the change on the named one only; the same target given twice differently is refused."""
    import shutil
    from pathlib import Path

    shutil.copy(Path(__file__).parents[1] / "skills" / "recipes" / "gan.py", workspace / "gan.py")
    git(workspace, "add", "gan.py")
    git(workspace, "commit", "-qm", "a GAN script")
    refusal = client.error("apply_skill", skill="mixed-precision", recipe="gan.py", dry_run=True)
    assert "`netG` at gan.py:" in refusal and "`netD` at gan.py:" in refusal
    conflict = client.error("apply_skill", skill="mixed-precision", recipe="gan.py", target="netD",
                            params={"target": "netG"})
    assert "bad_input: target is given twice" in conflict
    result = client.ok("apply_skill", skill="mixed-precision", recipe="gan.py", target="netD", dry_run=True)
    assert result["changed"] and result["params"]["target"] == "netD"
    changed = [line for line in result["diff"].splitlines() if line.startswith(("+", "-")) and not line.startswith(("+++", "---"))]
    assert any("netD(" in line for line in changed) and not any("netG(" in line for line in changed), result["diff"]
