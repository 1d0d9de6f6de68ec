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
