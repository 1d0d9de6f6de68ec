"""causal_lm with data.streaming: a folder of shards trains without the data cache, resumes
mid-stream bit for bit with a shuffle buffer (on one process and on two), and a bad record in a later shard fails the
run naming the shard and the record; the launch check reads only the first shard's first records."""

from __future__ import annotations

import itertools
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from engine import run_checkpoints
from engine import run_dir as rd
from engine.config import ConfigError
from engine.data_stream import PieceStream, StreamPosition, list_shards
from recipes_template.causal_lm import recipe as causal_lm
from tests.support import TINY, copy_template, engine_command, engine_env, existing_runs, losses, new_run_dirs, run_engine

STEPS = 8
SCHEDULE = (*TINY, "data.paths=[shards]", "data.streaming=true", f"train.max_steps={STEPS}", "checkpoint.every=4",
            "checkpoint.keep_last=5")
SHUFFLED = (*SCHEDULE, "data.shuffle_buffer=6")
WORDS = "def class return import self for in if else while yield lambda print range with as".split()


def write_shards(folder: Path, shards: int = 3, records: int = 5) -> None:
    """JSON-lines shards of records of 8 to 47 words: 1 to 5 pieces each at seq_len 64."""
    folder.mkdir(parents=True, exist_ok=True)
    for s in range(shards):
        with open(folder / f"part-{s:03d}.jsonl", "w") as f:
            for r in range(records):
                n = 8 + (7 * s + 11 * r) % 40
                f.write(json.dumps({"text": " ".join(WORDS[(s + r + i) % len(WORDS)] for i in range(n))}) + "\n")


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("streaming")
    write_shards(root / "shards")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TRAINWRIGHT_DATA_CACHE", str(root / "data-cache"))
        yield root, copy_template(root)


@pytest.fixture(scope="module")
def reference(workspace):
    root, recipe = workspace
    return run_engine(root, recipe, *SHUFFLED)


def position_after(root: Path, pieces: int, rank: int = 0, world: int = 1, shuffle_buffer: int = 0) -> StreamPosition:
    """Where a rank's stream of the workspace's shards stands after ``pieces`` pieces."""
    config = causal_lm.CausalLMConfig.model_validate({"data": {"paths": [str(root / "shards")], "streaming": True,
                                                               "seq_len": 64}})
    cfg = config.data
    stream = PieceStream(list_shards(cfg.paths), causal_lm.stream_pieces(cfg, causal_lm.ByteTokenizer()), rank, world,
                         shuffle_buffer=shuffle_buffer, seed=config.train.seed)
    return next(itertools.islice(stream.pieces(StreamPosition()), pieces - 1, None))[1]


def test_a_folder_of_shards_trains_and_leaves_the_data_cache_untouched(workspace, reference):
    root, _ = workspace
    record = rd.read_run(reference)
    assert record.status == rd.COMPLETED
    curve = losses(reference)
    assert sorted(curve) == list(range(1, STEPS + 1)) and curve[STEPS] < curve[1]
    data = record.data
    assert data.streaming and data.files == 3 and data.bytes == sum(p.stat().st_size for p in (root / "shards").iterdir())
    assert data.documents is None and data.tokens is None and data.fingerprint is None  # not counted: not known
    assert "streamed, 3 files" in data.describe()
    assert not (root / "data-cache").exists() or not any((root / "data-cache").iterdir())


def test_resume_mid_stream_with_a_shuffle_buffer_is_bit_identical(workspace, reference):
    root, recipe = workspace
    # The checkpoint at step 4 (16 sequences) stands inside the third block of 6, which starts
    # inside a record of the second shard.
    at = position_after(root, 16, shuffle_buffer=6)
    assert at.taken == 4 and at.shard == 1 and at.piece >= 1, at
    checkpoint = dict(run_checkpoints.list_checkpoints(reference))[4]
    resumed = run_engine(root, recipe, *SHUFFLED, resume_from=checkpoint)
    assert losses(resumed) == {s: v for s, v in losses(reference).items() if s > 4}


@pytest.mark.multiprocess
def test_two_processes_resume_mid_stream_bit_identical(workspace):
    root, recipe = workspace
    shuffled = (*SCHEDULE, "data.shuffle_buffer=5")
    two = run_engine(root, recipe, *shuffled, nproc=2)
    for rank in (0, 1):  # step 4: each rank 3 pieces into its second block, which starts in a record of its share
        at = position_after(root, 8, rank, 2, shuffle_buffer=5)
        assert at.taken == 3 and at.record % 2 == rank, (rank, at)
    resumed = run_engine(root, recipe, *shuffled, nproc=2, resume_from=dict(run_checkpoints.list_checkpoints(two))[4])
    assert losses(resumed) == {s: v for s, v in losses(two).items() if s > 4}
    refused = subprocess.run(engine_command(recipe, *shuffled, resume_from=dict(run_checkpoints.list_checkpoints(two))[4]),
                             cwd=root, env=engine_env(), capture_output=True, text=True, timeout=300)
    assert refused.returncode != 0
    assert "resumes on the number of processes it was saved on (2, not 1)" in refused.stdout + refused.stderr


def test_a_bad_record_in_a_later_shard_fails_the_run_naming_shard_and_record(workspace, tmp_path):
    root, recipe = workspace
    write_shards(root / "bad")
    with open(root / "bad" / "part-002.jsonl", "a") as f:
        f.write('{"body": "a record without the text column"}\n')
    before = existing_runs(root)
    # The launch check reads the first shard's first records only: it passes.
    overrides = [o.replace("[shards]", "[bad]") for o in SCHEDULE] + ["train.max_steps=40"]
    result = subprocess.run(engine_command(recipe, *overrides), cwd=root, env=engine_env(), capture_output=True,
                            text=True, timeout=300)
    assert result.returncode != 0
    (run,) = new_run_dirs(root, before)
    record = rd.read_run(run)
    assert record.status == rd.FAILED
    assert "part-002.jsonl:6: no text under 'text'" in record.error, record.error
    assert 1 <= max(losses(run)) < 40  # it trained until it read that record


def test_the_launch_check_reads_the_first_records_and_counts_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINWRIGHT_WORKSPACE", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    write_shards(tmp_path / "shards")
    config = causal_lm.CausalLMConfig.model_validate({"data": {"paths": ["shards"], "streaming": True}})
    summary = causal_lm.CausalLM.summarize_data(config)
    assert summary.streaming and summary.files == 3 and summary.train_documents is None
    assert summary.nothing_to_train() is None

    (tmp_path / "shards" / "part-000.jsonl").write_text('{"text": "fine"}\n{"content": "other column"}\n')
    with pytest.raises(ConfigError, match=r"part-000\.jsonl:2: no text under 'text'"):
        causal_lm.CausalLM.summarize_data(config)
    (tmp_path / "shards" / "part-000.jsonl").write_text("not json\n")
    with pytest.raises(ConfigError, match=r"part-000\.jsonl:1: not a JSON object"):
        causal_lm.CausalLM.summarize_data(config)


def test_streaming_settings_that_would_not_act_are_refused():
    with pytest.raises(ValueError, match="data.streaming reads data.paths"):
        causal_lm.CausalLMConfig.model_validate({"data": {"streaming": True}})
    with pytest.raises(ValueError, match="holds out no fraction of a stream"):
        causal_lm.CausalLMConfig.model_validate({"data": {"paths": ["x"], "streaming": True, "eval_fraction": 0.1}})
    causal_lm.CausalLMConfig.model_validate({"data": {"paths": ["x"], "streaming": True, "eval_fraction": 1}})
    with pytest.raises(ValueError, match="data.shuffle_buffer shuffles a stream"):
        causal_lm.CausalLMConfig.model_validate({"data": {"paths": ["x"], "shuffle_buffer": 8}})
    with pytest.raises(ValueError, match="data.dataset is read as a stream: set data.streaming=true"):
        causal_lm.CausalLMConfig.model_validate({"data": {"dataset": "org/corpus"}})
    hub = causal_lm.CausalLMConfig.model_validate({"data": {"dataset": "org/corpus", "streaming": True}}).data
    assert hub.source == "files" and hub.eval_fraction == 0


def test_a_shuffle_buffer_past_a_gib_of_a_ranks_memory_is_refused_naming_the_largest_that_fits():
    # seq_len 256: a piece is 257 int64 tokens and 512 bytes besides, 2,568 bytes; 1 GiB holds 418,123.
    stream = {"paths": ["x"], "streaming": True}
    with pytest.raises(ValueError, match=re.escape(
            "data.shuffle_buffer=1000000000 would hold about 2391.6 GiB of pieces of data.seq_len=256 in each "
            "rank's memory; at most 1 GiB: set it to 418123 or less")):
        causal_lm.CausalLMConfig.model_validate({"data": {**stream, "shuffle_buffer": 10**9}})
    with pytest.raises(ValueError, match="set it to 418123 or less"):
        causal_lm.CausalLMConfig.model_validate({"data": {**stream, "shuffle_buffer": 418_124}})
    assert causal_lm.CausalLMConfig.model_validate({"data": {**stream, "shuffle_buffer": 418_123}}).data.shuffle_buffer == 418_123
    with pytest.raises(ValueError, match=r"data.seq_len=4096 .* set it to 32256 or less"):  # longer pieces: fewer
        causal_lm.CausalLMConfig.model_validate({"data": {**stream, "seq_len": 4096, "shuffle_buffer": 40_000}})


def test_evaluate_scores_the_files_given_and_holds_nothing_out_of_the_stream(workspace, reference, monkeypatch):
    from engine import model_io
    from engine.errors import BadInput

    root, recipe = workspace
    monkeypatch.setenv("TRAINWRIGHT_WORKSPACE", str(root))
    monkeypatch.chdir(root)
    if not (reference / rd.SNAPSHOT_DIRNAME).exists():  # a direct engine start keeps no code snapshot
        shutil.copytree(recipe, reference / rd.SNAPSHOT_DIRNAME)
    assert rd.read_run(reference).config["data"]["eval_fraction"] == 0.0
    scored = model_io.evaluate(reference, STEPS, ["shards/part-002.jsonl"])
    assert scored.ok and scored.batches == 4 and scored.scored_tokens > 0 and scored.examples is None
    with pytest.raises(BadInput, match="no evaluation data"):
        model_io.evaluate(reference, STEPS)


def test_what_the_server_writes_of_a_streamed_run_says_streamed_and_no_counts(reference):
    from mcp_server.operations.model_card import model_card
    from runner.supervise import run_note

    record = rd.read_run(reference)
    card = model_card(record, STEPS, [], "transformers", 1000, None, "not asked")
    size = record.data.bytes
    assert f"- streamed: 3 files, {size:,} bytes (records and tokens were not counted ahead)" in card
    assert "None" not in card.split("## Data")[1].split("## Code")[0]
    assert "data files: streamed, 3 files" in run_note(record, None)


def test_a_hub_data_set_bound_by_the_server_streams_its_split(workspace, tmp_path):
    root, recipe = workspace
    # The snapshot the server downloads into the Hugging Face cache, bound for the run: files
    # that link to ../../blobs.
    repo = tmp_path / "hub" / "datasets--org--corpus"
    snapshot = repo / "snapshots" / ("c" * 40)
    write_shards(repo / "blobs", shards=2)
    (snapshot / "data").mkdir(parents=True)
    for i in range(2):
        (snapshot / "data" / f"train-{i:05d}-of-00002.jsonl").symlink_to(f"../../../blobs/part-{i:03d}.jsonl")
    (snapshot / "README.md").write_text("# a card, not data")
    before = existing_runs(root)
    overrides = [o for o in SCHEDULE if not o.startswith("data.paths")] + ["data.dataset=org/corpus", "train.max_steps=6",
                                                                           "checkpoint.every=0"]
    env = {**engine_env(), "TRAINWRIGHT_HUB_DATASETS": json.dumps({"org/corpus": str(snapshot)})}
    result = subprocess.run(engine_command(recipe, *overrides), cwd=root, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    (run,) = new_run_dirs(root, before)
    data = rd.read_run(run).data
    assert data.streaming and data.files == 2 and data.paths == ["org/corpus"]
    assert data.bytes == sum(p.stat().st_size for p in (repo / "blobs").iterdir())
    assert sorted(losses(run)) == list(range(1, 7))
