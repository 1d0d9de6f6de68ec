"""sequence-packing, proven by runs and by the written code itself:

- on variable-length documents, padding falls below 5% and useful tokens/s rise;
- each document's loss in a packed row equals its loss alone in a padded row (the
  block-diagonal mask from restarting position ids), for both label conventions;
- first-fit decreasing packs like the textbook algorithm.
"""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.skills.skill_helpers import (
    copy_recipe,
    load_recipe_module,
    on_documents,
    template_with,
    train,
    write_documents,
)

ROWS = ("data.seq_len=256", "data.batch_size=8", "train.max_steps=8")


@pytest.mark.slow
def test_packing_removes_padding_and_fills_each_step_with_more_tokens(tmp_path: Path, capsys):
    documents = write_documents(tmp_path / "docs.jsonl", 600, 4, 45)  # ≈ 20-250 bytes each
    data = on_documents(documents)
    padded = train(template_with([], tmp_path / "padded"), tmp_path / "run-padded", *ROWS, *data, threads=1)
    packed = train(template_with(["sequence-packing"], tmp_path / "packed"), tmp_path / "run-packed", *ROWS, *data, threads=1)

    def padding(records):
        return statistics.mean(r["padding_frac"] for r in records)

    def useful_tokens_per_s(records):
        return statistics.median(r["loss_tokens_per_s"] for r in records[1:])  # the first step warms up

    speedup = useful_tokens_per_s(packed) / useful_tokens_per_s(padded)
    with capsys.disabled():
        print(
            f"\n[sequence-packing] padding {padding(padded):.1%} -> {padding(packed):.1%}; useful tokens/s "
            f"{useful_tokens_per_s(padded):,.0f} -> {useful_tokens_per_s(packed):,.0f} ({speedup:.2f}x); "
            f"tokens per step {padded[0]['loss_tokens_seen']:,} -> {packed[0]['loss_tokens_seen']:,}"
        )
    assert padding(padded) > 0.3
    assert padding(packed) < 0.05
    # Each packed step learns from more tokens in the same positions. Its speed is a benchmark's
    # to claim (bench/throughput.py, peers interleaved), not a timed test's: printed above.
    assert packed[0]["loss_tokens_seen"] > 1.2 * padded[0]["loss_tokens_seen"]


def per_token_losses(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100, reduction="none").view(labels.shape)


def tiny_llama(vocab_size: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa")
    return LlamaForCausalLM(config).eval()


def test_packed_losses_equal_each_document_alone_in_the_template(tmp_path: Path):
    module = load_recipe_module(template_with(["sequence-packing"], tmp_path / "packed"))
    model = tiny_llama(258)
    generator = torch.Generator().manual_seed(0)
    pieces = [torch.randint(0, 256, (n,), generator=generator) for n in (40, 9, 23, 30, 5, 17, 33, 12)]
    seq_len = 64

    with torch.no_grad():
        alone = module.collate(pieces, seq_len, 257)
        alone_losses = per_token_losses(model(input_ids=alone["input_ids"], position_ids=alone["position_ids"], use_cache=False).logits, alone["labels"])
        rows = module.pack_pieces(pieces, seq_len)
        packed = module.collate_packed(rows, seq_len, 257)
        packed_losses = per_token_losses(model(input_ids=packed["input_ids"], position_ids=packed["position_ids"], use_cache=False).logits, packed["labels"])
        # Control: the same rows with positions that do not restart let documents see each other.
        mixed_positions = torch.arange(seq_len).expand_as(packed["input_ids"])
        mixed_losses = per_token_losses(model(input_ids=packed["input_ids"], position_ids=mixed_positions, use_cache=False).logits, packed["labels"])

    assert len(rows) < len(pieces)
    per_document = {}
    differences, control = [], []
    for row, members in enumerate(rows):
        start = 0
        for piece in members:
            n = len(piece) - 1
            index = next(i for i, p in enumerate(pieces) if p is piece)
            expected = alone_losses[index, :n]
            differences.append((packed_losses[row, start : start + n] - expected).abs().max().item())
            control.append((mixed_losses[row, start : start + n] - expected).abs().max().item())
            per_document[index] = True
            start += n
    assert len(per_document) == len(pieces)
    assert max(differences) < 1e-4
    assert max(control) > 1e-2  # without the mask, packing would change the losses


def test_packed_losses_equal_each_document_alone_when_the_model_shifts_labels(tmp_path: Path):
    from skills import apply_skill

    script = copy_recipe("hf_trainer_style", tmp_path)
    apply_skill("sequence-packing", script)
    module = load_recipe_module(script)
    model = tiny_llama(64)
    generator = torch.Generator().manual_seed(1)
    documents = [torch.randint(1, 64, (n,), generator=generator).tolist() for n in (30, 8, 20, 25, 6, 14)]
    seq_len = 48

    with torch.no_grad():
        alone = module.collate(documents, seq_len, 0)
        alone_out = model(input_ids=alone["input_ids"], attention_mask=alone["attention_mask"], use_cache=False)
        alone_losses = per_token_losses(alone_out.logits[:, :-1], alone["labels"][:, 1:])
        rows = module.pack_pieces(documents, seq_len)
        packed = module.collate_packed(rows, seq_len, 0)
        packed_out = model(input_ids=packed["input_ids"], position_ids=packed["position_ids"], use_cache=False)
        packed_losses = per_token_losses(packed_out.logits[:, :-1], packed["labels"][:, 1:])
        # The model's own loss (mean over the supervised tokens) agrees too.
        alone_mean = model(input_ids=alone["input_ids"], attention_mask=alone["attention_mask"], labels=alone["labels"], use_cache=False).loss
        packed_mean = model(input_ids=packed["input_ids"], position_ids=packed["position_ids"], labels=packed["labels"], use_cache=False).loss

    assert len(rows) < len(documents)
    differences = []
    for row, members in enumerate(rows):
        start = 0
        for document in members:
            n = len(document)
            index = next(i for i, d in enumerate(documents) if d is document)
            # Position start + k predicts token k + 1 of the document; the last predicts nothing.
            got = packed_losses[row, start : start + n - 1]
            expected = alone_losses[index, : n - 1]
            differences.append((got - expected).abs().max().item())
            assert packed["labels"][row, start].item() == -100
            start += n
    assert max(differences) < 1e-4
    assert abs(packed_mean.item() - alone_mean.item()) < 1e-4


def first_fit_decreasing_by_the_book(lengths: list[int], capacity: int) -> list[list[int]]:
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    bins: list[list[int]] = []
    room: list[int] = []
    for item in order:
        for b in range(len(bins)):
            if lengths[item] <= room[b]:
                bins[b].append(item)
                room[b] -= lengths[item]
                break
        else:
            bins.append([item])
            room.append(capacity - lengths[item])
    return bins


@pytest.fixture(scope="module")
def packing_module(tmp_path_factory):
    return load_recipe_module(template_with(["sequence-packing"], tmp_path_factory.mktemp("ffd")))


@settings(max_examples=200, deadline=None)
@given(capacity=st.integers(1, 64), data=st.data())
def test_first_fit_decreasing_packs_like_the_textbook_algorithm(packing_module, capacity, data):
    lengths = data.draw(st.lists(st.integers(1, capacity), max_size=60))
    bins = packing_module.first_fit_decreasing(lengths, capacity)
    assert bins == first_fit_decreasing_by_the_book(lengths, capacity)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= capacity for b in bins)


def test_packed_batches_of_variable_length_documents_compile_once(tmp_path: Path):
    """Compiled blocks on packed batches: every batch has one shape and one attention path (the
    block-diagonal mask), so the graphs compiled at the first step serve every later one. A
    batch whose every row is a single document of seq_len positions (documents longer than a
    row) takes the causal path without a mask: one more graph, compiled once."""
    from torch._dynamo.utils import counters

    module = load_recipe_module(template_with(["sequence-packing", "torch-compile"], tmp_path / "both"))
    config = module.CausalLMConfig(model={"hidden_size": 64, "intermediate_size": 128, "num_layers": 2})
    seq_len, pad = 64, module.ByteTokenizer.pad_token_id
    generator = torch.Generator().manual_seed(0)
    short = [torch.randint(0, 256, (int(n),), generator=generator) for n in torch.randint(5, 60, (200,), generator=generator)]
    stream = module.BatchStream(module.pack_pieces(short, seq_len), seq_len, pad, seed=0, micro_batch=4, dp_rank=0, dp_size=1)
    full_rows = module.collate_packed([torch.randint(0, 256, (seq_len + 1,), generator=generator) for _ in range(4)], seq_len, pad)
    torch.manual_seed(0)
    model = module.build_model(config.model, module.ByteTokenizer.vocab_size, seq_len)
    torch._dynamo.reset()
    counters.clear()
    _, blocks = module.find_blocks(model, "torch-compile")
    for block in blocks:
        block.compile(backend="eager")  # dynamo's guards decide recompilation, whatever the backend

    def train_step(batch) -> int:
        logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
        per_token_losses(logits, batch["labels"]).sum().backward()
        return counters["stats"]["unique_graphs"]

    after_first = train_step(next(stream))
    graphs = [train_step(next(stream)) for _ in range(12)]
    with_full_rows = [train_step(full_rows) for _ in range(2)] + [train_step(next(stream)) for _ in range(2)]

    assert after_first == 1
    assert graphs == [1] * 12
    assert with_full_rows == [2] * 4
