"""Attack: a run writes into the shared data cache while another run builds a store there. What
it plants in that build's folder (a link named as a file the builder writes next) must not make
the builder write through it — into a file of the builder's own run, which the planting run
cannot reach itself — and the build is refused, naming what was planted."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from engine import store_parts, token_store
from engine.config import ConfigError


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    path = tmp_path / "builder-run" / "run.json"
    path.parent.mkdir()
    path.write_text('{"status": "running"}')
    return path


@pytest.mark.parametrize("planted", ["train.idx.npy", "meta.json"])
def test_a_link_planted_in_a_build_is_not_written_through(tmp_path, victim, planted):
    """The builder's np.save of an index and its write of meta.json followed a link a run planted
    in the build folder meanwhile: the builder's own run.json was overwritten."""
    cache, key = tmp_path / "cache", "a" * 32
    cache.mkdir()

    def build(writer: token_store.StoreWriter) -> dict:
        writer.add("train", [1, 2, 3])
        os.symlink(victim, writer.folder / planted)  # another run, as the build goes on
        return {"documents": 1}

    with pytest.raises(ConfigError, match=f"the data cache's build of store {key} holds {planted}, which it did not "
                                          "write: a run writes into the data cache; stop it and launch again"):
        token_store.open_or_build(key, 1, "uint16", build, root=cache)
    assert victim.read_text() == '{"status": "running"}'
    assert list(cache.iterdir()) == []  # the build removed, the link with it


def test_a_link_planted_in_a_part_of_a_build_over_the_cores_is_not_written_through(tmp_path, victim):
    cache, key = tmp_path / "cache", "b" * 32
    cache.mkdir()

    def build_part(part: token_store.StoreWriter, index: int) -> dict:
        part.add("train", [index, 1])
        if index == 1:
            os.symlink(victim, part.folder / "eval.idx.npy")
        return {"documents": 1}

    def build(writer: token_store.StoreWriter) -> dict:
        store_parts.build_in_parts(writer, 2, build_part, workers=2)
        return {"documents": 2}

    with pytest.raises(ConfigError, match=f"the data cache's build of store {key} holds eval.idx.npy, which it did not "
                                          "write"):
        token_store.open_or_build(key, 1, "uint16", build, root=cache)
    assert victim.read_text() == '{"status": "running"}'
    assert list(cache.iterdir()) == []


def test_a_part_folder_planted_before_its_worker_makes_it_is_refused_naming_it(tmp_path, victim):
    """The worker's mkdir of a part another run made first failed with a bare FileExistsError."""
    cache, key = tmp_path / "cache", "c" * 32
    cache.mkdir()

    def build(writer: token_store.StoreWriter) -> dict:
        os.symlink(victim.parent, writer.folder / "part-1")
        store_parts.build_in_parts(writer, 2, lambda part, index: {"documents": 1}, workers=2)
        return {"documents": 2}

    with pytest.raises(ConfigError, match=f"the data cache's build of store {key} holds part-1, which it did not write"):
        token_store.open_or_build(key, 1, "uint16", build, root=cache)
    assert sorted(p.name for p in victim.parent.iterdir()) == ["run.json"] and list(cache.iterdir()) == []
