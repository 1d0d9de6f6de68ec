"""Attack: vlm_chat keeps each record's image as a reference, confined and its header checked when
the data is loaded, and opens it when a batch needs it (a thread prefetches them). Whatever
happens to that path in between — swapped for a link out of the workspace or for a FIFO, even
between the confinement check and the open — a batch gets the image checked or a clear refusal,
never another file's bytes and never a wait for ever."""

from __future__ import annotations

import multiprocessing
import os
import shutil
import sys
from pathlib import Path

import pytest
from PIL import Image

from engine import data_files
from engine.config import ConfigError
from engine.launch import load_recipe_class
from tests.support import REPO

vlm_chat = sys.modules[load_recipe_class(REPO / "recipes_template" / "vlm_chat").__module__]
INSIDE, OUTSIDE = (20, 20, 200), (200, 20, 20)  # the workspace's picture: blue; the one outside: red


@pytest.fixture
def image(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "ws"
    (root / "images").mkdir(parents=True)
    Image.new("RGB", (8, 8), INSIDE).save(root / "images" / "blue.png")
    (tmp_path / "outside").mkdir()
    Image.new("RGB", (8, 8), OUTSIDE).save(tmp_path / "outside" / "red.png")
    shutil.copyfile(root / "images" / "blue.png", root / "images" / "shown.png")
    monkeypatch.setenv(data_files.WORKSPACE_VARIABLE, str(root))
    return root / "images" / "shown.png"


def flip(path: Path, outside: Path, stop) -> None:
    """Another process: ``path`` swapped, atomically and over and over, between the workspace's
    picture and a link to the one outside."""
    inside, spare = path.with_name("blue.png"), path.with_name("spare")
    while not stop.is_set():
        os.link(inside, spare)
        os.replace(spare, path)
        os.symlink(outside, spare)
        os.replace(spare, path)


def test_an_image_swapped_for_a_link_out_between_check_and_open_is_never_read(image):
    """data_file resolved and confined the path, then Image.open opened it by name: a link swapped
    in between was followed, and the batch trained on a file outside the workspace."""
    ref = vlm_chat.ImageRef.checked("shown.png", image.parent, "data.jsonl:1")
    stop = multiprocessing.get_context("fork").Event()
    flipper = multiprocessing.get_context("fork").Process(target=flip, args=(image, image.parents[2] / "outside" / "red.png", stop))
    flipper.start()
    seen = {"inside": 0, "outside": 0, "refused": 0}
    try:
        for _ in range(3000):
            try:
                colour = ref.open().getpixel((0, 0))
            except ConfigError:
                seen["refused"] += 1
                continue
            seen["inside" if colour == INSIDE else "outside"] += 1
    finally:
        stop.set()
        flipper.join(10)
    assert seen["outside"] == 0, seen
    assert seen["inside"] > 0, seen
