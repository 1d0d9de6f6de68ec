"""sft with data.streaming: a folder of chat files, then a Hub data set's train split (a fake
Hugging Face cache the server would have bound), train without the data cache and resume
mid-stream bit for bit, in the Hub file; the launch check reads only the first file's first records, refusing a
bad one by name; settings a stream cannot honour are refused."""

from __future__ import annotations

import itertools
import json
import shutil
from pathlib import Path

import pytest

from engine import run_checkpoints
from engine import run_dir as rd
from engine.config import ConfigError
from engine.data_files import HUB_DATASETS_VARIABLE
from engine.data_stream import StreamPosition, read_pieces
from recipes_template.sft import recipe as sft
from tests.support import REPO, losses, run_engine

TEMPLATE = REPO / "recipes_template" / "sft"
STEPS = 6
SCHEDULE = (
    "model.hidden_size=64", "model.intermediate_size=160", "model.num_layers=2", "data.seq_len=64",
    "data.batch_size=4", "train.log_every=1", "optim.warmup_steps=2", "optim.lr=3e-3", "metrics.tensorboard=false",
    "data.paths=[chats]", "data.dataset=org/chats", "data.streaming=true", f"train.max_steps={STEPS}", "checkpoint.every=3",
    "checkpoint.keep_last=5",
)


def write_chats(folder: Path, files: int = 3, records: int = 6, first: int = 0) -> None:
    """Chat files of question/answer records; every fifth answer is empty (nothing to learn: no piece)."""
    folder.mkdir(parents=True, exist_ok=True)
    for f in range(first, first + files):
        with open(folder / f"part-{f}.jsonl", "w") as out:
            for r in range(records):
                i = 10 * f + r
                answer = "" if i % 5 == 4 else f"{i} is {'even' if i % 2 == 0 else 'odd'}."
                out.write(json.dumps({"messages": [{"role": "user", "content": f"Is {i} even or odd?"},
                                                   {"role": "assistant", "content": answer}]}) + "\n")


def write_hub_snapshot(hub: Path) -> Path:
    """The Hugging Face cache layout of the data set org/chats as the server downloads it: its
    train split's one file (the third of the chats) and a test split, linked to ../../blobs."""
    repo = hub / "datasets--org--chats"
    snapshot = repo / "snapshots" / ("c" * 40)
    write_chats(repo / "blobs", files=2, first=2)
    (snapshot / "data").mkdir(parents=True)
    (snapshot / "data" / "train-00000-of-00001.jsonl").symlink_to("../../../blobs/part-2.jsonl")
    (snapshot / "data" / "test-00000-of-00001.jsonl").symlink_to("../../../blobs/part-3.jsonl")
    (snapshot / "README.md").write_text("# a card, not data")
    return snapshot


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("sft-streaming")
    write_chats(root / "chats", files=2)
    snapshot = write_hub_snapshot(root.parent / f"{root.name}-hub")
    recipe = root / "sft"
    shutil.copytree(TEMPLATE, recipe, ignore=shutil.ignore_patterns("__pycache__"))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TRAINWRIGHT_DATA_CACHE", str(root / "data-cache"))
        patch.setenv(HUB_DATASETS_VARIABLE, json.dumps({"org/chats": str(snapshot)}))
        yield root, recipe


@pytest.fixture(scope="module")
def reference(workspace):
    root, recipe = workspace
    return run_engine(root, recipe, *SCHEDULE)


def test_a_folder_of_chat_files_then_a_hub_split_stream_without_the_data_cache(workspace, reference):
    root, _ = workspace
    record = rd.read_run(reference)
    assert record.status == rd.COMPLETED and sorted(losses(reference)) == list(range(1, STEPS + 1))
    data = record.data
    assert data.streaming and data.files == 3 and data.documents is None and data.eval_documents is None
    assert data.paths == ["chats", "org/chats"]
    hub_train = root.parent / f"{root.name}-hub" / "datasets--org--chats" / "blobs" / "part-2.jsonl"
    assert data.bytes == sum(p.stat().st_size for p in (root / "chats").iterdir()) + hub_train.stat().st_size
    assert not (root / "data-cache").exists() or not any((root / "data-cache").iterdir())


def test_resume_mid_stream_is_bit_identical(workspace, reference):
    root, recipe = workspace
    # Step 3 has taken 12 of the 15 conversations with an answer: the checkpoint stands in the third
    # file, the Hub data set's train split (its test split is not read).
    cfg = sft.SFTConfig.model_validate({"data": {"paths": [str(root / "chats")], "dataset": "org/chats",
                                                 "streaming": True, "seq_len": 64}}).data
    shards = sft.stream_shards(cfg)
    assert [shard.name for shard in shards] == ["part-0.jsonl", "part-1.jsonl",
                                                "org/chats/data/train-00000-of-00001.jsonl"]
    stream = read_pieces(shards, sft.stream_pieces(cfg, sft.load_tokenizer(None, None)), StreamPosition(), 0, 1)
    at = next(itertools.islice(stream, 11, None))[1]
    assert (at.epoch, at.shard, at.record, at.piece) == (0, 2, 1, 1) and at.offset > 0, at
    resumed = run_engine(root, recipe, *SCHEDULE, resume_from=dict(run_checkpoints.list_checkpoints(reference))[3])
    assert losses(resumed) == {s: v for s, v in losses(reference).items() if s > 3}


def test_the_launch_check_reads_the_first_records_and_refuses_a_bad_one(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINWRIGHT_WORKSPACE", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    write_chats(tmp_path / "chats")
    (tmp_path / "chats" / "notes.md").write_text("# not a record file: not streamed")
    config = sft.SFTConfig.model_validate({"data": {"paths": ["chats"], "streaming": True}})
    summary = sft.SFT.summarize_data(config)
    assert summary.streaming and summary.files == 3 and summary.nothing_to_train() is None
    assert "streamed, 3 files" in summary.describe()
    (tmp_path / "chats" / "part-0.jsonl").write_text('{"messages": [{"role": "user", "content": "hi"}]}\n'
                                                     '{"dialog": []}\n')
    with pytest.raises(ConfigError, match=r"^part-0\.jsonl:2: cannot tell the data format from its columns \['dialog'\]"):
        sft.SFT.summarize_data(config)
    monkeypatch.delenv(HUB_DATASETS_VARIABLE, raising=False)
    unbound = sft.SFTConfig.model_validate({"data": {"dataset": "org/chats", "streaming": True}})
    with pytest.raises(ConfigError, match=r"data.dataset 'org/chats' is not bound for this run"):
        sft.SFT.summarize_data(unbound)


def test_streaming_settings_a_stream_cannot_honour_are_refused():
    with pytest.raises(ValueError, match="data.streaming reads the files of data.paths"):
        sft.SFTConfig.model_validate({"data": {"streaming": True}})
    with pytest.raises(ValueError, match="data.streaming reads the files of data.paths"):
        sft.SFTConfig.model_validate({"data": {"dataset": "y", "subset": "z", "streaming": True}})
    assert sft.SFTConfig.model_validate({"data": {"dataset": "y", "streaming": True}}).data.source == "files"
    with pytest.raises(ValueError, match="holds out no fraction of a stream"):
        sft.SFTConfig.model_validate({"data": {"paths": ["x"], "streaming": True, "eval_fraction": 0.1}})
    assert sft.SFTConfig.model_validate({"data": {"paths": ["x"], "streaming": True}}).data.eval_fraction == 0
