"""The sft template: the loss covers exactly the assistant's tokens as the chat template marks
them, packing keeps each conversation's loss, and runs resume bit for bit and match on two
processes."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
import torch

from engine import run_dir as rd
from engine import run_checkpoints
from engine import run_metrics
from engine.config import ConfigError
from engine.engine import IGNORE_INDEX
from engine.launch import load_recipe_class
from recipes_template.sft import recipe as sft
from skills import apply_skill
from tests.support import REPO, losses, run_engine

TEMPLATE = REPO / "recipes_template" / "sft"
SMALL = (
    "model.hidden_size=64", "model.intermediate_size=160", "model.num_layers=2",
    "data.seq_len=128", "data.batch_size=4", "data.builtin_conversations=200", "data.max_turns=2",
    "train.log_every=1", "optim.warmup_steps=2", "optim.lr=3e-3", "metrics.tensorboard=false",
)
SCHEDULE = (*SMALL, "train.max_steps=8", "checkpoint.every=4", "checkpoint.keep_last=5")


def load_module(path: Path):
    """The module of a recipe folder, imported as the engine imports it."""
    return sys.modules[load_recipe_class(path).__module__]


def assistant_spans(text: str, messages: list[dict[str, str]], eos: str) -> list[tuple[int, int]]:
    """Character spans of each assistant reply and its end-of-turn token, found in the rendered text."""
    spans, start = [], 0
    for message in messages:
        if message["role"] == "assistant":
            begin = text.index("<|assistant|>\n" + message["content"] + eos, start) + len("<|assistant|>\n")
            start = begin + len(message["content"] + eos)
            spans.append((begin, start))
    return spans


def test_the_loss_covers_exactly_the_assistant_spans_of_the_chat_template():
    tokenizer = sft.byte_chat_tokenizer()
    conversations = [m for _, m in sft.builtin_conversations(50, max_turns=3)]
    assert any(m[0]["role"] == "system" for m in conversations)
    assert any(sum(x["role"] == "assistant" for x in m) == 3 for m in conversations)
    pieces = sft.tokenize_conversations(conversations, tokenizer, seq_len=256)
    batch = sft.collate(pieces, 256, tokenizer.pad_token_id)
    assert batch["input_ids"].shape[1] == max(p.shape[1] for p in pieces) - 1  # padded to the longest
    for row, messages in enumerate(conversations):
        text = tokenizer.apply_chat_template(messages, tokenize=False)
        encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        # Token i is supervised exactly when it lies in an assistant span of the rendered text.
        expected = [
            any(begin <= start and end <= stop for begin, stop in assistant_spans(text, messages, tokenizer.eos_token))
            for start, end in encoding["offset_mapping"]
        ]
        _, mask = sft.encode_conversation(tokenizer, messages)
        assert mask.tolist() == expected
        # The label of position i is token i + 1 where that token is the assistant's.
        ids = encoding["input_ids"]
        labels = batch["labels"][row, : len(ids) - 1].tolist()
        assert labels == [t if m else IGNORE_INDEX for t, m in zip(ids[1:], expected[1:])]
        assert (batch["labels"][row, len(ids) - 1 :] == IGNORE_INDEX).all()
        learnt = tokenizer.decode([t for t in labels if t != IGNORE_INDEX])
        assert learnt == "".join(m["content"] + "</s>" for m in messages if m["role"] == "assistant")


def test_a_chat_template_without_markers_masks_the_turns_it_renders():
    # The built-in format without its markers: turn by turn, the same tokens as the markers mark.
    unmarked = sft.CHAT_TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    marked, plain = sft.load_tokenizer(None, None), sft.load_tokenizer(None, unmarked)
    assert (sft.mask_method(marked, {"messages": []}), sft.mask_method(plain, {"messages": []})) == (
        "generation_markers", "turn_render"
    )
    for _, messages in sft.builtin_conversations(30, max_turns=3):
        by_markers, by_turns = sft.encode_conversation(marked, messages), sft.encode_conversation(plain, messages)
        assert torch.equal(by_markers[0], by_turns[0]) and torch.equal(by_markers[1], by_turns[1])


def test_a_template_that_rewrites_earlier_turns_and_cannot_be_read_whole_is_refused_naming_what_was_tried():
    # Marks the last message, wherever it is: rendering one more message changes the text before it;
    # and it writes no generation prompt, so the turns cannot be found in the whole rendering either.
    rewriting = "{% for m in messages %}{% if loop.last %}[last]{% endif %}{{ m['content'] }}\n{% endfor %}"
    tokenizer = sft.load_tokenizer(None, rewriting)
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    with pytest.raises(ConfigError, match=r"^data.jsonl:3: the chat template of the tokenizer cannot mark the "
                       r"assistant's tokens: turn by turn, message 2 \(assistant\) changes the text of the messages "
                       r"before it .*; in the whole rendering, the template writes no generation prompt to find the "
                       r"turns by\. Set data.chat_template to the family's training form"):
        sft.encode_conversation(tokenizer, messages, "data.jsonl:3")


def test_packing_keeps_each_conversations_loss_and_mask(tmp_path: Path):
    recipe = tmp_path / "packed"
    shutil.copytree(TEMPLATE, recipe, ignore=shutil.ignore_patterns("__pycache__"))
    apply_skill("sequence-packing", recipe)
    packed = load_module(recipe)
    tokenizer = sft.byte_chat_tokenizer()
    conversations = [m for _, m in sft.builtin_conversations(12, max_turns=3)]
    pieces = sft.tokenize_conversations(conversations, tokenizer, seq_len=256)
    rows = packed.pack_pieces(pieces, 256)
    assert len(rows) < len(pieces)  # several conversations share a row
    torch.manual_seed(0)
    model = sft.build_model(sft.ModelConfig(hidden_size=32, intermediate_size=64, num_layers=1), len(tokenizer), 256)

    def loss_sum(batch):
        logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), reduction="sum")

    packed_batch = packed.collate_packed(rows, 256, tokenizer.pad_token_id)
    padded_batch = sft.collate(pieces, 256, tokenizer.pad_token_id)
    assert (packed_batch["labels"] != IGNORE_INDEX).sum() == (padded_batch["labels"] != IGNORE_INDEX).sum()
    torch.testing.assert_close(loss_sum(packed_batch), loss_sum(padded_batch), rtol=1e-5, atol=1e-4)


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("sft")
    recipe = root / "sft"
    shutil.copytree(TEMPLATE, recipe, ignore=shutil.ignore_patterns("__pycache__"))
    return root, recipe


@pytest.fixture(scope="module")
def reference(workspace):
    root, recipe = workspace
    return run_engine(root, recipe, *SCHEDULE)


def test_a_run_learns_and_records_its_data(reference):
    record = rd.read_run(reference)
    assert record.status == rd.COMPLETED and record.data.source == "builtin"
    assert record.data.documents == 200 and 0 < record.data.eval_documents < 30
    curve = losses(reference)
    assert sorted(curve) == list(range(1, 9)) and curve[8] < curve[1]


def test_resume_is_bit_identical(workspace, reference):
    root, recipe = workspace
    (_, checkpoint), *_ = run_checkpoints.list_checkpoints(reference)
    resumed = run_engine(root, recipe, *SCHEDULE, resume_from=checkpoint)
    expected = {s: v for s, v in losses(reference).items() if s > 4}
    assert losses(resumed) == expected


@pytest.mark.multiprocess
def test_two_processes_match_one(workspace, reference):
    root, recipe = workspace
    two = run_engine(root, recipe, *SCHEDULE, "checkpoint.every=0", "checkpoint.at_end=false", nproc=2)
    one, both = losses(reference), losses(two)
    assert sorted(both) == sorted(one)
    for step in one:
        assert abs(both[step] - one[step]) <= 1e-5 * abs(one[step]), (step, one[step], both[step])


def test_packing_and_lora_apply_and_run(workspace, reference):
    root, _ = workspace
    recipe = root / "sft_packed_lora"
    shutil.copytree(TEMPLATE, recipe, ignore=shutil.ignore_patterns("__pycache__"))
    for skill in ("sequence-packing", "lora"):
        assert apply_skill(skill, recipe).changed
    run = run_engine(root, recipe, *SMALL, "train.max_steps=3", "checkpoint.every=0", "checkpoint.at_end=false")
    records = [r for r in run_metrics.read_all_metrics(run / rd.METRICS_JSONL) if "loss" in r]
    unpacked = [r for r in run_metrics.read_all_metrics(reference / rd.METRICS_JSONL) if "loss" in r][:3]
    # padding_frac counts padding only (not the masked prompts): packing takes it out.
    assert len(records) == 3

    def padding(rows):
        return sum(r["padding_frac"] for r in rows) / len(rows)

    assert padding(records) < 0.75 * padding(unpacked) and padding(unpacked) > 0.05, (records, unpacked)


def test_the_launch_check_counts_the_conversations_and_the_supervised_tokens(capsys, monkeypatch):
    import json
    import sys

    from engine.launch import main

    monkeypatch.chdir(REPO)
    monkeypatch.setattr(sys, "path", list(sys.path))  # the recipe folder the check puts first, dropped after
    # In this process: a fresh interpreter is ~10 s on 2 cores.
    main([str(TEMPLATE), "--check", "--set", "data.builtin_conversations=100", "--set", "data.paths=[missing.jsonl]"])
    assert json.loads(capsys.readouterr().out) == {"ok": False, "error": "data path 'missing.jsonl' does not exist (relative paths start at the workspace)"}
    data = sft.SFT.summarize_data(sft.SFTConfig.model_validate({"data": {"builtin_conversations": 100}}))
    assert (data.source, data.documents, data.tokenizer) == ("builtin", 100, "bytes (chat)")
    assert data.train_documents + data.eval_documents == 100
    conversations = [m for _, m in sft.builtin_conversations(100, 3)]
    answers = sum(len(m["content"]) + 1 for c in conversations for m in c if m["role"] == "assistant")
    assert data.loss_tokens == answers  # a byte a token, plus each reply's end-of-turn
    assert data.train_loss_tokens + data.eval_loss_tokens == answers
    assert data.tokens > answers  # every token of the conversations: the users' turns too
