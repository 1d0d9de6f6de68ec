"""A script run whose checkpoints are Hugging Face model folders (as TRL and the HF Trainer write
``checkpoint-N/``) is first-class: sample, evaluate (on files given) and export_checkpoint load
them, a full model or a peft adapter, through a real MCP client; a script checkpoint in its own
format, and evaluate without data, are refused saying what to do."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.fake_hub import tiny_llama_folder
from tests.lm_eval_tasks import QUESTIONS, lm_eval_reference, write_tasks
from tests.mcp.conftest import connect, git

pytestmark = pytest.mark.slow  # two short script runs, then model processes in the sandbox

SCRIPT = Path(__file__).parent / "scripts" / "hf_save_train.py"


@pytest.fixture(scope="module")
def setting(tmp_path_factory):
    workspace = tmp_path_factory.mktemp("script-checkpoints")
    with connect("memory", workspace) as client:
        shutil.copyfile(SCRIPT, workspace / "train.py")
        tiny_llama_folder(workspace / "base")
        (workspace / "notes").mkdir()
        (workspace / "notes" / "a.txt").write_text("def add(a, b):\n    return a + b\n")
        (workspace / "notes" / "b.txt").write_text("import os\nprint(os.getcwd())\n")
        git(workspace, "add", "train.py", "base", "notes")
        git(workspace, "commit", "-q", "-m", "a script that saves Hugging Face checkpoints")
        runs = {}
        for name, extra in (("full", []), ("lora", ["--lora"])):
            run_id = client.ok("launch_run", recipe="train.py",
                               args=["--base", str(workspace / "base"), "--steps", "2", *extra])["run_id"]
            assert client.wait_for_run(run_id)["status"] == "completed", run_id
            runs[name] = run_id
        yield client, workspace, runs


def logits(folder: Path, text: str = "def add(a, b):"):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        return model(**tokenizer(text, return_tensors="pt")).logits


@pytest.mark.parametrize("kind", ["full", "lora"])
def test_a_script_checkpoint_folder_is_sampled_and_evaluated(setting, kind):
    client, workspace, runs = setting
    listed = client.ok("list_checkpoints", run_id=runs[kind])
    assert [c["step"] for c in listed["checkpoints"]] == [2]
    sampled = client.ok("sample", run_id=runs[kind], prompts=["def "], max_new_tokens=5)
    assert sampled["step"] == 2 and len(sampled["samples"]) == 1
    assert 1 <= sampled["samples"][0]["new_tokens"] <= 5
    evaluated = client.ok("evaluate", run_id=runs[kind], data=["notes"])
    assert evaluated["split"] == "data" and evaluated["examples"] == 2
    assert evaluated["eval_loss"] > 0 and evaluated["scored_tokens"] == evaluated["loss_tokens"] > 0
    assert 0 <= evaluated["metrics"]["next_token_accuracy"] <= 1


def test_a_full_script_checkpoint_exports_as_the_model_it_holds(setting):
    client, workspace, runs = setting
    exported = client.ok("export_checkpoint", run_id=runs["full"], to="exports/full")
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(exported["files"])
    checkpoint = workspace / "runs" / runs["full"] / "checkpoints" / "checkpoint-2"
    import torch

    assert torch.equal(logits(workspace / "exports" / "full"), logits(checkpoint))


def test_a_lora_script_checkpoint_exports_merged_into_its_base(setting):
    client, workspace, runs = setting
    exported = client.ok("export_checkpoint", run_id=runs["lora"], to="exports/merged")
    assert exported["lora"] == "merged" and "adapter_config.json" not in exported["files"]
    import torch
    from peft import AutoPeftModelForCausalLM
    from transformers import AutoTokenizer

    checkpoint = workspace / "runs" / runs["lora"] / "checkpoints" / "checkpoint-2"
    adapter = AutoPeftModelForCausalLM.from_pretrained(checkpoint, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        expected = adapter(**AutoTokenizer.from_pretrained(checkpoint)("def add(a, b):", return_tensors="pt")).logits
    merged = logits(workspace / "exports" / "merged")
    assert torch.allclose(merged, expected, atol=1e-5)
    assert not torch.allclose(merged, logits(workspace / "base"), atol=1e-3)  # the adapter changed it


@pytest.mark.parametrize("kind", ["full", "lora"])
def test_lm_eval_tasks_score_a_script_checkpoint_as_lm_eval_itself_does(setting, kind):
    client, workspace, runs = setting
    write_tasks(workspace)
    evaluated = client.ok("evaluate", run_id=runs[kind], tasks=["code_mc", "code_gen"])
    checkpoint = workspace / "runs" / runs[kind] / "checkpoints" / "checkpoint-2"
    model = {"pretrained": str(checkpoint)} if kind == "full" else {"pretrained": str(workspace / "base"),
                                                                   "peft": str(checkpoint)}
    expected = lm_eval_reference(workspace, ["code_mc", "code_gen"], **model)
    assert evaluated["split"] == "tasks" and evaluated["eval_loss"] is None and evaluated["metrics"] == {}
    assert evaluated["tasks"] == {
        "code_mc": {"examples": 2 * len(QUESTIONS),
                    "metrics": {"acc": expected["code_mc"]["acc,none"], "acc_norm": expected["code_mc"]["acc_norm,none"]},
                    "stderr": {"acc": expected["code_mc"]["acc_stderr,none"],
                               "acc_norm": expected["code_mc"]["acc_norm_stderr,none"]}},
        "code_gen": {"examples": 2 * len(QUESTIONS), "metrics": {"exact_match": expected["code_gen"]["exact_match,none"]},
                     "stderr": {"exact_match": expected["code_gen"]["exact_match_stderr,none"]}},
    }
    assert evaluated["warnings"] == [
        "scores are over 12 example(s) of a task given, fewer than 30: a rate moves by 0.083 per example; "
        "give the task more examples for numbers to compare"]


def test_evaluate_without_data_and_a_checkpoint_in_a_scripts_own_format_are_refused(setting):
    client, workspace, runs = setting
    message = client.error("evaluate", run_id=runs["full"])
    assert "ran a script, whose held-out data trainwright does not know: pass data=[files or folders]" in message
    own = workspace / "runs" / runs["full"] / "checkpoints" / "ckpt_5.pt"
    own.write_bytes(b"a script's own format")
    try:
        message = client.error("sample", run_id=runs["full"], prompts=["def "])
        assert "checkpoint ckpt_5.pt of run " in message
        assert "is not a Hugging Face model folder (config.json and weights, or a peft adapter_config.json)" in message
        assert not (workspace / "exports" / "own").exists()
    finally:
        own.unlink()
