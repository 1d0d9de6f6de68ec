"""Preparing the data is the run's first phase for large data: the launch check reads only the
head of each file and checks the disk, the run tokenizes it with its progress in run.json (what
get_run and wait_run show), the summary it fills is exact, a second launch maps the store, and a
bad record deep in a file fails the run naming it and leaves no store. The same for causal_lm's
documents, sft's conversations and dpo's pairs (one machinery, engine/token_store.py)."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from engine import launch
from engine import run_dir as rd
from engine import store_parts, token_store
from engine.config import ConfigError
from engine.seams import LaunchVerdict
from engine.data_files import DataListing, data_files
from engine.data_formats import FILE_SUFFIXES
from recipes_template.causal_lm import recipe as causal_lm
from recipes_template.causal_lm.recipe import CausalLM
from recipes_template.sft.recipe import SFT
from tests.engine.test_data_listing import HashedBytes
from tests.support import REPO, TEMPLATE, engine_command, engine_env

SFT_TEMPLATE = REPO / "recipes_template" / "sft"


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    folder = tmp_path / "cache"
    monkeypatch.setenv(token_store.CACHE_VARIABLE, str(folder))
    return folder


def write_corpus(folder: Path, documents: int = 600, bad_at: int | None = None) -> Path:
    """``documents`` JSONL records over two files (a record without text at line ``bad_at`` of
    the second, when given)."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, lines in (("a.jsonl", range(documents // 2)), ("b.jsonl", range(documents // 2, documents))):
        with open(folder / name, "w") as f:
            for line, i in enumerate(lines, 1):
                f.write(json.dumps({"body": "no text"} if name == "b.jsonl" and line == bad_at
                                   else {"text": f"def f{i}(x):\n    return x * {i}\n" * 8}) + "\n")
    return folder


def check(recipe: Path, *overrides: str, capsys) -> dict:
    argv = [str(recipe), "--check"]
    for item in overrides:
        argv += ["--set", item]
    code = launch.main(argv)
    verdict = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    verdict["exit_code"] = code
    return verdict


def config_of(*overrides: str, recipe_class=CausalLM):
    from engine.config import overrides_to_dict

    return recipe_class.config_class.model_validate(_nested(overrides_to_dict(list(overrides))))


def _nested(dotted: dict) -> dict:
    tree: dict = {}
    for key, value in dotted.items():
        *parents, leaf = key.split(".")
        node = tree
        for parent in parents:
            node = node.setdefault(parent, {})
        node[leaf] = value
    return tree


def test_the_launch_check_leaves_large_data_to_the_run_reading_only_its_head(tmp_path, cache, capsys):
    data = write_corpus(tmp_path / "data", bad_at=250)  # deep in b.jsonl: past the head the check reads
    left = check(TEMPLATE, f"data.paths=[{data}]", "data.tokenize_in_check_mb=0", capsys=capsys)
    assert left["ok"] is True, left
    summary = rd.DataSummary.model_validate(left["data"])
    size = sum(p.stat().st_size for p in data.iterdir())
    assert summary.preparing == rd.DataPreparation(bytes_total=size)
    assert (summary.files, summary.bytes, summary.documents) == (2, size, 0)
    assert summary.nothing_to_train() is None
    assert not cache.exists() or list(cache.iterdir()) == []  # nothing tokenized, nothing written
    counted = check(TEMPLATE, f"data.paths=[{data}]", capsys=capsys)  # small data: the check tokenizes it all
    assert counted == {"ok": False, "error": "b.jsonl:250: no text under 'text' (columns: ['body']; set data.text_field)",
                       "exit_code": 2}


def test_a_bad_record_in_the_head_is_still_refused_at_launch(tmp_path, cache, capsys):
    data = write_corpus(tmp_path / "data", bad_at=3)
    verdict = check(TEMPLATE, f"data.paths=[{data}]", "data.tokenize_in_check_mb=0", capsys=capsys)
    assert verdict["error"] == "b.jsonl:3: no text under 'text' (columns: ['body']; set data.text_field)"
    assert not cache.exists() or list(cache.iterdir()) == []


def test_too_little_disk_for_the_store_is_refused_at_launch_with_the_numbers(tmp_path, cache, capsys, monkeypatch):
    data = write_corpus(tmp_path / "data")
    monkeypatch.setattr(token_store, "DISK_BYTES_PER_INPUT_BYTE", 10**12)
    verdict = check(TEMPLATE, f"data.paths=[{data}]", "data.tokenize_in_check_mb=0", capsys=capsys)
    assert verdict["ok"] is False and "GB free" in verdict["error"] and "the tokenized data needs up to" in verdict["error"]


def pending_run(tmp_path: Path, data: Path, capsys, recipe: Path = TEMPLATE) -> tuple[Path, rd.DataSummary]:
    """A run directory as the launcher leaves it for data the check left to the run."""
    verdict = check(recipe, f"data.paths=[{data}]", "data.tokenize_in_check_mb=0", capsys=capsys)
    pending = LaunchVerdict.model_validate({k: v for k, v in verdict.items() if k != "exit_code"}).data
    run_dir = tmp_path / "runs" / "r1"
    rd.create_run(run_dir, rd.RunRecord(id="r1", recipe="lm", data=pending, status=rd.RUNNING))
    return run_dir, pending


def test_the_run_tokenizes_as_its_first_phase_with_its_progress_in_run_json(tmp_path, cache, capsys, monkeypatch):
    data = write_corpus(tmp_path / "data")
    run_dir, pending = pending_run(tmp_path, data, capsys)
    seen: list[rd.DataPreparation] = []
    update_run = rd.update_run

    def recording(folder, **fields):
        record = update_run(folder, **fields)
        seen.append(rd.read_run(folder).data.preparing)  # what get_run reads meanwhile
        return record

    monkeypatch.setattr(rd, "update_run", recording)
    monkeypatch.setattr(token_store, "PROGRESS_EVERY_S", 0.0)
    config = config_of(f"data.paths=[{data}]", "data.tokenize_in_check_mb=0")
    summary = launch.prepare_data(run_dir, CausalLM, config, pending)

    # A report per document, from one process or from the workers as they read (several).
    documents = [p.documents for p in seen]
    assert len(seen) >= 2 and documents == sorted(documents) and documents[-1] == 600
    assert all(p.bytes_total == pending.bytes for p in seen)
    assert 0 < seen[0].bytes_done < seen[-1].bytes_done <= pending.bytes and seen[0].eta_s > 0
    assert f"tokenizing the data as the run's first phase: {documents[0]:,} document" in pending.model_copy(
        update={"preparing": seen[0]}).describe()
    # The summary is exact: what the launch check counts of the same data when it tokenizes it.
    exact = check(TEMPLATE, f"data.paths=[{data}]", capsys=capsys)
    assert summary.preparing is None and summary.model_dump(mode="json") == exact["data"]
    assert summary.documents == 600 and summary.train_documents > 0


def test_a_second_launch_maps_the_store_and_a_changed_file_is_tokenized_again(tmp_path, cache, capsys):
    data = write_corpus(tmp_path / "data")
    run_dir, pending = pending_run(tmp_path, data, capsys)
    config = config_of(f"data.paths=[{data}]", "data.tokenize_in_check_mb=0")
    launch.prepare_data(run_dir, CausalLM, config, pending)
    again = check(TEMPLATE, f"data.paths=[{data}]", "data.tokenize_in_check_mb=0", capsys=capsys)
    assert again["data"]["preparing"] is None and again["data"]["documents"] == 600  # the store, mapped
    with open(data / "a.jsonl", "a") as f:
        f.write(json.dumps({"text": "one more"}) + "\n")
    changed = check(TEMPLATE, f"data.paths=[{data}]", "data.tokenize_in_check_mb=0", capsys=capsys)
    assert changed["data"]["preparing"] is not None  # another fingerprint: left to the run again


def test_a_bad_record_deep_in_a_file_fails_the_run_naming_it_and_leaves_no_store(tmp_path, cache, capsys):
    data = write_corpus(tmp_path / "data", bad_at=250)
    run_dir, pending = pending_run(tmp_path, data, capsys)
    config = config_of(f"data.paths=[{data}]", "data.tokenize_in_check_mb=0")
    with pytest.raises(ConfigError, match=r"^b.jsonl:250: no text under 'text'"):
        launch.prepare_data(run_dir, CausalLM, config, pending)
    assert list(cache.iterdir()) == []  # no store, no half-built folder


def test_a_store_left_half_built_by_a_killed_build_is_never_trusted(tmp_path, cache, capsys):
    data = write_corpus(tmp_path / "data")
    verdict = check(TEMPLATE, f"data.paths=[{data}]", "data.tokenize_in_check_mb=0", capsys=capsys)
    assert verdict["data"]["preparing"] is not None
    key_folders_before = set(cache.iterdir()) if cache.exists() else set()
    run_dir, pending = pending_run(tmp_path, data, capsys)
    config = config_of(f"data.paths=[{data}]", "data.tokenize_in_check_mb=0")
    store = launch.prepare_data(run_dir, CausalLM, config, pending)
    (folder,) = set(cache.iterdir()) - key_folders_before
    # What a kill mid-build leaves: the folder being built, without its meta.json.
    half = cache / f"{folder.name}.building-x"
    os.rename(folder, half)
    (half / "meta.json").unlink()
    again = check(TEMPLATE, f"data.paths=[{data}]", "data.tokenize_in_check_mb=0", capsys=capsys)
    assert again["data"]["preparing"] is not None  # not trusted: the run builds it again
    rebuilt = launch.prepare_data(run_dir, CausalLM, config, pending)
    assert rebuilt == store and sorted(p.name for p in cache.iterdir()) == [folder.name]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_two_ranks_on_data_left_to_them_tokenize_once_then_train(tmp_path, cache, capsys):
    data = write_corpus(tmp_path / "data")
    run_dir, pending = pending_run(tmp_path, data, capsys)
    command = engine_command(
        TEMPLATE, f"data.paths=[{data}]", "data.tokenize_in_check_mb=0", "train.max_steps=2", "model.hidden_size=16",
        "model.intermediate_size=32", "model.num_layers=1", "data.seq_len=32", "checkpoint.at_end=false",
        nproc=2, run_dir=run_dir,
    )
    result = subprocess.run(command, env={**engine_env(), token_store.CACHE_VARIABLE: str(cache)},
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    record = rd.read_run(run_dir)
    assert record.data.preparing is None and record.data.documents == 600 and record.final_step == 2
    assert len(list(cache.iterdir())) == 1  # one store, built by the first rank, mapped by the second


@pytest.mark.parametrize("cores", [2, 5])
def test_tokenizing_over_the_cores_builds_the_very_store_one_process_builds(tmp_path, monkeypatch, cores):
    data = tmp_path / "data"
    write_corpus(data / "x", documents=120)
    write_corpus(data / "y", documents=60, bad_at=None)
    (data / "notes.md").write_text("# notes\n" * 50)
    built = {}
    for workers in (1, cores):
        monkeypatch.setenv(token_store.CACHE_VARIABLE, str(tmp_path / f"cache-{workers}"))
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid, n=workers: set(range(n)))
        store = causal_lm.token_store(causal_lm.CausalLMDataConfig(paths=[str(data)], seq_len=16, eval_fraction=0.2),
                                      causal_lm.ByteTokenizer(), DataListing())
        built[workers] = (store.meta, {p.name: p.read_bytes() for p in sorted(store.folder.iterdir())})
    assert built[1] == built[cores]
    assert built[1][0]["counts"]["files"] == 5 and sum(built[1][0]["counts"]["train"][:1]) > 0


def test_without_a_process_to_spare_the_parts_are_built_here(tmp_path, cache, monkeypatch):
    import multiprocessing.context

    def refused(*args, **kwargs):
        raise BlockingIOError(11, "Resource temporarily unavailable")

    data = write_corpus(tmp_path / "data", documents=40)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(multiprocessing.context.ForkContext, "Pool", refused)
    store = causal_lm.token_store(causal_lm.CausalLMDataConfig(paths=[str(data)], seq_len=16),
                                  causal_lm.ByteTokenizer(), DataListing())
    assert store.counts["files"] == 2 and sum(store.counts[s][0] for s in ("train", "eval")) == 40


def test_a_build_over_the_cores_reports_what_its_workers_have_read_before_their_parts_end(tmp_path, monkeypatch):
    import numpy as np

    monkeypatch.setattr(token_store, "PROGRESS_EVERY_S", 0.0)
    shown = tmp_path / "shown"  # there once the build has reported both workers' first documents

    def build_part(writer, index):
        for _ in range(5):
            writer.add("train", np.arange(3))
            writer.progress.advance(documents=1, bytes_read=10)
        waited = time.monotonic() + 10
        while not shown.exists() and time.monotonic() < waited:  # the part does not end before its documents show
            time.sleep(0.01)
        return {"documents": 5, "shown before the end": shown.exists()}

    reports = []

    def report(fields):
        reports.append(fields)
        if fields["documents"] == 10:
            shown.touch()

    writer = token_store.StoreWriter(tmp_path, rows=1, dtype="int32", input_bytes=100)
    with token_store.reporting(report):
        counts = store_parts.build_in_parts(writer, 2, build_part, workers=2)
    writer.close()
    assert counts == [{"documents": 5, "shown before the end": True}] * 2
    assert [r["documents"] for r in reports] == sorted(r["documents"] for r in reports) and reports[-1]["bytes_done"] == 100
    assert len(token_store.TokenStore(tmp_path, {"rows": 1, "dtype": "int32"}).pieces("train")) == 10


def test_data_that_leaves_nothing_to_train_fails_the_run_as_the_launch_check_refuses_it(tmp_path, cache, capsys):
    data = write_corpus(tmp_path / "data", documents=20)
    left = check(TEMPLATE, f"data.paths=[{data}]", "data.eval_fraction=1", "data.tokenize_in_check_mb=0", capsys=capsys)
    assert left["ok"] is True  # the check cannot know before tokenizing it all
    run_dir = tmp_path / "runs" / "r1"
    pending = LaunchVerdict.model_validate({k: v for k, v in left.items() if k != "exit_code"}).data
    rd.create_run(run_dir, rd.RunRecord(id="r1", recipe="lm", data=pending, status=rd.RUNNING))
    config = config_of(f"data.paths=[{data}]", "data.eval_fraction=1", "data.tokenize_in_check_mb=0")
    with pytest.raises(ConfigError) as failed:
        launch.prepare_data(run_dir, CausalLM, config, pending)
    # Once the store is there, the launch check counts it and refuses with the same message.
    refused = check(TEMPLATE, f"data.paths=[{data}]", "data.eval_fraction=1", "data.tokenize_in_check_mb=0", capsys=capsys)
    assert refused["ok"] is False and str(failed.value) == refused["error"]
    assert "holds out all of them" in refused["error"]


# sft: conversations through the same first phase ---------------------------------------------


def write_conversations(folder: Path, conversations: int = 240, bad_at: int | None = None) -> Path:
    """``conversations`` chat records over two JSONL files, every tenth with an empty answer (left
    out: nothing to learn), and at line ``bad_at`` of the second one whose messages are no list."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, lines in (("a.jsonl", range(conversations // 2)), ("b.jsonl", range(conversations // 2, conversations))):
        with open(folder / name, "w") as f:
            for line, i in enumerate(lines, 1):
                answer = "" if i % 10 == 0 else f"{i} is {'even' if i % 2 == 0 else 'odd'}."
                record = {"messages": [{"role": "user", "content": f"Is {i} even or odd?"},
                                       {"role": "assistant", "content": answer}]}
                f.write(json.dumps({"messages": "no list"} if name == "b.jsonl" and line == bad_at else record) + "\n")
    return folder


def test_sft_data_left_to_the_run_is_encoded_there_with_progress_and_the_exact_summary(tmp_path, cache, capsys,
                                                                                        monkeypatch):
    data = write_conversations(tmp_path / "data")
    run_dir, pending = pending_run(tmp_path, data, capsys, SFT_TEMPLATE)
    size = sum(p.stat().st_size for p in data.iterdir())
    assert pending.preparing == rd.DataPreparation(bytes_total=size) and (pending.files, pending.documents) == (2, 0)
    assert not cache.exists() or list(cache.iterdir()) == []  # only the head was read
    seen: list[rd.DataPreparation] = []
    update_run = rd.update_run

    def recording(folder, **fields):
        record = update_run(folder, **fields)
        seen.append(rd.read_run(folder).data.preparing)
        return record

    monkeypatch.setattr(rd, "update_run", recording)
    monkeypatch.setattr(token_store, "PROGRESS_EVERY_S", 0.0)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    config = config_of(f"data.paths=[{data}]", "data.tokenize_in_check_mb=0", recipe_class=SFT)
    summary = launch.prepare_data(run_dir, SFT, config, pending)
    documents = [p.documents for p in seen]  # two workers: what they have read, at least as each part ends
    assert len(seen) >= len(store_parts.file_parts(data_files([str(data)], FILE_SUFFIXES))) > 2
    assert documents == sorted(documents) and documents[-1] == 240
    assert 0 < seen[0].bytes_done < seen[-1].bytes_done <= size
    # Exact: what the launch check counts of the same data when it encodes it all (into a cache
    # of its own here), loss tokens and the examples left out included.
    monkeypatch.setenv(token_store.CACHE_VARIABLE, str(tmp_path / "other-cache"))
    exact = check(SFT_TEMPLATE, f"data.paths=[{data}]", capsys=capsys)
    assert summary.preparing is None and summary.model_dump(mode="json") == exact["data"]
    monkeypatch.setenv(token_store.CACHE_VARIABLE, str(cache))
    assert (summary.documents, summary.dropped) == (216, 24) and summary.loss_tokens > 0
    assert summary.dropped_why == "24: no assistant answer (empty or missing)"
    # A second launch maps the store; a changed file is left to the run again.
    again = check(SFT_TEMPLATE, f"data.paths=[{data}]", "data.tokenize_in_check_mb=0", capsys=capsys)
    assert again["data"] == exact["data"]
    with open(data / "a.jsonl", "a") as f:
        f.write(json.dumps({"messages": [{"role": "user", "content": "1?"}, {"role": "assistant", "content": "1"}]}) + "\n")
    changed = check(SFT_TEMPLATE, f"data.paths=[{data}]", "data.tokenize_in_check_mb=0", capsys=capsys)
    assert changed["data"]["preparing"] is not None


def test_sft_a_bad_record_is_refused_at_launch_in_the_head_and_fails_the_run_deeper(tmp_path, cache, capsys):
    head = write_conversations(tmp_path / "head", bad_at=3)
    refused = check(SFT_TEMPLATE, f"data.paths=[{head}]", "data.tokenize_in_check_mb=0", capsys=capsys)
    assert refused["ok"] is False and refused["error"].startswith("b.jsonl:3: "), refused
    deep = write_conversations(tmp_path / "deep", bad_at=110)  # past the 100 records the check reads
    run_dir, pending = pending_run(tmp_path, deep, capsys, SFT_TEMPLATE)
    config = config_of(f"data.paths=[{deep}]", "data.tokenize_in_check_mb=0", recipe_class=SFT)
    with pytest.raises(ConfigError) as failed:
        launch.prepare_data(run_dir, SFT, config, pending)
    assert str(failed.value) == refused["error"].replace(":3:", ":110:")
    assert list(cache.iterdir()) == []  # no store, no half-built folder


def test_sft_data_that_leaves_nothing_to_train_fails_the_run_as_the_launch_check_refuses_it(tmp_path, cache, capsys):
    data = write_conversations(tmp_path / "data", conversations=20)
    left = check(SFT_TEMPLATE, f"data.paths=[{data}]", "data.eval_fraction=1", "data.tokenize_in_check_mb=0",
                 capsys=capsys)
    assert left["ok"] is True
    run_dir = tmp_path / "runs" / "r1"
    pending = LaunchVerdict.model_validate({k: v for k, v in left.items() if k != "exit_code"}).data
    rd.create_run(run_dir, rd.RunRecord(id="r1", recipe="sft", data=pending, status=rd.RUNNING))
    config = config_of(f"data.paths=[{data}]", "data.eval_fraction=1", "data.tokenize_in_check_mb=0", recipe_class=SFT)
    with pytest.raises(ConfigError) as failed:
        launch.prepare_data(run_dir, SFT, config, pending)
    refused = check(SFT_TEMPLATE, f"data.paths=[{data}]", "data.eval_fraction=1", "data.tokenize_in_check_mb=0",
                    capsys=capsys)
    assert refused["ok"] is False and str(failed.value) == refused["error"]
    assert refused["error"].startswith("nothing to train on: all 18 usable examples of the data fall in the held-out")


def built_store(tmp_path, monkeypatch, workers: int, cache: str, build):
    """The meta and the files of the store ``build()`` makes on ``workers`` cores, in a cache of its own."""
    monkeypatch.setenv(token_store.CACHE_VARIABLE, str(tmp_path / cache))
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(workers)))
    store = build()
    return store.meta, {p.name: p.read_bytes() for p in sorted(store.folder.iterdir())}


def test_sft_over_the_cores_builds_the_very_store_one_process_builds_and_names_a_bad_record(tmp_path, monkeypatch):
    from recipes_template.sft import recipe as sft

    data = tmp_path / "data"
    data.mkdir()
    with open(data / "chats.jsonl", "w") as f:  # one large file (read apart at line starts), blank lines among it
        for i in range(300):
            answer = "" if i % 10 == 0 else f"{i} is {'even' if i % 2 == 0 else 'odd'}." * (1 + i % 7)
            question = "Why? " * 40 if i % 50 == 3 else f"Is {i} even or odd?" * (1 + i % 3)  # too long: dropped
            record = {"messages": [{"role": "user", "content": question},
                                   {"role": "assistant", "content": answer}]}
            f.write("\n" if i % 41 == 7 else json.dumps(record) + "\n")
    with open(data / "tasks.jsonl", "w") as f:  # another format in a file of its own
        for i in range(30):
            f.write(json.dumps({"instruction": f"Say {i}.", "output": str(i)}) + "\n")
    config = sft.SFTDataConfig(paths=[str(data)], seq_len=96, eval_fraction=0.2)
    tokenizer = sft.load_tokenizer(None, None)
    per_worker = store_parts.PARTS_PER_WORKER  # the large file in that many parts a worker, the small one whole
    assert len(store_parts.file_parts(data_files([str(data)], FILE_SUFFIXES), workers=3)) == 3 * per_worker + 1

    parts_built, build_in_parts = [], sft.build_in_parts
    monkeypatch.setattr(sft, "build_in_parts", lambda writer, count, build_part:
                        parts_built.append(count) or build_in_parts(writer, count, build_part))

    def build():
        return sft.token_store(config, tokenizer, DataListing())

    built = {workers: built_store(tmp_path, monkeypatch, workers, f"cache-{workers}", build) for workers in (1, 3)}
    assert built[1] == built[3] and parts_built == [per_worker + 1, 3 * per_worker + 1]
    counts = built[1][0]["counts"]
    assert {key: counts[key] for key in ("files", "documents", "format", "mask", "dropped", "dropped_why")} == {
        "files": 2, "documents": 288, "format": "alpaca, messages", "mask": "generation_markers", "dropped": 34,
        "dropped_why": "5: every assistant token lies past data.seq_len=96; 29: no assistant answer (empty or missing)"}
    assert counts["seq_len_to_keep"] > 96 and counts["truncated"] > 0
    assert counts["loss_tokens"] == counts["train_loss_tokens"] + counts["eval_loss_tokens"] > 0

    with open(data / "chats.jsonl", "a") as f:
        f.write(json.dumps({"messages": "no list"}) + "\n")
    for workers in (1, 3):  # a bad record in the last part is named by its line, as one reader names it
        with pytest.raises(ConfigError, match=r"^chats\.jsonl:301: "):
            built_store(tmp_path, monkeypatch, workers, f"bad-{workers}", build)
        assert [p.name for p in (tmp_path / f"bad-{workers}").iterdir() if p.suffix != ".lock"] == []  # nothing built


def test_dpo_pairs_left_to_the_run_are_tokenized_there_with_the_exact_summary(tmp_path, cache, capsys, monkeypatch):
    from recipes_template.dpo.recipe import DPO, builtin_pairs

    data = tmp_path / "pairs"
    data.mkdir()
    with open(data / "pairs.jsonl", "w") as f:
        for _, record in builtin_pairs(40):
            f.write(json.dumps(record) + "\n")
    dpo_template = REPO / "recipes_template" / "dpo"
    run_dir, pending = pending_run(tmp_path, data, capsys, dpo_template)
    assert pending.preparing is not None and pending.documents == 0
    assert not cache.exists() or list(cache.iterdir()) == []
    config = config_of(f"data.paths=[{data}]", "data.tokenize_in_check_mb=0", recipe_class=DPO)
    summary = launch.prepare_data(run_dir, DPO, config, pending)
    monkeypatch.setenv(token_store.CACHE_VARIABLE, str(tmp_path / "other-cache"))
    exact = check(dpo_template, f"data.paths=[{data}]", capsys=capsys)
    assert summary.preparing is None and summary.model_dump(mode="json") == exact["data"]
    assert summary.documents == 40 and summary.loss_tokens > 0 and summary.format == "prompt_chosen_rejected"


def test_dpo_over_the_cores_builds_the_very_store_one_process_builds_and_names_a_bad_record(tmp_path, monkeypatch):
    from recipes_template.dpo import recipe as dpo

    import pyarrow as pa
    import pyarrow.parquet as pq

    data = tmp_path / "pairs"
    data.mkdir()
    records = [{**record, "prompt": "Why? " * 30} if i % 40 == 9 else record  # no room for an answer: dropped
               for i, (_, record) in enumerate(dpo.builtin_pairs(300))]
    pq.write_table(pa.Table.from_pylist(records), data / "pairs.parquet", row_group_size=10)  # read apart by row groups
    assert len(store_parts.file_parts([(data / "pairs.parquet", "pairs.parquet")], workers=3)) > 3
    config = dpo.DPODataConfig(paths=[str(data)], seq_len=96, eval_fraction=0.2)
    tokenizer = dpo.load_tokenizer(None, None)

    def build():
        return dpo.token_store(config, tokenizer, DataListing())

    built = {workers: built_store(tmp_path, monkeypatch, workers, f"cache-{workers}", build) for workers in (1, 3)}
    assert built[1] == built[3]
    counts = built[1][0]["counts"]
    assert {key: counts[key] for key in ("files", "documents", "format", "dropped", "dropped_why")} == {
        "files": 1, "documents": 292, "format": "prompt_chosen_rejected", "dropped": 8,
        "dropped_why": "8: an answer lies wholly past data.seq_len=96"}
    assert counts["loss_tokens"] == counts["train_loss_tokens"] + counts["eval_loss_tokens"] > 0

    records.append({"prompt": "Hi", "chosen": None, "rejected": "no"})
    pq.write_table(pa.Table.from_pylist(records), data / "pairs.parquet", row_group_size=10)
    for workers in (1, 3):  # a bad row in the last part is named by its row, as one reader names it
        with pytest.raises(ConfigError, match=r"^pairs\.parquet:301: "):
            built_store(tmp_path, monkeypatch, workers, f"bad-{workers}", build)
        assert [p.name for p in (tmp_path / f"bad-{workers}").iterdir() if p.suffix != ".lock"] == []  # nothing built


def test_a_rank_that_waits_for_the_store_reads_the_corpus_once(tmp_path, cache, monkeypatch):
    data = write_corpus(tmp_path / "data")
    config = config_of(f"data.paths=[{data}]")
    CausalLM.summarize_data(config)  # rank 0 built the store
    corpus = sum(path.stat().st_size for path in data.iterdir())
    hashed = HashedBytes(monkeypatch)  # rank 1, a process of its own: nothing hashed yet
    monkeypatch.setenv("LOCAL_RANK", "1")
    CausalLM.summarize_data(config)  # what engine.launch.train has it do to wait for the store
    causal_lm.token_store(config.data, causal_lm.data_tokenizer(config), DataListing())  # the engine's store
    assert corpus <= hashed.count < corpus + 5_000  # the files once, and the fingerprints' lines


def test_one_large_jsonl_file_is_read_apart_at_line_starts_into_the_store_one_process_builds(tmp_path, monkeypatch):
    from engine.data_files import jsonl_records, line_ranges

    data = tmp_path / "data" / "one.jsonl"
    data.parent.mkdir()
    with open(data, "w") as f:
        for i in range(300):  # blank lines among the records, the last without its newline
            f.write("\n" if i % 37 == 5 else json.dumps({"text": f"def f{i}(x):\n    return x * {i}\n" * (1 + i % 5)})
                    + ("\n" if i < 299 else ""))
    whole = list(jsonl_records(data, "one.jsonl"))
    for count in (2, 3, 7):
        ranges = line_ranges(data, count)
        assert len(ranges) == count and ranges[0].start == 0 and ranges[-1].end is None
        assert [r.end for r in ranges[:-1]] == [r.start for r in ranges[1:]]
        assert [record for lines in ranges for record in jsonl_records(data, "one.jsonl", lines)] == whole
    assert len(store_parts.file_parts([(data, "one.jsonl")], workers=3)) == 3 * store_parts.PARTS_PER_WORKER

    built = {}
    for workers in (1, 3):
        monkeypatch.setenv(token_store.CACHE_VARIABLE, str(tmp_path / f"cache-{workers}"))
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid, n=workers: set(range(n)))
        store = causal_lm.token_store(causal_lm.CausalLMDataConfig(paths=[str(data.parent)], seq_len=16,
                                                                   eval_fraction=0.2),
                                      causal_lm.ByteTokenizer(), DataListing())
        built[workers] = (store.meta, {p.name: p.read_bytes() for p in sorted(store.folder.iterdir())})
    assert built[1] == built[3] and built[1][0]["counts"]["files"] == 1

    with open(data, "a") as f:
        f.write('\n{"body": "no text"}\n')
    for workers in (1, 3):  # a bad record in the last part is named by its line, as one reader names it
        monkeypatch.setenv(token_store.CACHE_VARIABLE, str(tmp_path / f"bad-{workers}"))
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid, n=workers: set(range(n)))
        with pytest.raises(ConfigError, match=r"one\.jsonl:301: no text under 'text'"):
            causal_lm.token_store(causal_lm.CausalLMDataConfig(paths=[str(data.parent)], seq_len=16),
                                  causal_lm.ByteTokenizer(), DataListing())


def test_one_large_parquet_file_is_read_apart_by_row_groups_into_the_store_one_process_builds(tmp_path, monkeypatch):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from engine.data_formats import parquet_rows, row_group_ranges

    data = tmp_path / "data" / "one.parquet"
    data.parent.mkdir()
    texts = [f"def f{i}(x):\n    return x * {i}\n" * (1 + i % 5) for i in range(60)]
    pq.write_table(pa.table({"text": texts}), data, row_group_size=7)  # 9 row groups
    whole = list(parquet_rows(data, "one.parquet"))
    ranges = row_group_ranges(data, "one.parquet", 3)
    assert len(ranges) == 3 and (ranges[0].start, ranges[-1].end) == (0, 9)
    assert [r.end for r in ranges[:-1]] == [r.start for r in ranges[1:]]
    assert [row for groups in ranges for row in parquet_rows(data, "one.parquet", groups)] == whole

    def build(workers: int, cache: str):
        monkeypatch.setenv(token_store.CACHE_VARIABLE, str(tmp_path / cache))
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(workers)))
        return causal_lm.token_store(causal_lm.CausalLMDataConfig(paths=[str(data.parent)], seq_len=16,
                                                                   eval_fraction=0.2),
                                     causal_lm.ByteTokenizer(), DataListing())

    built = {workers: build(workers, f"cache-{workers}") for workers in (1, 3)}
    assert built[1].meta == built[3].meta
    assert {p.name: p.read_bytes() for p in built[1].folder.iterdir()} == \
        {p.name: p.read_bytes() for p in built[3].folder.iterdir()}

    pq.write_table(pa.table({"text": texts[:50] + [None] + texts[51:]}), data, row_group_size=7)
    for workers in (1, 3):  # a bad row in the last part is named by its row, as one reader names it
        with pytest.raises(ConfigError, match=r"one\.parquet:51: no text under 'text'"):
            build(workers, f"bad-{workers}")


def chat(i: int) -> dict:
    """A question and its answer (none at every tenth: nothing to learn, dropped)."""
    answer = "" if i % 10 == 0 else f"{i} is {'even' if i % 2 == 0 else 'odd'}." * (1 + i % 7)
    return {"messages": [{"role": "user", "content": f"Is {i} even or odd?" * (1 + i % 3)},
                         {"role": "assistant", "content": answer}]}


def hub_snapshot(tmp_path: Path, monkeypatch, files: list[list[dict]]) -> Path:
    """The data set org/chats as the server binds it: a snapshot of parquet files of 16-row groups."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from engine.data_files import HUB_DATASETS_VARIABLE

    snapshot = tmp_path / "hub" / "datasets--org--chats" / "snapshots" / ("c" * 40)
    (snapshot / "data").mkdir(parents=True, exist_ok=True)
    for index, rows in enumerate(files):
        pq.write_table(pa.Table.from_pylist(rows), snapshot / "data" / f"train-0000{index}-of-0000{len(files)}.parquet",
                       row_group_size=16)
    monkeypatch.setenv(HUB_DATASETS_VARIABLE, json.dumps({"org/chats": str(snapshot)}))
    return snapshot


def test_sft_saved_folders_and_a_hub_data_set_are_read_apart_into_the_store_one_process_builds(tmp_path, monkeypatch):
    import datasets

    from engine.data_formats import part_examples, read_examples
    from recipes_template.sft import recipe as sft

    saved = tmp_path / "data" / "saved"
    datasets.Dataset.from_list([chat(i) for i in range(120)]).save_to_disk(str(saved), num_shards=2)
    hub_snapshot(tmp_path, monkeypatch, [[chat(1000 + 100 * f + i) for i in range(100)] for f in range(2)])
    config = sft.SFTDataConfig(paths=[str(saved)], dataset="org/chats", seq_len=96, eval_fraction=0.2)

    parts = store_parts.source_parts(config.paths, FILE_SUFFIXES, DataListing(), config.dataset, workers=3)
    assert [name for _, name, _ in parts] == ["saved"] * 12 + ["org/chats"] * 12  # rows of each, row groups of the Hub's
    one_reader = [pair for source in read_examples("sft", config.paths, dataset=config.dataset) for pair in source.records]
    apart = [pair for part in parts for pair in part_examples("sft", *part).records]
    assert apart == one_reader and apart[120][0] == "org/chats:1" and apart[-1][0] == "org/chats:200"

    parts_built, build_in_parts = [], sft.build_in_parts
    monkeypatch.setattr(sft, "build_in_parts", lambda writer, count, build_part:
                        parts_built.append(count) or build_in_parts(writer, count, build_part))
    tokenizer = sft.load_tokenizer(None, None)

    def build():
        return sft.token_store(config, tokenizer, DataListing())

    built = {workers: built_store(tmp_path, monkeypatch, workers, f"cache-{workers}", build) for workers in (1, 3)}
    assert built[1] == built[3] and parts_built == [2 * store_parts.PARTS_PER_WORKER, 6 * store_parts.PARTS_PER_WORKER]
    counts = built[1][0]["counts"]
    assert {key: counts[key] for key in ("files", "documents", "format", "dropped")} == {
        "files": 2, "documents": 288, "format": "messages", "dropped": 32}

    hub_snapshot(tmp_path, monkeypatch, [[chat(1000 + i) for i in range(100)], [chat(1100 + i) for i in range(99)]
                                         + [{"messages": [{"role": "user", "content": "Hi"}, {"role": None, "content": "no"}]}]])
    for workers in (1, 3):  # a bad record in the last part is named by its row, as one reader names it
        with pytest.raises(ConfigError, match=r"^org/chats:200"):
            built_store(tmp_path, monkeypatch, workers, f"bad-{workers}", build)
        assert [p.name for p in (tmp_path / f"bad-{workers}").iterdir() if p.suffix != ".lock"] == []  # nothing built


def test_dpo_and_causal_lm_saved_folders_are_read_apart_into_the_store_one_process_builds(tmp_path, monkeypatch):
    import datasets

    from recipes_template.dpo import recipe as dpo

    pairs = datasets.Dataset.from_list([record for _, record in dpo.builtin_pairs(90)])
    datasets.DatasetDict({"train": pairs, "test": pairs.select(range(5))}).save_to_disk(str(tmp_path / "pairs"))
    config = dpo.DPODataConfig(paths=[str(tmp_path / "pairs")], seq_len=96, eval_fraction=0.2)
    tokenizer = dpo.load_tokenizer(None, None)
    assert len(store_parts.source_parts(config.paths, FILE_SUFFIXES, DataListing(), workers=3)) == 12
    built = {workers: built_store(tmp_path, monkeypatch, workers, f"dpo-{workers}",
                                  lambda: dpo.token_store(config, tokenizer, DataListing())) for workers in (1, 3)}
    assert built[1] == built[3] and built[1][0]["counts"]["documents"] == 90

    texts = [f"def f{i}(x):\n    return x * {i}\n" * (1 + i % 5) for i in range(200)]
    datasets.Dataset.from_list([{"text": text} for text in texts]).save_to_disk(str(tmp_path / "texts"), num_shards=2)
    (tmp_path / "notes.md").write_text("# notes\n" * 50)
    documents = causal_lm.CausalLMDataConfig(paths=[str(tmp_path / "notes.md"), str(tmp_path / "texts")], seq_len=16,
                                             eval_fraction=0.2)
    assert [name for name, _ in causal_lm.read_documents(documents)][:2] == ["texts:1", "texts:2"]  # saved folders first
    built = {workers: built_store(tmp_path, monkeypatch, workers, f"causal-{workers}",
                                  lambda: causal_lm.token_store(documents, causal_lm.ByteTokenizer(), DataListing()))
             for workers in (1, 3)}
    assert built[1] == built[3] and built[1][0]["counts"]["files"] == 2
    assert sum(built[1][0]["counts"][split][0] for split in ("train", "eval")) == 201
