"""export_checkpoint(to="hub:org/name[@branch]") through an MCP client, against a Hub endpoint
served on 127.0.0.1 (``HF_ENDPOINT``): the run fine-tunes a Hub model, the push is read back
with ``huggingface_hub`` (files, model card), a branch and a private repo, progress on the way,
the server's token in no file of the workspace, result or audit entry; refused clearly without
a token, with a read-only one, for a namespace the token cannot write, offline or unreachable,
each leaving nothing on the Hub or on disk."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from tests.fake_hub import FakeHub, hub_environment, tiny_llama_folder
from tests.mcp.conftest import connect, git

pytestmark = pytest.mark.slow  # one short run, then exports in the sandbox

TOKEN = "hf_fakePushWriterToken0123456789abcdef"
READER = "hf_fakePushReaderToken0123456789abcdef"
RUN = {"train.max_steps": 4, "checkpoint.every": 4, "train.log_every": 1, "data.seq_len": 32, "data.batch_size": 2}


@pytest.fixture(scope="module")
def setting(tmp_path_factory):
    root = tmp_path_factory.mktemp("hub-push")
    server = FakeHub(writers={TOKEN: ["me"]}, readers={READER})
    server.add("org/tiny-llama", tiny_llama_folder(root / "model"))
    url = server.start()
    workspace = root / "workspace"
    workspace.mkdir()
    with hub_environment(url, root / "hf", TOKEN), connect("memory", workspace) as client:
        client.ok("scaffold_recipe", template="causal_lm", name="hub_lm",
                  config={"model.pretrained_path": "org/tiny-llama"})
        run_id = client.ok("launch_run", recipe="recipes/hub_lm", overrides=RUN)["run_id"]
        assert client.wait_for_run(run_id)["status"] == "completed"
        yield client, workspace, server, url, run_id
    server.stop()


def api(url: str):
    from huggingface_hub import HfApi

    return HfApi(endpoint=url, token=TOKEN)


@pytest.fixture(scope="module")
def pushed(setting):
    """One push (an export and an evaluation in the sandbox, then the upload) that several tests
    read: its result and the progress it reported."""
    client, workspace, server, url, run_id = setting
    progress: list = []
    result = client.ok("export_checkpoint", progress, run_id=run_id, to="hub:me/tiny-ft")
    return result, progress


def test_a_push_uploads_the_export_with_a_model_card_read_back_by_huggingface_hub(setting, pushed):
    client, workspace, server, url, run_id = setting
    result, progress = pushed
    commit = server.repos["me/tiny-ft"].commit
    assert result["path"] == f"hub:me/tiny-ft@{commit}" and result["step"] == 4
    files = api(url).list_repo_files("me/tiny-ft")
    assert {"config.json", "model.safetensors", "README.md", "tokenizer.json"} <= set(files)
    assert sorted(result["files"]) == sorted(files)
    assert not server.repos["me/tiny-ft"].private
    from huggingface_hub import ModelCard, hf_hub_download

    card = ModelCard.load(hf_hub_download("me/tiny-ft", "README.md", endpoint=url, token=TOKEN,
                                          cache_dir=str(workspace.parent / "read-back")))
    assert card.data.base_model == "org/tiny-llama"
    assert card.data.library_name == "transformers"
    assert card.data.tags == ["trainwright"]
    record = json.loads((workspace / "runs" / run_id / "run.json").read_text())
    base_commit = server.repos["org/tiny-llama"].commit
    assert f"`org/tiny-llama` at revision `main`, commit `{base_commit}`" in card.text
    fingerprint = record["data"]["fingerprint"] or "none: generated data"
    assert f"fingerprint (SHA-256 of the files' paths and bytes): `{fingerprint}`" in card.text
    assert f"{record['data']['documents']:,} examples" in card.text
    assert f"at commit `{git(workspace, 'rev-parse', 'HEAD')}`" in card.text
    assert "- eval loss " in card.text and " examples, " in card.text  # the evaluation with its counts
    assert '"max_steps": 4' in card.text  # the resolved config
    config = json.loads(Path(hf_hub_download("me/tiny-ft", "config.json", endpoint=url, token=TOKEN,
                                             cache_dir=str(workspace.parent / "read-back"))).read_text())
    assert config["model_type"] == "llama"
    messages = [message for _, _, message in progress]
    assert messages[0] == "loading the checkpoint in the sandbox" and messages[-1] == "done"
    assert messages[1].startswith("exported step 4 of ") and messages[1].endswith(" MiB); evaluating it")
    assert re.fullmatch(rf"uploading to hub:me/tiny-ft: {len(files)} files, [\d.]+ MiB", messages[2]), messages
    assert messages[3] == f"uploaded to hub:me/tiny-ft: commit {commit[:12]}"
    values = [value for value, _, _ in progress]
    assert values == sorted(values) and len(set(values)) == len(values)
    assert not list(workspace.glob("exports*")) and not (workspace / "hub:me").exists()


def test_a_push_to_a_branch_of_a_new_private_repo(setting):
    client, workspace, server, url, run_id = setting
    result = client.ok("export_checkpoint", run_id=run_id, to="hub:me/tiny-private@dev", private=True)
    repo = server.repos["me/tiny-private"]
    assert repo.private and repo.files == {}  # main holds nothing: the commit is on dev
    assert result["path"] == f"hub:me/tiny-private@{repo.branches['dev']}"
    assert "model.safetensors" in api(url).list_repo_files("me/tiny-private", revision="dev")
    from huggingface_hub import HfApi
    from huggingface_hub.errors import RepositoryNotFoundError

    with pytest.raises(RepositoryNotFoundError):  # private: not without the token
        HfApi(endpoint=url, token=False).list_repo_files("me/tiny-private", revision="dev")


def test_the_servers_token_is_in_no_workspace_file_result_or_audit_entry(setting, pushed):
    client, workspace, server, url, run_id = setting
    assert TOKEN not in json.dumps(pushed[0]) + json.dumps(pushed[1])
    texts = [json.dumps(client.ok("get_run", run_id=run_id)), client.read_text(f"run://{run_id}/log")]
    assert all(TOKEN not in text for text in texts)
    for path in workspace.rglob("*"):
        if path.is_file() and not path.is_symlink():
            assert TOKEN.encode() not in path.read_bytes(), path
    assert all(TOKEN.encode() not in data for data in server.repos["me/tiny-ft"].files.values())
    # The requests that wrote carried it; every request of the sandboxed processes would be a GET.
    assert any(h.get("authorization") == f"Bearer {TOKEN}" for m, p, h in server.requests if m == "POST")


def refused(client, workspace: Path, server: FakeHub, **arguments) -> str:
    before = sorted(str(p) for p in workspace.rglob("*") if ".git" not in p.parts)
    repos = set(server.repos)
    message = client.error("export_checkpoint", **arguments)
    assert set(server.repos) == repos
    assert sorted(str(p) for p in workspace.rglob("*") if ".git" not in p.parts) == before
    assert TOKEN not in message and READER not in message
    return message.split(": ", 1)[1] if message.startswith("Error executing tool") else message


def test_a_push_is_refused_without_a_token_offline_or_unreachable(setting, monkeypatch):
    client, workspace, server, url, run_id = setting
    monkeypatch.delenv("HF_TOKEN")
    message = refused(client, workspace, server, run_id=run_id, to="hub:me/no-token")
    assert message.startswith("bad_input: the server has no Hugging Face token, so it cannot push: ")
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    message = refused(client, workspace, server, run_id=run_id, to="hub:me/offline")
    assert message.startswith("bad_input: the server runs with HF_HUB_OFFLINE set")
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens on the discard port
    message = refused(client, workspace, server, run_id=run_id, to="hub:me/unreachable")
    assert message.startswith("bad_input: the Hub at http://127.0.0.1:9 cannot be reached")


def test_a_push_is_refused_with_a_token_that_cannot_write_there(setting, monkeypatch):
    client, workspace, server, url, run_id = setting
    message = refused(client, workspace, server, run_id=run_id, to="hub:someone-else/model")
    assert message.startswith("bad_input: the Hub refused the server's token for hub:someone-else/model (HTTP 403)")
    monkeypatch.setenv("HF_TOKEN", READER)
    message = refused(client, workspace, server, run_id=run_id, to="hub:me/read-only")
    assert message.startswith("bad_input: the server's Hugging Face token can only read")
    monkeypatch.setenv("HF_TOKEN", "hf_fakeUnknownToken0123456789abcdefgh")
    message = refused(client, workspace, server, run_id=run_id, to="hub:me/unknown-token")
    assert "(HTTP 401)" in message and "hf_fakeUnknownToken" not in message


def test_bad_hub_targets_and_private_without_one_are_refused(setting):
    client, workspace, server, url, run_id = setting
    message = refused(client, workspace, server, run_id=run_id, to="hub:not a repo")
    assert message.startswith("bad_input: to 'hub:not a repo' is not a Hub repo: give hub:org/name")
    message = refused(client, workspace, server, run_id=run_id, to="exports/x", private=True)
    assert message == "bad_input: private applies to a push (to=hub:org/name); a workspace folder has no visibility"


def test_the_card_front_matter_is_yaml_the_hub_reads(setting, pushed):
    client, workspace, server, url, run_id = setting
    card = server.repos["me/tiny-ft"].files["README.md"].decode()
    front = yaml.safe_load(card.split("---\n")[1])
    assert front == {"base_model": "org/tiny-llama", "library_name": "transformers", "tags": ["trainwright"]}
