"""vlm_chat counts an example's image tokens from its images' sizes, as their files' headers give
them, where the family's processor expands an image by a rule of its size alone: the same ids as
the processor makes of the decoded pictures (the built-in examples' count); data files are encoded
once into the store, each picture decoded there, and never again while they do not change."""

from __future__ import annotations

import json
import shutil
import sys

import numpy as np
import pytest

from engine.config import ConfigError
from engine.data_files import WORKSPACE_VARIABLE
from engine.token_store import CACHE_VARIABLE
from engine.launch import load_recipe_class
from tests.support import REPO
from tests.vlm_families import FAMILIES, PREFIX_SUFFIX_FAMILIES, available, each, tiny_vlm_folder

vlm = sys.modules[load_recipe_class(REPO / "recipes_template" / "vlm_chat").__module__]

ALL = FAMILIES + PREFIX_SUFFIX_FAMILIES
# Counted from sizes: one image, several. Idefics3 splits an image into tiles, each its own text
# around its tokens; PaliGemma's prefix is the processor's own; OneVision's several images take
# a count of their own (not its rule of one image's size): these count through the processor.
BY_SIZE = {"llava": (True, True), "qwen2_vl": (True, True), "qwen2_5_vl": (True, True), "qwen3_vl": (True, True),
           "gemma3": (True, True), "llava_onevision": (True, False), "idefics3": (False, False),
           "paligemma": (False, False)}
SIZES = [(1, 1), (17, 1000), (1000, 17), (37, 53), (56, 56), (333, 211), (480, 640), (1080, 1920)]  # (height, width)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("vlm_sizes")
    return {family: tiny_vlm_folder(root / family, family) for family in available(ALL)}


def picture(size, seed=0):
    from PIL import Image

    height, width = size
    return Image.fromarray(np.random.default_rng(seed).integers(0, 255, (height, width, 3), dtype=np.uint8))


def conversation(images: int):
    return [vlm.user_turn(["What is it?"], images), vlm.assistant_turn("a thing")]


@pytest.mark.parametrize("family", each(ALL))
def test_each_familys_count_from_sizes_is_the_processors_on_the_pictures(family, folders):
    processor = vlm.load_processor(str(folders[family]))
    expansions = {n: vlm.expansion_of(processor, n) for n in (1, 2)}
    assert (expansions[1] is not None, expansions[2] is not None) == BY_SIZE[family]
    if family == "paligemma":
        messages = conversation(1)
        assert vlm.encode(processor, messages, [picture((17, 1000))], 4096, "r", expansions[1])["ids"].numel() > 0
        return
    shown = [[size] for size in SIZES] + [[a, b] for a, b in zip(SIZES, reversed(SIZES))]
    for sizes in shown:
        pictures = [picture(size, seed) for seed, size in enumerate(sizes)]
        expansion = expansions[len(sizes)]
        counted = vlm.encode(processor, conversation(len(sizes)), pictures, 8192, f"sizes {sizes}", expansion)
        made = vlm.encode(processor, conversation(len(sizes)), pictures, 8192, f"sizes {sizes}")
        assert counted["ids"].tolist() == made["ids"].tolist(), sizes
        assert counted["targets"].tolist() == made["targets"].tolist(), sizes
        if expansion is not None:
            unit = processor.tokenizer.convert_tokens_to_ids(expansion.unit)
            assert (made["ids"] == unit).sum() == sum(vlm.tokens_by_size(processor, sizes)), sizes


@pytest.fixture
def workspace(tmp_path, monkeypatch):
    """LLaVA records of PNG photos of several sizes, one with a truncated file whose header reads."""
    monkeypatch.setenv(WORKSPACE_VARIABLE, str(tmp_path))
    (tmp_path / "images").mkdir()
    records = []
    for i, size in enumerate(SIZES[1:] * 3):
        picture(size, i).save(tmp_path / "images" / f"{i}.png")
        records.append({"image": f"images/{i}.png", "conversations": [
            {"from": "human", "value": "<image>\nWhat is it?"}, {"from": "gpt", "value": f"thing {i}"}]})
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    whole = (tmp_path / "images" / "0.png").read_bytes()
    (tmp_path / "images" / "cut.png").write_bytes(whole[: len(whole) // 2])
    (tmp_path / "cut.jsonl").write_text(json.dumps({**records[0], "image": "images/cut.png"}) + "\n")
    return tmp_path


def model_in(workspace, folder):
    """The model folder inside the workspace, where a run reads it."""
    return str(shutil.copytree(folder, workspace / "models" / folder.name))


def decodes(monkeypatch) -> list:
    """The images PIL decodes from now on (each kept, so that each has its own id)."""
    from PIL import ImageFile

    loaded, load = [], ImageFile.ImageFile.load
    monkeypatch.setattr(ImageFile.ImageFile, "load", lambda self: loaded.append(self) or load(self))
    return loaded


@pytest.mark.parametrize("family", ["qwen2_vl", "gemma3"])
def test_the_data_summary_decodes_each_image_once_into_the_store_and_a_second_decodes_none(family, folders, workspace,
                                                                                           monkeypatch, tmp_path):
    monkeypatch.setenv(CACHE_VARIABLE, str(tmp_path / "cache"))
    config = vlm.VLMChatConfig(model=vlm.ModelConfig(pretrained_path=model_in(workspace, folders[family])),
                               data=vlm.VLMChatDataConfig(paths=[str(workspace / "data.jsonl")], seq_len=4096))
    loaded = decodes(monkeypatch)
    summary = vlm.VLMChat.summarize_data(config)
    assert summary.documents == 21 and summary.format == "llava (21 images)"
    assert len({id(image) for image in loaded}) == 21  # the store's build: the processor decodes every picture
    decoded = len(loaded)
    assert vlm.VLMChat.summarize_data(config) == summary and len(loaded) == decoded  # the store again: nothing decoded


def test_a_truncated_image_whose_header_reads_is_refused_naming_its_record_when_decoded(folders, workspace, monkeypatch,
                                                                                       tmp_path):
    monkeypatch.setenv(CACHE_VARIABLE, str(tmp_path / "cache"))
    config = vlm.VLMChatConfig(model=vlm.ModelConfig(pretrained_path=model_in(workspace, folders["qwen2_vl"])),
                               data=vlm.VLMChatDataConfig(paths=[str(workspace / "cut.jsonl")], seq_len=4096))
    message = r"^cut.jsonl:1: image 'images/cut.png' cannot be read \(.*truncated"
    with pytest.raises(ConfigError, match=message):  # the launch check (or the run's first phase) encodes every example
        vlm.VLMChat.summarize_data(config)
    assert [p.name for p in (tmp_path / "cache").iterdir() if not p.name.endswith(".lock")] == []  # nothing kept
    (where, messages, images), = vlm.load_examples(config.data)[0]  # the reading checks the header alone
    processor = vlm.load_processor(config.model.pretrained_path)
    with pytest.raises(ConfigError, match=message):
        vlm.encode(processor, messages, images, 4096, where)
    with pytest.raises(ConfigError, match=message):  # a batch that makes its images again
        vlm.image_inputs(processor, {"images": images, "inputs": None, "text": "<|image_pad|>", "call": {}})


def test_a_bomb_is_refused_from_its_header_and_a_picture_keeps_its_size(workspace):
    from PIL import Image

    ref = vlm.ImageRef.checked("images/1.png", workspace, "data.jsonl:2")
    assert ref.size == (1000, 17) and vlm.size_of(ref) == (1000, 17) and vlm.size_of(picture((17, 1000))) == (17, 1000)
    Image.new("1", (20_000, 10_000)).save(workspace / "images" / "bomb.png")  # 200 M pixels: over PIL's limit
    with pytest.raises(ConfigError, match=r"^data.jsonl:3: image 'images/bomb.png' cannot be read \(.*decompression"):
        vlm.ImageRef.checked("images/bomb.png", workspace, "data.jsonl:3")
