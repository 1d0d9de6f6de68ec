"""Your model, your data, through a real MCP client: a tiny Qwen2-family model in a workspace
folder (random weights, a BPE tokenizer trained here, ChatML without {% generation %} markers)
is scaffolded as an SFT recipe with LoRA on a parquet file, trained, evaluated and exported;
the export loads as the model's own class with its tokenizer and chat template."""

from __future__ import annotations

import pytest

from workspace import git as workspace_git
from tests.mcp.conftest import connect
from tests.model_families import CHATML, tiny_model_folder
from tests.sandbox.helpers import make_workspace

pytestmark = pytest.mark.slow

QUESTIONS = [(f"What is {a} + {b}?", f"It is {a + b}.") for a in range(6) for b in range(4)]


def test_a_local_model_folder_fine_tunes_with_lora_on_parquet_then_evaluates_and_exports(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    from transformers import AutoModelForCausalLM, AutoTokenizer

    workspace = make_workspace(tmp_path / "ws")
    tiny_model_folder(workspace / "models" / "tiny-qwen", "qwen2")
    (workspace / "data").mkdir()
    rows = [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]} for q, a in QUESTIONS]
    pq.write_table(pa.Table.from_pylist(rows), workspace / "data" / "train.parquet")
    workspace_git.commit_paths(workspace_git.ensure_repo(workspace), [workspace / "models", workspace / "data"],
                             "add a model and its data", [])
    config = {
        "model.pretrained_path": "models/tiny-qwen", "data.paths": ["data/train.parquet"], "data.seq_len": 64,
        "data.batch_size": 2, "data.eval_fraction": 0.2, "data.eval_prompts": 2, "data.max_new_tokens": 4,
        "train.max_steps": 2, "checkpoint.every": 2, "train.log_every": 1, "metrics.tensorboard": False,
    }
    with connect("memory", workspace) as client:
        scaffolded = client.ok("scaffold_recipe", template="sft", name="chat", config=config, skills=["lora"])
        assert scaffolded["path"] == "recipes/chat" and [s["skill"] for s in scaffolded["skills"]] == ["lora"]
        run_id = client.ok("launch_run", recipe="chat")["run_id"]
        run = client.wait_for_run(run_id)
        assert run["status"] == "completed", run
        data = run["data"]
        assert (data["format"], data["mask"], data["documents"]) == ("messages", "turn_render", len(QUESTIONS))
        assert data["loss_tokens"] > 0 and data["fingerprint"]
        evaluated = client.ok("evaluate", run_id=run_id)
        assert evaluated["eval_loss"] > 0 and "answer_accuracy" in evaluated["metrics"]
        client.ok("export_checkpoint", run_id=run_id, to="exports/chat")
    folder = workspace / "exports" / "chat"
    model = AutoModelForCausalLM.from_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert tokenizer.chat_template == CHATML
    assert tokenizer.decode(tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True)
                            ).endswith("<|im_start|>assistant\n")


def test_data_whose_format_cannot_be_told_is_bad_input_and_writes_nothing(tmp_path):
    workspace = make_workspace(tmp_path / "ws")
    (workspace / "data").mkdir()
    (workspace / "data" / "odd.csv").write_text("question,answer\nq,a\n")
    with connect("memory", workspace) as client:
        result = client.call("scaffold_recipe", template="sft", name="chat", config={"data.paths": ["data/odd.csv"]})
    assert result.is_error
    assert result.content[0].text.endswith(
        "bad_input: odd.csv: cannot tell the data format from its columns ['answer', 'question']; the sft template "
        "knows: messages (messages); sharegpt (conversations); alpaca (instruction, output); prompt_completion "
        "(prompt, completion); text (text). Set data.format, and data.columns to map your column names "
        '(e.g. data.columns={"messages": "dialog"})'
    )
    assert not (workspace / "recipes" / "chat").exists() and not (workspace / "runs").exists()


def test_a_saved_folder_and_a_datasets_folder_are_counted_inside_the_sandbox(tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    workspace = make_workspace(tmp_path / "ws")
    rows = [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]} for q, a in QUESTIONS]
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)}).save_to_disk(str(workspace / "data" / "saved"))
    (workspace / "data" / "set" / "data").mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(rows[:10]), workspace / "data" / "set" / "data" / "train-00000-of-00001.parquet")
    with connect("memory", workspace) as client:
        client.ok("scaffold_recipe", template="sft", name="chat", config={
            "data.paths": ["data/saved"], "data.dataset": "data/set", "train.max_steps": 1})
        run = client.ok("launch_run", recipe="chat", overrides={"train.max_steps": 1, "checkpoint.every": 0,
                                                                 "checkpoint.at_end": False})
        assert client.wait_for_run(run["run_id"])["status"] == "completed"
    data = run["data"]
    assert (data["documents"], data["format"], data["mask"]) == (len(QUESTIONS) + 10, "messages", "generation_markers")
    assert data["paths"] == ["data/saved", "data/set"] and data["fingerprint"]


def test_a_qwen2_model_and_a_data_set_by_hub_id_fine_tune_evaluate_and_export(tmp_path, monkeypatch):
    """The same flow from a Hub served on 127.0.0.1: ``model.pretrained_path: org/tiny-qwen`` and
    ``data.dataset: org/chats`` (ShareGPT rows in parquet) are downloaded by the server and bound
    read-only into the sandbox; a second launch, offline, finds both in the cache."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from tests.fake_hub import FakeHub

    hub = FakeHub()
    hub.add("org/tiny-qwen", tiny_model_folder(tmp_path / "source", "qwen2"))
    chats = tmp_path / "chats"
    (chats / "data").mkdir(parents=True)
    rows = [{"conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": a}]} for q, a in QUESTIONS]
    pq.write_table(pa.Table.from_pylist(rows), chats / "data" / "train-00000-of-00001.parquet")
    hub.add("org/chats", chats, repo_type="dataset")
    monkeypatch.setenv("HF_ENDPOINT", hub.start())
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    workspace = make_workspace(tmp_path / "ws")
    config = {
        "model.pretrained_path": "org/tiny-qwen", "data.dataset": "org/chats", "data.seq_len": 64,
        "data.batch_size": 2, "data.eval_fraction": 0.2, "data.eval_prompts": 2, "data.max_new_tokens": 4,
        "train.max_steps": 2, "checkpoint.every": 2, "train.log_every": 1, "metrics.tensorboard": False,
    }
    try:
        with connect("memory", workspace) as client:
            client.ok("scaffold_recipe", template="sft", name="chat", config=config)
            run_id = client.ok("launch_run", recipe="chat")["run_id"]
            run = client.wait_for_run(run_id)
            assert run["status"] == "completed", run
            assert run["hub_models"] == [f"org/tiny-qwen@{hub.repos['org/tiny-qwen'].commit}",
                                         f"datasets/org/chats@{hub.repos['datasets/org/chats'].commit}"]
            assert (run["data"]["format"], run["data"]["mask"], run["data"]["documents"]) == (
                "sharegpt", "turn_render", len(QUESTIONS))
            assert client.ok("evaluate", run_id=run_id)["eval_loss"] > 0
            client.ok("export_checkpoint", run_id=run_id, to="exports/chat")
            hub.stop()
            monkeypatch.setenv("HF_HUB_OFFLINE", "1")
            again = client.wait_for_run(client.ok("launch_run", recipe="chat")["run_id"])
            assert again["status"] == "completed" and again["hub_models"] == run["hub_models"]
    finally:
        hub.stop()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = workspace / "exports" / "chat"
    assert type(AutoModelForCausalLM.from_pretrained(folder)).__name__ == "Qwen2ForCausalLM"
    assert AutoTokenizer.from_pretrained(folder).chat_template == CHATML
