"""The vlm template's examples in the token store: each caption's tokens and targets with its
resized image beside it (uint8), mapped by every rank and later run, the pixel values made per
piece from those bytes (the very tensors of the in-memory path); a second launch maps the store,
a changed image or caption file is read again; large data is left to the run with its progress;
a bad record is refused naming it, and a refusal keeps nothing in the cache."""

from __future__ import annotations

import json
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import torch

from engine import launch, token_store
from engine import run_dir as rd
from engine.config import ConfigError, build_config
from engine.distributed import DistInfo
from engine.token_store import TokenStore
from recipes_template.vlm import recipe as vlm
from tests.engine.test_data_preparation import check, config_of, pending_run
from tests.support import REPO

TEMPLATE = REPO / "recipes_template" / "vlm"
SMALL = ("model.hidden_size=32", "model.intermediate_size=64", "model.vision_hidden_size=32", "model.vision_layers=1",
         "model.num_layers=1", "data.seq_len=48", "data.batch_size=4", "data.image_size=16")


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    folder = tmp_path / "cache"
    monkeypatch.setenv(token_store.CACHE_VARIABLE, str(folder))
    return folder


def stores(cache: Path) -> list[str]:
    """The stores and builds in the cache (its lock files aside)."""
    return sorted(p.name for p in cache.iterdir() if p.suffix != ".lock") if cache.exists() else []


def write_set(folder: Path, count: int, size: int = 23) -> Path:
    """``count`` noisy PNGs of ``size`` × ``size + 5`` pixels (resized by the template) and their captions."""
    from PIL import Image

    (folder / "images").mkdir(parents=True, exist_ok=True)
    with open(folder / "data.jsonl", "w") as f:
        for i in range(count):
            pixels = np.random.default_rng(i).integers(0, 255, (size + 5, size, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(folder / "images" / f"{i}.png")
            f.write(json.dumps({"image": f"images/{i}.png", "caption": f"picture {i} of {'ab' * (i % 4)}"}) + "\n")
    return folder / "data.jsonl"


def engine_of(*overrides: str) -> vlm.VLM:
    config = build_config(vlm.VLMConfig, None, [*SMALL, *overrides])
    return vlm.VLM(config, DistInfo(0, 1, 0, torch.device("cpu"), None))


def test_a_rank_reads_its_pieces_from_the_store_and_they_are_the_in_memory_pieces(tmp_path, cache):
    """Before: every rank held a list of every example's tokens and float pixel values."""
    data = write_set(tmp_path / "set", 40)
    engine_of(f"data.paths=[{data}]").store  # built once, as the launch check builds it
    engine = engine_of(f"data.paths=[{data}]", "data.eval_fraction=0.2")
    engine.store  # another key (eval_fraction): built too
    tracemalloc.start()
    try:
        stream = engine.prepare_data()
        first = next(stream)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert isinstance(engine.store, TokenStore) and isinstance(stream.pieces, vlm.StoredExamples)
    assert peak < 200_000, peak  # a batch of 4, never the 40 examples' pixel values
    examples = vlm.load_examples(engine.config.data)
    train = [e for e in examples if not vlm.is_eval_document(e[0], 0.2)]
    held_out = [e for e in examples if vlm.is_eval_document(e[0], 0.2)]
    assert len(stream.pieces) == len(train) and len(engine.held_out) == len(held_out) > 0
    in_memory = vlm.make_pieces(train, engine.processor, 48)
    for (tokens, pixels), (stored_tokens, stored_pixels) in zip(in_memory, stream.pieces):
        assert torch.equal(tokens, stored_tokens) and torch.equal(pixels, stored_pixels)
    expected = vlm.collate([in_memory[stream._order[1][i]] for i in range(4)], 48, engine.processor.tokenizer.pad_token_id)
    assert all(torch.equal(first[k], expected[k]) for k in expected)
    assert [engine.held_out.about(i) for i in range(len(held_out))] == [(name, text) for name, _, text in held_out]
    assert np.array_equal(engine.held_out.image(0), np.asarray(held_out[0][1]))


def test_a_second_launch_maps_the_store_and_a_changed_image_or_caption_is_read_again(tmp_path, cache, capsys,
                                                                                    monkeypatch):
    from PIL import Image

    data = write_set(tmp_path / "set", 12)
    first = check(TEMPLATE, *SMALL, f"data.paths=[{data}]", capsys=capsys)
    assert first["ok"] and first["data"]["documents"] == 12 and len(stores(cache)) == 1
    assert first["data"]["loss_tokens"] == sum(len(f"picture {i} of {'ab' * (i % 4)}") + 1 for i in range(12))

    def no_build(*args, **kwargs):
        raise AssertionError("the store was built again")

    with monkeypatch.context() as patched:
        patched.setattr(token_store, "StoreWriter", no_build)
        again = check(TEMPLATE, *SMALL, f"data.paths=[{data}]", capsys=capsys)
    assert again["data"] == first["data"] and len(stores(cache)) == 1
    Image.new("RGB", (30, 30), (1, 2, 3)).save(tmp_path / "set" / "images" / "5.png")  # the .jsonl is unchanged
    changed = check(TEMPLATE, *SMALL, f"data.paths=[{data}]", capsys=capsys)
    assert changed["data"]["fingerprint"] != first["data"]["fingerprint"] and len(stores(cache)) == 2
    engine = engine_of(f"data.paths=[{data}]", "data.eval_fraction=0")  # a store of its own: every image trains
    stored = {vlm.StoredExamples(engine.store, "train", engine.processor).about(i)[0]: i for i in range(12)}
    image = vlm.StoredExamples(engine.store, "train", engine.processor).image(stored["data.jsonl:6"])
    assert (image == np.array([1, 2, 3], dtype=np.uint8)).all()  # the new image, resized
    data.write_text(data.read_text().replace("picture 3 ", "photo 3 "))
    recaptioned = check(TEMPLATE, *SMALL, f"data.paths=[{data}]", capsys=capsys)
    assert recaptioned["data"]["loss_tokens"] == changed["data"]["loss_tokens"] - 2 and len(stores(cache)) == 4


def test_large_image_data_is_left_to_the_run_with_its_progress_and_the_exact_summary(tmp_path, cache, capsys,
                                                                                   monkeypatch):
    data = write_set(tmp_path / "set", 30)
    run_dir, pending = pending_run(tmp_path, data, capsys, TEMPLATE)
    assert pending.preparing is not None and pending.documents == 0 and stores(cache) == []
    seen: list[rd.DataPreparation] = []
    update_run = rd.update_run

    def recording(folder, **fields):
        record = update_run(folder, **fields)
        seen.append(rd.read_run(folder).data.preparing)
        return record

    monkeypatch.setattr(rd, "update_run", recording)
    monkeypatch.setattr(token_store, "PROGRESS_EVERY_S", 0.0)
    config = config_of(f"data.paths=[{data}]", "data.tokenize_in_check_mb=0", recipe_class=vlm.VLM)
    summary = launch.prepare_data(run_dir, vlm.VLM, config, pending)
    documents = [p.documents for p in seen]
    assert documents == sorted(documents) and documents[-1] == 30
    monkeypatch.setenv(token_store.CACHE_VARIABLE, str(tmp_path / "other-cache"))
    exact = check(TEMPLATE, f"data.paths=[{data}]", capsys=capsys)  # the launch check reads it all
    assert summary.preparing is None and summary.model_dump(mode="json") == exact["data"]
    assert summary.documents == 30 and summary.files == 1


@pytest.mark.parametrize("bad, expected", [
    ("missing", "data.jsonl:8: image 'images/7.png' cannot be read"),
    ("corrupt", "data.jsonl:8: image 'images/7.png' cannot be read"),
    ("caption", 'data.jsonl:8: a record is {"image": "relative/path.png", "caption": "..."}'),
])
def test_a_bad_record_is_refused_naming_it_and_nothing_is_kept(tmp_path, cache, capsys, bad, expected):
    data = write_set(tmp_path / "set", 10)
    if bad == "missing":
        (tmp_path / "set" / "images" / "7.png").unlink()
    elif bad == "corrupt":
        (tmp_path / "set" / "images" / "7.png").write_bytes(b"\x89PNG not really")
    else:
        lines = data.read_text().splitlines()
        lines[7] = json.dumps({"image": "images/7.png"})
        data.write_text("\n".join(lines) + "\n")
    refused = check(TEMPLATE, *SMALL, f"data.paths=[{data}]", capsys=capsys)
    assert refused["ok"] is False and refused["error"].startswith(expected), refused["error"]
    assert stores(cache) == []
    with pytest.raises(ConfigError, match=expected.replace("(", r"\(").replace("{", r"\{").replace(".", r"\.")):
        engine_of(f"data.paths=[{data}]").store
    assert stores(cache) == []


@pytest.mark.slow  # two runs
def test_a_run_on_image_files_resumes_mid_epoch_bit_for_bit_from_the_store(tmp_path, cache):
    import shutil

    from engine import run_checkpoints
    from tests.support import losses, run_engine

    data = write_set(tmp_path / "set", 30)
    recipe = tmp_path / "vlm"
    shutil.copytree(TEMPLATE, recipe, ignore=shutil.ignore_patterns("__pycache__"))
    schedule = (*SMALL, f"data.paths=[{data}]", "model.stage=align", "train.max_steps=6", "train.log_every=1",
                "train.eval_every=0", "checkpoint.every=3", "checkpoint.keep_last=5", "metrics.tensorboard=false")
    reference = run_engine(tmp_path, recipe, *schedule)  # 28 or so training images, 4 a step: step 3 is mid-epoch
    assert rd.read_run(reference).data.documents == 30 and len(stores(cache)) == 1
    (_, checkpoint), *_ = run_checkpoints.list_checkpoints(reference)  # step 3
    resumed = run_engine(tmp_path, recipe, *schedule, resume_from=checkpoint)
    assert sorted(losses(resumed)) == [4, 5, 6] and len(stores(cache)) == 1
    assert losses(resumed) == {s: v for s, v in losses(reference).items() if s > 3}
