"""Workflows as MCP prompts (slash commands in clients that list prompts), and completions of
prompt arguments and ``run://`` URIs from the workspace as it is."""

from __future__ import annotations

import re

import pytest
from mcp.shared.exceptions import MCPError
from mcp_types import INVALID_PARAMS, PromptReference, ResourceTemplateReference

from tests.mcp.conftest import connect
from tests.sandbox.helpers import fake_run, make_workspace

TOOL_CALL = re.compile(r"\b([a-z_]+)\(")


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    workspace = make_workspace(tmp_path_factory.mktemp("prompts") / "ws")
    for run_id in ("20260101-000000-lm-0000", "20260102-000000-lm-0001", "20260102-000001-other-0002"):
        fake_run(workspace, run_id)
    with connect("memory", workspace) as client:
        yield client


def prompt_text(session, prompt: str, **arguments: str) -> str:
    result = session.portal.call(lambda: session.client.get_prompt(prompt, arguments))
    (message,) = result.messages
    assert message.role == "user"
    return message.content.text


def test_the_workflows_are_listed_with_their_arguments(session):
    prompts = {p.name: p for p in session.portal.call(session.client.list_prompts).prompts}
    assert set(prompts) == {"finetune", "reinforce", "speed_up", "diagnose_run"}
    arguments = {name: {(a.name, a.required) for a in p.arguments} for name, p in prompts.items()}
    assert arguments["finetune"] == {("model", True), ("data", True), ("template", False), ("name", False)}
    assert arguments["reinforce"] == {("model", True), ("data", True), ("reward", True), ("name", False)}
    assert arguments["diagnose_run"] == {("run_id", True)}
    assert all(p.description for p in prompts.values())


@pytest.mark.parametrize("name, arguments, in_order", [
    ("finetune", {"model": "org/tiny-qwen@main", "data": "data/chats.parquet"},
     ["describe_recipe", "scaffold_recipe", "apply_skill", "launch_run", "wait_run", "tail_metrics",
      "evaluate", "export_checkpoint"]),
    ("reinforce", {"model": "org/tiny-qwen", "data": "data/questions.jsonl", "reward": "the answer is right"},
     ["describe_recipe", "scaffold_recipe", "apply_skill", "launch_run", "wait_run", "tail_metrics", "evaluate",
      "export_checkpoint"]),
    ("speed_up", {"recipe": "recipes/lm"}, ["list_runs", "get_run", "list_skills", "get_skill", "apply_skill",
                                            "compare_runs"]),
    ("diagnose_run", {"run_id": "20260101-000000-lm-0000"}, ["get_run", "tail_metrics", "list_checkpoints",
                                                            "resume_checkpoint"]),
])
def test_each_prompt_names_existing_tools_in_order_with_its_arguments_filled_in(session, name, arguments, in_order):
    text = prompt_text(session, name, **arguments)
    tools = set(session.tools())
    called = [t for t in TOOL_CALL.findall(text) if t in tools]
    assert called, text
    firsts = [called.index(tool) for tool in in_order]
    assert firsts == sorted(firsts), (name, called)
    # Every name followed by "(" that looks like a tool is one the server has.
    assert {t for t in TOOL_CALL.findall(text) if "_" in t} <= tools | {"data_files"}, text
    for value in arguments.values():
        assert f'"{value}"' in text


def test_finetune_fills_the_recipe_path_and_the_config_keys(session):
    text = prompt_text(session, "finetune", model="org/m", data="data/a.jsonl", name="chat")
    assert 'scaffold_recipe(template="sft", name="chat", config={"model.pretrained_path": "org/m", ' \
           '"data.paths": ["data/a.jsonl"]' in text
    assert 'launch_run(recipe="recipes/chat")' in text


def test_a_hostile_argument_is_quoted_and_bounded(session):
    text = prompt_text(session, "diagnose_run", run_id='x") ; stop_run(run_id="*\n\x1b[2J' + "y" * 1000)
    assert "\x1b" not in text and '\\"' in text
    assert len(text) < 3000


def test_an_unknown_prompt_or_a_missing_argument_is_invalid_params(session):
    with pytest.raises(MCPError) as unknown:
        session.portal.call(lambda: session.client.get_prompt("train_everything", {}))
    assert unknown.value.error.code == INVALID_PARAMS
    assert "unknown prompt 'train_everything'; prompts: diagnose_run, finetune, reinforce, speed_up" in str(unknown.value)
    with pytest.raises(MCPError) as missing:
        session.portal.call(lambda: session.client.get_prompt("finetune", {"model": "org/m"}))
    assert missing.value.error.code == INVALID_PARAMS


def complete(session, ref, name: str, value: str) -> list[str]:
    result = session.portal.call(lambda: session.client.complete(ref, {"name": name, "value": value}))
    return result.completion.values


def test_run_ids_complete_in_uris_and_prompts_newest_first(session):
    metrics = ResourceTemplateReference(type="ref/resource", uri="run://{run_id}/metrics")
    assert complete(session, metrics, "run_id", "2026010") == [
        "20260102-000001-other-0002", "20260102-000000-lm-0001", "20260101-000000-lm-0000"]
    assert complete(session, metrics, "run_id", "20260102-000000") == ["20260102-000000-lm-0001"]
    assert complete(session, metrics, "run_id", "nothing") == []
    diagnose = PromptReference(type="ref/prompt", name="diagnose_run")
    assert complete(session, diagnose, "run_id", "20260101") == ["20260101-000000-lm-0000"]


def test_recipes_and_templates_complete_from_the_workspace_and_the_library(session):
    assert complete(session, PromptReference(type="ref/prompt", name="speed_up"), "recipe", "rec") == ["recipes/lm"]
    finetune = PromptReference(type="ref/prompt", name="finetune")
    assert complete(session, finetune, "template", "") == sorted(
        t["name"] for t in session.ok("list_templates")["templates"])
    assert complete(session, finetune, "template", "s") == ["sft"]
    assert complete(session, finetune, "name", "") == []


def test_speed_up_measures_each_skill_as_an_interleaved_a_b_of_its_commit(session):
    text = prompt_text(session, "speed_up", recipe="recipes/lm")
    without, with_it = text.index('commit="C^") (a: without it)'), text.index('commit="C") (b: with it)')
    assert without < with_it < text.index("then b again and a again") < text.index("compare_runs(run_a, run_b)")
    assert '`trainwright ab SKILL "recipes/lm" --steps 30 --note`' in text
    assert "compare_runs(run_a, run_b) for each pair, first_step_s and wall_s" in text


def test_speed_up_on_a_script_says_its_runs_take_args_where_a_recipes_take_overrides(session):
    text = prompt_text(session, "speed_up", recipe="train.py")
    assert "a script's runs take its command line as args=A (which sets its steps) wherever a recipe's take " \
        "overrides=O" in text
    assert 'launch_run(recipe="train.py", overrides=O, commit="C^")' in text  # commit= runs a script's commit too
    assert 'for a script `trainwright ab SKILL "train.py" --note -- A`' in text


@pytest.mark.slow
def test_the_finetune_prompts_calls_succeed_as_written_and_what_it_says_to_read_is_there(tmp_path):
    """The prompt's own scaffold config, run: the data summary it sends the agent to is in
    get_run, the smoke run logs enough records to see the loss fall, the export it names works."""
    import json
    import shutil

    from tests.model_families import tiny_model_folder

    workspace = make_workspace(tmp_path / "ws")
    tiny_model_folder(workspace / "models" / "tiny", "qwen2")
    (workspace / "data").mkdir()
    chats = [{"messages": [{"role": "user", "content": f"What is {a} + {b}?"},
                           {"role": "assistant", "content": str(a + b)}]} for a in range(8) for b in range(8)]
    (workspace / "data" / "chats.jsonl").write_text("".join(json.dumps(c) + "\n" for c in chats))
    with connect("memory", workspace) as session:
        text = prompt_text(session, "finetune", model="models/tiny", data="data/chats.jsonl", name="chat")
        config = json.loads(re.search(r"scaffold_recipe\(template=\"sft\", name=\"chat\", config=(\{.*?\})\);",
                                      text).group(1))
        assert session.ok("describe_recipe", recipe="sft")["fields"]
        assert session.ok("scaffold_recipe", template="sft", name="chat", config=config)["path"] == "recipes/chat"
        assert 'launch_run(recipe="recipes/chat")' in text
        run_id = session.ok("launch_run", recipe="recipes/chat")["run_id"]
        info = session.wait_for_run(run_id)
        assert info["status"] == "completed", info
        data = session.ok("get_run", run_id=run_id)["data"]
        assert (data["format"], data["mask"], data["dropped"]) == ("messages", "turn_render", 0) and data["loss_tokens"]
        records = session.ok("tail_metrics", run_id=run_id)["records"]
        assert len(records) >= 5 and records[-1]["loss"] < records[0]["loss"]  # "the loss must fall" can be read
        to = re.search(r"export_checkpoint\(run_id, to=\"([^\"]+)\"\)", text).group(1)
        assert to == "exports/chat"
        assert session.ok("export_checkpoint", run_id=run_id, to=to)["path"].endswith("exports/chat")
        assert (workspace / "exports" / "chat" / "config.json").is_file()
        shutil.rmtree(workspace / "exports")


def _called(text: str, tool: str) -> str:
    """The argument text of the first ``tool(...)`` call the prompt names."""
    start = text.index(f"{tool}(") + len(tool) + 1
    depth, end = 1, start
    while depth:
        depth += {"(": 1, ")": -1}.get(text[end], 0)
        end += 1
    return text[start:end - 1]


@pytest.mark.slow
def test_the_speed_up_and_diagnose_run_prompts_calls_succeed_as_written(tmp_path):
    """Each call the two prompts name, run as written on a small recipe: the figures speed_up
    sends the agent to read are in get_run, its A/B of a skill commit runs and compares, and
    diagnose_run's reads and resume work on the run."""
    import json

    from tests.support import TINY

    workspace = make_workspace(tmp_path / "ws")
    with connect("memory", workspace) as session:
        sizes = dict(item.split("=", 1) for item in TINY)
        config = {key: json.loads(value) if value[0].isdigit() else value for key, value in sizes.items()}
        session.ok("scaffold_recipe", template="causal_lm", name="fast",
                   config={**config, "checkpoint.every": 10, "data.source": "random"})
        text = prompt_text(session, "speed_up", recipe="recipes/fast")

        # 1. No run yet: the prompt's own smoke run; then the figures it names.
        assert session.ok("list_runs")["runs"] == []
        overrides = json.loads(re.search(r'launch_run\(recipe="recipes/fast", overrides=(\{.*?\})\)', text).group(1))
        assert overrides == {"train.max_steps": 30}
        baseline = session.ok("launch_run", recipe="recipes/fast", overrides=overrides)["run_id"]
        assert session.wait_for_run(baseline)["status"] == "completed"
        info = session.ok("get_run", run_id=baseline)
        assert "tokens/s" in info["speed"] and "warnings" in info
        assert {"padding_frac", "peak_mem_mb"} <= set(info["latest"])

        # 2-3. The skills, one's card, its dry run and its commit C.
        assert {"sequence-packing", "torch-compile", "flash-attention"} <= {s["name"] for s in session.ok("list_skills")["skills"]}
        assert "When to use" in session.ok("get_skill", skill="sequence-packing")["skill_md"]
        assert _called(text, "apply_skill") == 'skill, recipe="recipes/fast", dry_run=true'
        assert session.ok("apply_skill", skill="sequence-packing", recipe="recipes/fast", dry_run=True)["diff"]
        commit = session.ok("apply_skill", skill="sequence-packing", recipe="recipes/fast")["commit"]

        # 4. The A/B: the commit before C (a) and C (b), the same overrides; compared.
        ab = {"train.max_steps": 10, "train.log_every": 1}
        run_a = session.ok("launch_run", recipe="recipes/fast", overrides=ab, commit=f"{commit}^")["run_id"]
        assert session.wait_for_run(run_a)["status"] == "completed"
        run_b = session.ok("launch_run", recipe="recipes/fast", overrides=ab, commit=commit)["run_id"]
        assert session.wait_for_run(run_b)["status"] == "completed"
        compared = session.ok("compare_runs", run_a=run_a, run_b=run_b)
        assert compared["metrics"] and any("sequence-packing" in str(d) for d in compared.values())

        # diagnose_run, on the baseline: each read and the resume it names.
        text = prompt_text(session, "diagnose_run", run_id=baseline)
        assert session.ok("get_run", run_id=baseline)["status"] == "completed"
        assert _called(text, "tail_metrics") == f'run_id="{baseline}", follow_resumes=true'
        assert session.ok("tail_metrics", run_id=baseline, follow_resumes=True)["records"]
        png, mime = session.read_bytes(f"run://{baseline}/loss.png")
        assert mime == "image/png" and png.startswith(b"\x89PNG")
        steps = [c["step"] for c in session.ok("list_checkpoints", run_id=baseline)["checkpoints"]]
        assert steps[-1] == 30 and len(steps) >= 2  # the recipe keeps the last ones
        assert "resume_checkpoint(run_id, step)" in text
        resumed = session.ok("resume_checkpoint", run_id=baseline, step=steps[0])["run_id"]
        assert session.wait_for_run(resumed)["status"] == "completed"
