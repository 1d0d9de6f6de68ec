"""The template's data loading: document names (which decide the train/eval split) do not
depend on where the data is stored."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from engine.config import ConfigError, build_config
from recipes_template.causal_lm import recipe


def write_corpus(root: Path) -> Path:
    (root / "sub").mkdir(parents=True)
    (root / "a.txt").write_text("first document")
    (root / "sub" / "b.md").write_text("second document")
    (root / "notes.bin").write_bytes(b"\0skipped: not a text suffix")
    with open(root / "c.jsonl", "w") as f:
        for i in range(3):
            f.write(json.dumps({"text": f"record {i}"}) + "\n")
        f.write("\n")  # blank lines are skipped
    return root


def documents(*paths: Path) -> list[tuple[str, str]]:
    cfg = recipe.CausalLMDataConfig(source="files", paths=[str(p) for p in paths])
    return recipe.load_documents(cfg)


def test_names_are_relative_to_the_folder_given(tmp_path: Path):
    corpus = write_corpus(tmp_path / "corpus")
    assert documents(corpus) == [
        ("a.txt", "first document"),
        ("c.jsonl:1", "record 0"),
        ("c.jsonl:2", "record 1"),
        ("c.jsonl:3", "record 2"),
        ("sub/b.md", "second document"),
    ]
    assert documents(corpus / "c.jsonl")[0] == ("c.jsonl:1", "record 0")


def test_moving_the_data_keeps_the_train_eval_split(tmp_path: Path):
    here = write_corpus(tmp_path / "here")
    for i in range(200):
        (here / f"doc{i}.txt").write_text(f"document {i}")
    there = tmp_path / "elsewhere" / "deeper"
    shutil.copytree(here, there)

    def split(root: Path) -> list[bool]:
        return [recipe.is_eval_document(name, 0.2) for name, _ in documents(root)]

    assert documents(here) == documents(there)
    assert split(here) == split(there)
    assert 0 < sum(split(here)) < len(split(here))  # both sides of the split are used


def test_missing_paths_are_named(tmp_path: Path):
    with pytest.raises(ConfigError, match="data path '.*nowhere' does not exist"):
        documents(tmp_path / "nowhere")
    with pytest.raises(ValueError, match="no documents"):
        (tmp_path / "empty").mkdir()
        documents(tmp_path / "empty")


# ---------------------------------------------------------------------------------------------
# Which data: no combination of keys trains on other data than asked for
# ---------------------------------------------------------------------------------------------


def data_config(*overrides: str) -> recipe.CausalLMDataConfig:
    return build_config(recipe.CausalLMConfig, None, list(overrides)).data


def test_data_paths_alone_mean_files():
    assert data_config('data.paths=["corpus"]').source == "files"
    assert data_config().source == "stdlib"
    assert data_config("data.source=random").source == "random"


@pytest.mark.parametrize("source", ["stdlib", "random"])
def test_data_paths_with_another_source_are_refused(source):
    with pytest.raises(ConfigError, match=f"data.paths is set but data.source={source} would ignore it"):
        data_config('data.paths=["corpus"]', f"data.source={source}")


def test_files_without_paths_are_refused():
    with pytest.raises(ConfigError, match="data.source=files needs data.paths"):
        data_config("data.source=files")


def test_the_data_summary_counts_what_the_run_will_read(tmp_path: Path, monkeypatch):
    write_corpus(tmp_path / "corpus")
    monkeypatch.chdir(tmp_path)
    config = build_config(recipe.CausalLMConfig, None, ['data.paths=["corpus"]', "data.eval_fraction=0"])
    summary = recipe.CausalLM.summarize_data(config)
    texts = ["first document", "record 0", "record 1", "record 2", "second document"]
    assert (summary.source, summary.paths, summary.files, summary.documents) == ("files", ["corpus"], 3, 5)
    assert summary.tokens == sum(len(text) + 1 for text in texts)  # bytes + end of document
    assert (summary.train_documents, summary.eval_documents, summary.eval_tokens) == (5, 0, 0)


def test_pad_to_longest_ends_a_batch_at_its_last_label_with_the_same_loss_and_gradients():
    import torch
    import torch.nn.functional as F

    cfg = data_config("data.pad_to_longest=true", "data.seq_len=64")
    generator = torch.Generator().manual_seed(0)
    pieces = [torch.randint(0, 256, (n,), generator=generator) for n in (10, 30, 21)]

    def first_batch(pad_to_longest: bool) -> dict[str, torch.Tensor]:
        stream = recipe.BatchStream(pieces, cfg.seq_len, 257, seed=0, micro_batch=3, dp_rank=0, dp_size=1,
                                    pad_to_longest=pad_to_longest)
        return next(stream)

    padded, longest = first_batch(False), first_batch(cfg.pad_to_longest)
    assert padded["input_ids"].shape == (3, 64)
    assert {key: value.shape for key, value in longest.items()} == {key: (3, 29) for key in padded}  # 30 tokens: 29 pairs
    assert all(torch.equal(longest[key], padded[key][:, :29]) for key in padded)
    assert (padded["labels"][:, 29:] == recipe.IGNORE_INDEX).all()

    def loss_and_gradients(batch):
        torch.manual_seed(0)
        model = recipe.build_model(recipe.ModelConfig(hidden_size=32, intermediate_size=64, num_layers=2), 258, 64)
        logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
        loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=recipe.IGNORE_INDEX,
                               reduction="sum")
        loss.backward()
        return loss.detach(), [p.grad for p in model.parameters()]

    (loss, gradients), (cut_loss, cut_gradients) = loss_and_gradients(padded), loss_and_gradients(longest)
    torch.testing.assert_close(cut_loss, loss, rtol=1e-6, atol=0)
    for cut, whole in zip(cut_gradients, gradients):
        torch.testing.assert_close(cut, whole, rtol=1e-5, atol=1e-6)  # rounded in other places


@pytest.mark.parametrize("setting, compiled, width", [
    ([], False, 29),  # unset, eager: a batch ends at its last label, as the Trainer's default collator pads
    ([], True, 64),  # unset, compiled blocks: rows of data.seq_len (one width, one graph)
    (["data.pad_to_longest=false"], False, 64),
    (["data.pad_to_longest=true"], True, 29),
    (["parallel.sp=4"], False, 32),  # sequence parallelism splits each row in 4 parts
])
def test_by_default_a_batch_ends_at_its_last_label_unless_some_of_the_model_is_compiled(
        tmp_path: Path, monkeypatch, setting, compiled, width):
    import torch

    from engine.distributed import DistInfo

    with open(tmp_path / "docs.jsonl", "w") as f:
        for n in (10, 29, 21):  # pieces of n + 1 tokens (the end of the document): at most 29 pairs
            f.write(json.dumps({"text": "x" * n}) + "\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TRAINWRIGHT_DATA_CACHE", str(tmp_path / "cache"))
    config = build_config(recipe.CausalLMConfig, None, [
        "data.paths=[docs.jsonl]", "data.eval_fraction=0", "data.seq_len=64", "data.batch_size=3",
        "model.hidden_size=32", "model.intermediate_size=64", "model.num_layers=2", *setting])
    engine = recipe.CausalLM(config, DistInfo(0, 1, 0, torch.device("cpu"), None))
    model = recipe.build_model(config.model, 258, 64)
    if compiled:
        model.model.layers[0].compile()  # as the torch-compile skill does; nothing compiles before a call
    engine.model = model
    batch = next(engine.prepare_data())
    assert {key: value.shape for key, value in batch.items()} == {
        key: (3, width) for key in ("input_ids", "labels", "position_ids")}
