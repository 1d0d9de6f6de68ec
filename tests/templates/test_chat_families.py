"""The chat models people fine-tune now: tiny random models whose tokenizers carry real families'
templates (Qwen3's with <think> and tools, which rewrites earlier turns; Qwen2.5's and Llama
3.1's with tools; ChatML as the control), and conversations with reasoning, tool calls and tool
results. The loss covers each assistant turn as the whole conversation's rendering writes it —
counted here by hand in that rendering — and never a tool result."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from engine import data_files as df
from engine.chat import assistant_spans, encode_conversation, render
from engine.chat_messages import conversation
from engine.config import ConfigError
from engine.engine import IGNORE_INDEX
from recipes_template.dpo import recipe as dpo
from recipes_template.sft import recipe as sft
from tests.model_families import FAMILIES, bpe_tokenizer, tiny_model_folder

TOOLS = [{"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}},
}}]
CALL = {"type": "function", "function": {"name": "add", "arguments": '{"a": 12, "b": 1}'}}

# Two questions; the first answer's reasoning lies before the last user message (Qwen3 drops it).
MULTI_TURN = [
    {"role": "user", "content": "What is 3 + 4?"},
    {"role": "assistant", "content": "<think>\nadd them\n</think>\n\nIt is 7."},
    {"role": "user", "content": "Is 12 even or odd?"},
    {"role": "assistant", "content": "even", "reasoning_content": "12 is 2 times 6"},
]
# One question answered through a tool: call, result, answer.
AGENTIC = [
    {"role": "system", "content": "You add numbers."},
    {"role": "user", "content": "What is 12 + 1?"},
    {"role": "assistant", "content": None, "reasoning_content": "call add", "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call-1", "content": "13"},
    {"role": "assistant", "content": "It is 13.", "reasoning_content": "the tool answered"},
]
# Both: a tool turn, then a new question (the first turns' reasoning is dropped).
AGENTIC_THEN_MORE = AGENTIC + [
    {"role": "user", "content": "Which letter comes after b?"},
    {"role": "assistant", "content": "The letter c.", "reasoning_content": "b, c"},
]


@pytest.fixture(scope="module")
def tokenizers():
    return {family: bpe_tokenizer(FAMILIES[family][3], FAMILIES[family][4], FAMILIES[family][2])
            for family in ("qwen3", "qwen2.5", "llama3.1", "qwen2")}


def by_hand(text: str, header: str, end_of_turn: str) -> list[tuple[int, int]]:
    """Each assistant turn in the rendering: after its header, through its end of turn and the
    blank the template writes after it."""
    spans, at = [], text.find(header)
    while at >= 0:
        start = at + len(header)
        stop = text.index(end_of_turn, start) + len(end_of_turn)
        stop += len(text[stop:]) - len(text[stop:].lstrip())
        spans.append((start, stop))
        at = text.find(header, stop)
    return spans


def learnt(tokenizer, ids, mask) -> str:
    return tokenizer.decode([t for t, m in zip(ids, mask) if m])


def counted_by_hand(tokenizer, text: str, spans) -> tuple[list[int], int]:
    encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    inside = [any(b <= s and e <= t for b, t in spans) for s, e in encoding["offset_mapping"]]
    return encoding["input_ids"], sum(inside)


HEADERS = {"qwen3": ("<|im_start|>assistant\n", "<|im_end|>"), "qwen2.5": ("<|im_start|>assistant\n", "<|im_end|>"),
           "llama3.1": ("<|start_header_id|>assistant<|end_header_id|>\n\n", "<|eot_id|>")}


@pytest.mark.parametrize("family", ["qwen3", "qwen2.5", "llama3.1"])
@pytest.mark.parametrize("name, raw", [("multi_turn", MULTI_TURN), ("agentic", AGENTIC), ("both", AGENTIC_THEN_MORE)])
def test_the_mask_is_each_assistant_turn_of_the_whole_rendering_counted_by_hand(tokenizers, family, name, raw):
    tokenizer = tokenizers[family]
    messages = conversation(raw, "chat.jsonl:1")
    ids, mask = encode_conversation(tokenizer, messages, "chat.jsonl:1", TOOLS)
    text = render(tokenizer, messages, tools=TOOLS)  # the rendering the model sees
    expected_ids, expected_count = counted_by_hand(tokenizer, text, by_hand(text, *HEADERS[family]))
    assert ids == expected_ids
    assert sum(mask) == expected_count
    assert "13" not in learnt(tokenizer, ids, mask).replace("It is 13.", "")  # the tool's result is never learnt
    if name != "multi_turn":
        assert '"name": "add"' in learnt(tokenizer, ids, mask)  # the call is


def test_qwen3_drops_past_reasoning_and_the_mask_follows_the_final_rendering(tokenizers):
    tokenizer = tokenizers["qwen3"]
    messages = conversation(AGENTIC_THEN_MORE, "chat.jsonl:1")
    assert sft.mask_method(tokenizer, {"messages": messages, "tools": TOOLS}) == "final_render"
    ids, mask = encode_conversation(tokenizer, messages, "chat.jsonl:1", TOOLS)
    assert learnt(tokenizer, ids, mask) == (
        '<tool_call>\n{"name": "add", "arguments": {"a": 12, "b": 1}}\n</tool_call><|im_end|>\n'
        "It is 13.<|im_end|>\n"
        "<think>\nb, c\n</think>\n\nThe letter c.<|im_end|>\n"
    )
    # Reasoning left out of the loss: only the <think> block goes.
    ids, mask = encode_conversation(tokenizer, messages, "chat.jsonl:1", TOOLS, reasoning=False)
    assert learnt(tokenizer, ids, mask).endswith("It is 13.<|im_end|>\nThe letter c.<|im_end|>\n")
    # One question answered through a tool renders each turn the same whatever follows: turn by turn.
    assert sft.mask_method(tokenizer, {"messages": conversation(AGENTIC, "x"), "tools": TOOLS}) == "turn_render"


def test_a_final_qwen3_turn_without_reasoning_learns_the_empty_think_block_the_template_writes(tokenizers):
    tokenizer = tokenizers["qwen3"]
    messages = conversation([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}], "x")
    ids, mask = encode_conversation(tokenizer, messages)
    assert learnt(tokenizer, ids, mask) == "<think>\n\n</think>\n\nHello.<|im_end|>\n"


@pytest.mark.parametrize("family", ["qwen3", "qwen2"])
def test_turn_by_turn_and_the_whole_rendering_find_the_same_spans_where_both_apply(tokenizers, family):
    from engine import chat

    tokenizer = tokenizers[family]
    for raw in (AGENTIC[:3] + [{"role": "tool", "content": "13"}, AGENTIC[4]], MULTI_TURN[:2]):
        messages = conversation(raw, "x")
        tools = TOOLS if family == "qwen3" else None
        turn_text, turn, why = chat._turn_spans(tokenizer, messages, tools)
        whole_text, whole, also = chat._final_spans(tokenizer, messages, tools, "x")
        assert (why, also) == (None, None)
        assert (turn_text, turn) == (whole_text, whole)


def test_reasoning_goes_to_the_template_as_the_family_reads_it(tokenizers):
    messages = conversation(MULTI_TURN[2:], "x")
    qwen3 = tokenizers["qwen3"].apply_chat_template(messages, tokenize=False)
    assert "<think>\n12 is 2 times 6\n</think>\n\neven" in qwen3  # Qwen3 reads reasoning_content
    from engine.chat import render

    # A template that knows no reasoning gets it in the content, as <think>…</think>.
    assert "<|im_start|>assistant\n<think>\n12 is 2 times 6\n</think>\n\neven<|im_end|>" in render(tokenizers["qwen2"], messages)
    thinking = "{% for m in messages %}{{ m.role }}:{% if m.thinking %}[{{ m.thinking }}]{% endif %}{{ m.content }}\n{% endfor %}"
    tokenizer = sft.load_tokenizer(None, thinking)
    assert render(tokenizer, messages) == "user:Is 12 even or odd?\nassistant:[12 is 2 times 6]even\n"
    # <think> in the content and a thinking field read the same.
    assert conversation([{"role": "assistant", "content": "<think>\nr\n</think>\n\nA"}], "x") == conversation(
        [{"role": "assistant", "content": "A", "thinking": "r"}], "x") == [
        {"role": "assistant", "content": "A", "reasoning_content": "r"}]


# ---------------------------------------------------------------------------------------------
# Data files: messages JSONL and ShareGPT with tool calls, the data summary, bad input
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def qwen3_folder(tmp_path_factory) -> Path:
    return tiny_model_folder(tmp_path_factory.mktemp("models") / "tiny-qwen3", "qwen3")


@pytest.fixture
def workspace(tmp_path, monkeypatch, qwen3_folder):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(df.WORKSPACE_VARIABLE, str(tmp_path))
    shutil.copytree(qwen3_folder, tmp_path / "models" / "tiny-qwen3")
    return tmp_path


def write_jsonl(path: Path, records) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def sharegpt_form(messages) -> dict:
    """AGENTIC as LLaMA-Factory writes it: function_call and observation turns, tools as a JSON string."""
    turns = []
    for m in messages:
        if m.get("tool_calls"):
            call = m["tool_calls"][0]["function"]
            turns.append({"from": "function_call", "value": json.dumps({"name": call["name"], "arguments": json.loads(call["arguments"])})})
        elif m["role"] == "tool":
            turns.append({"from": "observation", "value": m["content"]})
        else:
            turns.append({"from": {"user": "human", "assistant": "gpt", "system": "system"}[m["role"]], "value": m["content"]})
    return {"conversations": turns, "tools": json.dumps(TOOLS)}


def test_sharegpt_function_call_and_observation_learn_as_the_messages_form(workspace):
    plain = [{k: v for k, v in m.items() if k != "reasoning_content"} for m in AGENTIC]
    write_jsonl(workspace / "chat.jsonl", [{"messages": plain, "tools": TOOLS}])
    write_jsonl(workspace / "sharegpt.jsonl", [sharegpt_form(plain)])
    tokenizer = sft.load_tokenizer("models/tiny-qwen3", None)
    pieces = {}
    for name in ("chat.jsonl", "sharegpt.jsonl"):
        examples, formats = sft.load_conversations(sft.SFTDataConfig(paths=[name], seq_len=2048))
        pieces[name] = sft.tokenize_conversations([e for _, e in examples], tokenizer, 2048)[0]
    assert torch.equal(pieces["chat.jsonl"], pieces["sharegpt.jsonl"])
    text = tokenizer.decode(pieces["chat.jsonl"][0])
    assert '"name": "add"' in text.split("</tools>\n\nFor each")[0]  # the tools are rendered into the system prompt
    taught = tokenizer.decode([t for t in pieces["chat.jsonl"][1].tolist() if t != IGNORE_INDEX])
    assert '<tool_call>\n{"name": "add", "arguments": {"a": 12, "b": 1}}\n</tool_call>' in taught
    assert "<tool_response>" not in taught


def test_the_summary_says_final_render_and_counts_the_loss_tokens_of_the_final_rendering(workspace):
    write_jsonl(workspace / "chat.jsonl", [{"messages": m, "tools": TOOLS} for m in (MULTI_TURN, AGENTIC, AGENTIC_THEN_MORE)])
    config = sft.SFTConfig.model_validate(
        {"model": {"pretrained_path": "models/tiny-qwen3"}, "data": {"paths": ["chat.jsonl"], "seq_len": 2048}}
    )
    summary = sft.SFT.summarize_data(config)
    tokenizer = sft.load_tokenizer("models/tiny-qwen3", None)
    expected = 0
    for raw in (MULTI_TURN, AGENTIC, AGENTIC_THEN_MORE):
        text = render(tokenizer, conversation(raw, "x"), tools=TOOLS)
        expected += counted_by_hand(tokenizer, text, by_hand(text, *HEADERS["qwen3"]))[1]
    assert (summary.format, summary.mask, summary.documents, summary.loss_tokens) == (
        "messages", "final_render, turn_render", 3, expected)
    config.data.reasoning_loss = False
    assert sft.SFT.summarize_data(config).loss_tokens < expected


@pytest.mark.parametrize("record, error", [
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": {"name": "add"}}]},
     r"^bad.jsonl:2: messages\[2\]: 'tool_calls' must be a list of \{\"type\": \"function\""),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [
        {"type": "function", "function": {"name": "add", "arguments": "{a: 1"}}]}]},
     r"^bad.jsonl:2: messages\[2\]: tool call 1 \(add\): 'arguments' is not JSON"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "tool", "content": "13"}]},
     r"^bad.jsonl:2: messages\[2\] is a tool result with no call before it"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x"}], "tools": {"name": "add"}},
     r"^bad.jsonl:2: 'tools' must be a list of function schemas, got dict"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x"}], "tools": [{"parameters": {}}]},
     r"^bad.jsonl:2: tools\[1\] is not a function schema"),
    ({"conversations": [{"from": "human", "value": "hi"}, {"from": "function_call", "value": "add(1)"}]},
     r"^bad.jsonl:2: conversations\[2\]: a function_call turn must hold a JSON call"),
])
def test_bad_tool_data_is_refused_naming_file_and_record_and_nothing_is_written(workspace, record, error):
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    if "conversations" in record:
        good = {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]}
    write_jsonl(workspace / "bad.jsonl", [good, record])
    before = sorted(p.name for p in workspace.iterdir())
    config = sft.SFTConfig.model_validate({"model": {"pretrained_path": "models/tiny-qwen3"}, "data": {"paths": ["bad.jsonl"]}})
    with pytest.raises(ConfigError, match=error):
        sft.SFT.summarize_data(config)
    assert sorted(p.name for p in workspace.iterdir()) == before


def test_llama_3_1_renders_a_call_whose_tool_calls_were_null_elsewhere(tokenizers):
    # Llama 3.1's template fails on "tool_calls": null: such fields are left out when read.
    messages = conversation([{"role": "user", "content": "hi", "tool_calls": None},
                             {"role": "assistant", "content": "hello", "tool_calls": None}], "x")
    text, spans = assistant_spans(tokenizers["llama3.1"], messages)
    assert text[spans[0][0]:spans[0][1]] == "hello<|eot_id|>"


def test_a_preference_pair_that_ends_in_a_tool_call_learns_the_call(tokenizers):
    tokenizer = tokenizers["qwen3"]
    from engine.data_formats import normalise

    record = normalise("prompt_chosen_rejected", {
        "prompt": AGENTIC[:2], "tools": TOOLS, "chosen": [AGENTIC[2]],
        "rejected": [{"role": "assistant", "content": "It is 14.", "reasoning_content": "guess"}],
    }, "pairs.jsonl:1")
    pair = dpo.tokenize_pair(tokenizer, record, 1024)
    assert "# Tools" in tokenizer.decode(pair.prompt) and tokenizer.decode(pair.prompt).endswith("<|im_start|>assistant\n")
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 12, "b": 1}}\n</tool_call><|im_end|>\n'
    assert tokenizer.decode(pair.chosen) == "<think>\ncall add\n</think>\n\n" + call
    assert tokenizer.decode(pair.rejected) == "<think>\nguess\n</think>\n\nIt is 14.<|im_end|>\n"
    assert pair.learnt is None and pair.learnt_tokens() == len(pair.chosen) + len(pair.rejected)
    # data.reasoning_loss=false: the same tokens are read, the reasoning is not in the log-probabilities.
    unreasoned = dpo.tokenize_pair(tokenizer, record, 1024, reasoning=False)
    assert unreasoned[:3] == pair[:3]
    labels = dpo.collate([unreasoned], 1024, tokenizer.pad_token_id)["labels"]
    learnt = [tokenizer.decode([t for t in row.tolist() if t != IGNORE_INDEX]) for row in labels]
    assert learnt == [call, "It is 14.<|im_end|>\n"]
    assert unreasoned.learnt_tokens() == sum(len(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in learnt)


# ---------------------------------------------------------------------------------------------
# TRL's SFTTrainer(assistant_only_loss=True), with its training chat templates, as the reference
# ---------------------------------------------------------------------------------------------

SINGLE_QUERY = [
    AGENTIC,
    [{"role": "user", "content": "What is 3 + 4?"}, {"role": "assistant", "content": "It is 7."}],
    [{"role": "user", "content": "Is 12 even?"}, {"role": "assistant", "content": "Yes.", "reasoning_content": "12 = 2 * 6"}],
]


def trl_tokenized(folder: Path, records: list[dict], tmp_path: Path) -> list[tuple[list[int], list[bool]]]:
    """``(ids, assistant mask)`` per record as TRL's SFTTrainer prepares them."""
    trl = pytest.importorskip("trl", reason="trl (the test extra) is the reference assistant-only loss")
    import datasets
    from transformers import AutoModelForCausalLM

    tokenizer = sft.load_tokenizer(str(folder), None)
    args = trl.SFTConfig(output_dir=str(tmp_path), report_to=[], use_cpu=True, assistant_only_loss=True,
                         dataset_num_proc=None, max_length=None)
    trainer = trl.SFTTrainer(model=AutoModelForCausalLM.from_pretrained(folder), args=args, processing_class=tokenizer,
                             train_dataset=datasets.Dataset.from_list(records))
    assert trainer.chat_template != tokenizer.chat_template  # TRL trains through its training form of the template
    return [(row["input_ids"], [label != IGNORE_INDEX for label in row["labels"]]) for row in trainer.train_dataset]


def test_the_qwen3_mask_equals_trls_where_its_training_template_renders_as_the_final_one(qwen3_folder, tmp_path):
    # TRL's Qwen3 training template keeps every turn's <think> block; the model's own template keeps
    # those after the last user message: on one-question conversations (tool calls included) both
    # render the same, and the masks agree token for token.
    records = [{"messages": conversation(m, "x"), "tools": TOOLS} for m in SINGLE_QUERY]
    theirs = trl_tokenized(qwen3_folder, records, tmp_path)
    tokenizer = sft.load_tokenizer(str(qwen3_folder), None)
    for record, (their_ids, their_mask) in zip(records, theirs):
        ids, mask = encode_conversation(tokenizer, record["messages"], "x", TOOLS)
        assert (ids, mask) == (their_ids, their_mask)


# gpt-oss writes one assistant message as several harmony messages (an analysis, then a call or the
# final answer, each opened by "<|start|>assistant"), and drops the analysis of earlier answers.
GPT_OSS_CONVERSATIONS = [MULTI_TURN, AGENTIC, AGENTIC_THEN_MORE]


def test_gpt_oss_harmony_turns_are_found_in_the_final_rendering_analysis_dropped_before_the_last(tmp_path):
    tokenizer = sft.load_tokenizer(str(tiny_model_folder(tmp_path / "tiny-gpt-oss", "gpt-oss")), None)
    messages = conversation(AGENTIC_THEN_MORE, "chat.jsonl:1")
    assert sft.mask_method(tokenizer, {"messages": messages, "tools": TOOLS}) == "final_render"
    ids, mask = encode_conversation(tokenizer, messages, "chat.jsonl:1", TOOLS)
    assert learnt(tokenizer, ids, mask) == (
        ' to=functions.add<|channel|>commentary json<|message|>{"a": 12, "b": 1}<|call|>'
        "<|channel|>final<|message|>It is 13.<|end|>"
        "<|channel|>analysis<|message|>b, c<|end|><|start|>assistant<|channel|>final<|message|>The letter c.<|return|>"
    )
    # Reasoning left out of the loss: the analysis message goes, the answer's own header stays.
    ids, mask = encode_conversation(tokenizer, messages, "chat.jsonl:1", TOOLS, reasoning=False)
    assert learnt(tokenizer, ids, mask).endswith(
        "<|end|><|start|>assistant<|channel|>final<|message|>The letter c.<|return|>")
    assert "b, c" not in learnt(tokenizer, ids, mask)


def test_the_gpt_oss_mask_is_trls_less_the_generation_prompt_of_each_answer(tmp_path):
    # TRL's gpt-oss training template opens {% generation %} before "<|start|>assistant", which
    # the generation prompt writes and the model never does: its mask has those tokens more at the
    # start of each assistant message (not inside one: a final after an analysis is the model's).
    folder = tiny_model_folder(tmp_path / "tiny-gpt-oss", "gpt-oss")
    records = [{"messages": conversation(m, "x"), "tools": TOOLS} for m in GPT_OSS_CONVERSATIONS]
    theirs = trl_tokenized(folder, records, tmp_path)
    tokenizer = sft.load_tokenizer(str(folder), None)
    header = tokenizer("<|start|>assistant", add_special_tokens=False)["input_ids"]
    for record, (their_ids, their_mask) in zip(records, theirs):
        ids, mask = encode_conversation(tokenizer, record["messages"], "x", TOOLS)
        assert ids == their_ids
        opens = [i for i in range(len(ids)) if ids[i:i + len(header)] == header and (i == 0 or not mask[i - 1])]
        header_of_an_answer = [any(o <= i < o + len(header) for o in opens) for i in range(len(ids))]
        assert [m or h and t for m, h, t in zip(mask, header_of_an_answer, their_mask)] == their_mask
        assert sum(their_mask) - sum(mask) == len(header) * sum(m["role"] == "assistant" for m in record["messages"])


def test_the_qwen2_5_mask_is_trls_less_the_newline_of_the_generation_prompt(tmp_path):
    # TRL's Qwen2.5 training template opens {% generation %} before the newline that ends
    # "<|im_start|>assistant\n", which the generation prompt writes and the model never does: its
    # mask has that one token more per assistant turn, and is otherwise the same.
    folder = tiny_model_folder(tmp_path / "tiny-qwen2.5", "qwen2.5")
    plain = [[{k: v for k, v in m.items() if k != "reasoning_content"} for m in raw] for raw in SINGLE_QUERY]
    two_questions = [MULTI_TURN[0], {"role": "assistant", "content": "It is 7."}, MULTI_TURN[2],
                     {"role": "assistant", "content": "even"}]
    records = [{"messages": conversation(m, "x"), "tools": TOOLS} for m in plain + [two_questions]]
    theirs = trl_tokenized(folder, records, tmp_path)
    tokenizer = sft.load_tokenizer(str(folder), None)
    header = tokenizer("<|im_start|>assistant", add_special_tokens=False)["input_ids"]
    for record, (their_ids, their_mask) in zip(records, theirs):
        ids, mask = encode_conversation(tokenizer, record["messages"], "x", TOOLS)
        assert ids == their_ids
        after_header = [i >= len(header) and ids[i - len(header):i] == header for i in range(len(ids))]
        assert [m or a for m, a in zip(mask, after_header)] == their_mask
        assert sum(their_mask) - sum(mask) == sum(m["role"] == "assistant" for m in record["messages"])


# ---------------------------------------------------------------------------------------------
# A run: a tiny Qwen3 trains on agentic data, exports, and its exported template renders the same
# ---------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_qwen3_model_trains_on_tool_calls_and_reasoning_and_exports_its_template(qwen3_folder, tmp_path, monkeypatch):
    import contextlib
    import io
    import sys

    from transformers import AutoTokenizer

    from engine import run_dir as rd
    from engine.model_io import main
    from tests.support import REPO, losses, run_engine

    recipe = tmp_path / "sft"
    shutil.copytree(REPO / "recipes_template" / "sft", recipe, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(qwen3_folder, tmp_path / "model")
    write_jsonl(tmp_path / "agent.jsonl", [{"messages": m, "tools": TOOLS} for m in (AGENTIC, AGENTIC_THEN_MORE, MULTI_TURN)] * 4)
    run = run_engine(tmp_path, recipe, "model.pretrained_path=model", "data.paths=[agent.jsonl]", "data.seq_len=1024",
                     "data.batch_size=2", "train.max_steps=2", "train.log_every=1", "checkpoint.every=2",
                     "metrics.tensorboard=false", "data.eval_fraction=0")
    record = rd.read_run(run)
    assert record.status == rd.COMPLETED and record.data.mask == "final_render, turn_render"
    tokenizer = sft.load_tokenizer(str(qwen3_folder), None)
    expected = 0
    for raw in (AGENTIC, AGENTIC_THEN_MORE, MULTI_TURN):
        text = render(tokenizer, conversation(raw, "x"), tools=TOOLS)
        expected += 4 * counted_by_hand(tokenizer, text, by_hand(text, *HEADERS["qwen3"]))[1]
    assert record.data.loss_tokens == expected
    assert sorted(losses(run)) == [1, 2]
    out = tmp_path / "export"
    shutil.copytree(recipe, run / "recipe")  # the snapshot a supervised run keeps
    monkeypatch.chdir(tmp_path)  # model.pretrained_path=model, as the run read it
    monkeypatch.setattr(sys, "path", list(sys.path))  # the snapshot folder each call puts first, dropped after

    def model_io(*argv: str) -> dict:
        """``python -m engine.model_io ARGV``'s one JSON line, run in this process (a fresh
        interpreter is ~10 s on 2 cores)."""
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            main(list(argv))
        return json.loads(printed.getvalue().strip().splitlines()[-1])

    exported = model_io("export", str(run), "--step", "2", "--to", str(out))
    assert exported["ok"], exported
    # sample renders the prompt with the template's thinking switch and returns the text as written beside it.
    sampled = model_io("sample", str(run), "--step", "2", "--prompt=Hi", "--max-new-tokens", "8", "--reasoning", "off")
    assert sampled["ok"] and sampled["chat"], sampled
    assert isinstance(sampled["samples"][0]["raw"], str) and sampled["samples"][0]["new_tokens"] >= 1
    exported = AutoTokenizer.from_pretrained(out)
    for raw in (AGENTIC, AGENTIC_THEN_MORE):
        messages = conversation(raw, "x")
        assert exported.apply_chat_template(messages, tools=TOOLS, tokenize=False) == render(tokenizer, messages, tools=TOOLS)


def test_a_completion_is_parsed_into_reasoning_calls_and_answer():
    from engine.chat import parse_completion

    raw = ('<think>\nthe tool adds\n</think>\n\nLet me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 12, "b": 1}}'
           '\n</tool_call><|im_end|>\nleft over')
    assert parse_completion(raw, "<|im_end|>") == {
        "reasoning": "the tool adds", "content": "Let me add.", "tool_calls": [{"name": "add", "arguments": {"a": 12, "b": 1}}]}
    # gpt-oss's harmony messages, by their channels: analysis, a call addressed to a function, final.
    assert parse_completion("<|channel|>analysis<|message|>12 = 2 * 6<|end|><|start|>assistant<|channel|>final"
                            "<|message|>even<|return|>", "<|return|>") == {
        "reasoning": "12 = 2 * 6", "content": "even", "tool_calls": None}
    assert parse_completion(' to=functions.add<|channel|>commentary json<|message|>{"a": 12, "b": 1}<|call|>') == {
        "reasoning": None, "content": "", "tool_calls": [{"name": "add", "arguments": {"a": 12, "b": 1}}]}
    # A block that is not a JSON call stays in the answer; no <think>: no reasoning.
    assert parse_completion("<tool_call>add(1)</tool_call>") == {
        "reasoning": None, "content": "<tool_call>add(1)</tool_call>", "tool_calls": None}
