"""vlm_chat's examples of data files in the token store: encoded once (ids and targets as the store's
pieces; per-token inputs, positions, grids, the processor call and the media references, a data
set's image bytes included, in each piece's record), mapped by every rank and later run. The batches
are those of the examples encoded in memory, a stream resumes mid-epoch bit for bit, a second launch
reuses the store, a changed image is encoded again, and large data is left to the run."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
import torch

from engine import token_store
from engine.config import ConfigError, build_config
from engine.data_files import WORKSPACE_VARIABLE
from engine.distributed import DistInfo
from engine.launch import load_recipe_class
from tests.templates.test_vlm_chat import TEMPLATE, vlm
from tests.vlm_families import available, each, tiny_vlm_folder

FAMILIES = ("qwen2_vl", "llava")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("vlm_families")
    return {family: tiny_vlm_folder(root / family, family) for family in available(FAMILIES)}


def noise(path, size, seed) -> None:
    from PIL import Image

    width, height = size
    Image.fromarray(np.random.default_rng(seed).integers(0, 255, (height, width, 3), dtype=np.uint8)).save(path)


@pytest.fixture
def workspace(tmp_path, monkeypatch, tmp_path_factory):
    """LLaVA records of images of four sizes by path, and messages records whose images are bytes
    in a parquet file (as a Hub data set holds them); the data cache of its own."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    monkeypatch.setenv(WORKSPACE_VARIABLE, str(tmp_path_factory.getbasetemp()))  # the models' and the data's
    monkeypatch.setenv(token_store.CACHE_VARIABLE, str(tmp_path / "cache"))
    (tmp_path / "images").mkdir()
    records, embedded = [], []
    for i in range(10):
        noise(tmp_path / "images" / f"{i}.png", [(56, 56), (30, 90), (90, 30), (64, 48)][i % 4], i)
        records.append({"image": f"images/{i}.png", "conversations": [
            {"from": "human", "value": "<image>\nWhat is it?"}, {"from": "gpt", "value": f"thing {i}"}]})
        embedded.append({"images": [{"bytes": (tmp_path / "images" / f"{i}.png").read_bytes(), "path": None}],
                         "messages": [{"role": "user", "content": [{"type": "image", "text": None},
                                                                   {"type": "text", "text": "And this?"}]},
                                      {"role": "assistant", "content": [{"type": "text", "text": f"bytes {i}"}]}]})
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    pq.write_table(pa.Table.from_pylist(embedded), tmp_path / "embedded.parquet")
    return tmp_path


def engine_of(folder, workspace, *overrides: str):
    recipe = load_recipe_class(TEMPLATE)
    config = build_config(recipe.config_class, None, [
        f"model.pretrained_path={folder}", f"data.paths=[{workspace / 'data.jsonl'},{workspace / 'embedded.parquet'}]",
        "data.seq_len=256", "data.batch_size=3", "data.eval_fraction=0.2", "checkpoint.every=0",
        "metrics.tensorboard=false", *overrides])
    return recipe(config, DistInfo(0, 1, 0, torch.device("cpu"), None))


def stores(workspace) -> list[str]:
    return sorted(path.name for path in (workspace / "cache").iterdir() if (path / "meta.json").is_file())


def same(expected: dict, got: dict) -> bool:
    return expected.keys() == got.keys() and all(torch.equal(expected[k], got[k]) for k in expected)


@pytest.mark.parametrize("family", each(FAMILIES))
def test_the_stores_batches_are_those_of_the_examples_encoded_in_memory_and_resume_mid_epoch(family, folders, workspace):
    engine = engine_of(folders[family], workspace)
    template = sys.modules[type(engine).__module__]  # load_recipe_class loads the module anew
    stored = engine.split_pieces("train")
    examples = [e for e in template.load_examples(engine.config.data)[0] if not template.is_eval_document(e[0], 0.2)]
    assert isinstance(stored, template.StoredPieces)
    memory = engine.pieces(examples)  # the template's encoding in memory, every image tensor kept
    assert len(stored) == len(memory) == 15
    assert [len(p["ids"]) - 1 for p in memory] == stored.lengths()
    kinds = {type(image.value) for i in range(len(stored)) for image in stored[i]["images"]}
    assert kinds == {str, bytes}  # images by path, and a parquet's image bytes kept in the store's records

    def stream(pieces, packed=False):
        rows = template.PackedRows(pieces, 256) if packed else pieces
        return template.BatchStream(rows, engine.processor, seed=5, micro_batch=3, dp_rank=0, dp_size=1, packed=packed,
                               prefetch=True)

    for packed in (False, True) if family in vlm.PACKS else (False,):
        plain, from_store = stream(memory, packed), stream(stored, packed)
        batches = [(next(plain), next(from_store)) for _ in range(4)]  # past an epoch of 15 (packed: fewer rows)
        resumed = stream(stored, packed)
        resumed.load_state_dict(from_store.state_dict())
        batches += [(next(plain), next(resumed)) for _ in range(3)]
        assert all(same(expected, got) for expected, got in batches)


def test_a_run_holds_a_token_store_not_its_examples(folders, workspace):
    engine = engine_of(folders["qwen2_vl"], workspace, "train.max_steps=1", "train.eval_every=1")
    engine.before_train()
    assert isinstance(engine.store, token_store.TokenStore) and engine.examples[0] == []
    assert type(engine.train_batches.pieces).__name__ == "StoredPieces"
    assert len(engine.train_batches.pieces) + engine.store.counts["eval"][0] == 20
    assert len(engine.examples[1]) == engine.store.counts["eval"][0] == 5  # the held-out questions task_metrics asks
    assert torch.isfinite(engine.train_step().loss) and engine.eval_batches


def test_a_second_launch_reuses_the_store_and_a_changed_image_is_encoded_again(folders, workspace, monkeypatch):
    config = engine_of(folders["qwen2_vl"], workspace).config
    summary = vlm.VLMChat.summarize_data(config)
    assert summary.documents == 20 and summary.format == "llava, messages (20 images)"
    assert summary.train_documents == 15 and summary.files == 2 and summary.fingerprint is not None
    first = stores(workspace)
    encode = vlm.encode
    monkeypatch.setattr(vlm, "encode", lambda *args, **kwargs: pytest.fail("encoded again"))
    assert vlm.VLMChat.summarize_data(config) == summary and stores(workspace) == first

    noise(workspace / "images" / "0.png", (28, 28), 99)  # a quarter of the pixels: fewer image tokens
    monkeypatch.setattr(vlm, "encode", encode)
    changed = vlm.VLMChat.summarize_data(config)
    assert len(stores(workspace)) == 2 and changed.tokens == summary.tokens - 3
    fresh = workspace / "fresh-cache"
    monkeypatch.setenv(token_store.CACHE_VARIABLE, str(fresh))
    assert vlm.VLMChat.summarize_data(config) == changed  # what a first encoding of the data as it is counts
    monkeypatch.setenv(token_store.CACHE_VARIABLE, str(workspace / "cache"))
    monkeypatch.setattr(vlm, "encode", lambda *args, **kwargs: pytest.fail("encoded again"))
    assert vlm.VLMChat.summarize_data(config) == changed and len(stores(workspace)) == 2


def test_large_data_is_left_to_the_run_with_progress_and_a_bad_record_is_refused_writing_nothing(folders, workspace,
                                                                                                monkeypatch):
    config = engine_of(folders["llava"], workspace, "data.tokenize_in_check_mb=0").config
    with token_store.launch_check():
        pending = vlm.VLMChat.summarize_data(config)
    assert pending.preparing is not None and pending.documents == 0 and pending.files == 2 and stores(workspace) == []
    reported: list[dict] = []
    monkeypatch.setattr(token_store, "PROGRESS_EVERY_S", 0.0)
    with token_store.reporting(reported.append):  # the run's first phase
        summary = vlm.VLMChat.summarize_data(config)
    assert summary.documents == 20 and len(stores(workspace)) == 1
    assert reported and reported[-1]["documents"] == 20

    # Data files of a few KB that name images of more: the images decide (10 PNGs of 5-15 KB over 10 KB).
    small = config.model_copy(update={"data": config.data.model_copy(update={"paths": [str(workspace / "data.jsonl")]})})
    for limit, left in ((0.01, True), (1.0, False)):
        small.data.tokenize_in_check_mb = limit
        with token_store.launch_check():
            assert (vlm.VLMChat.summarize_data(small).preparing is not None) == left
    assert (workspace / "data.jsonl").stat().st_size < 10_000 and len(stores(workspace)) == 2

    bad = workspace / "bad.jsonl"
    bad.write_text(json.dumps({"image": "images/missing.png", "conversations": [
        {"from": "human", "value": "<image>\nWhat?"}, {"from": "gpt", "value": "x"}]}) + "\n")
    config = config.model_copy(update={"data": config.data.model_copy(update={"paths": [str(bad)]})})
    for check in (True, False):  # the head the launch check reads, and the whole build of small data
        config.data.tokenize_in_check_mb = 0 if check else 64
        with pytest.raises(ConfigError, match=r"^bad.jsonl:1: image 'images/missing.png' cannot be read"):
            with token_store.launch_check():
                vlm.VLMChat.summarize_data(config)
        assert len(stores(workspace)) == 2
        assert not [p for p in (workspace / "cache").iterdir() if ".building-" in p.name]


def test_a_store_of_many_images_is_reused_its_meta_within_the_stores_check(folders, workspace, monkeypatch):
    """The media a store read are listed beside it, not in its meta.json: a store of 100k images
    names 100k files, and a meta.json past engine.store_check's bound is no store's (every launch
    built it again, and a rank waiting for another's build waited for ever). Here the bound is
    lowered below what the stats of 10 images by path took in meta.json (1,350 bytes)."""
    from engine import store_check

    monkeypatch.setattr(store_check, "MAX_META_BYTES", 800)
    config = engine_of(folders["qwen2_vl"], workspace).config
    summary = vlm.VLMChat.summarize_data(config)
    (name,) = stores(workspace)
    assert (workspace / "cache" / name / "meta.json").stat().st_size <= 800
    monkeypatch.setattr(vlm, "encode", lambda *args, **kwargs: pytest.fail("encoded again"))
    assert vlm.VLMChat.summarize_data(config) == summary and stores(workspace) == [name]
