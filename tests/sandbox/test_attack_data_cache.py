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
