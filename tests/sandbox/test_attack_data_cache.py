"""Attack: content a run could plant in the shared data cache must not make the server's
listing/removal (data_cache tool) leave the cache, delete outside it, or hang."""

import os
from pathlib import Path

from mcp_server.operations.data_cache import data_cache
from workspace.workspace import Workspace, data_cache_dir


def test_planted_links_in_data_cache_do_not_escape(tmp_path: Path) -> None:
    ws_root = tmp_path / "ws"
    ws_root.mkdir()
    ws = Workspace.open(ws_root)
    ws.prepare_state()
    cache = data_cache_dir(ws_root)

    outside = tmp_path / "outside"
    (outside / "precious").mkdir(parents=True)
    (outside / "precious" / "keep.txt").write_text("secret")
    (outside / "file.bin").write_bytes(b"x" * 10)

    # a link named like a store, leading out of the workspace
    os.symlink(outside / "precious", cache / "deadbeef-store")
    # a real store holding links out and a FIFO (listing must not open/hang on it)
    store = cache / "abc123"
    store.mkdir()
    (store / "meta.json").write_text("{}")
    os.symlink(outside / "file.bin", store / "tokens.bin")
    os.symlink(outside / "precious", store / "sub")
    os.mkfifo(store / "pipe")
    # a link to the workspace root itself
    os.symlink(ws_root, cache / "root-link")

    listed = data_cache(ws, [])
    assert "deadbeef-store" not in listed.stores and "root-link" not in listed.stores
    assert listed.stores == {"abc123": 2}

    result = data_cache(ws, ["all"])
    assert set(result.removed) == {"abc123"}
    assert (outside / "precious" / "keep.txt").read_text() == "secret"
    assert (outside / "file.bin").read_bytes() == b"x" * 10
    assert ws_root.is_dir() and (ws_root / ".trainwright").is_dir()
    assert not store.exists()

    # a folder name that is not UTF-8: the listing must still serialize (not break the tool)
    os.mkdir(os.fsencode(cache) + b"/bad\xff-name")
    listed = data_cache(ws, [])
    listed.model_dump_json()


def test_removing_an_unknown_store_among_thousands_a_run_made_says_so_in_a_bounded_message(tmp_path: Path) -> None:
    """The refusal named every store: 3,000 folders with 200-character names made it 650 KB."""
    import pytest

    from engine.errors import MAX_QUOTED_CHARS, NotFound
    from tests.sandbox.helpers import make_workspace, tree_hash

    root = make_workspace(tmp_path / "ws")
    cache = data_cache_dir(root, create=True)
    for index in range(3000):
        (cache / (f"\x1b[2J{index:05d}" + "x" * 200)).mkdir()
    before = tree_hash(root)
    with pytest.raises(NotFound) as refused:
        data_cache(Workspace.open(root), ["nope" * 1000])
    message = str(refused.value)
    assert len(message) < 3 * MAX_QUOTED_CHARS and message.startswith("no cached data 'nopenope")
    assert message.endswith("… (3000 stores; `trainwright data-cache` lists them)"), message[-200:]
    assert tree_hash(root) == before


def test_a_planted_build_link_is_no_progress_of_a_build_and_the_next_build_removes_it(tmp_path: Path) -> None:
    """A run plants ``<key>.building-x`` as a link to a folder that grows (or to ``/``): a waiter
    walked it at every poll, counted its growth as the holder's build (a stalled holder never
    timed out), and the builder's ``rmtree`` of stale builds left a link in place for ever."""
    from engine import store_lock, token_store

    cache, outside, key = tmp_path / "cache", tmp_path / "outside", "d" * 32
    cache.mkdir()
    outside.mkdir()
    (outside / "grows.bin").write_bytes(b"x" * 1000)
    os.symlink(outside, cache / f"{key}.building-planted")
    assert store_lock.building_bytes(cache, key) == 0

    def build(writer):
        writer.add("train", [1, 2, 3])
        return {"documents": 1}

    store = token_store.open_or_build(key, 1, "uint16", build, root=cache)
    assert store.meta["counts"] == {"documents": 1}
    assert not os.path.lexists(cache / f"{key}.building-planted")
    assert (outside / "grows.bin").read_bytes() == b"x" * 1000  # the link removed, not what it leads to


def test_a_store_planted_as_a_link_to_a_folder_without_meta_is_built_in_its_place(tmp_path: Path) -> None:
    """``<key>`` planted as a link to a folder with no ``meta.json`` (or to nothing): the builder's
    ``rmtree`` left the link and its ``os.replace`` of the built folder onto it failed, so every
    later run of that data failed after tokenizing it all."""
    from engine import token_store

    cache, outside, key = tmp_path / "cache", tmp_path / "outside", "e" * 32
    cache.mkdir()
    (outside / "empty").mkdir(parents=True)
    for target in (outside / "empty", outside / "nothing"):
        os.symlink(target, cache / key)
        store = token_store.open_or_build(key, 1, "uint16", lambda writer: {"documents": 0}, root=cache)
        assert store.counts == {"documents": 0}
        assert (cache / key).is_dir() and not (cache / key).is_symlink()
        assert list((outside / "empty").iterdir()) == []
        token_store.shutil.rmtree(cache / key)
