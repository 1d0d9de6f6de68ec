"""The grpo template's prompts in the token store: rendered and tokenized once, each with its
record beside it, mapped by every rank and later run; a second launch maps the store and a
changed file is tokenized again; rewards see the records as the data holds them; a rank holds
the store, not a list of every record; large data is left to the run, built over the cores; bad
data is refused naming the record, and a refusal keeps nothing in the cache."""

from __future__ import annotations

import json
import shutil
import tracemalloc
from pathlib import Path

import pytest
import torch

from engine import launch, run_checkpoints, token_store
from engine import run_dir as rd
from engine.config import ConfigError, build_config
from engine.data_files import DataListing
from engine.data_formats import file_rows
from engine.distributed import DistInfo
from engine.token_store import TokenStore
from recipes_template.grpo import recipe as grpo
from tests.engine.test_data_preparation import built_store, check, config_of, pending_run
from tests.support import REPO, losses, run_engine
from tests.templates.test_grpo import SMALL

TEMPLATE = REPO / "recipes_template" / "grpo"


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    folder = tmp_path / "cache"
    monkeypatch.setenv(token_store.CACHE_VARIABLE, str(folder))
    return folder


def stores(cache: Path) -> list[str]:
    """The stores and builds in the cache (its lock files aside)."""
    return sorted(p.name for p in cache.iterdir() if p.suffix != ".lock") if cache.exists() else []


def records(count: int, start: int = 0) -> list[dict]:
    """Prompt records with nested columns of every JSON type the reward functions read."""
    return [{"prompt": f"What is {i} + 1?", "answer": i + 1, "steps": [i, 1],
             "meta": {"tags": ["sum", str(i)], "weight": 0.5 * i, "note": None, "exact": i % 2 == 0}}
            for i in range(start, start + count)]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def engine_of(*overrides: str) -> grpo.GRPO:
    return grpo.GRPO(build_config(grpo.GRPOConfig, None, [*SMALL, *overrides]), DistInfo(0, 1, 0, torch.device("cpu"), None))


@pytest.mark.parametrize("kind", ["jsonl", "parquet"])
def test_the_reward_functions_see_each_record_as_the_data_holds_it(tmp_path, cache, monkeypatch, kind):
    path = write_jsonl(tmp_path / "prompts.jsonl", records(12))
    if kind == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(records(12)), tmp_path / "prompts.parquet", row_group_size=4)
        path = tmp_path / "prompts.parquet"
    as_read = {row["answer"]: row for _, row in file_rows(path, path.name)}  # what the reader gives, nested types and all
    seen: list[tuple] = []

    def spy(prompts, completions, **columns):
        seen.extend(zip(prompts, *(columns[k] for k in ("answer", "steps", "meta"))))
        assert "completion_ids" in columns and set(columns) == {"answer", "steps", "meta", "completion_ids"}
        return [0.0] * len(completions)

    monkeypatch.setattr(grpo, "spy", spy, raising=False)
    engine = engine_of(f"data.paths=[{path}]", "data.eval_fraction=0", "grpo.reward_functions=[spy]")
    engine.model = engine.prepare_model()
    next(engine.prepare_data())  # one generation: 2 prompts × 4 completions
    assert len(seen) == 8
    for prompt, answer, steps, meta in seen:
        expected = as_read[answer]
        assert repr((prompt, answer, steps, meta)) == repr(tuple(expected[k] for k in ("prompt", "answer", "steps", "meta")))
    assert type(seen[0][1]) is int and type(seen[0][3]["weight"]) is float and seen[0][3]["note"] is None


def test_a_column_the_store_cannot_keep_is_refused_naming_the_record_and_the_column():
    import datetime

    record = {"prompt": "When?", "answer": 1, "when": datetime.date(2024, 1, 2), "text": "caf\u00e9 \ud800"}
    with pytest.raises(ConfigError, match=r"^dates.parquet:3: column 'when' holds a date, which the prompt store cannot "
                                          r"keep for the reward functions; give it as text, a number, a list or a mapping$"):
        grpo.stored_columns(record, "dates.parquet:3")
    deep: list = []
    for _ in range(3000):  # deeper than json writes
        deep = [deep]
    with pytest.raises(ConfigError, match=r"^dates.parquet:3: a column is nested too deeply to keep for the reward "):
        grpo.stored_columns({"prompt": "When?", "deep": deep}, "dates.parquet:3")
    del record["when"]
    stored = grpo.stored_columns(record, "dates.parquet:3")
    assert json.loads(stored.decode("utf-8", "surrogatepass")) == record  # any text, as read


def test_a_second_launch_maps_the_store_and_a_changed_file_is_tokenized_again(tmp_path, cache, capsys, monkeypatch):
    data = write_jsonl(tmp_path / "data" / "prompts.jsonl", records(40))
    first = check(TEMPLATE, f"data.paths=[{data}]", capsys=capsys)
    assert first["ok"] and first["data"]["documents"] == 40 and first["data"]["format"] == "prompt"
    assert len(stores(cache)) == 1

    def no_build(*args, **kwargs):
        raise AssertionError("the store was built again")

    with monkeypatch.context() as patched:
        patched.setattr(token_store, "StoreWriter", no_build)
        again = check(TEMPLATE, f"data.paths=[{data}]", capsys=capsys)
    assert again["data"] == first["data"] and len(stores(cache)) == 1
    write_jsonl(data, records(41))  # one record more
    changed = check(TEMPLATE, f"data.paths=[{data}]", capsys=capsys)
    assert changed["data"]["documents"] == 41 and changed["data"]["fingerprint"] != first["data"]["fingerprint"]
    assert len(stores(cache)) == 2


def test_a_rank_reads_its_prompts_from_the_store_not_from_a_list_of_every_record(tmp_path, cache):
    rows = [row | {"context": f"{i} " + "x" * 20_000} for i, row in enumerate(records(600))]  # 12 MB of columns
    data = write_jsonl(tmp_path / "prompts.jsonl", rows)
    engine_of(f"data.paths=[{data}]").store  # built once, as the launch check builds it
    engine = engine_of(f"data.paths=[{data}]")
    tracemalloc.start()
    try:
        train, held_out = engine.prompts
        first = [train[i] for i in range(4)]
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert isinstance(engine.store, TokenStore) and not isinstance(train, list)
    assert len(train) + len(held_out) == 600 and peak < 1_000_000, peak  # the records alone are 12 MB
    record, ids = first[0]
    assert record == next(row for row in rows if row["context"].split()[0] == record["context"].split()[0])
    assert ids == grpo.prompt_tokens(engine.tokenizer, record)


def test_prompts_that_all_leave_no_room_are_refused_with_the_counts_and_nothing_kept(tmp_path, cache, capsys):
    data = write_jsonl(tmp_path / "prompts.jsonl", records(3))
    longest = max(len(grpo.prompt_tokens(grpo.load_chat_tokenizer(None, None), row)) for row in records(3))
    refused = check(TEMPLATE, f"data.paths=[{data}]", "data.seq_len=20", "grpo.max_completion_length=6", capsys=capsys)
    assert refused["ok"] is False and refused["error"] == (
        f"no prompt to train on: all 3 prompts read are longer than the 14 tokens data.seq_len=20 leaves beside "
        f"grpo.max_completion_length=6 (the longest: {longest} tokens); set data.seq_len={longest + 6} or lower "
        "grpo.max_completion_length")
    assert stores(cache) == []
    kept = check(TEMPLATE, f"data.paths=[{data}]", f"data.seq_len={longest + 6}", "grpo.max_completion_length=6",
                 capsys=capsys)
    assert kept["ok"] and kept["data"]["documents"] == 3 and kept["data"]["dropped"] == 0


def test_large_prompt_data_is_left_to_the_run_built_over_the_cores_with_the_exact_summary(tmp_path, cache, capsys,
                                                                                         monkeypatch):
    data = tmp_path / "data"
    write_jsonl(data / "a.jsonl", records(120))
    write_jsonl(data / "b.jsonl", records(120, start=120))
    run_dir, pending = pending_run(tmp_path, data, capsys, TEMPLATE)
    assert pending.preparing is not None and pending.documents == 0 and stores(cache) == []  # only the heads read
    seen: list[rd.DataPreparation] = []
    update_run = rd.update_run

    def recording(folder, **fields):
        record = update_run(folder, **fields)
        seen.append(rd.read_run(folder).data.preparing)
        return record

    monkeypatch.setattr(rd, "update_run", recording)
    monkeypatch.setattr(token_store, "PROGRESS_EVERY_S", 0.0)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1})
    config = config_of(f"data.paths=[{data}]", "data.tokenize_in_check_mb=0", recipe_class=grpo.GRPO)
    summary = launch.prepare_data(run_dir, grpo.GRPO, config, pending)
    documents = [p.documents for p in seen]
    assert documents == sorted(documents) and documents[-1] == 240
    monkeypatch.setenv(token_store.CACHE_VARIABLE, str(tmp_path / "other-cache"))
    exact = check(TEMPLATE, f"data.paths=[{data}]", capsys=capsys)  # the launch check tokenizes it all
    assert summary.preparing is None and summary.model_dump(mode="json") == exact["data"]
    assert summary.documents == 240 and summary.files == 2

    def build():
        return grpo.prompt_store(config, grpo.load_chat_tokenizer(None, None), DataListing())

    built = {workers: built_store(tmp_path, monkeypatch, workers, f"cache-{workers}", build) for workers in (1, 3)}
    assert built[1] == built[3]  # over the cores: the very store one process builds, records and all
    assert {"train.records.bin", "train.records.idx.npy"} <= set(built[1][1])


def test_a_record_without_the_prompt_column_fails_the_run_naming_it_and_leaves_no_store(tmp_path, cache, capsys):
    data = tmp_path / "data"
    rows = records(240)
    rows[109] = {"question": "What is 1 + 1?", "answer": 2}  # past the 100 records the launch check reads
    write_jsonl(data / "prompts.jsonl", rows)
    run_dir, pending = pending_run(tmp_path, data, capsys, TEMPLATE)
    config = config_of(f"data.paths=[{data}]", "data.tokenize_in_check_mb=0", recipe_class=grpo.GRPO)
    with pytest.raises(ConfigError) as failed:
        launch.prepare_data(run_dir, grpo.GRPO, config, pending)
    assert str(failed.value) == ("prompts.jsonl:110: no prompt column 'prompt' (columns: ['answer', 'question']); "
                                 "name the prompt's column with data.prompt_column")
    assert stores(cache) == []


@pytest.mark.slow  # two runs
def test_a_run_on_prompt_files_resumes_bit_for_bit_from_the_store(tmp_path, cache):
    write_jsonl(tmp_path / "prompts.jsonl", records(60))
    recipe = tmp_path / "grpo"
    shutil.copytree(TEMPLATE, recipe, ignore=shutil.ignore_patterns("__pycache__"))
    schedule = (*SMALL, "data.paths=[prompts.jsonl]", "train.max_steps=4", "checkpoint.every=2", "checkpoint.keep_last=5")
    reference = run_engine(tmp_path, recipe, *schedule)
    assert rd.read_run(reference).data.documents == 60 and len(stores(cache)) == 1
    (_, checkpoint), *_ = run_checkpoints.list_checkpoints(reference)  # step 2
    resumed = run_engine(tmp_path, recipe, *schedule, resume_from=checkpoint)
    assert losses(resumed) == {s: v for s, v in losses(reference).items() if s > 2} and len(stores(cache)) == 1


def test_a_saved_folder_and_a_hub_data_set_are_built_over_the_cores_into_the_store_one_process_builds(tmp_path,
                                                                                                      monkeypatch):
    import datasets

    from engine import store_parts
    from engine.data_formats import FILE_SUFFIXES
    from tests.engine.test_data_preparation import hub_snapshot

    datasets.Dataset.from_list(records(90)).save_to_disk(str(tmp_path / "saved"), num_shards=2)
    hub_snapshot(tmp_path, monkeypatch, [records(40, start=100), records(40, start=140)])
    config = config_of(f"data.paths=[{tmp_path / 'saved'}]", "data.dataset=org/chats", recipe_class=grpo.GRPO)
    parts = store_parts.source_parts(config.data.paths, FILE_SUFFIXES, DataListing(), "org/chats", workers=3)
    assert [name for _, name, _ in parts] == ["saved"] * 12 + ["org/chats"] * 6  # the Hub's by its 6 row groups

    def build():
        return grpo.prompt_store(config, grpo.load_chat_tokenizer(None, None), DataListing())

    built = {workers: built_store(tmp_path, monkeypatch, workers, f"cache-{workers}", build) for workers in (1, 3)}
    assert built[1] == built[3] and built[1][0]["counts"]["documents"] == 170  # records and all
    assert {"train.records.bin", "train.records.idx.npy"} <= set(built[1][1])
