"""Models by Hub id (runner/hub.py) against a Hub endpoint served on 127.0.0.1: download with
progress, resume after a dropped connection, gated and missing repos, pickled weights, the disk
check, offline use of the cache, and the binding a run's sandbox gets."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from engine import run_dir as rd
from engine.data_files import HUB_MODELS_VARIABLE, hub_model_path
from engine.errors import BadInput, NotFound
from runner import hub
from tests.fake_hub import FakeHub, tiny_llama_folder


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory) -> Path:
    return tiny_llama_folder(tmp_path_factory.mktemp("model") / "tiny")


@pytest.fixture
def fake_hub(model_folder, tmp_path, monkeypatch):
    server = FakeHub()
    server.add("org/tiny", model_folder)
    server.add("org/gated", model_folder, gated=True)
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "config.json").write_text((model_folder / "config.json").read_text())
    (pickled / "pytorch_model.bin").write_bytes(b"\x80\x04pickle")
    server.add("org/pickled", pickled)
    url = server.start()
    for name in ("HF_HUB_OFFLINE", "HF_TOKEN", "HF_HUB_CACHE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", url)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    yield server
    server.stop()


def ref(value: str, workspace: Path) -> hub.HubRef:
    found = hub.hub_ref(value, workspace)
    assert found is not None
    return found


def test_a_hub_id_is_downloaded_with_increasing_progress_and_its_commit_recorded(fake_hub, model_folder, tmp_path):
    seen: list[tuple[float, float | None, str]] = []
    model = hub.resolve(ref("org/tiny", tmp_path), progress=lambda *p: seen.append(p))
    assert model.commit == fake_hub.repos["org/tiny"].commit
    assert model.repo_id == "org/tiny" and model.revision == "main" and model.given == "org/tiny"
    snapshot = Path(model.path)
    assert snapshot.name == model.commit and snapshot.is_relative_to(tmp_path / "hf" / "hub")
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        assert (snapshot / name).read_bytes() == (model_folder / name).read_bytes()
    total = sum(len(data) for data in fake_hub.repos["org/tiny"].files.values())
    assert model.bytes == total
    assert seen[0][0] == 0 and seen[0][1] == total and "5 files" in seen[0][2]
    assert seen[-1][:2] == (total, total)
    values = [value for value, _, _ in seen]
    assert values == sorted(values)


def test_a_download_the_server_drops_midway_resumes_with_a_range_request(fake_hub, model_folder, tmp_path,
                                                                         monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "DOWNLOAD_CHUNK_SIZE", 4096)  # written as it comes
    fake_hub.drop_once.add("org/tiny/model.safetensors")
    model = hub.resolve(ref("org/tiny", tmp_path))
    gets = [headers for method, path, headers in fake_hub.requests
            if method == "GET" and path.endswith("/model.safetensors")]
    assert len(gets) == 2 and "range" not in gets[0]
    start = int(gets[1]["range"].removeprefix("bytes=").split("-")[0])
    assert 0 < start <= (model_folder / "model.safetensors").stat().st_size // 2
    assert (Path(model.path) / "model.safetensors").read_bytes() == (model_folder / "model.safetensors").read_bytes()


def test_a_gated_repo_without_a_token_is_bad_input_that_says_how_to_get_access(fake_hub, tmp_path, monkeypatch):
    with pytest.raises(BadInput, match=r"org/gated is a gated repo .* \(HF_TOKEN in the environment of `trainwright serve`"):
        hub.resolve(ref("org/gated", tmp_path))
    assert not (tmp_path / "hf" / "hub" / "models--org--gated" / "snapshots").exists()
    monkeypatch.setenv("HF_TOKEN", fake_hub.repos["org/gated"].token)
    assert hub.resolve(ref("org/gated", tmp_path)).commit == fake_hub.repos["org/gated"].commit


def test_a_missing_repo_or_revision_is_not_found(fake_hub, tmp_path):
    with pytest.raises(NotFound, match="no model repo org/missing on the Hub"):
        hub.resolve(ref("org/missing", tmp_path))


def test_pickled_weights_need_the_trusted_setting(fake_hub, tmp_path):
    with pytest.raises(BadInput, match=r"only pickled weights \(pytorch_model.bin\).*runs.allow_pickled_weights"):
        hub.resolve(ref("org/pickled", tmp_path))
    model = hub.resolve(ref("org/pickled", tmp_path), allow_pickled=True)
    assert (Path(model.path) / "pytorch_model.bin").is_file()


def test_a_repo_larger_than_the_free_disk_is_refused_before_anything_is_fetched(fake_hub, tmp_path, monkeypatch):
    import shutil

    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**9, 10**9, 1000))
    with pytest.raises(BadInput, match=r"org/tiny needs 0.00 GiB and the Hugging Face cache .* has 0.00 GiB free"):
        hub.resolve(ref("org/tiny", tmp_path))
    assert not any(method == "GET" and path.endswith("/model.safetensors") for method, path, _ in fake_hub.requests)


def test_offline_the_cache_answers_without_a_request(fake_hub, tmp_path, monkeypatch):
    first = hub.resolve(ref("org/tiny", tmp_path))
    fake_hub.requests.clear()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    again = hub.resolve(ref("org/tiny", tmp_path))
    assert (again.commit, again.path) == (first.commit, first.path)
    assert fake_hub.requests == []
    with pytest.raises(NotFound, match=r"org/other is not in the local Hugging Face cache .*HF_HUB_OFFLINE is set"):
        hub.resolve(ref("org/other", tmp_path))


def test_a_resume_loads_the_recorded_commit_though_main_moved_on(fake_hub, model_folder, tmp_path):
    first = hub.resolve(ref("org/tiny", tmp_path))
    moved = tmp_path / "moved"
    moved.mkdir()
    for path in model_folder.iterdir():
        (moved / path.name).write_bytes(path.read_bytes())
    (moved / "generation_config.json").write_text(json.dumps({"max_length": 7}))
    fake_hub.add("org/tiny", moved)
    assert fake_hub.repos["org/tiny"].commit != first.commit
    binding = hub.bind(tmp_path, "org/tiny", recorded=[first])
    assert [m.commit for m in binding.models] == [first.commit]
    assert hub.bind(tmp_path, "org/tiny").models[0].commit == fake_hub.repos["org/tiny"].commit


def test_an_existing_workspace_folder_wins_and_only_hub_shaped_values_are_ids(tmp_path):
    assert hub.hub_ref("org/name", tmp_path) == hub.HubRef("org/name", "org/name", None)
    assert hub.hub_ref("org/name@v1.0", tmp_path) == hub.HubRef("org/name@v1.0", "org/name", "v1.0")
    (tmp_path / "models" / "tiny").mkdir(parents=True)
    for value in ("models/tiny", "../org/name", "a/b/c", "org/..", "/abs/path", "name", "org/name.git", "", None, 3):
        assert hub.hub_ref(value, tmp_path) is None, value


def test_the_sandbox_sees_the_repo_cache_folder_and_the_engine_loads_the_bound_snapshot(fake_hub, tmp_path,
                                                                                       monkeypatch):
    binding = hub.bind(tmp_path, "org/tiny@main")
    (model,) = binding.models
    assert binding.read_only() == [tmp_path / "hf" / "hub" / "models--org--tiny"]
    env = binding.env()
    assert env["HF_HUB_OFFLINE"] == "1"
    monkeypatch.setenv(HUB_MODELS_VARIABLE, env[HUB_MODELS_VARIABLE])
    assert hub_model_path("org/tiny@main") == model.path
    monkeypatch.delenv(HUB_MODELS_VARIABLE)
    with pytest.raises(Exception, match="a Hub id with a revision is resolved by trainwright's server"):
        hub_model_path("org/tiny@main")


def test_recorded_models_are_found_again_in_the_cache_never_at_the_recorded_path(fake_hub, tmp_path):
    model = hub.resolve(ref("org/tiny", tmp_path))
    secret = tmp_path / "secret"
    secret.mkdir()
    forged = [
        model.model_copy(update={"path": str(secret)}),  # a path of the run's choosing
        model.model_copy(update={"given": "org/other", "repo_id": "org/tiny"}),  # given and repo disagree
        model.model_copy(update={"commit": "--upload-pack=x"}),
        rd.HubModel(given="org/unknown", repo_id="org/unknown", commit="0" * 40, path=str(secret)),
    ]
    binding = hub.recorded_binding(forged)
    assert [m.path for m in binding.models] == [model.path]
    assert all(secret not in p.parents and p != secret for p in binding.read_only())


def test_no_request_leaves_the_machine(fake_hub, tmp_path):
    hub.resolve(ref("org/tiny", tmp_path))
    assert fake_hub.requests and os.environ["HF_ENDPOINT"].startswith("http://127.0.0.1:")


def test_a_revision_the_repo_lacks_is_not_found(fake_hub, tmp_path):
    with pytest.raises(NotFound, match="org/tiny has no revision 'v9'"):
        hub.resolve(ref("org/tiny@v9", tmp_path))


def test_a_hub_data_set_is_downloaded_with_its_data_files_and_readme_and_bound_for_the_engine(fake_hub, tmp_path,
                                                                                              monkeypatch):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from engine.data_formats import _load_dataset

    folder = tmp_path / "chats"
    (folder / "data").mkdir(parents=True)
    rows = [{"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]}
            for i in range(5)]
    pq.write_table(pa.Table.from_pylist(rows), folder / "data" / "train-00000-of-00001.parquet")
    (folder / "README.md").write_text("---\nlicense: mit\n---\n# chats\n")
    (folder / "loader.py").write_text("raise SystemExit('never fetched')\n")
    fake_hub.add("org/chats", folder, repo_type="dataset")
    binding = hub.bind(tmp_path, None, dataset="org/chats")
    (model,) = binding.models
    assert model.repo_type == "dataset" and model.commit == fake_hub.repos["datasets/org/chats"].commit
    snapshot = Path(model.path)
    assert sorted(p.relative_to(snapshot).as_posix() for p in snapshot.rglob("*") if p.is_file()) == [
        "README.md", "data/train-00000-of-00001.parquet"]
    assert binding.read_only() == [tmp_path / "hf" / "hub" / "datasets--org--chats"]
    with pytest.raises(NotFound, match="no dataset repo org/nothing on the Hub .* data.dataset may also name"):
        hub.bind(tmp_path, None, dataset="org/nothing")
    for key, value in binding.env().items():  # what a run's engine gets
        monkeypatch.setenv(key, value)
    assert [r["messages"][1]["content"] for r in _load_dataset("org/chats", None, None)] == [f"a{i}" for i in range(5)]


def test_hostile_hub_shaped_values_never_reach_the_hub(fake_hub, tmp_path):
    for value in ("org/name@../../etc", "org/name@-F/proc/self/environ", "org/name@--upload-pack=x", "org/../name",
                  "org/name@rev\n", "-org/name", "org/name@" + "a" * 200):
        assert hub.hub_ref(value, tmp_path) is None, value
        assert hub.bind(tmp_path, value, dataset=value).models == ()
    assert fake_hub.requests == []


def test_offline_a_cached_snapshot_of_pickled_weights_still_needs_the_trusted_setting(fake_hub, tmp_path, monkeypatch):
    hub.resolve(ref("org/pickled", tmp_path), allow_pickled=True)  # in the cache, as another run left it
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(BadInput, match=r"only pickled weights \(pytorch_model.bin\).*runs.allow_pickled_weights"):
        hub.resolve(ref("org/pickled", tmp_path))
    assert (Path(hub.resolve(ref("org/pickled", tmp_path), allow_pickled=True).path) / "pytorch_model.bin").is_file()


def test_an_id_huggingface_hub_refuses_is_bad_input_and_the_two_agree_on_every_id(tmp_path):
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    ids = ["org--x/name", "org/na--me", "org/name-", "org/-name", "org/.name", "org/name.", "o/n", "org_x/na.me",
           "Org-1/Name_2.v3", "a" * 96 + "/b", "a" * 97 + "/b", "org/" + "n" * 96, "org/" + "n" * 97, "org/n_-_x"]
    for value in ids:
        try:
            validate_repo_id(value)
            valid = True
        except HFValidationError:
            valid = False
        try:
            shaped = hub.hub_ref(value, tmp_path)
        except BadInput as e:
            assert not valid, value
            assert str(e).startswith(f"{value!r} is shaped like a Hub id, which huggingface_hub refuses ("), value
            continue
        assert (shaped is not None) == valid or (shaped is None and not valid), value
    with pytest.raises(BadInput, match="Cannot have -- or .. in repo_id"):
        hub.hub_ref("org--x/name", tmp_path)


def test_an_unreachable_hub_is_bad_input_that_says_what_to_do(fake_hub, tmp_path, monkeypatch):
    import socket

    with socket.socket() as closed:  # a port on this machine nothing listens on
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    with pytest.raises(BadInput) as refused:
        hub.resolve(ref("org/tiny", tmp_path))
    message = str(refused.value)
    assert message.startswith(f"org/tiny could not be downloaded: the Hub at http://127.0.0.1:{port} cannot be reached")
    assert message.endswith("check the network and HF_ENDPOINT, or use a model already in the cache with HF_HUB_OFFLINE=1")


def test_a_model_already_in_the_cache_is_not_refused_for_the_disk_it_would_not_use(fake_hub, tmp_path, monkeypatch):
    import shutil

    first = hub.resolve(ref("org/tiny", tmp_path))
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**9, 10**9, 1000))
    assert hub.resolve(ref("org/tiny", tmp_path)).commit == first.commit


def test_an_estimate_downloads_the_models_config_and_tokenizer_but_never_its_weights(fake_hub, model_folder, tmp_path):
    from mcp_server.operations import estimate
    from mcp_server.operations import recipes as recipe_ops
    from transformers import AutoModelForCausalLM
    from workspace.workspace import Workspace

    (tmp_path / "ws").mkdir()
    ws = Workspace.open(tmp_path / "ws")
    recipe_ops.scaffold_recipe(ws, "sft", "chat")
    fake_hub.requests.clear()
    result = estimate.estimate_run(ws, "recipes/chat", {"model.pretrained_path": "org/tiny", "data.seq_len": 128})
    assert result.estimate["params"] == AutoModelForCausalLM.from_pretrained(model_folder).num_parameters()
    fetched = [path for method, path, _ in fake_hub.requests if method == "GET" and "/resolve/" in path]
    assert any(p.endswith("/config.json") for p in fetched) and any(p.endswith("/tokenizer.json") for p in fetched)
    assert not [p for p in fetched if p.endswith(".safetensors")]
    snapshot = hub.resolve(ref("org/tiny", tmp_path), weights=False)
    assert (Path(snapshot.path) / "config.json").is_file() and not (Path(snapshot.path) / "model.safetensors").exists()
    # A launch after it downloads the weights into the same snapshot.
    assert (Path(hub.resolve(ref("org/tiny", tmp_path)).path) / "model.safetensors").is_file()
