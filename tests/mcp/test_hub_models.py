"""A model by Hub id through an MCP client, from a Hub endpoint served on 127.0.0.1
(``HF_ENDPOINT``): scaffold and launch download it with progress notifications, the run loads
the bound snapshot inside its sandbox, run.json / get_run / the git note / describe_recipe name
the repo and commit, a resume loads the same commit after the Hub's main moved on, and the
server's HF_TOKEN is found in no run process, run file, tool result or audit entry."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from tests.fake_hub import FakeHub, hub_environment, tiny_llama_folder
from tests.mcp.conftest import connect, git, run_note

pytestmark = pytest.mark.slow  # three short runs and a resume (about 100 s on an idle machine)

TOKEN = "hf_fakeServerSecretToken0123456789abcdef"
RUN = {"train.max_steps": 4, "checkpoint.every": 2, "train.log_every": 1, "data.seq_len": 32, "data.batch_size": 2}


@pytest.fixture(scope="module")
def setting(tmp_path_factory):
    root = tmp_path_factory.mktemp("hub-flow")
    model = tiny_llama_folder(root / "model")
    server = FakeHub()
    server.add("org/tiny-llama", model, gated=True)
    server.repos["org/tiny-llama"].token = TOKEN
    url = server.start()
    workspace = root / "workspace"
    workspace.mkdir()
    with hub_environment(url, root / "hf", TOKEN), connect("memory", workspace) as client:
        yield client, workspace, server, model, root
    server.stop()


@pytest.fixture(scope="module")
def launched(setting):
    client, workspace, server, _, _ = setting
    progress: list = []
    client.ok("scaffold_recipe", template="causal_lm", name="hub_lm", config={"model.pretrained_path": "org/tiny-llama"})
    server.requests.clear()
    started = client.ok("launch_run", progress=progress, recipe="recipes/hub_lm", overrides=RUN)
    return started, progress


def test_scaffold_and_launch_download_the_model_once_with_progress(setting, launched):
    client, workspace, server, _, root = setting
    started, progress = launched
    info = client.ok("get_run", run_id=started["run_id"])
    assert info["hub_models"] == [f"org/tiny-llama@{server.repos['org/tiny-llama'].commit}"]
    # Scaffolding downloaded it; the launch found every file cached (a HEAD each, no body again).
    assert not [p for method, p, _ in server.requests if method == "GET" and "/resolve/" in p]
    values = [value for value, _, _ in progress]
    assert values == sorted(values) and len(set(values)) == len(values)
    assert progress[-1][0] == progress[-1][1] == 2


def test_the_run_trains_the_bound_snapshot_in_its_sandbox_and_records_the_commit(setting, launched):
    client, workspace, server, model_folder, root = setting
    started, _ = launched
    finished = client.wait_for_run(started["run_id"])
    assert finished["status"] == "completed", finished
    commit = server.repos["org/tiny-llama"].commit
    assert finished["hub_models"] == [f"org/tiny-llama@{commit}"]
    record = json.loads((workspace / "runs" / started["run_id"] / "run.json").read_text())
    assert record["hub_models"][0]["revision"] == "main"
    assert record["hub_models"][0]["path"].endswith(f"models--org--tiny-llama/snapshots/{commit}")
    assert any(p.endswith("models--org--tiny-llama") for p in record["sandbox"]["read_only"])
    assert record["config"]["model"]["pretrained_path"] == "org/tiny-llama"
    hidden = json.loads((model_folder / "config.json").read_text())["hidden_size"]
    assert hidden == 32  # the tiny model's own size, not the recipe's
    note = run_note(workspace, git(workspace, "rev-parse", "HEAD"), started["run_id"])
    assert f"model org/tiny-llama@{commit[:12]}" in note
    described = client.ok("describe_recipe", recipe="recipes/hub_lm")
    assert described["hub_models"] == [f"org/tiny-llama@{commit}"]


def test_a_resume_loads_the_commit_the_run_recorded_though_main_moved_on(setting, launched):
    client, workspace, server, model_folder, root = setting
    started, _ = launched
    client.wait_for_run(started["run_id"])
    first = server.repos["org/tiny-llama"].commit
    moved = root / "moved"
    moved.mkdir(exist_ok=True)
    for path in model_folder.iterdir():
        (moved / path.name).write_bytes(path.read_bytes())
    (moved / "README.md").write_text("a new commit on main\n")
    server.add("org/tiny-llama", moved, gated=True)
    server.repos["org/tiny-llama"].token = TOKEN
    assert server.repos["org/tiny-llama"].commit != first
    resumed = client.ok("resume_checkpoint", run_id=started["run_id"], step=2)
    assert client.ok("get_run", run_id=resumed["run_id"])["hub_models"] == [f"org/tiny-llama@{first}"]
    assert client.wait_for_run(resumed["run_id"])["status"] == "completed"


def test_the_servers_token_reaches_no_run_process_file_result_or_audit_entry(setting, launched):
    client, workspace, server, _, root = setting
    started, _ = launched
    run = client.ok("launch_run", recipe="recipes/hub_lm",
                    overrides={**RUN, "train.max_steps": 100_000, "checkpoint.every": 100_000})
    seen = []
    try:
        client.wait_for_step(run["run_id"], 1)
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                environ = Path(f"/proc/{pid}/environ").read_bytes()
            except OSError:
                continue
            if f"TRAINWRIGHT_RUN_ID={run['run_id']}".encode() in environ:
                seen.append(pid)
                assert TOKEN.encode() not in environ
                assert b"HF_HUB_OFFLINE=1" in environ
    finally:
        client.ok("stop_run", run_id=run["run_id"])
    assert seen, "no process of the run was found"
    results = json.dumps([client.ok("get_run", run_id=r) for r in (started["run_id"], run["run_id"])])
    assert TOKEN not in results
    for path in [*(workspace / "runs").rglob("*"), *(workspace / ".trainwright").rglob("*")]:
        if path.is_file() and not path.is_symlink():
            assert TOKEN.encode() not in path.read_bytes(), path
    time.sleep(0.1)
