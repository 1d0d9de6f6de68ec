"""The vision-language template's data and inputs, written by someone hostile: a data file or an
image that cannot be read is a clear ConfigError naming its line (the launch check's bad_input),
never a crash deep in training or a launch check that hangs; a caption or a sample prompt cannot
add image tokens; and the images are part of the data fingerprint, so a run that trains on other
images than its launch check counted says so."""

from __future__ import annotations

import json
import os
import signal
import struct
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

from engine import data_files
from engine.config import ConfigError
from engine.launch import load_recipe_class
from tests.support import REPO

vlm = sys.modules[load_recipe_class(REPO / "recipes_template" / "vlm").__module__]


def _png_header(width: int, height: int) -> bytes:
    """A PNG that claims a size and holds (almost) nothing: a decompression bomb's header."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(
        b"IEND", b"")


@pytest.fixture
def workspace(tmp_path, monkeypatch):
    from PIL import Image

    root = tmp_path / "ws"
    (root / "images").mkdir(parents=True)
    Image.new("RGB", (20, 20), (200, 20, 20)).save(root / "images" / "ok.png")
    monkeypatch.chdir(root)
    monkeypatch.setenv(data_files.WORKSPACE_VARIABLE, str(root))
    yield root


def _load(root: Path, record_bytes: bytes, listing: data_files.DataListing | None = None):
    (root / "data.jsonl").write_bytes(b'{"image": "images/ok.png", "caption": "a red square"}\n' + record_bytes + b"\n")
    return vlm.load_examples(vlm.VLMDataConfig(paths=["data.jsonl"]), listing)


class Hung(BaseException):
    """Not an OSError (TimeoutError is one, and the loader catches those)."""


def _timeout(signum, frame):
    raise Hung("the data loader hung")


@pytest.mark.parametrize("case", ["bomb", "not_utf8", "deep_json", "fifo", "lone_surrogate", "image_path_nul", "link_loop"])
def test_hostile_data_is_a_config_error_naming_its_line(workspace, case):
    if case == "bomb":  # PIL refuses its size with DecompressionBombError, which is not an OSError
        (workspace / "images" / "bomb.png").write_bytes(_png_header(30000, 30000))
        record = b'{"image": "images/bomb.png", "caption": "x"}'
    elif case == "not_utf8":
        record = b'{"image": "images/ok.png", "caption": "\xff\xfe"}'
    elif case == "deep_json":
        record = b"[" * 100_000
    elif case == "lone_surrogate":  # valid JSON; the tokenizer raised TypeError in the launch check
        record = b'{"image": "images/ok.png", "caption": "\\ud800 a caption"}'
    elif case == "image_path_nul":
        record = b'{"image": "images/ok.png\\u0000", "caption": "x"}'
    elif case == "link_loop":  # Path.resolve raised RuntimeError('Symlink loop ...')
        os.symlink("b.png", workspace / "images" / "a.png")
        os.symlink("a.png", workspace / "images" / "b.png")
        record = b'{"image": "images/a.png", "caption": "x"}'
    else:  # opening a FIFO waits for a writer that never comes
        os.mkfifo(workspace / "images" / "fifo.png")
        record = b'{"image": "images/fifo.png", "caption": "x"}'
    previous = signal.signal(signal.SIGALRM, _timeout)
    signal.alarm(10)
    try:
        with pytest.raises(ConfigError, match="^data.jsonl:2: "):
            _load(workspace, record)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def test_every_image_mode_becomes_three_channels(workspace):
    from PIL import Image

    images = {
        "i16.png": Image.fromarray(np.full((20, 20), 40000, np.uint16)),
        "palette.png": Image.new("P", (20, 20)),
        "rgba.png": Image.new("RGBA", (20, 20), (1, 2, 3, 0)),
        "gray.png": Image.new("L", (20, 20), 7),
        "bits.png": Image.new("1", (20, 20), 1),
        "cmyk.jpg": Image.new("CMYK", (20, 20)),
    }
    lines = []
    for name, image in images.items():
        image.save(workspace / "images" / name)
        lines.append(json.dumps({"image": f"images/{name}", "caption": name}))
    examples = _load(workspace, "\n".join(lines).encode())
    pixels = vlm.pixel_values(vlm.build_processor(16, 8), [image for _, image, _ in examples])
    assert pixels.shape == (len(images) + 1, 3, 16, 16)
    assert torch.isfinite(pixels).all() and pixels.abs().max() <= 1


def test_special_tokens_in_a_caption_are_its_text(workspace):
    """``<image>`` in a caption would add an image token the splice has no features for
    (transformers: "Image features and image tokens do not match", at the first step)."""
    processor = vlm.build_processor(32, 8)
    text = "a <image> at </s> the <pad> left<image>"
    examples = _load(workspace, json.dumps({"image": "images/ok.png", "caption": text}).encode())
    pieces = vlm.make_pieces(examples, processor, seq_len=128)
    tokens, targets = pieces[1][0]
    assert int((tokens == processor.image_token_id).sum()) == vlm.image_tokens(processor)
    caption = targets[targets != -100].tolist()
    assert caption[-1] == processor.tokenizer.eos_token_id and caption.count(processor.tokenizer.eos_token_id) == 1
    assert bytes(caption[:-1]).decode() == text
    config = vlm.ModelConfig(hidden_size=32, intermediate_size=64, vision_hidden_size=32, vision_layers=1, num_layers=1)
    model = vlm.build_model(config, processor, seq_len=128)
    batch = vlm.collate(pieces, 128, processor.tokenizer.pad_token_id)
    logits = model(input_ids=batch["input_ids"], pixel_values=batch["pixel_values"], use_cache=False).logits
    assert torch.isfinite(logits).all()


def test_a_sample_prompt_cannot_add_image_tokens():
    from engine.distributed import DistInfo

    config = vlm.VLMConfig.model_validate({"data": {"builtin_images": 40, "eval_fraction": 0.25}})
    engine = vlm.VLM(config, DistInfo(0, 1, 0, torch.device("cpu"), None))
    inputs, _ = engine.sample_inputs(0, "<image><image> a")
    assert inputs["input_ids"].tolist() == [[engine.processor.image_token_id] * 16 + list(b"<image><image> a")]


def test_the_images_are_part_of_the_data_fingerprint(workspace):
    from PIL import Image

    listing = data_files.DataListing()
    _load(workspace, b"", listing)
    counted = listing.fingerprint()
    assert listing.changed() == []
    Image.new("RGB", (20, 20), (20, 200, 20)).save(workspace / "images" / "ok.png")  # the .jsonl is unchanged
    assert listing.changed() == [(workspace / "images" / "ok.png").resolve()]
    listing = data_files.DataListing()
    _load(workspace, b"", listing)
    assert listing.fingerprint() != counted


def test_evaluate_on_given_images_is_a_valid_config():
    """``evaluate(data=[...])`` holds every image out (``data.eval_fraction=1``)."""
    from engine.config import build_config
    from engine.model_io import evaluation_overrides

    recipe = load_recipe_class(REPO / "recipes_template" / "vlm")
    fields = build_config(recipe.config_class, None, {}).model_dump(mode="json")
    config = build_config(recipe.config_class, None, evaluation_overrides(fields, ["data.jsonl"]), base=fields)
    assert (config.data.paths, config.data.eval_fraction) == (["data.jsonl"], 1.0)


def test_a_run_with_every_image_held_out_is_refused_by_the_check():
    """Before: the launch check passed and training stopped at its first batch (ZeroDivisionError)."""
    from engine.distributed import DistInfo

    config = vlm.VLMConfig.model_validate({"data": {"builtin_images": 10, "eval_fraction": 0.99}})
    with pytest.raises(ConfigError, match="no training images: data.eval_fraction=0.99 holds out all of them"):
        vlm.VLM.summarize_data(config)
    engine = vlm.VLM(config, DistInfo(0, 1, 0, torch.device("cpu"), None))
    with pytest.raises(ConfigError, match="no training images"):
        engine.prepare_data()


def test_a_vlm_run_evaluates_on_given_images_and_fingerprinted_them(tmp_path, monkeypatch):
    """One short run on image files whose captions hold ``<image>`` (it trains: before, its first
    step failed): its run.json's fingerprint covers the images (an image changed afterwards
    changes it), and ``evaluate`` on given images works."""
    import shutil

    from PIL import Image

    from engine import model_io
    from engine import run_dir as rd
    from tests.support import run_engine

    recipe = tmp_path / "vlm"
    shutil.copytree(REPO / "recipes_template" / "vlm", recipe, ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "set" / "images").mkdir(parents=True)
    with open(tmp_path / "set" / "data.jsonl", "w") as f:
        for i in range(24):
            Image.new("RGB", (16, 16), ((i * 40) % 255, 20, 200)).save(tmp_path / "set" / "images" / f"{i}.png")
            f.write(json.dumps({"image": f"images/{i}.png", "caption": f"picture {i % 3} <image>"}) + "\n")
    small = ("model.hidden_size=32", "model.intermediate_size=64", "model.vision_hidden_size=32", "model.vision_layers=1",
             "model.num_layers=1", "data.seq_len=48", "data.batch_size=4", "data.eval_prompts=2",
             "metrics.tensorboard=false", "train.max_steps=2", "train.eval_every=0", "checkpoint.every=2")
    run = run_engine(tmp_path, recipe, *small, "data.paths=[set]", "data.eval_fraction=0.2")
    shutil.copytree(recipe, run / rd.SNAPSHOT_DIRNAME)
    counted = rd.read_run(run).data
    assert counted is not None and counted.fingerprint

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(data_files.WORKSPACE_VARIABLE, raising=False)
    listing = data_files.DataListing()
    vlm.load_examples(vlm.VLMDataConfig(paths=["set"]), listing)
    assert listing.fingerprint() == counted.fingerprint
    Image.new("RGB", (16, 16), (1, 2, 3)).save(tmp_path / "set" / "images" / "5.png")
    listing = data_files.DataListing()
    vlm.load_examples(vlm.VLMDataConfig(paths=["set"]), listing)
    assert listing.fingerprint() != counted.fingerprint

    result = model_io.evaluate(run, 2, data=["set"])
    assert result.batches >= 1 and result.tokens > 0 and result.eval_loss > 0
    assert set(result.metrics) == {"caption_accuracy"}


def test_what_sample_shows_of_a_caption_is_bounded(workspace):
    """sample names each held-out image's caption beside its completion: 8 captions of 150,000
    characters made the model process's result too large (over 1 MB), so sample failed."""
    from engine.distributed import DistInfo
    from runner.model_process import MAX_RESULT_BYTES

    (workspace / "data.jsonl").write_text("".join(
        json.dumps({"image": "images/ok.png", "caption": "a long caption " * 10_000}) + "\n" for _ in range(4)))
    config = vlm.VLMConfig.model_validate({"data": {"paths": ["data.jsonl"], "eval_fraction": 0.999}})
    engine = vlm.VLM(config, DistInfo(0, 1, 0, torch.device("cpu"), None))
    shown = [engine.sample_inputs(i, "a")[1] for i in range(8)]
    assert len(json.dumps(shown)) < MAX_RESULT_BYTES // 8
    assert all(about["expected"].startswith("a long caption a long") for about in shown)


HAND_FROZEN = '''
import torch
from torch import nn


class VLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.vision_tower = nn.Linear(4, 4)
        self.projector = nn.Linear(4, 8)
        self.language_model = nn.ModuleList([nn.Linear(8, 8) for _ in range(2)])


def main():
    model = VLM()
    FREEZE
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
'''


@pytest.mark.parametrize("freeze", [
    "list(model.parameters())[0].requires_grad = False",
    "setattr(model.language_model[0].weight, 'requires_grad', False)",
    "model.language_model[0].weight.requires_grad = False",
])
def test_the_stage_policy_refuses_to_overrule_hand_written_freezing(tmp_path, freeze):
    """The policy sets requires_grad of every parameter after the model is built: it is refused
    where the recipe freezes by hand. A subscript on the way, or setattr, went unseen, and the
    policy silently unfroze what the recipe froze."""
    from skills.apply import apply_skill
    from skills.errors import SkillRefused

    recipe = tmp_path / "recipe.py"
    recipe.write_text(HAND_FROZEN.replace("FREEZE", freeze))
    with pytest.raises(SkillRefused, match="already sets requires_grad at recipe.py:16"):
        apply_skill("vlm-freeze-policy", recipe)
    assert recipe.read_text() == HAND_FROZEN.replace("FREEZE", freeze)


def test_a_loop_of_links_among_the_data_is_a_config_error(workspace):
    """Given as a data path, or met in a data folder: a RuntimeError from the launch check before."""
    (workspace / "corpus").mkdir()
    (workspace / "corpus" / "a.jsonl").write_text("{}\n")
    os.symlink("y.jsonl", workspace / "corpus" / "x.jsonl")
    os.symlink("x.jsonl", workspace / "corpus" / "y.jsonl")
    for paths in (["corpus"], ["corpus/x.jsonl"]):
        with pytest.raises(ConfigError, match="loop of symbolic links"):
            data_files.data_files(paths, suffixes={".jsonl"})


def test_launch_run_refuses_a_decompression_bomb_with_its_line_and_changes_nothing(tmp_path):
    """Through the tool, in the sandboxed launch check: bad_input naming the record, and the
    workspace (and its git history) hash the same afterwards."""
    import shutil

    from mcp_server.server import build_server
    from workspace import git as workspace_git
    from tests.sandbox.helpers import error_text, live_client, make_workspace, tree_hash

    root = make_workspace(tmp_path / "ws")
    shutil.copytree(REPO / "recipes_template" / "vlm", root / "recipes" / "vlm",
                    ignore=shutil.ignore_patterns("__pycache__"))
    (root / "set" / "images").mkdir(parents=True)
    (root / "set" / "images" / "bomb.png").write_bytes(_png_header(30000, 30000))
    (root / "set" / "data.jsonl").write_text(json.dumps({"image": "images/bomb.png", "caption": "a bomb"}) + "\n")
    workspace_git.commit_paths(workspace_git.ensure_repo(root), [root / "recipes" / "vlm", root / "set"], "vlm", [])
    with live_client(build_server(root)) as client:
        before = tree_hash(root)
        result = client.call("launch_run", {"recipe": "recipes/vlm", "overrides": {"data.paths": ["set"]}})
        message = error_text(result)
        assert result.is_error and "bad_input" in message, message
        assert "data.jsonl:1: image 'images/bomb.png' cannot be read" in message and "decompression bomb" in message
        assert tree_hash(root) == before


def test_a_data_file_swapped_for_a_fifo_after_listing_does_not_hang_the_check_of_changes(workspace):
    """The run hashes its data files again as it starts; a FIFO swapped in for one (after it was
    listed) made that wait for a writer for ever."""
    listing = data_files.DataListing()
    _load(workspace, b"", listing)
    os.remove(workspace / "images" / "ok.png")
    os.mkfifo(workspace / "images" / "ok.png")
    previous = signal.signal(signal.SIGALRM, _timeout)
    signal.alarm(10)
    try:
        assert listing.changed() == [(workspace / "images" / "ok.png").resolve()]
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
