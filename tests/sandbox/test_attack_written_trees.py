"""Attack: trees a run or a recipe's code wrote (an export of a million empty files, folders nested
past Python's recursion limit) and stores planted in the data cache must not make the server walk
them all, fail with an internal error, or leave them half-removed; a planted store is built over."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from engine import run_dir as rd
from engine import token_store
from mcp_server import limits
from mcp_server.operations import model_tools
from mcp_server.operations import starting_model as sm
from mcp_server.operations.data_cache import data_cache
from runner.model_process import ModelProcessFailed
from tests.sandbox.helpers import fake_run, make_workspace
from workspace.workspace import Workspace, data_cache_dir

DEEP = sys.getrecursionlimit() + 500


@pytest.fixture(autouse=True)
def _deep_folders_removed(tmp_path):
    """What a failing test leaves nested past the recursion limit would fail pytest's own cleanup."""
    yield
    subprocess.run(["rm", "-rf", "--", str(tmp_path)], check=False)


def nest(parent: Path, depth: int = DEEP) -> None:
    """Folders ``depth`` deep under ``parent``, made a name at a time as a run's code can."""
    fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY)
    for _ in range(depth):
        os.mkdir("d", dir_fd=fd)
        inner = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
        os.close(fd)
        fd = inner
    os.close(fd)


def empty_files(count: int):
    """A stand-in export that writes ``count`` empty files, as a recipe's export code could."""
    def export(root, run, verb, step, args, *rest, **kw):
        staging = Path(args[args.index("--to") + 1])
        for index in range(count):
            (staging / f"f{index}").touch()
    return export


def test_an_export_of_more_files_than_the_limit_is_refused_and_removed(tmp_path, monkeypatch):
    """A recipe's export code wrote any number of empty files: every one was walked, chmodded,
    renamed into place and listed (a million of them, as many times)."""
    workspace = make_workspace(tmp_path / "ws")
    run_dir = fake_run(workspace, "20260101-000000-lm-0001")
    (run_dir / rd.SNAPSHOT_DIRNAME).mkdir()
    (run_dir / rd.SNAPSHOT_DIRNAME / "recipe.py").write_text("# the run's code\n")
    monkeypatch.setattr(limits, "MAX_EXPORT_ENTRIES", 20)
    monkeypatch.setattr(model_tools, "run_model_io", empty_files(21))
    (workspace / "out").mkdir()
    with pytest.raises(ModelProcessFailed, match="the export holds more than 20 files and folders"):
        model_tools.export_checkpoint(Workspace(workspace), "20260101-000000-lm-0001", "out/model", step=2)
    assert list((workspace / "out").iterdir()) == []  # the staging folder removed


def test_a_start_model_export_of_more_files_than_the_limit_is_refused_and_removed(tmp_path, monkeypatch):
    workspace = make_workspace(tmp_path / "ws")
    run_dir = fake_run(workspace, "20260101-000000-lm-0001")
    monkeypatch.setattr(limits, "MAX_EXPORT_ENTRIES", 20)
    monkeypatch.setattr(sm, "run_model_io", empty_files(21))
    with pytest.raises(ModelProcessFailed, match="at most 20"):
        sm.exported_checkpoint(Workspace(workspace), run_dir, 2)
    assert list(sm.start_models_dir(workspace).iterdir()) == []


def test_an_export_at_the_limit_is_kept_and_listed(tmp_path, monkeypatch):
    workspace = make_workspace(tmp_path / "ws")
    run_dir = fake_run(workspace, "20260101-000000-lm-0001")
    monkeypatch.setattr(limits, "MAX_EXPORT_ENTRIES", 20)
    monkeypatch.setattr(sm, "run_model_io", empty_files(20))
    folder = sm.exported_checkpoint(Workspace(workspace), run_dir, 2)
    assert len(list(folder.iterdir())) == 20


def test_a_half_written_export_of_many_files_is_listed_from_its_first_files(tmp_path, monkeypatch):
    """A staging folder a killed server left in start-models/ is listed by `trainwright data-cache`:
    its size counts the first MAX_EXPORT_ENTRIES entries, not every file."""
    workspace = make_workspace(tmp_path / "ws")
    left = sm.start_models_dir(workspace) / ".partial-x"
    left.mkdir(parents=True)
    for index in range(30):
        (left / f"f{index}").write_bytes(b"x")
    monkeypatch.setattr(limits, "MAX_EXPORT_ENTRIES", 20)
    assert sm.start_models(Workspace(workspace)) == [(".partial-x", 20, [])]


def test_a_data_cache_store_nested_past_the_recursion_limit_is_removed(tmp_path):
    """`trainwright data-cache --remove NAME` (and `all`) of a store a run nested 1,500 deep
    raised RecursionError in rmtree: an internal error, and the store stayed."""
    root = make_workspace(tmp_path / "ws")
    cache = data_cache_dir(root, create=True)
    for name in ("a" * 32, "b" * 32):
        (cache / name).mkdir()
        nest(cache / name)
    ws = Workspace.open(root)
    assert data_cache(ws, ["a" * 32]).removed == {"a" * 32: 0}
    assert data_cache(ws, ["all"]).removed == {"b" * 32: 0}
    assert [p.name for p in cache.iterdir() if not p.name.endswith(".lock")] == []


def test_a_build_removes_stale_folders_nested_past_the_recursion_limit(tmp_path):
    """A run planted ``<key>.building-x`` and ``<key>`` (no meta.json) nested 1,500 deep: the next
    build's rmtree of stale builds raised RecursionError, and every run of that data failed."""
    cache, key = tmp_path / "cache", "c" * 32
    cache.mkdir()
    for name in (f"{key}.building-planted", key):
        (cache / name).mkdir()
        nest(cache / name)
    store = token_store.open_or_build(key, 1, "uint16", build_one, root=cache)
    assert store.counts == {"documents": 1} and list(store.pieces("train")[0]) == [1, 2, 3]
    assert [p.name for p in cache.iterdir() if not p.name.endswith(".lock")] == [key]


def test_a_model_process_output_folder_nested_past_the_recursion_limit_is_removed(tmp_path, monkeypatch):
    """sample's model process (the recipe's code) nested its output folder 1,500 deep: the
    server's rmtree of it raised RecursionError, an internal error, and the folder stayed in /tmp."""
    import tempfile

    from runner import model_process

    workspace = make_workspace(tmp_path / "ws")
    run_dir = fake_run(workspace, "r1")
    (run_dir / rd.SNAPSHOT_DIRNAME).mkdir()
    (run_dir / rd.SNAPSHOT_DIRNAME / "recipe.py").write_text("# the run's code\n")
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temporary))

    def nesting(command, workspace, visible, writable, env, limits, timeout_s, mark, bound_fds=None):
        nest(Path(command[command.index("--result") + 1]).parent)
        return "", "nested"

    monkeypatch.setattr(model_process, "run_contained", nesting)
    with pytest.raises(ModelProcessFailed, match="ended without a result"):
        model_tools.sample(Workspace.open(workspace), "r1", ["p"])
    assert list(temporary.iterdir()) == []


def build_one(writer):
    writer.add("train", [1, 2, 3])
    return {"documents": 1}


def built(cache: Path, key: str) -> Path:
    token_store.open_or_build(key, 1, "uint16", build_one, root=cache)
    return cache / key


def rebuilt_after(cache: Path, key: str, plant) -> token_store.TokenStore:
    """The store of ``key`` opened again after ``plant(folder)`` changed its folder."""
    plant(cache / key)
    calls = []
    store = token_store.open_or_build(key, 1, "uint16", lambda writer: calls.append(1) or build_one(writer), root=cache)
    assert calls == [1], "the planted folder was read as a store"
    return store


def write_meta(folder: Path, text: str) -> None:
    (folder / "meta.json").write_text(text)


def npy_claiming(rows: int) -> bytes:
    """An .npy header that claims ``rows`` int64 values, and 8 bytes of them."""
    import io

    from numpy.lib import format as npy

    header = io.BytesIO()
    npy.write_array_header_1_0(header, {"descr": "<i8", "fortran_order": False, "shape": (rows,)})
    return header.getvalue() + b"\0" * 8


PLANTED = {
    "meta not JSON": lambda f: write_meta(f, "{not json"),
    "meta nested past the parser": lambda f: write_meta(f, "[" * 100_000),
    "meta a list": lambda f: write_meta(f, "[1, 2]"),
    "meta without counts": lambda f: write_meta(f, json.dumps({"key": "f" * 32, "rows": 1, "dtype": "uint16"})),
    "meta of other rows": lambda f: write_meta(f, json.dumps({"key": "f" * 32, "rows": 2, "dtype": "uint16",
                                                              "counts": {}})),
    "meta a link": lambda f: (os.replace(f / "meta.json", f / "real.json"), os.symlink(f / "real.json", f / "meta.json")),
    "meta a FIFO": lambda f: (os.unlink(f / "meta.json"), os.mkfifo(f / "meta.json")),
    "index of 10^12 rows": lambda f: (f / "train.idx.npy").write_bytes(npy_claiming(10**12)),
    "index past the values": lambda f: np.save(f / "train.idx.npy", np.array([0, 3, 9], dtype=np.int64)),
    "index going back": lambda f: np.save(f / "train.idx.npy", np.array([0, 3, 1, 3], dtype=np.int64)),
    "index not numbers": lambda f: (f / "train.idx.npy").write_bytes(b"not an npy file"),
    "index of floats": lambda f: np.save(f / "train.idx.npy", np.array([0.0, 3.0])),
    "values cut short": lambda f: (f / "train.bin").write_bytes(b"\1\0"),
    "values missing": lambda f: (f / "eval.bin").unlink(),
}


@pytest.mark.parametrize("plant", PLANTED.values(), ids=PLANTED.keys())
def test_a_planted_store_is_built_over_under_the_lock(tmp_path, plant):
    """A run planted (or cut short) a store's files in the data cache: json.loads raised
    JSONDecodeError or RecursionError, a meta of another shape a KeyError or TypeError later, and
    an index that disagrees with its values a ValueError in np.memmap, or pieces read past the
    values; each an internal error of the launch check or the run, at every launch of that data."""
    cache, key = tmp_path / "cache", "f" * 32
    cache.mkdir()
    built(cache, key)
    store = rebuilt_after(cache, key, plant)
    assert store.counts == {"documents": 1} and [list(p) for p in store.pieces("train")] == [[1, 2, 3]]
    assert len(store.pieces("eval")) == 0


def test_an_intact_store_is_mapped_not_built_again(tmp_path):
    cache, key = tmp_path / "cache", "f" * 32
    cache.mkdir()
    built(cache, key)
    store = token_store.open_or_build(key, 1, "uint16", lambda writer: pytest.fail("built again"), root=cache)
    assert [list(p) for p in store.pieces("train")] == [[1, 2, 3]]


@pytest.mark.parametrize("plant", [PLANTED["meta not JSON"], PLANTED["meta a list"]], ids=["not JSON", "a list"])
def test_the_launch_check_leaves_a_planted_store_of_large_data_to_the_run(tmp_path, plant):
    """The check took a folder with any meta.json for a built store and tokenized large data itself."""
    cache, key = tmp_path / "cache", "f" * 32
    cache.mkdir()
    built(cache, key)
    with token_store.launch_check():
        assert not token_store.left_to_run(key, 10**9, 64.0, cache)
        plant(cache / key)
        assert token_store.left_to_run(key, 10**9, 64.0, cache)


@pytest.mark.parametrize("plant", PLANTED.values(), ids=PLANTED.keys())
def test_the_data_cache_command_lists_and_removes_a_planted_store(tmp_path, plant):
    root = make_workspace(tmp_path / "ws")
    cache = data_cache_dir(root, create=True)
    built(cache, "f" * 32)
    plant(cache / ("f" * 32))
    ws = Workspace.open(root)
    assert list(data_cache(ws, []).stores) == ["f" * 32]
    assert list(data_cache(ws, ["f" * 32]).removed) == ["f" * 32]
    assert not (cache / ("f" * 32)).exists()
