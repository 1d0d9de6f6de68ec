"""Your model, your data: a tiny Qwen2-family model (a BPE tokenizer trained here, ChatML without
{% generation %} markers) in a workspace folder learns the same conversations from every form
users keep them in — and the loss covers exactly the assistant's turns."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from engine import data_files as df
from engine.chat import encode_conversation
from engine.config import ConfigError
from engine.engine import IGNORE_INDEX
from recipes_template.dpo import recipe as dpo
from recipes_template.sft import recipe as sft
from tests.model_families import CHATML_MARKED, tiny_model_folder

SEQ_LEN = 96
QUESTIONS = [
    ("What is 3 + 4?", "It is 7."),
    ("Which letter comes after b?", "The letter c."),
    ("Tell me a short story about a cat.", "A cat met a dog, and they became friends."),
    ("Is 12 even or odd?", "even"),
    ("Summarise the text in one sentence, please.", "The quick brown fox jumps over the lazy dog."),
]
CONVERSATIONS = [[{"role": "user", "content": q}, {"role": "assistant", "content": a}] for q, a in QUESTIONS]


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory) -> Path:
    return tiny_model_folder(tmp_path_factory.mktemp("models") / "tiny-qwen", "qwen2")


def write_jsonl(path: Path, records) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def write_every_form(root: Path) -> dict[str, dict]:
    """The same conversations in each form; for each, the data config that reads it."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    write_jsonl(root / "chat.jsonl", [{"messages": m} for m in CONVERSATIONS])
    sharegpt = [{"conversations": [{"from": {"user": "human", "assistant": "gpt"}[m["role"]], "value": m["content"]}
                                   for m in c]} for c in CONVERSATIONS]
    (root / "sharegpt.json").write_text(json.dumps(sharegpt, indent=1))  # a JSON array
    write_jsonl(root / "alpaca.json", [{"instruction": q, "input": "", "output": a} for q, a in QUESTIONS])  # a line each
    pq.write_table(pa.Table.from_pylist([{"messages": m} for m in CONVERSATIONS]), root / "chat.parquet", row_group_size=2)
    with open(root / "pc.csv", "w", newline="") as f:
        import csv

        writer = csv.writer(f)
        writer.writerow(["prompt", "completion"])
        writer.writerows(QUESTIONS)
    datasets.Dataset.from_list([{"messages": m} for m in CONVERSATIONS]).save_to_disk(str(root / "saved"))
    (root / "hub-like" / "data").mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist([{"conversations": r["conversations"]} for r in sharegpt]),
                   root / "hub-like" / "data" / "train-00000-of-00001.parquet")
    return {
        "messages jsonl": {"paths": ["chat.jsonl"]},
        "sharegpt json array": {"paths": ["sharegpt.json"]},
        "alpaca json lines": {"paths": ["alpaca.json"]},
        "parquet": {"paths": ["chat.parquet"]},
        "csv prompt/completion": {"paths": ["pc.csv"]},
        "save_to_disk folder": {"paths": ["saved"]},
        "datasets data set": {"dataset": "hub-like"},
    }


def chatml_assistant_spans(text: str, answers: list[str]) -> list[tuple[int, int]]:
    """Character spans of each answer and its end of turn, found in ChatML text by hand."""
    spans, start = [], 0
    for answer in answers:
        header = "<|im_start|>assistant\n"
        begin = text.index(header + answer + "<|im_end|>\n", start) + len(header)
        start = begin + len(answer + "<|im_end|>\n")
        spans.append((begin, start))
    return spans


@pytest.fixture
def workspace(tmp_path, monkeypatch, model_folder):
    import datasets

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(df.WORKSPACE_VARIABLE, str(tmp_path))
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)  # no network, ever
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / ".hf-cache"))
    shutil.copytree(model_folder, tmp_path / "models" / "tiny-qwen")  # a workspace folder
    return tmp_path


def batch_of(cfg: sft.SFTDataConfig, tokenizer) -> tuple[dict[str, torch.Tensor], list[str]]:
    examples, formats = sft.load_conversations(cfg)
    pieces = sft.tokenize_conversations([e for _, e in examples], tokenizer, cfg.seq_len)
    return sft.collate(pieces, cfg.seq_len, tokenizer.pad_token_id), formats


def test_every_form_of_the_same_conversations_gives_the_same_ids_and_labels(workspace):
    forms = write_every_form(workspace)
    tokenizer = sft.load_tokenizer("models/tiny-qwen", None)
    assert "{% generation %}" not in tokenizer.chat_template and "<|im_start|>" in tokenizer.chat_template
    reference, _ = batch_of(sft.SFTDataConfig(paths=["chat.jsonl"], seq_len=SEQ_LEN), tokenizer)
    seen = {}
    for form, fields in forms.items():
        batch, formats = batch_of(sft.SFTDataConfig(seq_len=SEQ_LEN, **fields), tokenizer)
        seen[form] = formats
        assert torch.equal(batch["input_ids"], reference["input_ids"]), form
        assert torch.equal(batch["labels"], reference["labels"]), form
    assert seen == {
        "messages jsonl": ["messages"], "sharegpt json array": ["sharegpt"], "alpaca json lines": ["alpaca"],
        "parquet": ["messages"], "csv prompt/completion": ["prompt_completion"],
        "save_to_disk folder": ["messages"], "datasets data set": ["sharegpt"],
    }
    # The labels are the next token exactly where it lies in an assistant answer (ChatML, by hand).
    for row, messages in enumerate(CONVERSATIONS):
        text = tokenizer.apply_chat_template(messages, tokenize=False)
        encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        spans = chatml_assistant_spans(text, [m["content"] for m in messages if m["role"] == "assistant"])
        inside = [any(b <= s and e <= t for b, t in spans) for s, e in encoding["offset_mapping"]]
        ids = encoding["input_ids"]
        expected = [t if m else IGNORE_INDEX for t, m in zip(ids[1:], inside[1:])]
        assert reference["input_ids"][row, : len(ids) - 1].tolist() == ids[:-1]
        assert reference["labels"][row, : len(ids) - 1].tolist() == expected
        assert (reference["labels"][row, len(ids) - 1 :] == IGNORE_INDEX).all()
        assert tokenizer.decode([t for t in expected if t != IGNORE_INDEX]) == messages[1]["content"] + "<|im_end|>\n"


def test_multi_turn_sharegpt_with_a_system_prompt_reads_as_messages(workspace, model_folder):
    conversation = [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 3 + 4?"},
        {"role": "assistant", "content": "7"}, {"role": "user", "content": "And 2 + 2?"},
        {"role": "assistant", "content": "4"},
    ]
    roles = {"system": "system", "user": "human", "assistant": "gpt"}
    write_jsonl(workspace / "chat.jsonl", [{"dialog": conversation}])
    write_jsonl(workspace / "sg.jsonl", [{"conversations": [{"from": roles[m["role"]], "value": m["content"]}
                                                            for m in conversation]}])
    tokenizer = sft.load_tokenizer("models/tiny-qwen", None)
    renamed, _ = batch_of(sft.SFTDataConfig(paths=["chat.jsonl"], columns={"messages": "dialog"}), tokenizer)
    sharegpt, _ = batch_of(sft.SFTDataConfig(paths=["sg.jsonl"]), tokenizer)
    assert torch.equal(renamed["labels"], sharegpt["labels"]) and torch.equal(renamed["input_ids"], sharegpt["input_ids"])
    learnt = tokenizer.decode([t for t in renamed["labels"][0].tolist() if t != IGNORE_INDEX])
    assert learnt == "7<|im_end|>\n4<|im_end|>\n"


def test_turn_render_mask_equals_the_generation_marker_mask_on_a_marked_chatml(model_folder):
    tokenizer = sft.load_tokenizer(str(model_folder), CHATML_MARKED)
    assert sft.mask_method(tokenizer, {"messages": []}) == "generation_markers"
    plain = sft.load_tokenizer(str(model_folder), None)
    assert sft.mask_method(plain, {"messages": []}) == "turn_render"
    multi = [CONVERSATIONS[0] + CONVERSATIONS[1], [{"role": "system", "content": "Be brief."}] + CONVERSATIONS[2]]
    for messages in CONVERSATIONS + multi:
        by_markers = encode_conversation(tokenizer, messages)
        by_turns = encode_conversation(plain, messages)
        assert by_markers == by_turns and any(by_markers[1])


def test_the_summary_says_format_mask_loss_tokens_and_what_was_cut_or_dropped(workspace):
    long_answer = "word " * 200
    write_jsonl(workspace / "chat.jsonl", [{"messages": m} for m in CONVERSATIONS] + [
        {"messages": [{"role": "user", "content": "Say a lot."}, {"role": "assistant", "content": long_answer}]},
        {"messages": [{"role": "user", "content": long_answer}, {"role": "assistant", "content": "ok"}]},
        {"messages": [{"role": "user", "content": "Nothing?"}, {"role": "assistant", "content": ""}]},
    ])
    config = sft.SFTConfig.model_validate(
        {"model": {"pretrained_path": "models/tiny-qwen"}, "data": {"paths": ["chat.jsonl"], "seq_len": SEQ_LEN}}
    )
    summary = sft.SFT.summarize_data(config)
    tokenizer = sft.load_tokenizer("models/tiny-qwen", None)
    batch, _ = batch_of(config.data, tokenizer)
    assert (summary.format, summary.mask, summary.documents) == ("messages", "turn_render", 6)
    assert summary.loss_tokens == int((batch["labels"] != IGNORE_INDEX).sum())
    assert (summary.truncated, summary.dropped) == (2, 2)
    assert summary.dropped_why == (
        f"1: every assistant token lies past data.seq_len={SEQ_LEN}; 1: no assistant answer (empty or missing)"
    )
    assert "format messages, loss on turn_render" in summary.describe()


def test_a_file_whose_format_cannot_be_told_names_its_columns_and_the_formats_known(workspace):
    write_jsonl(workspace / "odd.jsonl", [{"question": "q", "answer": "a"}])
    with pytest.raises(ConfigError) as refused:
        sft.load_conversations(sft.SFTDataConfig(paths=["odd.jsonl"]))
    assert str(refused.value).startswith(
        "odd.jsonl: cannot tell the data format from its columns ['answer', 'question']; the sft template knows: "
        "messages (messages); sharegpt (conversations); alpaca (instruction, output); prompt_completion (prompt, "
        "completion); text (text). Set data.format"
    )
    # Renamed, it reads; forced without its columns, it names what is missing.
    examples, formats = sft.load_conversations(sft.SFTDataConfig(
        paths=["odd.jsonl"], columns={"prompt": "question", "completion": "answer"}))
    assert formats == ["prompt_completion"] and examples[0][1]["completion"] == [{"role": "assistant", "content": "a"}]
    with pytest.raises(ConfigError, match=r"data.format=alpaca needs the columns \['instruction', 'output'\]"):
        sft.load_conversations(sft.SFTDataConfig(paths=["odd.jsonl"], format="alpaca"))


def test_the_fingerprint_covers_parquet_csv_and_saved_folders(workspace):
    write_every_form(workspace)
    for fields in ({"paths": ["chat.parquet"]}, {"paths": ["pc.csv"]}, {"paths": ["saved"]}, {"dataset": "hub-like"}):
        listing = df.DataListing()
        sft.load_conversations(sft.SFTDataConfig(**fields), listing)
        assert listing.fingerprint() is not None, fields
    listing = df.DataListing()
    sft.load_conversations(sft.SFTDataConfig(paths=["chat.parquet"]), listing)
    before = listing.fingerprint()
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([{"messages": CONVERSATIONS[0]}]), workspace / "chat.parquet")
    assert listing.changed() == [(workspace / "chat.parquet").resolve()]
    listing = df.DataListing()
    sft.load_conversations(sft.SFTDataConfig(paths=["chat.parquet"]), listing)
    assert listing.fingerprint() != before


def test_a_jsonl_line_that_is_not_json_is_named(workspace):
    (workspace / "bad.jsonl").write_text('{"messages": []}\n{oops\n')
    with pytest.raises(ConfigError, match=r"^bad.jsonl:2: not a JSON object"):
        sft.load_conversations(sft.SFTDataConfig(paths=["bad.jsonl"]))


def test_dpo_reads_whole_conversations_and_string_pairs_from_parquet_alike(workspace):
    import pyarrow as pa
    import pyarrow.parquet as pq

    prompt = [{"role": "user", "content": "What is 3 + 4?"}]
    whole = {"chosen": prompt + [{"role": "assistant", "content": "7."}],
             "rejected": prompt + [{"role": "assistant", "content": "8."}]}
    write_jsonl(workspace / "pairs.jsonl", [whole])
    pq.write_table(pa.Table.from_pylist([{"prompt": "What is 3 + 4?", "chosen": "7.", "rejected": "8."}]),
                   workspace / "pairs.parquet")
    tokenizer = dpo.load_tokenizer("models/tiny-qwen", None)
    [(_, conversational)] = dpo.load_pairs(dpo.DPODataConfig(paths=["pairs.jsonl"]))
    [(_, strings)] = dpo.load_pairs(dpo.DPODataConfig(paths=["pairs.parquet"]))
    assert conversational == strings
    prompt_ids, chosen, rejected, _ = dpo.tokenize_pair(tokenizer, strings, 64)
    assert tokenizer.decode(chosen) == "7.<|im_end|>\n" and tokenizer.decode(rejected) == "8.<|im_end|>\n"
    config = dpo.DPOConfig.model_validate(
        {"model": {"pretrained_path": "models/tiny-qwen"}, "data": {"paths": ["pairs.jsonl"]}}
    )
    summary = dpo.DPO.summarize_data(config)
    assert (summary.format, summary.mask, summary.loss_tokens) == ("chosen_rejected", "completion", len(chosen) + len(rejected))


@pytest.mark.parametrize("form", ["assistant_only", "completion_only"])
def test_the_sft_loss_on_one_batch_equals_trls_sft_trainer(form, model_folder, tmp_path):
    trl = pytest.importorskip("trl", reason="trl (the test extra) is the reference SFT loss")
    import datasets
    from transformers import AutoModelForCausalLM

    multi = [CONVERSATIONS[0] + CONVERSATIONS[1], [{"role": "system", "content": "Be brief."}] + CONVERSATIONS[2]]
    if form == "assistant_only":  # TRL's assistant-only loss needs a template with markers
        tokenizer = sft.load_tokenizer(str(model_folder), CHATML_MARKED)
        records = [{"messages": m} for m in CONVERSATIONS + multi]
    else:  # TRL's completion-only loss on conversational prompt/completion; the template as it is
        tokenizer = sft.load_tokenizer(str(model_folder), None)
        records = [{"prompt": m[:-1], "completion": m[-1:]} for m in CONVERSATIONS + multi]
    model = AutoModelForCausalLM.from_pretrained(model_folder, dtype=torch.float32).eval()
    args = trl.SFTConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=len(records), report_to=[], use_cpu=True,
        assistant_only_loss=form == "assistant_only", completion_only_loss=form == "completion_only" or None,
        dataset_num_proc=None, max_length=None,
    )
    trainer = trl.SFTTrainer(model=model, args=args, processing_class=tokenizer,
                             train_dataset=datasets.Dataset.from_list(records))
    theirs = next(iter(trainer.get_train_dataloader()))
    with torch.no_grad():
        trl_loss = float(trainer.compute_loss(model, theirs))

    ours = sft.collate(sft.tokenize_conversations(records, tokenizer, 256), 256, tokenizer.pad_token_id)
    # The same rows (TRL shuffles them) with the same tokens learnt...
    def rows(ids, labels):
        return sorted((tuple(i), tuple(label)) for i, label in zip(ids.tolist(), labels.tolist()))

    width = int((theirs["attention_mask"].sum(1)).max())
    their_labels = theirs["labels"][:, 1:width]
    assert ours["input_ids"].shape[1] == width - 1
    assert rows(ours["input_ids"].masked_fill(ours["labels"] == IGNORE_INDEX, -1), ours["labels"]) == rows(
        theirs["input_ids"][:, :width - 1].masked_fill(their_labels == IGNORE_INDEX, -1), their_labels)
    # ... and the loss per token TRL reports.
    with torch.no_grad():
        logits = model(input_ids=ours["input_ids"], position_ids=ours["position_ids"], use_cache=False).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ours["labels"].flatten(), reduction="sum")
    ours_loss = float(loss) / int((ours["labels"] != IGNORE_INDEX).sum())
    assert abs(ours_loss - trl_loss) < 1e-5, (ours_loss, trl_loss)


def test_causal_lm_reads_a_text_column_from_every_file_kind(workspace):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    from recipes_template.causal_lm import recipe as causal_lm

    texts = ["first document", "second, with a comma", "third\nwith a newline"]
    pq.write_table(pa.Table.from_pylist([{"text": t, "id": i} for i, t in enumerate(texts)]), workspace / "t.parquet")
    import csv

    with open(workspace / "t.csv", "w", newline="") as f:
        csv.writer(f).writerows([["text"], *[[t] for t in texts]])
    (workspace / "t.json").write_text(json.dumps([{"text": t} for t in texts]))
    datasets.Dataset.from_list([{"body": t} for t in texts]).save_to_disk(str(workspace / "saved"))
    for paths, field in ((["t.parquet"], "text"), (["t.csv"], "text"), (["t.json"], "text"), (["saved"], "body")):
        cfg = causal_lm.CausalLMDataConfig(paths=paths, text_field=field)
        documents = causal_lm.load_documents(cfg)
        assert [text for _, text in documents] == texts, paths
        assert [name for name, _ in documents] == [f"{Path(paths[0]).name}:{i}" for i in (1, 2, 3)]
    with pytest.raises(ConfigError, match=r"^t.parquet:1: no text under 'body' \(columns: \['id', 'text'\]"):
        causal_lm.load_documents(causal_lm.CausalLMDataConfig(paths=["t.parquet"], text_field="body"))


def test_a_hub_data_set_not_in_the_local_cache_is_refused_offline(workspace):
    with pytest.raises(ConfigError, match=r"^data.dataset 'nobody/nothing' \(subset None, split 'train'\) could not be "
                       r"loaded \(HF_DATASETS_OFFLINE is set: only the local cache is looked at\).*give a workspace folder"):
        sft.load_conversations(sft.SFTDataConfig(dataset="nobody/nothing"))


def test_data_that_leaves_nothing_to_train_is_refused_at_the_launch_check_with_the_seq_len_that_keeps_it(
        workspace):
    """Every example longer than data.seq_len before its answer: the check refuses, saying how many
    were left out, why, and the data.seq_len that keeps them; then that seq_len is accepted."""
    long_question = "word " * 60
    write_jsonl(workspace / "long.jsonl", [
        {"messages": [{"role": "user", "content": long_question + q}, {"role": "assistant", "content": a}]}
        for q, a in QUESTIONS
    ])
    recipe = workspace / "recipes" / "sft"
    shutil.copytree(Path(sft.__file__).parent, recipe)
    sets = ["model.pretrained_path=models/tiny-qwen", 'data.paths=["long.jsonl"]', f"data.seq_len={SEQ_LEN}"]
    refused = launch_check(workspace, recipe, sets)
    config = sft.SFTConfig.model_validate(
        {"model": {"pretrained_path": "models/tiny-qwen"}, "data": {"paths": ["long.jsonl"], "seq_len": SEQ_LEN}})
    summary = sft.SFT.summarize_data(config)
    tokenizer = sft.load_tokenizer("models/tiny-qwen", None)
    needed = max(sft.seq_len_to_learn(tokenizer, {"messages": m}) for m in
                 ([{"role": "user", "content": long_question + q}, {"role": "assistant", "content": a}]
                  for q, a in QUESTIONS))
    assert needed > SEQ_LEN and summary.seq_len_to_keep == needed
    assert refused == {"ok": False, "error": (
        f"nothing to train on: all 5 examples read were left out (5: every assistant token lies past "
        f"data.seq_len={SEQ_LEN}); data.seq_len={needed} would keep those cut by length")}
    kept = launch_check(workspace, recipe, [*sets[:2], f"data.seq_len={needed}"])
    assert kept["ok"] is True and kept["data"]["train_documents"] + kept["data"]["eval_documents"] == 5
    assert kept["data"]["dropped"] == 0


def test_data_with_no_answer_anywhere_is_refused_naming_why_and_a_direct_start_writes_no_run(workspace):
    write_jsonl(workspace / "empty.jsonl", [
        {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": " "}]} for q, _ in QUESTIONS])
    recipe = workspace / "recipes" / "sft"
    shutil.copytree(Path(sft.__file__).parent, recipe)
    sets = ["model.pretrained_path=models/tiny-qwen", 'data.paths=["empty.jsonl"]']
    assert launch_check(workspace, recipe, sets)["error"] == (
        "nothing to train on: all 5 examples read were left out (5: no assistant answer (empty or missing))")
    out = launch_check(workspace, recipe, sets, check=False)
    assert out.returncode == 2 and "error: nothing to train on: all 5 examples" in out.stderr
    assert not (workspace / "runs").exists()


def launch_check(workspace: Path, recipe: Path, sets: list[str], check: bool = True):
    """The launch check's verdict (``check``: ``engine.launch.main`` in this process, in
    ``workspace``, its one JSON line read; a fresh interpreter costs ~10 s on 2 cores), or a direct
    start as its own process (not ``check``: its exit code and stderr)."""
    import contextlib
    import io
    import os
    import subprocess
    import sys

    from engine.launch import main

    arguments = [str(recipe), *(["--check"] if check else []), *[f"--set={item}" for item in sets]]
    if not check:
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2]), "OMP_NUM_THREADS": "1",
               "HF_HUB_OFFLINE": "1"}
        return subprocess.run([sys.executable, "-m", "engine.launch", *arguments], cwd=workspace, env=env,
                              capture_output=True, text=True, timeout=300)
    out, path, cwd = io.StringIO(), list(sys.path), os.getcwd()
    os.chdir(workspace)
    try:
        with contextlib.redirect_stdout(out):
            main(arguments)
    finally:
        os.chdir(cwd)
        sys.path[:] = path  # the recipe folder the check puts first
    verdict = json.loads(out.getvalue().strip().splitlines()[-1])
    return {"ok": verdict["ok"], "error": verdict.get("error")} if not verdict["ok"] else verdict
