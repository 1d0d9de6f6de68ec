"""A run's data is tokenized once into a store that later readers map: the same pieces as
tokenizing in memory, rebuilt when a file, the tokenizer or seq_len changes, and nothing left
behind by a build that fails."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from engine import store_lock, token_store
from engine.config import ConfigError
from engine.errors import BadInput, NotFound
from engine.data_files import DataListing
from recipes_template.causal_lm import recipe as causal_lm
from recipes_template.sft import recipe as sft
from workspace.workspace import cached_data, data_cache_dir, remove_cached_data


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    folder = data_cache_dir(tmp_path / "ws")  # the workspace's .trainwright/data-cache
    monkeypatch.setenv(token_store.CACHE_VARIABLE, str(folder))
    return folder


def corpus(root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    with open(root / "docs.jsonl", "w") as f:
        for i in range(40):
            f.write(json.dumps({"text": f"document {i} " + "word " * (i * 7)}) + "\n")
    return root


def causal_store(cfg, listing=None):
    return causal_lm.token_store(cfg, causal_lm.ByteTokenizer(), listing or DataListing())


def test_the_store_holds_the_pieces_tokenizing_in_memory_gives(tmp_path, cache):
    cfg = causal_lm.CausalLMDataConfig(paths=[str(corpus(tmp_path / "data"))], seq_len=32, eval_fraction=0.2)
    store = causal_store(cfg)
    documents = causal_lm.load_documents(cfg)
    expected = {
        split: causal_lm.tokenize_documents(
            [text for name, text in documents if causal_lm.is_eval_document(name, 0.2) == (split == "eval")],
            causal_lm.ByteTokenizer(), 32)
        for split in ("train", "eval")
    }
    for split in ("train", "eval"):
        pieces = store.pieces(split, torch.from_numpy)
        assert len(pieces) == len(expected[split]) > 0
        assert all(torch.equal(a, b) for a, b in zip(pieces, expected[split]))
    assert store.meta["dtype"] == "uint16"  # 258 byte tokens fit
    assert store.counts["train"][0] + store.counts["eval"][0] == 40
    assert [p.parent for p in cache.glob("*/meta.json")] == [store.folder]


def test_a_second_reader_maps_the_store_and_a_change_builds_another(tmp_path, cache):
    data = corpus(tmp_path / "data")
    cfg = causal_lm.CausalLMDataConfig(paths=[str(data)], seq_len=32)
    first = causal_store(cfg)
    (first.folder / "train.bin").write_bytes(b"\0" * (first.folder / "train.bin").stat().st_size)
    again = causal_store(cfg)  # not rebuilt: the (now zeroed) file is what it maps
    assert again.folder == first.folder and int(again.pieces("train")[0].sum()) == 0

    with open(data / "docs.jsonl", "a") as f:
        f.write(json.dumps({"text": "one more"}) + "\n")
    changed = causal_store(cfg)
    assert changed.folder != first.folder
    assert changed.counts["train"][0] + changed.counts["eval"][0] == 41
    other_length = causal_store(cfg.model_copy(update={"seq_len": 16}))
    assert other_length.folder not in (first.folder, changed.folder)


def test_a_build_that_fails_leaves_nothing_and_says_where(tmp_path, cache):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "bad.jsonl").write_text('{"text": "fine"}\n{"body": "no text"}\n')
    cfg = causal_lm.CausalLMDataConfig(paths=[str(tmp_path / "data")])
    with pytest.raises(ConfigError, match=r"bad.jsonl:2: no text under 'text'"):
        causal_store(cfg)
    assert list(cache.iterdir()) == []


def test_too_little_disk_is_refused_with_the_numbers(tmp_path, cache, monkeypatch):
    cfg = causal_lm.CausalLMDataConfig(paths=[str(corpus(tmp_path / "data"))])
    monkeypatch.setattr(token_store.shutil, "disk_usage", lambda path: type("Usage", (), {"free": 1000})())
    with pytest.raises(ConfigError, match=r"the tokenized data needs up to 0\.00 GB in .*cache, which has 0\.00 GB "
                                          r"free; free space there, or set TRAINWRIGHT_DATA_CACHE"):
        causal_store(cfg)
    assert list(cache.iterdir()) == []


def test_the_sft_store_keeps_tokens_and_targets_and_the_summary(cache):
    cfg = sft.SFTDataConfig(builtin_conversations=20, seq_len=64)
    tokenizer = sft.load_tokenizer(None, None)
    store = sft.token_store(cfg, tokenizer, DataListing())
    examples, _ = sft.load_conversations(cfg)
    train = [e for name, e in examples if not sft.is_eval_document(name, cfg.eval_fraction)]
    expected = sft.tokenize_conversations(train, tokenizer, 64)
    pieces = store.pieces("train", torch.from_numpy)
    assert len(pieces) == len(expected) and all(torch.equal(a, b) for a, b in zip(pieces, expected))
    assert store.meta["dtype"] == "int32"  # the targets hold -100
    assert store.counts["documents"] + store.counts["dropped"] == 20 and store.counts["format"] == "messages"
    assert store.counts["train_loss_tokens"] == sum(int((p[1, 1:] != -100).sum()) for p in expected)


def test_cached_data_is_listed_with_its_size_and_removed_by_name(tmp_path, cache):
    cfg = causal_lm.CausalLMDataConfig(paths=[str(corpus(tmp_path / "data"))])
    store = causal_store(cfg)
    other = causal_store(cfg.model_copy(update={"seq_len": 16}))
    listed = dict(cached_data(tmp_path / "ws"))
    assert listed == {s.folder.name: sum(f.stat().st_size for f in s.folder.iterdir()) for s in (store, other)}
    with pytest.raises(NotFound, match="no cached data 'nothing'; cached: "):
        remove_cached_data(tmp_path / "ws", [store.folder.name, "nothing"])
    assert dict(cached_data(tmp_path / "ws")) == listed  # a bad name removes nothing
    assert remove_cached_data(tmp_path / "ws", [store.folder.name]) == [(store.folder.name, listed[store.folder.name])]
    assert [name for name, _ in cached_data(tmp_path / "ws")] == [other.folder.name]
    assert causal_store(cfg).folder == store.folder  # built again when asked for again
    remove_cached_data(tmp_path / "ws", ["all"])
    assert cached_data(tmp_path / "ws") == []


def test_the_data_cache_command_lists_and_removes_what_runs_tokenized(tmp_path, cache, capsys):
    import subprocess

    from mcp_server import cli

    subprocess.run(["git", "init", "-q", str(tmp_path / "ws")], check=True)
    store = causal_store(causal_lm.CausalLMDataConfig(paths=[str(corpus(tmp_path / "data"))]))
    size = sum(f.stat().st_size for f in store.folder.iterdir())
    assert cli.main(["data-cache", "--workspace", str(tmp_path / "ws"), "--json"]) == 0
    listed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert listed == {"folder": ".trainwright/data-cache", "stores": {store.folder.name: size}, "not_listed": 0,
                      "total_bytes": size, "removed": {}, "start_models": {}}
    assert cli.main(["data-cache", "--remove", "elsewhere", "--workspace", str(tmp_path / "ws"), "--json"]) == 3
    assert store.folder.is_dir()
    assert cli.main(["data-cache", "--remove", "all", "--workspace", str(tmp_path / "ws"), "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (out["stores"], out["removed"]) == ({}, {store.folder.name: size}) and not store.folder.exists()


def test_the_data_cache_lists_its_largest_stores_and_counts_the_rest(tmp_path, cache, capsys, monkeypatch):
    from mcp_server import cli
    from mcp_server.operations import data_cache

    monkeypatch.setattr(data_cache, "MAX_LIST_STORES", 2)
    for i, size in enumerate([10, 30, 20, 5]):
        (cache / f"store-{i}").mkdir(parents=True)
        (cache / f"store-{i}" / "train.bin").write_bytes(b"x" * size)
    assert cli.main(["data-cache", "--workspace", str(tmp_path / "ws"), "--json"]) == 0
    listed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (listed["stores"], listed["not_listed"], listed["total_bytes"]) == ({"store-1": 30, "store-2": 20}, 2, 65)
    assert cli.main(["data-cache", "--workspace", str(tmp_path / "ws")]) == 0
    assert "… 2 smaller store(s) not listed" in capsys.readouterr().out


def test_the_cache_lock_refuses_a_link_in_the_folders_place(tmp_path, monkeypatch):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "cache").symlink_to(elsewhere)
    with pytest.raises(ConfigError, match="the data cache .*cache is a symbolic link or not a folder"):
        with store_lock.locked_store(tmp_path / "cache", "k" * 32):
            pass
    ws = tmp_path / "ws"
    (ws / ".trainwright").mkdir(parents=True)
    (ws / ".trainwright" / "data-cache").symlink_to(elsewhere)
    (elsewhere / "kept").mkdir()
    from engine.errors import BadInput

    assert cached_data(ws) == []  # nothing listed through the link
    with pytest.raises(BadInput, match="symbolic link"):  # and the lock a removal takes refuses it
        remove_cached_data(ws, [])
    assert (elsewhere / "kept").is_dir()


def test_a_store_being_built_holds_up_only_the_builds_and_removals_of_that_store(tmp_path, cache, monkeypatch):
    building, other = "a" * 32, "b" * 32
    (cache / building).mkdir(parents=True)
    (cache / other).mkdir()
    with store_lock.locked_store(cache, building):
        with store_lock.locked_store(cache, other, wait=False):  # other data builds meanwhile
            pass
        with pytest.raises(BlockingIOError):
            with store_lock.locked_store(cache, building, wait=False):
                pass
        with pytest.raises(BadInput, match=f"a run is tokenizing its data into the cache \\(store {building}\\)"):
            remove_cached_data(tmp_path / "ws", ["all"])
        assert (cache / other).is_dir()  # refused: nothing removed
        assert remove_cached_data(tmp_path / "ws", [other]) == [(other, 0)]
    assert remove_cached_data(tmp_path / "ws", [building]) == [(building, 0)]
    assert sorted(cache.iterdir()) == []  # a lock's file is there only while it is held


def test_a_waiter_waits_while_the_holder_builds_and_gives_up_naming_a_holder_that_builds_nothing(cache, monkeypatch):
    import threading
    import time

    monkeypatch.setattr(store_lock, "LOCK_STALL_S", 0.6)
    monkeypatch.setattr(store_lock, "WAIT_POLL_S", 0.05)
    monkeypatch.setenv(store_lock.RUN_ID_VARIABLE, "lm-20261204-holder")
    key = "c" * 32
    cache.mkdir(parents=True, exist_ok=True)
    held, release = threading.Event(), threading.Event()

    def holder(writes: int) -> None:
        with store_lock.locked_store(cache, key):
            held.set()
            part = cache / f"{key}.building-x" / "train.bin"
            part.parent.mkdir(exist_ok=True)
            for _ in range(writes):  # a build that goes on: 1.2 s in all, twice the stall
                with open(part, "ab") as f:
                    f.write(b"x" * 100)
                time.sleep(0.2)
            release.wait(10)

    thread = threading.Thread(target=holder, args=(6,))
    thread.start()
    held.wait(10)
    release.set()
    start = time.monotonic()
    with store_lock.locked_store(cache, key):  # waited for the whole build, then got it
        assert time.monotonic() - start >= 1.0
    thread.join()

    release.clear()
    held.clear()
    thread = threading.Thread(target=holder, args=(0,))
    thread.start()
    held.wait(10)
    try:
        with pytest.raises(ConfigError, match=f"the data cache's store {key} is locked by run lm-20261204-holder, "
                                              "which has written nothing of it for 1 s"):
            with store_lock.locked_store(cache, key):
                pass
    finally:
        release.set()
        thread.join()
