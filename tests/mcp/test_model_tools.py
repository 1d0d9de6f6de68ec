"""export_checkpoint, sample and evaluate through a real MCP client, on one short causal_lm run.

Each tool loads the run's recipe in the run sandbox (``python -m engine.model_io``); what comes
back is bounded, a bad request is refused before anything starts, and a refused export changes
nothing in the workspace.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mcp_server.limits import AGENT_BUDGET_CHARS
from tests.mcp.conftest import SHORT_RUN, connect, tiny_config
from tests.sandbox.helpers import DATA_CACHE, make_workspace, tree_hash

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    workspace = make_workspace(tmp_path_factory.mktemp("model-tools") / "ws")  # recipes/lm: the template
    with connect("memory", workspace) as client:
        run_id = client.ok("launch_run", recipe="lm", overrides=tiny_config(**SHORT_RUN))["run_id"]
        assert client.wait_for_run(run_id)["status"] == "completed"
        yield client, workspace, run_id


def text_size(result: dict) -> int:
    return len(json.dumps(result, indent=2, ensure_ascii=False))


def test_sample_and_evaluate_answer_with_bounded_results(session):
    client, workspace, run_id = session
    progress: list = []
    result = client.ok("sample", progress, run_id=run_id, prompts=["def ", "import os\n"], max_new_tokens=24)
    assert result["step"] == 6 and result["chat"] is False
    assert [s["prompt"] for s in result["samples"]] == ["def ", "import os\n"]
    for item in result["samples"]:
        # The byte tokenizer: each new token is a byte, or the end of a document (which stops it).
        assert item["stopped"] in ("eos", "max_new_tokens") and 1 <= item["new_tokens"] <= 24
        assert item["completion"] and not item["cut"]
    assert [p[:2] for p in progress] == [(0, 1), (1, 1)]
    assert text_size(result) < 2000

    (workspace / "eval").mkdir()
    (workspace / "eval" / "a.txt").write_text("print('hello world')\n" * 20)
    evaluated = client.ok("evaluate", run_id=run_id, step=3, data=["eval/a.txt"])
    assert evaluated["step"] == 3 and 0 < evaluated["eval_loss"] < 6.0 and evaluated["tokens"] > 0
    assert 0 <= evaluated["metrics"]["next_token_accuracy"] <= 1
    assert text_size(evaluated) < 1000


def test_sample_results_are_cut_to_the_agent_budget():
    from engine.seams import GeneratedSample
    from mcp_server.operations.model_tools import _bounded_samples

    raw = [GeneratedSample(prompt="p" * 4000, completion="\x01é" * 2000, new_tokens=512, stopped="max_new_tokens")] * 8
    samples = [s.model_dump() for s in _bounded_samples(raw)]
    assert text_size({"run_id": "x" * 40, "step": 1, "samples": samples}) < AGENT_BUDGET_CHARS
    assert all(s["cut"] and s["completion"].startswith("\x01é") and s["completion"].endswith("…") for s in samples)
    short = [GeneratedSample(prompt="a", completion="b", new_tokens=1, stopped="eos")]
    assert [s.model_dump() for s in _bounded_samples(short)] == [
        {"prompt": "a", "completion": "b", "new_tokens": 1, "stopped": "eos", "cut": False, "input": None, "expected": None,
         "raw": {}}]
    # A chat model's text as written, its reasoning and its calls share the budget with the answer.
    written = [GeneratedSample(prompt="p", completion="c" * 4000, raw="<think>" + "r" * 3000 + "</think>" + "c" * 4000,
                               reasoning="r" * 3000, tool_calls=[{"name": "add", "arguments": {"a": 1}}],
                               new_tokens=512, stopped="max_new_tokens")] * 8
    samples = [s.model_dump() for s in _bounded_samples(written)]
    assert text_size({"run_id": "x" * 40, "step": 1, "samples": samples}) < AGENT_BUDGET_CHARS
    assert all(s["cut"] and s["raw"]["text"].startswith("<think>r") and s["raw"]["reasoning"].startswith("rrr")
               and s["raw"]["tool_calls"] == [{"name": "add", "arguments": {"a": 1}}] for s in samples)


def test_export_writes_a_hugging_face_folder_and_refuses_a_folder_with_files(session):
    client, workspace, run_id = session
    result = client.ok("export_checkpoint", run_id=run_id, to="exports/lm")
    folder = workspace / "exports" / "lm"
    assert result["path"] == "exports/lm" and result["lora"] is None
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"} <= set(result["files"])
    assert sorted(p.name for p in folder.iterdir()) == sorted(result["files"])
    assert json.loads((folder / "generation_config.json").read_text())["eos_token_id"] == 256
    assert not [p for p in (workspace / "exports").iterdir() if p.name.startswith(".")]  # no staging left

    before = tree_hash(workspace)
    error = client.error("export_checkpoint", run_id=run_id, to="exports/lm")
    assert "bad_input: to 'exports/lm' exists and is not an empty folder; give a new folder" in error
    assert "bad_input: to 'runs/x' is inside runs/" in client.error("export_checkpoint", run_id=run_id, to="runs/x")
    assert "outside the workspace" in client.error("export_checkpoint", run_id=run_id, to="../x")
    assert f"not_found: run {run_id} has no complete checkpoint at step 4; available steps: 3, 6" in client.error(
        "export_checkpoint", run_id=run_id, to="exports/x", step=4)
    assert tree_hash(workspace) == before


def test_bad_sample_requests_are_refused_before_anything_starts(session):
    client, _, run_id = session
    assert "bad_input: prompts must be" in client.error("sample", run_id=run_id, prompts=[])
    assert "bad_input: at most 8 prompts" in client.error("sample", run_id=run_id, prompts=["a"] * 9)
    assert "bad_input: max_new_tokens must be an integer between 1 and 512" in client.error(
        "sample", run_id=run_id, prompts=["a"], max_new_tokens=513)
    assert "bad_input: prompt 0 is empty" in client.error("sample", run_id=run_id, prompts=[""])
    assert "not_found: no run" in client.error("sample", run_id="20990101-000000-lm-0000", prompts=["a"])
    # Images: one per prompt, files of the workspace, and only for a recipe that takes them.
    assert "bad_input: images: give one image per prompt (1 images for 2 prompts)" in client.error(
        "sample", run_id=run_id, prompts=["a", "b"], images=["x.png"])
    assert "bad_input" in client.error("sample", run_id=run_id, prompts=["a"], images=["../../etc/passwd"])
    assert "takes no image in sample" in client.error("sample", run_id=run_id, prompts=["a"], images=["recipes/lm/recipe.py"])


def test_a_failed_export_leaves_nothing_behind(session):
    """A run whose checkpoint cannot be loaded (its DCP metadata is empty): the recipe's code
    fails in the sandbox, and neither the destination nor the folders made for it remain."""
    import shutil

    from engine import run_dir as rd
    from tests.sandbox.helpers import fake_run

    client, workspace, run_id = session
    broken = fake_run(workspace, "20260101-000000-lm-brkn", config=rd.read_run(workspace / "runs" / run_id).config)
    shutil.copytree(workspace / "runs" / run_id / rd.SNAPSHOT_DIRNAME, broken / rd.SNAPSHOT_DIRNAME)
    before = tree_hash(workspace)
    error = client.error("export_checkpoint", run_id=broken.name, to="exports/deep/broken")
    assert f"bad_input: the model in checkpoint step-00000004 of run {broken.name} cannot be loaded" in error
    assert tree_hash(workspace) == before and not (workspace / "exports" / "deep").exists()


def test_a_gguf_export_is_one_file_that_loads_back_with_the_models_logits(session):
    """The template's run as GGUF (f32: the same numbers; q8_0: within its rounding), loaded
    back by transformers' GGUF reader from a folder holding nothing else; bad combinations are
    refused before anything is written."""
    import torch
    from transformers import AutoModelForCausalLM

    client, workspace, run_id = session
    client.ok("export_checkpoint", run_id=run_id, to="exports/hf")
    reference = AutoModelForCausalLM.from_pretrained(workspace / "exports" / "hf").eval()
    ids = torch.tensor([[100, 101, 32, 40, 41, 58, 10]])
    for quantization, tolerance in (("f32", 1e-5), ("q8_0", 0.05)):
        result = client.ok("export_checkpoint", run_id=run_id, to=f"exports/gguf-{quantization}", gguf=quantization)
        assert list(result["files"]) == [f"model-{quantization}.gguf"]
        folder = workspace / "exports" / f"gguf-{quantization}"
        assert [p.name for p in folder.iterdir()] == [f"model-{quantization}.gguf"]
        loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=f"model-{quantization}.gguf",
                                                      dtype=torch.float32).eval()
        with torch.no_grad():
            expected, got = reference(ids).logits, loaded(ids).logits
        assert (got - expected).abs().max() <= tolerance * max(1.0, expected.abs().max().item())
    before = tree_hash(workspace)
    assert "a GGUF file holds the merged model" in client.error(
        "export_checkpoint", run_id=run_id, to="exports/x", gguf="f16", lora="adapter")
    assert "bad_input" in client.error("export_checkpoint", run_id=run_id, to="exports/x", gguf="q3_k")
    assert tree_hash(workspace) == before


def test_lm_eval_tasks_score_the_recipes_checkpoint_as_lm_eval_itself_scores_its_export(session, tmp_path,
                                                                                         monkeypatch):
    """evaluate(tasks=...) in the sandbox: the numbers of lm-eval's simple_evaluate with HFLM
    over the same checkpoint exported as a Hugging Face folder, in this process; a task whose data
    is a Hub data set of the server's cache (offline) reads its snapshot, shown read-only."""
    from tests.lm_eval_tasks import QUESTIONS, lm_eval_reference, write_hub_task

    client, workspace, run_id = session
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))  # the server's cache (it runs in this process)
    write_hub_task(workspace, tmp_path / "hub")  # code_mc's questions as org/code-questions
    progress: list = []
    # The workspace lm-eval sees (its data copies go to the sandbox's /tmp); the server's records,
    # the run's folder and git's are left out: the run's supervisor may still be writing its last
    # lines and its git note (run alone, this test starts as the run ends).
    def seen_by_lm_eval() -> str:
        return tree_hash(workspace, caches=(DATA_CACHE, Path(".trainwright"), Path("runs"), Path(".git")))

    before = seen_by_lm_eval()
    evaluated = client.ok("evaluate", progress, run_id=run_id, tasks=["code_mc", "code_hub"])
    assert seen_by_lm_eval() == before
    client.ok("export_checkpoint", run_id=run_id, to="exports/lm-eval")
    expected = lm_eval_reference(workspace, ["code_mc"], pretrained=str(workspace / "exports" / "lm-eval"))["code_mc"]
    assert (evaluated["step"], evaluated["split"], evaluated["eval_loss"]) == (6, "tasks", None)
    scored = {"examples": 2 * len(QUESTIONS),
              "metrics": {"acc": expected["acc,none"], "acc_norm": expected["acc_norm,none"]},
              "stderr": {"acc": expected["acc_stderr,none"], "acc_norm": expected["acc_norm_stderr,none"]}}
    assert evaluated["tasks"] == {"code_mc": scored, "code_hub": scored}
    # The model process's stage, as for sample, and between its start and end each task as it starts.
    assert progress == [(0, 1, "loading the checkpoint in the sandbox"), (0.5, 2, "task 1 of 2: code_mc"),
                        (0.99, 2, "task 2 of 2: code_hub"), (1, 1, "done")]
    assert text_size(evaluated) < 1000


def test_bad_lm_eval_requests_are_refused_and_change_nothing(session, tmp_path, monkeypatch):
    from tests.lm_eval_tasks import BUILTIN_DATASET, BUILTIN_TASK, write_tasks

    client, workspace, run_id = session
    write_tasks(workspace)
    before = tree_hash(workspace)
    error = client.error("evaluate", run_id=run_id, tasks=["code_mcq"])
    assert "bad_input: unknown lm-eval task 'code_mcq'; near names: code_mc" in error
    assert "bad_input: evaluate takes data or tasks, not both" in client.error(
        "evaluate", run_id=run_id, tasks=["code_mc"], data=["eval_tasks"])
    assert "bad_input: task '../x' is not an lm-eval task name" in client.error(
        "evaluate", run_id=run_id, tasks=["../x"])
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-hub"))  # the server's cache holds no data set
    assert (f"bad_input: lm-eval task '{BUILTIN_TASK}' reads the Hub data set '{BUILTIN_DATASET}', which is not in "
            "the server's Hugging Face cache") in client.error("evaluate", run_id=run_id, tasks=[BUILTIN_TASK])
    assert tree_hash(workspace) == before
    (workspace / "eval_tasks" / "code_missing.yaml").write_text(
        (workspace / "eval_tasks" / "code_mc.yaml").read_text().replace("code_mc", "code_missing")
        .replace("eval_tasks/code.jsonl", "eval_tasks/nowhere.jsonl"))
    before = tree_hash(workspace)
    error = client.error("evaluate", run_id=run_id, tasks=["code_missing"])
    assert "bad_input: the data of lm-eval task(s) code_missing is not available offline" in error
    assert tree_hash(workspace) == before
