"""data.streaming's reader (engine/data_stream.py): shards in a fixed order, each rank its share,
a position from which the stream goes on exactly as it would have, bad records named, nothing
read ahead beyond its queue."""

from __future__ import annotations

import itertools
import json
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from engine.config import ConfigError
from engine.data_files import DataListing
from engine.data_stream import (
    PieceStream,
    StreamBatches,
    StreamPosition,
    first_records,
    hub_shards,
    list_shards,
    read_pieces,
)


def chunks(where, record):
    """Pieces of 5 characters of a record's text, each tagged with where it came from."""
    text = record if isinstance(record, str) else record["text"]
    return [(where, text[i:i + 5]) for i in range(0, len(text), 5)]


@pytest.fixture
def corpus(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINWRIGHT_WORKSPACE", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data" / "more").mkdir(parents=True)
    texts = [f"record {i} " + "abc" * (i % 7) for i in range(23)]
    with open(tmp_path / "data" / "a.jsonl", "w") as f:
        for text in texts[:9]:
            f.write(json.dumps({"text": text}) + "\n")
        f.write("\n")  # a blank line: no record
    pq.write_table(pa.table({"text": texts[9:17]}), tmp_path / "data" / "b.parquet", row_group_size=3)
    (tmp_path / "data" / "more" / "c.txt").write_text("a text file is one record of its own")
    with open(tmp_path / "data" / "more" / "d.jsonl", "w") as f:
        for text in texts[17:]:
            f.write(json.dumps({"text": text}) + "\n")
    return list_shards(["data"])


def test_shards_are_listed_in_a_fixed_order_without_reading_them(corpus, tmp_path):
    listing = DataListing()
    assert [s.name for s in list_shards(["data"], listing)] == ["a.jsonl", "b.parquet", "more/c.txt", "more/d.jsonl"]
    assert listing.files == {} and listing.fingerprint() is None  # not hashed: a stream's bytes are read once
    with pytest.raises(ConfigError, match="no data files"):
        (tmp_path / "empty").mkdir()
        list_shards(["empty"])


@pytest.mark.parametrize("world", [1, 2, 3])
def test_the_ranks_share_every_record_once_an_epoch(corpus, world):
    per_rank = []
    for rank in range(world):
        taken = list(itertools.takewhile(lambda item: item[1].epoch == 0,
                                         read_pieces(corpus, chunks, StreamPosition(), rank, world)))
        per_rank.append({where for (where, _), _ in taken})
    everything = set().union(*per_rank)
    assert sum(len(r) for r in per_rank) == len(everything) == 9 + 8 + 1 + 6  # blank line: none
    assert "a.jsonl:3" in per_rank[2 % world] and "b.parquet:5" in per_rank[4 % world]  # record i to rank i % world


@pytest.mark.parametrize("rank,world", [(0, 1), (1, 2)])
def test_a_stream_resumed_at_any_position_goes_on_as_the_uninterrupted_one(corpus, rank, world):
    reference = list(itertools.islice(read_pieces(corpus, chunks, StreamPosition(), rank, world), 400))
    assert reference[-1][1].epoch >= 2  # the epochs wrap
    assert any(p.piece > 1 and p.shard > 0 for _, p in reference)  # positions inside a record of a later shard
    for k in range(0, len(reference) - 20, 7):
        resumed = itertools.islice(read_pieces(corpus, chunks, reference[k][1], rank, world), 20)
        assert list(resumed) == reference[k + 1:k + 21], k


def test_a_piece_stream_checkpoints_where_the_trainer_is_not_where_the_reader_is(corpus):
    stream = PieceStream(corpus, chunks, 0, 1, read_ahead=4)
    batches = StreamBatches(stream, micro_batch=3, collate=list)
    first = [next(batches) for _ in range(5)]
    time.sleep(0.2)
    assert stream._queue.qsize() <= 4  # read ahead is bounded, however long the trainer pauses
    state = batches.state_dict()
    after = [next(batches) for _ in range(4)]

    again = StreamBatches(PieceStream(corpus, chunks, 0, 1), micro_batch=3, collate=list)
    again.load_state_dict(state)
    assert [next(again) for _ in range(4)] == after
    assert [next(StreamBatches(PieceStream(corpus, chunks, 0, 1), 3, list)) for _ in range(1)] == first[:1]
    stream.close()

    two_ranks = json.loads(state["streaming"])
    two_ranks.update(world=2, per_rank=two_ranks["per_rank"] * 2)
    with pytest.raises(ConfigError, match=r"resumes on the number of processes it was saved on \(2, not 1\)"):
        StreamBatches(PieceStream(corpus, chunks, 0, 1), 3, list).load_state_dict({"streaming": json.dumps(two_ranks)})
    with pytest.raises(ConfigError, match="not a stream's"):
        StreamBatches(PieceStream(corpus, chunks, 0, 1), 3, list).load_state_dict({"position": 12})


@pytest.mark.parametrize("rank,world", [(0, 1), (1, 2)])
def test_a_shuffle_buffer_reorders_each_block_by_the_seed_and_resumes_anywhere_as_the_uninterrupted_one(
        corpus, rank, world):
    in_order = [piece for piece, _ in itertools.islice(read_pieces(corpus, chunks, StreamPosition(), rank, world), 300)]
    shuffled = list(itertools.islice(PieceStream(corpus, chunks, rank, world, shuffle_buffer=7, seed=3)
                                     .pieces(StreamPosition()), 300))
    pieces = [piece for piece, _ in shuffled]
    for block in range(0, 294, 7):  # each block of 7 is the stream's next 7 pieces, in another order
        assert sorted(pieces[block:block + 7]) == sorted(in_order[block:block + 7])
    assert pieces[:294] != in_order[:294]
    assert pieces == [p for p, _ in itertools.islice(
        PieceStream(corpus, chunks, rank, world, shuffle_buffer=7, seed=3).pieces(StreamPosition()), 300)]
    assert pieces != [p for p, _ in itertools.islice(
        PieceStream(corpus, chunks, rank, world, shuffle_buffer=7, seed=4).pieces(StreamPosition()), 300)]
    stream = PieceStream(corpus, chunks, rank, world, shuffle_buffer=7, seed=3)
    for k in range(0, len(shuffled) - 20, 5):
        assert list(itertools.islice(stream.pieces(shuffled[k][1]), 20)) == shuffled[k + 1:k + 21], k


def test_a_shuffled_stream_resumes_only_with_its_buffer(corpus):
    batches = StreamBatches(PieceStream(corpus, chunks, 0, 1, shuffle_buffer=5, seed=1), 3, list)
    [next(batches) for _ in range(4)]
    state = batches.state_dict()
    after = [next(batches) for _ in range(3)]
    again = StreamBatches(PieceStream(corpus, chunks, 0, 1, shuffle_buffer=5, seed=1), 3, list)
    again.load_state_dict(state)
    assert [next(again) for _ in range(3)] == after
    batches.stream.close()
    again.stream.close()
    with pytest.raises(ConfigError, match=r"resumes with the data.shuffle_buffer it was saved with \(5, not 0\)"):
        StreamBatches(PieceStream(corpus, chunks, 0, 1), 3, list).load_state_dict(state)


def test_a_bad_record_in_a_later_shard_fails_the_stream_naming_shard_and_record(corpus, tmp_path):
    with open(tmp_path / "data" / "more" / "d.jsonl", "a") as f:
        f.write('{"text": "fine"}\n{"text": broken\n')
    assert [where for where, _ in first_records(list_shards(["data"]))][:2] == ["a.jsonl:1", "a.jsonl:2"]
    stream = PieceStream(list_shards(["data"]), chunks, 0, 1)
    with pytest.raises(ConfigError, match=r"more/d\.jsonl:8: not a JSON object"):
        stream.take(10_000)



def fake_snapshot(cache, files: dict[str, str]):
    """A Hub data set's snapshot as huggingface_hub lays it out: links to ../../blobs."""
    repo = cache / "datasets--org--corpus"
    snapshot = repo / "snapshots" / ("c" * 40)
    (repo / "blobs").mkdir(parents=True)
    for i, (name, text) in enumerate(files.items()):
        (repo / "blobs" / f"blob{i}").write_text(text)
        (snapshot / name).parent.mkdir(parents=True, exist_ok=True)
        (snapshot / name).symlink_to(Path("../" * (name.count("/") + 2)) / "blobs" / f"blob{i}")
    return snapshot


def test_a_hub_data_set_streams_the_files_of_its_split(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINWRIGHT_WORKSPACE", str(tmp_path / "ws"))
    line = json.dumps({"text": "hello"}) + "\n"
    snapshot = fake_snapshot(tmp_path / "hub", {"README.md": "# card", "data/train-00001-of-00002.jsonl": line,
                                                "data/train-00000-of-00002.jsonl": line,
                                                "data/test-00000-of-00001.jsonl": line})
    monkeypatch.setenv("TRAINWRIGHT_HUB_DATASETS", json.dumps({"org/corpus": str(snapshot)}))
    assert [s.name for s in hub_shards("org/corpus", "train")] == [
        "org/corpus/data/train-00000-of-00002.jsonl", "org/corpus/data/train-00001-of-00002.jsonl"]
    assert [s.name for s in hub_shards("org/corpus", "test")] == ["org/corpus/data/test-00000-of-00001.jsonl"]
    with pytest.raises(ConfigError, match="no data files of split 'validation'"):
        hub_shards("org/corpus", "validation")
    with pytest.raises(ConfigError, match="'org/other' is not bound for this run"):
        hub_shards("org/other", "train")

    unnamed = fake_snapshot(tmp_path / "hub2", {"corpus.jsonl": line, "more/b.jsonl": line})
    monkeypatch.setenv("TRAINWRIGHT_HUB_DATASETS", json.dumps({"org/corpus": str(unnamed)}))
    assert [s.name for s in hub_shards("org/corpus", "train")] == ["org/corpus/corpus.jsonl", "org/corpus/more/b.jsonl"]
