"""sample, evaluate and export_checkpoint through a real MCP client on a short run of each
post-training template (sft, dpo): prompts are rendered by the run's chat template, evaluate
returns the template's task metric, results stay bounded, and an exported SFT model loads with
transformers' Auto classes, chat template and all."""

from __future__ import annotations

import json
import shutil

import pytest

from workspace import git as workspace_git
from tests.mcp.conftest import connect
from tests.support import REPO
from tests.sandbox.helpers import make_workspace

pytestmark = pytest.mark.slow

TINY_MODEL = {"model.hidden_size": 32, "model.intermediate_size": 64, "model.num_layers": 1,
              "train.max_steps": 2, "checkpoint.every": 2, "train.log_every": 1, "metrics.tensorboard": False}
RUNS = {
    "sft": {**TINY_MODEL, "data.seq_len": 96, "data.batch_size": 2, "data.builtin_conversations": 60,
            "data.max_turns": 1, "data.eval_fraction": 0.1, "data.eval_prompts": 3, "data.max_new_tokens": 4},
    "dpo": {**TINY_MODEL, "data.seq_len": 64, "data.batch_size": 2, "data.builtin_pairs": 60,
            "data.eval_fraction": 0.1, "data.eval_prompts": 3, "data.max_new_tokens": 4},
}
METRICS = {"sft": {"answer_accuracy"}, "dpo": {"preferred_rate", "chosen_answer_rate"}}


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    workspace = make_workspace(tmp_path_factory.mktemp("post-training") / "ws")
    for name in RUNS:
        shutil.copytree(REPO / "recipes_template" / name, workspace / "recipes" / name,
                        ignore=shutil.ignore_patterns("__pycache__"))
    workspace_git.commit_paths(workspace_git.ensure_repo(workspace), [workspace / "recipes"], "add sft and dpo", [])
    with connect("memory", workspace) as client:
        runs = {name: client.ok("launch_run", recipe=name, overrides=overrides)["run_id"]
                for name, overrides in RUNS.items()}
        for run_id in runs.values():
            assert client.wait_for_run(run_id)["status"] == "completed"
        yield client, workspace, runs


def text_size(result: dict) -> int:
    return len(json.dumps(result, indent=2, ensure_ascii=False))


@pytest.mark.parametrize("template", sorted(RUNS))
def test_sample_renders_the_chat_template_and_evaluate_gives_the_task_metric(session, template):
    client, _, runs = session
    result = client.ok("sample", run_id=runs[template], prompts=["What is 2 plus 3?", "Hi"], max_new_tokens=12)
    assert result["step"] == 2 and result["chat"] is True
    assert [s["prompt"] for s in result["samples"]] == ["What is 2 plus 3?", "Hi"]
    for item in result["samples"]:
        assert item["stopped"] in ("eos", "max_new_tokens") and 1 <= item["new_tokens"] <= 12
        assert "<|assistant|>" not in item["completion"]  # the rendered prompt is not echoed back
    assert text_size(result) < 8000

    evaluated = client.ok("evaluate", run_id=runs[template])
    assert evaluated["step"] == 2 and evaluated["eval_loss"] > 0 and evaluated["tokens"] > 0
    assert set(evaluated["metrics"]) == METRICS[template]
    assert all(0 <= v <= 1 for v in evaluated["metrics"].values())
    assert text_size(evaluated) < 8000


def test_an_exported_sft_model_loads_with_the_auto_classes_and_keeps_its_chat_template(session):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    client, workspace, runs = session
    result = client.ok("export_checkpoint", run_id=runs["sft"], to="exports/sft")
    folder = workspace / "exports" / "sft"
    model = AutoModelForCausalLM.from_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert result["step"] == 2 and model.config.hidden_size == 32
    assert tokenizer.chat_template and "{% generation %}" in tokenizer.chat_template
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True)
    assert tokenizer.decode(ids).endswith("<|assistant|>\n")


DATA = {
    "sft": [{"messages": [{"role": "user", "content": f"What is {i} plus 1?"},
                          {"role": "assistant", "content": str(i + 1)}]} for i in range(5)],
    "dpo": [{"prompt": f"What is {i} plus 1?", "chosen": str(i + 1), "rejected": str(i + 2)} for i in range(5)],
}


@pytest.mark.parametrize("template", sorted(RUNS))
def test_evaluate_says_how_many_examples_of_which_split_and_warns_under_thirty(session, template):
    client, workspace, runs = session
    launched = client.ok("get_run", run_id=runs[template])["data"]
    evaluated = client.ok("evaluate", run_id=runs[template])
    assert evaluated["split"] == "held_out" and evaluated["examples"] == launched["eval_documents"] < 30
    # The same split, counted the same way as launch_run's data summary.
    assert (evaluated["tokens"], evaluated["loss_tokens"]) == (launched["eval_tokens"], launched["eval_loss_tokens"])
    assert evaluated["loss_tokens"] < evaluated["tokens"]  # prompts are not trained on
    assert evaluated["scored_tokens"] > 0
    assert evaluated["warnings"][0].startswith(
        f"eval_loss and metrics are over {launched['eval_documents']} example(s) of the run's held-out split, "
        "fewer than 30")

    data = workspace / "eval" / f"{template}.jsonl"
    data.parent.mkdir(exist_ok=True)
    data.write_text("".join(json.dumps(record) + "\n" for record in DATA[template]))
    given = client.ok("evaluate", run_id=runs[template], data=[f"eval/{template}.jsonl"])
    assert given["split"] == "data" and given["examples"] == 5 and given["eval_loss"] > 0
    assert "5 example(s) of the data given" in given["warnings"][0]
    assert set(given["metrics"]) == METRICS[template]
