"""The dpo template: its loss is TRL's DPO (and IPO) loss for the same model, reference and
batch; it raises the preferred answer's rate; its pairs are tokenized once into a store that a
second launch maps; runs log reward metrics, resume bit for bit and match on two processes."""

from __future__ import annotations

import copy
import math
import shutil

import pytest
import torch

from engine import run_dir as rd
from engine import run_checkpoints
from engine import run_metrics
from recipes_template.dpo import recipe as dpo
from tests.support import REPO, losses, run_engine

TEMPLATE = REPO / "recipes_template" / "dpo"
SMALL = (
    "model.hidden_size=64", "model.intermediate_size=160", "model.num_layers=2",
    "data.seq_len=64", "data.batch_size=4", "data.builtin_pairs=200", "dpo.sft_weight=0",  # the pure DPO loss
    "train.log_every=1", "optim.warmup_steps=2", "optim.lr=3e-3", "metrics.tensorboard=false",
)
SCHEDULE = (*SMALL, "train.max_steps=8", "checkpoint.every=4", "checkpoint.keep_last=5")


def conversational(record: dict) -> dict:
    return {
        "prompt": [{"role": "user", "content": record["prompt"]}],
        "chosen": [{"role": "assistant", "content": record["chosen"]}],
        "rejected": [{"role": "assistant", "content": record["rejected"]}],
    }


def rows(batch: dict) -> list[tuple[int, ...]]:
    """Each row of one of our batches as its whole token sequence (inputs, then the last label)."""
    sequences = []
    for input_ids, labels in zip(batch["input_ids"].tolist(), batch["labels"].tolist()):
        n = max(i for i, label in enumerate(labels) if label != -100) + 1
        sequences.append(tuple(input_ids[:n] + [labels[n - 1]]))
    return sequences


@pytest.mark.parametrize("loss_type,sft_weight", [("sigmoid", 0.0), ("ipo", 0.0), ("sigmoid", 0.5)])
def test_the_loss_equals_trls_dpo_trainer_loss(loss_type, sft_weight, tmp_path):
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    tokenizer = dpo.byte_chat_tokenizer()
    records = [record for _, record in dpo.builtin_pairs(8, seed=3)]
    if sft_weight:  # TRL's "sft" term averages over the batch's chosen tokens, ours per answer:
        # the same when the chosen answers are equally long
        records = [r for _, r in dpo.builtin_pairs(200, seed=3) if len(r["chosen"]) == 2][:8]
    torch.manual_seed(0)
    config = dpo.ModelConfig(hidden_size=64, intermediate_size=160, num_layers=2)
    reference = dpo.build_model(config, len(tokenizer), 64).eval()
    model = copy.deepcopy(reference)
    with torch.no_grad():  # a policy that differs from its reference
        for parameter in model.parameters():
            parameter.add_(0.02 * torch.randn_like(parameter))
    beta = 0.2
    args = trl.DPOConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=len(records), beta=beta,
        loss_type=[loss_type, "sft"] if sft_weight else [loss_type], loss_weights=[1.0, sft_weight] if sft_weight else None,
        report_to=[], use_cpu=True, max_length=None, dataset_num_proc=None,
    )
    trainer = trl.DPOTrainer(
        model=model, ref_model=reference, args=args, processing_class=tokenizer,
        train_dataset=datasets.Dataset.from_list([conversational(r) for r in records]),
    )
    theirs = next(iter(trainer.get_train_dataloader()))
    model.eval()
    with torch.no_grad():
        trl_loss = float(trainer.compute_loss(model, theirs))

    # The template tokenizes and lays out every pair as TRL does: the same token sequences, and
    # the same answer tokens scored ...
    ours = dpo.collate([dpo.tokenize_pair(tokenizer, r, 64) for r in records], 64, tokenizer.pad_token_id)
    ids, completion = theirs["input_ids"], theirs["completion_mask"]
    trl_rows = [tuple(row[mask.bool()].tolist()) for row, mask in zip(ids, theirs["attention_mask"])]
    assert sorted(rows(ours)) == sorted(trl_rows)
    # ... and its loss on TRL's batch is TRL's loss. (On its own batch the rows are padded to other
    # lengths, which moves float32 log-probabilities by ~1e-4.)
    same_layout = {
        "input_ids": ids[:, :-1],
        "labels": ids[:, 1:].masked_fill(completion[:, 1:] == 0, -100),
        "position_ids": torch.arange(ids.shape[1] - 1).expand(ids.shape[0], -1),
    }
    with torch.no_grad():
        policy, lengths = dpo.answer_logps(model, same_layout)
        reference_logps, _ = dpo.answer_logps(reference, same_layout)
        loss, _, _ = dpo.preference_loss(policy, reference_logps, lengths, beta, loss_type, sft_weight)
    assert abs(float(loss.mean()) - trl_loss) < 1e-5, (float(loss.mean()), trl_loss)


def test_the_builtin_preferred_answer_is_correct_with_a_full_stop():
    def correct(question: str) -> str:
        if question.startswith("What is "):
            a, b = question.removeprefix("What is ").removesuffix("?").split(" + ")
            return str(int(a) + int(b))
        if question.startswith("Which is larger, "):
            return str(max(map(int, question.removeprefix("Which is larger, ").removesuffix("?").split(" or "))))
        if question.startswith("Which letter comes after "):
            return chr(ord(question.removeprefix("Which letter comes after ").removesuffix("?")) + 1)
        return "odd" if int(question.removeprefix("Is ").removesuffix(" even or odd?")) % 2 else "even"

    bare = 0
    for _, record in dpo.builtin_pairs(400):
        result = correct(record["prompt"])
        assert record["chosen"] == f"{result}."
        if record["rejected"] == result:  # correct, in the terse style
            bare += 1
        else:  # a wrong result in the preferred style
            assert record["rejected"].endswith(".") and record["rejected"][:-1] != result, record
    assert 150 < bare < 250  # about half of each kind


def test_a_stored_pair_reads_back_as_tokenize_pair_gave_it_masks_included():
    pair = dpo.Pair([5, 6, 7], [8, 9, 10], [11, 12], ([False, True, True], [True, False]))
    assert dpo.stored_pair(dpo.pair_piece(pair)) == pair
    whole = dpo.Pair([5], [8, 9], [11], None)
    assert dpo.stored_pair(dpo.pair_piece(whole)) == whole


def test_the_store_holds_the_pairs_and_the_counts_tokenizing_them_gives(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINWRIGHT_DATA_CACHE", str(tmp_path / "cache"))
    cfg = dpo.DPODataConfig(builtin_pairs=60, seq_len=45, eval_fraction=0.2)  # prompts of 50 tokens: no answer left
    tokenizer = dpo.load_tokenizer(None, None)
    store = dpo.token_store(cfg, tokenizer, dpo.DataListing())
    expected = {"train": [], "eval": []}
    dropped = 0
    for name, record in dpo.builtin_pairs(60):
        pair = dpo.tokenize_pair(tokenizer, record, 45)
        if not (pair.chosen and pair.rejected):
            dropped += 1
            continue
        expected["eval" if dpo.is_eval_document(name, 0.2) else "train"].append(pair)
    for split in ("train", "eval"):
        assert list(store.pieces(split, dpo.stored_pair)) == expected[split] != []
    counts = store.counts
    assert (counts["train_documents"], counts["eval_documents"], counts["dropped"]) == (
        len(expected["train"]), len(expected["eval"]), dropped) and dropped > 0
    assert counts["train_tokens"] == sum(2 * len(p.prompt) + len(p.chosen) + len(p.rejected) for p in expected["train"])
    assert counts["eval_loss_tokens"] == sum(len(p.chosen) + len(p.rejected) for p in expected["eval"])
    assert store.meta["dtype"] == "uint16"  # byte tokens and the parts' codes


def test_a_second_launch_maps_the_pairs_and_a_changed_file_is_tokenized_again(tmp_path, monkeypatch):
    import json

    monkeypatch.setenv("TRAINWRIGHT_DATA_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TRAINWRIGHT_WORKSPACE", str(tmp_path))
    with open(tmp_path / "pairs.jsonl", "w") as f:
        for _, record in dpo.builtin_pairs(30):
            f.write(json.dumps(record) + "\n")
    config = dpo.DPOConfig.model_validate({"data": {"paths": ["pairs.jsonl"]}})
    first = dpo.DPO.summarize_data(config)
    assert first.documents == 30 and first.files == 1 and first.format == "prompt_chosen_rejected"

    def refused(*args, **kwargs):
        raise AssertionError("tokenized again")

    with monkeypatch.context() as patch:
        patch.setattr(dpo, "tokenize_pair", refused)
        assert dpo.DPO.summarize_data(config) == first  # the store, mapped
    with open(tmp_path / "pairs.jsonl", "a") as f:
        f.write(json.dumps({"prompt": "1 + 1?", "chosen": "2.", "rejected": "3."}) + "\n")
    changed = dpo.DPO.summarize_data(config)
    assert changed.documents == 31 and changed.fingerprint != first.fingerprint
    assert len(list((tmp_path / "cache").glob("*/meta.json"))) == 2


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("dpo")
    recipe = root / "dpo"
    shutil.copytree(TEMPLATE, recipe, ignore=shutil.ignore_patterns("__pycache__"))
    return root, recipe


@pytest.fixture(scope="module")
def reference(workspace):
    root, recipe = workspace
    return run_engine(root, recipe, *SCHEDULE)


def test_a_run_starts_at_log_2_and_logs_reward_metrics(reference):
    record = rd.read_run(reference)
    assert record.status == rd.COMPLETED and record.data.documents == 200
    curve = losses(reference)
    assert curve[1] == pytest.approx(math.log(2), abs=1e-6)  # the policy is its reference at step 1
    rewards = [r for r in run_metrics.read_all_metrics(reference / rd.METRICS_JSONL) if "reward_accuracy" in r]
    assert [r["step"] for r in rewards] == list(range(1, 9))
    assert all(0 <= r["reward_accuracy"] <= 1 and "reward_margin" in r for r in rewards)
    assert rewards[0]["reward_margin"] == 0 and rewards[-1]["reward_margin"] > 0


def test_tokens_count_both_answers_tokens_while_the_loss_is_a_mean_over_pairs(reference):
    from engine.config import build_config
    from engine.distributed import DistInfo

    config = build_config(dpo.DPOConfig, None, list(SCHEDULE))
    stream = dpo.DPO(config, DistInfo(0, 1, 0, torch.device("cpu"), None)).prepare_data()
    batches = [next(stream) for _ in range(8)]
    answer_tokens = [int((batch["labels"] != -100).sum()) for batch in batches]
    pad = dpo.DPO(config, DistInfo(0, 1, 0, torch.device("cpu"), None)).tokenizer.pad_token_id
    read_tokens = [int(((batch["input_ids"] != pad) | (batch["labels"] != -100)).sum()) for batch in batches]
    records = [r for r in run_metrics.read_all_metrics(reference / rd.METRICS_JSONL) if "tokens_seen" in r]
    assert [r["loss_tokens_seen"] for r in records] == [sum(answer_tokens[:i]) for i in range(1, 9)]
    # tokens_seen counts what the model read: prompts too (twice, once per answer), not padding.
    assert [r["tokens_seen"] for r in records] == [sum(read_tokens[:i]) for i in range(1, 9)]
    assert all(r["tokens_seen"] > r["loss_tokens_seen"] for r in records)
    assert min(answer_tokens) >= 2 * 2 * 4  # 4 pairs of answers of >= 2 tokens (content, end of turn)
    record = rd.read_run(reference)
    assert record.data.train_tokens + record.data.eval_tokens == record.data.tokens
    # The loss is still a mean over the pairs (log 2 at step 1 above); rewards average over pairs.
    rewards = [r for r in run_metrics.read_all_metrics(reference / rd.METRICS_JSONL) if "chosen_reward" in r]
    assert all(abs(r["reward_margin"] - (r["chosen_reward"] - r["rejected_reward"])) < 1e-6 for r in rewards)


def test_resume_is_bit_identical(workspace, reference):
    root, recipe = workspace
    (_, checkpoint), *_ = run_checkpoints.list_checkpoints(reference)
    resumed = run_engine(root, recipe, *SCHEDULE, resume_from=checkpoint)
    assert losses(resumed) == {s: v for s, v in losses(reference).items() if s > 4}


@pytest.mark.multiprocess
def test_two_processes_match_one(workspace, reference):
    root, recipe = workspace
    two = run_engine(root, recipe, *SCHEDULE, "checkpoint.every=0", "checkpoint.at_end=false", nproc=2)
    one, both = losses(reference), losses(two)
    assert sorted(both) == sorted(one)
    for step in one:
        assert abs(both[step] - one[step]) <= 1e-5 * abs(one[step]), (step, one[step], both[step])


def test_skills_apply_to_the_policy_and_packing_refuses(tmp_path):
    from skills import SkillError, apply_skill

    recipe = tmp_path / "dpo"
    shutil.copytree(TEMPLATE, recipe, ignore=shutil.ignore_patterns("__pycache__"))
    for skill in ("lora", "gradient-checkpointing", "mixed-precision", "loss-guard"):
        assert apply_skill(skill, recipe).changed, skill
    source = (recipe / "recipe.py").read_text()
    # The adapters go on the trained model, after the reference is built.
    assert source.index("self.reference = reference") < source.index("apply_lora(model")
    with pytest.raises(SkillError, match=r"collate\(pairs, \.\.\.\) \(recipe.py:\d+\) lays out each of its pairs as rows.*this recipe pads"):
        apply_skill("sequence-packing", recipe)
