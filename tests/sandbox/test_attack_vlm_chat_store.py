"""Hostile stores: a run writes into the data cache, so what the vlm_chat template reads back of a
store (a piece's record, the list of media it read) may be what a run planted there. Refused
naming the store, or read as a store to build anew; never trusted, never an internal error."""

from __future__ import annotations

import numpy as np
import pytest

from engine.config import ConfigError
from tests.templates.test_vlm_chat_store import engine_of, stores, vlm
from tests.templates.test_vlm_chat_store import folders, workspace  # noqa: F401, F811 (the fixtures)


def test_a_record_planted_in_the_store_is_refused_naming_the_store(folders, workspace):  # noqa: F811 (the fixtures imported above)
    """A run writes into the data cache: a piece's record overwritten (its index, and so the
    store's check, still agreeing) is refused naming the store and how to remove it, not an
    internal error in the middle of a run."""
    engine = engine_of(folders["qwen2_vl"], workspace)
    assert len(engine.split_pieces("train")) == 15
    (name,) = stores(workspace)
    folder = workspace / "cache" / name
    starts = np.load(folder / "train.records.idx.npy")
    with open(folder / "train.records.bin", "r+b") as file:
        file.seek(int(starts[0]))
        file.write(b"\xff" * int(starts[1] - starts[0]))
    planted = engine_of(folders["qwen2_vl"], workspace).split_pieces("train")
    assert type(planted).__name__ == "StoredPieces"  # the store is still mapped: its index agrees
    with pytest.raises(ConfigError, match=f"store {name}: piece 0's record is not one this template writes.*"
                                          f"data-cache --remove {name}"):
        planted[0]
    assert planted[1]["ids"].numel()  # the others read as before


@pytest.mark.parametrize("planted", ["link", "long line", "not JSON", "gone"])
def test_a_media_list_a_run_planted_in_the_store_makes_it_built_anew_not_trusted(folders, workspace, planted):  # noqa: F811
    """A run writes into the data cache: a store's media list that is a link, a line longer than any
    path (read a bounded line at a time), not JSON or missing reads as media that changed: the
    examples are encoded again into a store beside it, and the summary is the same."""
    config = engine_of(folders["qwen2_vl"], workspace).config
    summary = vlm.VLMChat.summarize_data(config)
    (name,) = stores(workspace)
    listed = workspace / "cache" / name / vlm.MEDIA_LIST
    listed.unlink()
    if planted == "link":
        listed.symlink_to(workspace / "data.jsonl")
    elif planted == "long line":
        listed.write_text("x" * (vlm.MAX_MEDIA_LINE * 4))
    elif planted == "not JSON":
        listed.write_text("{\n")
    assert vlm.VLMChat.summarize_data(config) == summary
    assert len(stores(workspace)) == 2
