"""Preference alignment with DPO: a causal language model learns to prefer the chosen answer.

Read it top to bottom: configuration, the chat tokenizer, the built-in preference set, data,
model, then the recipe class. It runs as it is (``trainwright run recipes/<name>``): on a
generated set of prompts (add, compare, next letter, parity) whose preferred answer is correct
and ends with a full stop ("7.") and whose rejected answer is the bare result ("7") or a near
miss ("8."), the model's preference for the preferred answer rises within minutes on a CPU.

Supports:
- preference pairs (``engine/data_formats.py``), tokenized once into a store that every rank and
  later run maps (``engine/token_store.py``; large data as the run's first phase), in JSONL, JSON, parquet, CSV/TSV files,
  ``save_to_disk`` folders (``data.paths``) or a data set ``datasets`` loads (``data.dataset``):
  ``{"prompt": ..., "chosen": ..., "rejected": ...}`` with strings or chat messages, or whole
  chosen/rejected conversations (split at the messages they share), with a ``tools`` column,
  reasoning and tool calls as the sft template reads them; rendered by the tokenizer's own chat
  template, markers or not: an answer is what the template adds after the prompt (its
  reasoning, its tool call, its text); ``data.reasoning_loss=false`` leaves the reasoning out of
  the answers' log-probabilities
- Direct Preference Optimization (Rafailov et al., 2023; ``dpo.loss_type=sigmoid``) and IPO
  (Azar et al., 2023; ``dpo.loss_type=ipo``) against a frozen reference model (the starting
  weights), with ``dpo.beta``, and optionally the chosen answers' NLL (``dpo.sft_weight``, RPO);
  logged: reward accuracy, margin, chosen and rejected rewards
- starting from a local Hugging Face folder (``model.pretrained_path``, e.g. an SFT run
  exported with ``trainwright export``) or from a tiny model built from a config
- everything the engine does: FSDP2 over N processes, checkpoints resumable bit for bit
- the ``lora`` skill (the reference stays the model without adapters' updates), and the skills
  that act on the model (gradient checkpointing, compile, mixed precision)
"""

from __future__ import annotations

import hashlib
import random
from functools import cached_property
from itertools import islice
from typing import Any, Iterator, Literal, NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import Field, model_validator
from torch.distributed.checkpoint.stateful import Stateful
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from engine.chat import CHAT_TEMPLATE, byte_chat_tokenizer, load_chat_tokenizer  # noqa: F401 (the chat format)
from engine.chat import encode_completion
from engine.config import ConfigError, EngineConfig, Section
from engine.data_files import DataListing, confined_path
from engine.data_formats import FILE_SUFFIXES, part_examples, read_examples
from engine.distributed import dp_all_reduce_sum
from engine.engine import IGNORE_INDEX, Engine, StepContext, Window
from engine.flops import non_embedding_params, transformer_flops_per_token
from engine.fsdp import apply_fsdp
from engine.optimizers import adamw_8bit
from engine.data_summary import added_up, split_counts
from engine.run_dir import DataSummary
from engine.store_parts import build_in_parts, source_parts
from engine.token_store import (
    StoredDataConfig,
    TokenStore,
    data_identity,
    leave_to_run,
    open_or_build,
    store_key,
    text_size,
    tokenizer_identity,
    value_dtype,
)

# =============================================================================================
# Configuration
# =============================================================================================


class ModelConfig(Section):
    hidden_size: int = Field(256, ge=8, description="Model width.")
    intermediate_size: int = Field(688, ge=8, description="MLP width.")
    num_layers: int = Field(4, ge=1, description="Decoder layers.")
    num_heads: int = Field(4, ge=1, description="Attention heads.")
    num_kv_heads: int = Field(2, ge=1, description="Key/value heads (GQA).")
    rope_theta: float = Field(10000.0, gt=0, description="RoPE base frequency.")
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2"] | None = Field(
        None, description="Attention kernel; default: sdpa, or with model.pretrained_path the model's own default."
    )
    pretrained_path: str | None = Field(
        None, description="A Hugging Face model folder, Hub id, or run:RUN_ID@STEP: an earlier run's checkpoint."
    )


class DPODataConfig(StoredDataConfig):
    source: Literal["builtin", "files"] | None = Field(
        None, description="builtin: the generated preference set; files: data.paths (the default when set)."
    )
    paths: list[str] = Field(
        default_factory=list,
        description="Data files (.jsonl, .json, .parquet, .csv, .tsv) of preference pairs, folders, or save_to_disk folders.",
    )
    dataset: str | None = Field(
        None, description="A data set for datasets.load_dataset: a workspace folder, or a Hub id in the local cache."
    )
    subset: str | None = Field(None, description="data.dataset: its configuration (subset) name.")
    split: str | None = Field(None, description="data.dataset or a saved DatasetDict: the split (default train).")
    format: Literal["prompt_chosen_rejected", "chosen_rejected"] | None = Field(
        None, description="The records' format; default: recognised from the columns."
    )
    columns: dict[str, str] = Field(
        default_factory=dict, description='Renames columns to the format\'s names, e.g. {"chosen": "good"}.'
    )
    chat_template: str | None = Field(
        None, description="A Jinja chat template instead of the tokenizer's own ({% generation %} markers optional)."
    )
    reasoning_loss: bool = Field(
        True, description="An answer's log-probability covers its <think> reasoning (gpt-oss: analysis); false: never."
    )
    eval_fraction: float = Field(
        0.05, ge=0, le=1, description="Pairs held out for evaluation (1: all, as `evaluate` with data does)."
    )
    builtin_pairs: int = Field(4000, ge=10, description="data.source=builtin: how many pairs.")
    eval_prompts: int = Field(100, ge=1, description="Held-out pairs task_metrics() looks at.")
    max_new_tokens: int = Field(16, ge=1, description="task_metrics(): tokens generated per answer at most.")

    @model_validator(mode="after")
    def _source_matches_paths(self) -> "DPODataConfig":
        given = bool(self.paths or self.dataset)
        if self.source is None:
            object.__setattr__(self, "source", "files" if given else "builtin")
        elif given and self.source != "files":
            raise ValueError(f"data.paths is set but data.source={self.source} would ignore it; drop data.source")
        elif self.source == "files" and not given:
            raise ValueError("data.source=files needs data.paths (data files, relative to the workspace) or data.dataset")
        return self


class PreferenceConfig(Section):
    beta: float = Field(0.1, gt=0, description="Strength of the pull towards the reference model.")
    loss_type: Literal["sigmoid", "ipo"] = Field(
        "sigmoid", description="sigmoid: DPO; ipo: IPO (log-ratios averaged per completion token, as TRL does)."
    )
    sft_weight: float = Field(
        0.0, ge=0, description="Adds this times the chosen answer's mean token NLL (RPO; TRL's 'sft' loss term)."
    )


class DPOConfig(EngineConfig):
    model: ModelConfig = ModelConfig()
    data: DPODataConfig = DPODataConfig(seq_len=128)
    dpo: PreferenceConfig = PreferenceConfig()


# =============================================================================================
# Tokenizer: the model's own chat template (CHAT_TEMPLATE, engine/chat.py, for the byte tokenizer)
# =============================================================================================


def load_tokenizer(model_path: str | None, chat_template: str | None):
    """The tokenizer beside the weights (the byte tokenizer when there is none), with a chat template."""
    return load_chat_tokenizer(model_path, chat_template)


# =============================================================================================
# The built-in preference set: the chosen answer is correct and ends with a full stop
# =============================================================================================

LETTERS = "abcdefghijklmnopqrstuvwxyz"


def make_pair(rng: random.Random) -> tuple[str, str, str]:
    """``(question, chosen, rejected)``. The chosen answer is the correct result as a sentence,
    with a full stop ("7."); the rejected one is either the bare result ("7": correct, in the
    terse style the ``sft`` template's instruction set teaches) or a near miss with a full stop
    ("8."). So an SFT model has a preference to learn, and must keep the results right."""
    kind = rng.choice(("add", "larger", "next", "parity"))
    if kind == "add":
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        question, result, miss = f"What is {a} + {b}?", str(a + b), str(a + b + rng.choice((-2, -1, 1, 2)))
    elif kind == "larger":
        a, b = rng.sample(range(10, 100), 2)
        question, result, miss = f"Which is larger, {a} or {b}?", str(max(a, b)), str(min(a, b))
    elif kind == "next":
        index = rng.randint(1, len(LETTERS) - 3)
        question = f"Which letter comes after {LETTERS[index]}?"
        result, miss = LETTERS[index + 1], LETTERS[index + rng.choice((-1, 2))]
    else:
        number = rng.randint(10, 99)
        result, miss = ("odd", "even") if number % 2 else ("even", "odd")
        question = f"Is {number} even or odd?"
    return question, f"{result}.", result if rng.random() < 0.5 else f"{miss}."


def builtin_pairs(count: int, seed: int = 0) -> list[tuple[str, dict[str, Any]]]:
    rng = random.Random(seed)
    pairs = []
    for i in range(count):
        question, good, bad = make_pair(rng)
        pairs.append((f"builtin-{i}", {"prompt": question, "chosen": good, "rejected": bad}))
    return pairs


# =============================================================================================
# Data: pairs → (prompt, chosen, rejected) token ids (tokenized once, into a store that every
# rank and later run maps) → batches of [chosen rows; rejected rows]
# =============================================================================================


def as_messages(value: Any, role: str) -> list[dict[str, str]]:
    """A string as one message of ``role``; a list of messages as it is."""
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    if isinstance(value, list) and all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in value):
        return value
    raise ConfigError(f"a {role} must be a string or a list of {{'role': ..., 'content': ...}} messages")


def load_pairs(cfg: DPODataConfig, listing: DataListing | None = None) -> list[tuple[str, dict[str, Any]]]:
    """``(name, record)``; the name decides the train/eval split, so it must be stable. The
    files read are fingerprinted into ``listing``."""
    return list(read_pairs(cfg, listing))


def read_pairs(cfg: DPODataConfig, listing: DataListing | None = None, formats: list[str] | None = None,
               head: int | None = None) -> Iterator[tuple[str, dict[str, Any]]]:
    """The ``(name, record)`` pairs of :func:`load_pairs`, read one at a time; the format of
    each source is appended to ``formats``. ``head``: only the first pairs of each source."""
    if cfg.source == "builtin":
        if formats is not None:
            formats.append("prompt_chosen_rejected")
        yield from builtin_pairs(cfg.builtin_pairs)
        return
    found = False
    for source in read_examples(
        "dpo", cfg.paths, format=cfg.format, columns=cfg.columns, dataset=cfg.dataset, subset=cfg.subset, split=cfg.split,
        listing=listing,
    ):
        if formats is not None:
            formats.append(source.format)
        for pair in islice(source.records, head):
            found = True
            yield pair
    if not found:
        raise ConfigError(NO_PAIRS.format(paths=cfg.paths, dataset=cfg.dataset))


NO_PAIRS = "no preference pairs in data.paths={paths} data.dataset={dataset}"


def is_eval_document(name: str, eval_fraction: float) -> bool:
    bucket = int(hashlib.sha1(name.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF
    return eval_fraction >= 1 or bucket < eval_fraction


class Pair(NamedTuple):
    """A pair's token ids; ``learnt``: per answer, which of its tokens its log-probability covers
    (None: all of them)."""

    prompt: list[int]
    chosen: list[int]
    rejected: list[int]
    learnt: tuple[list[bool], list[bool]] | None = None

    def learnt_tokens(self) -> int:
        return len(self.chosen) + len(self.rejected) if self.learnt is None else sum(map(sum, self.learnt))


def tokenize_pair(tokenizer, record: dict[str, Any], seq_len: int, reasoning: bool = True) -> Pair:
    """A pair's token ids. Each answer is what the chat template adds after the prompt and its
    generation prompt (reasoning, tool calls, content and end of turn), the conversation's
    ``tools`` rendered with it; prompt + answer is cut to ``seq_len + 1`` tokens.
    ``reasoning=False``: the answers' reasoning is read, not learnt."""
    prompt = as_messages(record["prompt"], "user")
    prompt_ids, answers, learnt = None, [], []
    for key in ("chosen", "rejected"):
        tokens, mask = encode_completion(tokenizer, prompt, as_messages(record[key], "assistant"), tools=record.get("tools"))
        start = mask.index(True) if True in mask else len(tokens)
        if prompt_ids is not None and tokens[:start] != prompt_ids:
            raise ConfigError("the chat template renders the prompt differently before each answer; set data.chat_template")
        prompt_ids = tokens[:start]
        answers.append(tokens[start : seq_len + 1])
        if not reasoning:
            kept = encode_completion(tokenizer, prompt, as_messages(record[key], "assistant"), tools=record.get("tools"),
                                     reasoning=False)[1]
            learnt.append(kept[start : seq_len + 1])
    assert prompt_ids is not None
    return Pair(prompt_ids[:seq_len], answers[0], answers[1], None if reasoning else (learnt[0], learnt[1]))


# A stored pair is a 2 × n piece: its tokens (prompt, chosen answer, rejected answer, back to
# back) and, per token, the part it is of: PROMPT, CHOSEN or REJECTED, + NOT_LEARNT for an answer
# token its log-probability does not cover (data.reasoning_loss=false).
PROMPT, CHOSEN, REJECTED, NOT_LEARNT = 0, 2, 4, 1


def pair_piece(pair: Pair) -> np.ndarray:
    """``pair`` as the store keeps it (:func:`stored_pair` reads it back)."""
    learnt = pair.learnt or ([True] * len(pair.chosen), [True] * len(pair.rejected))
    parts = [PROMPT] * len(pair.prompt)
    for part, answer, kept in ((CHOSEN, pair.chosen, learnt[0]), (REJECTED, pair.rejected, learnt[1])):
        parts += [part + NOT_LEARNT * (not kept[i]) for i in range(len(answer))]
    return np.array([pair.prompt + pair.chosen + pair.rejected, parts], dtype=np.int64)


def stored_pair(piece: np.ndarray) -> Pair:
    """The :class:`Pair` of a stored piece (``learnt`` None when every answer token is learnt)."""
    tokens, parts = piece[0].tolist(), piece[1]
    prompt_end = int((parts < CHOSEN).sum())
    chosen_end = prompt_end + int(((parts >= CHOSEN) & (parts < REJECTED)).sum())
    kept = (parts % 2 == 0).tolist()
    learnt = None if all(kept) else (kept[prompt_end:chosen_end], kept[chosen_end:])
    return Pair(tokens[:prompt_end], tokens[prompt_end:chosen_end], tokens[chosen_end:], learnt)


def token_store(cfg: DPODataConfig, tokenizer, listing: DataListing) -> TokenStore | None:
    """Every pair tokenized once (:func:`tokenize_pair`, as :func:`pair_piece` lays it out),
    train and held-out apart, with the data summary's counts, in the store of the data's
    fingerprint, the tokenizer (chat template included) and the settings that change tokens:
    built on first use (one pair in memory at a time), mapped by every rank and later run. A
    pair with an answer cut off entirely is left out (counted as dropped). None in the launch
    check for data left to the run (:func:`engine.token_store.leave_to_run`), once the first
    pairs of each file tokenize and the disk has room for the store."""
    if cfg.source == "builtin":
        identity, size = ["builtin", cfg.builtin_pairs], 0
    else:
        identity, size = data_identity(cfg.paths, FILE_SUFFIXES, listing, cfg.dataset)
    key = store_key(template="dpo", data=identity, tokenizer=tokenizer_identity(tokenizer), seq_len=cfg.seq_len,
                    eval_fraction=cfg.eval_fraction, format=cfg.format, columns=cfg.columns, subset=cfg.subset,
                    split=cfg.split, reasoning_loss=cfg.reasoning_loss)

    def read_head(pairs: int) -> None:
        for _, record in read_pairs(cfg, DataListing(hashing=False), head=pairs):  # hashed just now
            tokenize_pair(tokenizer, record, cfg.seq_len, cfg.reasoning_loss)

    if leave_to_run(key, size, cfg.tokenize_in_check_mb, read_head):
        return None

    def add_pairs(store, pairs, formats: set[str]) -> dict[str, Any]:
        counts = {True: [0, 0, 0], False: [0, 0, 0]}  # held out? -> [pairs, tokens, answer tokens]
        names, truncated, dropped = set(), 0, 0
        for name, record in pairs:
            whole = tokenize_pair(tokenizer, record, cfg.seq_len + 1)
            truncated += len(whole.prompt) + max(len(whole.chosen), len(whole.rejected)) > cfg.seq_len + 1
            pair = tokenize_pair(tokenizer, record, cfg.seq_len, cfg.reasoning_loss)
            store.progress.advance(documents=1, bytes_read=text_size(record))
            names.add(name.split(":", 1)[0])
            if not (pair.chosen and pair.rejected):  # an answer cut off entirely: nothing to compare
                dropped += 1
                continue
            held_out = is_eval_document(name, cfg.eval_fraction)
            store.add("eval" if held_out else "train", pair_piece(pair))
            counted = counts[held_out]
            counted[0] += 1
            counted[1] += 2 * len(pair.prompt) + len(pair.chosen) + len(pair.rejected)  # both rows
            counted[2] += pair.learnt_tokens()  # the loss's, and what loss_tokens_seen counts in training
        return dict(counts=counts, names=names, formats=formats, truncated=truncated, dropped=dropped)

    def add_part(store, files, index: int) -> dict[str, Any]:
        source = part_examples("dpo", *files[index], format=cfg.format, columns=cfg.columns)
        return add_pairs(store, source.records if source else [], {source.format} if source else set())

    def build(store) -> dict[str, Any]:
        read = DataListing()
        if cfg.source == "files":  # files, saved folders and data.dataset in parts (a large one: several)
            files = source_parts(cfg.paths, FILE_SUFFIXES, read, cfg.dataset, cfg.subset, cfg.split)
            parts = build_in_parts(store, len(files), lambda part, i: add_part(part, files, i))
            total = added_up([add_pairs(store, [], set()), *parts])  # nothing's counts, then each part's
            if not sum(counted[0] for counted in total["counts"].values()) + total["dropped"]:
                raise ConfigError(NO_PAIRS.format(paths=cfg.paths, dataset=cfg.dataset))
        else:
            formats: list[str] = []  # each source's, told as read_pairs reads it
            total = add_pairs(store, read_pairs(cfg, read, formats), set())
            total["formats"].update(formats)
        if read.fingerprint() != listing.fingerprint() or read.changed():
            raise ConfigError("the data changed while it was tokenized; launch again once it is written")
        dropped = total["dropped"]
        return dict(
            files=len(total["names"]) if cfg.source == "files" else None,
            **split_counts(total["counts"]),
            format=", ".join(sorted(total["formats"])),
            mask="completion",
            truncated=total["truncated"],
            dropped=dropped,
            dropped_why=f"{dropped}: an answer lies wholly past data.seq_len={cfg.seq_len}" if dropped else None,
        )

    # Token ids and the parts' codes in one array: uint16 when the vocabulary fits.
    return open_or_build(key, rows=2, dtype=value_dtype(max(len(tokenizer), REJECTED + NOT_LEARNT + 1) - 1),
                         build=build, input_bytes=size, whole_size=not cfg.dataset)


def collate(pairs: list[Pair], seq_len: int, pad_id: int) -> dict[str, torch.Tensor]:
    """Rows ``[prompt + chosen] * B`` then ``[prompt + rejected] * B``, right-padded to
    ``seq_len``; labels are the next token where it belongs to the answer (and is learnt)."""
    rows = [(p.prompt, p.chosen, p.learnt and p.learnt[0]) for p in pairs]
    rows += [(p.prompt, p.rejected, p.learnt and p.learnt[1]) for p in pairs]
    input_ids = torch.full((len(rows), seq_len), pad_id, dtype=torch.int64)
    labels = torch.full((len(rows), seq_len), IGNORE_INDEX, dtype=torch.int64)
    for row, (prompt, answer, learnt) in enumerate(rows):
        tokens = torch.tensor(prompt + answer)[: seq_len + 1]
        n = len(tokens) - 1
        input_ids[row, :n] = tokens[:-1]
        targets = tokens[len(prompt) :]
        if learnt:
            targets = targets.masked_fill(~torch.tensor(learnt[: len(targets)]), IGNORE_INDEX)
        labels[row, len(prompt) - 1 : n] = targets
    position_ids = torch.arange(seq_len).expand(len(rows), seq_len).clone()
    return {"input_ids": input_ids, "labels": labels, "position_ids": position_ids}


class BatchStream(Stateful):
    """This rank's micro-batches of pairs, forever: each epoch visits the pairs in a new seeded
    order. The position counts the pairs of the *global* stream consumed, so a checkpoint resumes
    with the very next batch on any number of processes."""

    def __init__(self, pairs, seq_len, pad_id, seed, micro_batch, dp_rank, dp_size):
        self.pairs, self.seq_len, self.pad_id, self.seed = pairs, seq_len, pad_id, seed
        self.micro_batch = micro_batch
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.position = 0
        self._order: tuple[int, torch.Tensor] | None = None

    def _pair_at(self, index: int):
        epoch, offset = divmod(index, len(self.pairs))
        if self._order is None or self._order[0] != epoch:
            generator = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
            self._order = (epoch, torch.randperm(len(self.pairs), generator=generator))
        return self.pairs[int(self._order[1][offset])]

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        start = self.position + self.dp_rank * self.micro_batch
        batch = [self._pair_at(i) for i in range(start, start + self.micro_batch)]
        self.position += self.micro_batch * self.dp_size
        return collate(batch, self.seq_len, self.pad_id)

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.position = int(state_dict["position"])


# =============================================================================================
# Model and the preference loss
# =============================================================================================


def build_model(cfg: ModelConfig, vocab_size: int, seq_len: int) -> torch.nn.Module:
    if cfg.pretrained_path:
        # The family's own attention unless one is asked for (Gemma 2 has no sdpa, for one).
        chosen = {"attn_implementation": cfg.attn_implementation} if cfg.attn_implementation else {}
        return AutoModelForCausalLM.from_pretrained(confined_path(cfg.pretrained_path), dtype=torch.float32, **chosen)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=2 * seq_len,  # room for generated answers after a full prompt
        rope_theta=cfg.rope_theta,
        tie_word_embeddings=False,
        attn_implementation=cfg.attn_implementation or "sdpa",
    )
    return LlamaForCausalLM(config)


def answer_logps(model, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: the summed log-probability of the answer's tokens, and their number."""
    logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
    labels = batch["labels"]
    mask = labels != IGNORE_INDEX
    log_probs = logits.log_softmax(-1, dtype=torch.promote_types(logits.dtype, torch.float32))
    token_logps = torch.gather(log_probs, 2, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return (token_logps * mask).sum(-1), mask.sum(-1)


def preference_loss(
    policy: torch.Tensor, reference: torch.Tensor, lengths: torch.Tensor, beta: float, loss_type: str,
    sft_weight: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per pair: ``(loss, chosen reward, rejected reward)`` from the answers' log-probabilities
    (rows: chosen answers, then rejected ones). Rewards are ``beta * (policy - reference)``.
    ``sft_weight`` adds the chosen answer's mean negative log-likelihood per token (RPO), which
    keeps the chosen answers likely while the pair's margin grows (per pair here; TRL's "sft"
    term averages over the batch's chosen tokens, the same when the answers are equally long)."""
    chosen_ratio, rejected_ratio = (policy - reference).chunk(2)
    chosen_length, rejected_length = lengths.clamp(min=1).chunk(2)
    if loss_type == "sigmoid":
        loss = -F.logsigmoid(beta * (chosen_ratio - rejected_ratio))
    else:  # ipo: log-ratios per answer token, pulled to a margin of 1 / (2 beta)
        loss = (chosen_ratio / chosen_length - rejected_ratio / rejected_length - 1 / (2 * beta)) ** 2
    if sft_weight:
        loss = loss - sft_weight * policy.chunk(2)[0] / chosen_length
    return loss, beta * chosen_ratio.detach(), beta * rejected_ratio.detach()


@torch.no_grad()
def greedy_answers(model, tokenizer, prompts: list[list[dict[str, str]]], max_new_tokens: int) -> list[str]:
    """The model's greedy reply to each conversation (left-padded into one batch)."""
    encoded = [tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"] for p in prompts]
    width = max(len(ids) for ids in encoded)
    input_ids = torch.full((len(encoded), width), tokenizer.pad_token_id, dtype=torch.int64)
    attention_mask = torch.zeros((len(encoded), width), dtype=torch.int64)
    for row, ids in enumerate(encoded):
        input_ids[row, width - len(ids) :] = torch.tensor(ids)
        attention_mask[row, width - len(ids) :] = 1
    device = next(model.parameters()).device
    output = model.generate(
        input_ids=input_ids.to(device),
        attention_mask=attention_mask.to(device),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return [tokenizer.decode(row[width:], skip_special_tokens=True).strip() for row in output.tolist()]


# =============================================================================================
# The recipe
# =============================================================================================


class DPO(Engine):
    """Direct Preference Optimization (or IPO) against a frozen copy of the starting model."""

    config_class = DPOConfig

    @cached_property
    def tokenizer(self):
        return load_tokenizer(self.config.model.pretrained_path, self.config.data.chat_template)

    def prepare_model(self) -> torch.nn.Module:
        # The reference is the starting model, built first from the same seed; it is not handed to
        # the optimizer and runs under no_grad, so it never changes.
        with torch.random.fork_rng():
            reference = build_model(self.config.model, len(self.tokenizer), self.config.data.seq_len)
        self.reference = reference.eval().to(self.device)
        model = build_model(self.config.model, len(self.tokenizer), self.config.data.seq_len)
        model = model.to(self.device)
        model = apply_fsdp(model, self.dist, self.config.parallel)
        self.preference_sums = torch.zeros(5, dtype=torch.float64, device=self.device)
        return model

    def prepare_optimizer(self, model: torch.nn.Module) -> torch.optim.Optimizer:
        optim = self.config.optim
        if optim.name == "adamw_8bit":  # 8-bit states: a quarter of AdamW's memory
            return adamw_8bit([p for p in model.parameters() if p.requires_grad], optim)
        return torch.optim.AdamW(
            [p for p in model.parameters() if p.requires_grad],
            lr=optim.lr,
            betas=(optim.beta1, optim.beta2),
            eps=optim.eps,
            weight_decay=optim.weight_decay,
            fused=True,
        )

    @classmethod
    def summarize_data(cls, config: DPOConfig) -> DataSummary:
        cfg = config.data
        listing = DataListing()
        store = token_store(cfg, load_tokenizer(config.model.pretrained_path, cfg.chat_template), listing)
        tokenizer = f"from {config.model.pretrained_path}" if config.model.pretrained_path else "bytes (chat)"
        if store is None:  # the run tokenizes it as its first phase
            return DataSummary.left_to_run(cfg.source, cfg.paths, len(listing.files),
                                           sum(path.stat().st_size for path in listing.files), tokenizer=tokenizer,
                                           **listing.summary_fields())
        return DataSummary(source=cfg.source, paths=cfg.paths[:20], tokenizer=tokenizer, **store.counts,
                           **listing.summary_fields())

    @cached_property
    def store(self) -> TokenStore:
        """The tokenized pairs, mapped (built by the launch check, or now when it was not)."""
        return token_store(self.config.data, self.tokenizer, self.data_listing)

    @cached_property
    def held_out_records(self) -> list[dict[str, Any]]:
        """The first ``data.eval_prompts`` held-out records, for the task metric."""
        cfg, records = self.config.data, []
        for name, record in read_pairs(cfg):
            if len(records) == cfg.eval_prompts:
                break
            if is_eval_document(name, cfg.eval_fraction):
                records.append(record)
        return records

    def _stream(self, split: str, seed: int) -> BatchStream:
        return BatchStream(
            self.store.pieces(split, stored_pair), self.config.data.seq_len, self.tokenizer.pad_token_id, seed=seed,
            micro_batch=self.micro_batch_size, dp_rank=self.dist.dp_rank, dp_size=self.dist.dp_size,
        )

    def prepare_data(self) -> BatchStream:
        return self._stream("train", self.config.train.seed)

    def prepare_eval_data(self) -> list[dict[str, torch.Tensor]] | None:
        if not self.config.train.eval_every or not self.store.counts["eval_documents"]:
            return None
        stream = self._stream("eval", seed=0)
        return [next(stream) for _ in range(self.config.train.eval_batches)]

    def count_loss_units(self, batch: dict[str, torch.Tensor]) -> int:
        """The loss is a mean over pairs; ``count_loss_tokens`` (the engine's) still counts the
        tokens of both answers, so ``loss_tokens_per_s`` compares with other recipes."""
        return batch["input_ids"].shape[0] // 2

    def compute_loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        policy, lengths = answer_logps(self.model, batch)
        with torch.no_grad():
            reference, _ = answer_logps(self.reference, batch)
        loss, chosen_reward, rejected_reward = preference_loss(
            policy, reference, lengths, self.config.dpo.beta, self.config.dpo.loss_type, self.config.dpo.sft_weight
        )
        if self.model.training:  # the window's sums for log_step: accuracy, margin, rewards
            self.preference_sums += torch.stack([
                (chosen_reward > rejected_reward).sum(), (chosen_reward - rejected_reward).sum(),
                chosen_reward.sum(), rejected_reward.sum(), torch.tensor(chosen_reward.numel()),
            ]).double()
        return loss.sum()

    def log_step(self, ctx: StepContext, window: Window) -> None:
        super().log_step(ctx, window)
        sums = dp_all_reduce_sum(self.preference_sums, self.dist).clone()  # reduced in place
        self.preference_sums.zero_()
        accuracy, margin, chosen, rejected = (float(x) for x in sums[:4] / sums[4].clamp(min=1))
        self.logger.log({
            "step": self.state.step, "reward_accuracy": accuracy, "reward_margin": margin,
            "chosen_reward": chosen, "rejected_reward": rejected,
        })

    def flops_per_token(self) -> float:
        cfg = self.model.config
        return transformer_flops_per_token(
            non_embedding_params(self.model), cfg.num_hidden_layers, cfg.hidden_size, self.config.data.seq_len
        )

    # Looking at the model: export, sample, evaluate ------------------------------------------

    def hf_model(self):
        return self.model

    def hf_processing(self):
        return self.tokenizer

    @torch.no_grad()
    def task_metrics(self) -> dict[str, float]:
        """On held-out pairs: ``preferred_rate``, how often the model gives the chosen answer a
        higher log-probability than the rejected one (chance: 0.5), and ``chosen_answer_rate``,
        how often its greedy answer is the chosen one."""
        records = self.held_out_records
        if not records:
            return {}
        was_training = self.model.training
        self.model.eval()
        cfg = self.config.data
        batch = collate([tokenize_pair(self.tokenizer, r, cfg.seq_len) for r in records], cfg.seq_len, self.tokenizer.pad_token_id)
        logps, _ = answer_logps(self.model, self.to_device(batch))
        chosen, rejected = logps.chunk(2)
        prompts = [as_messages(r["prompt"], "user") for r in records]
        answers = greedy_answers(self.model, self.tokenizer, prompts, cfg.max_new_tokens)
        expected = [r["chosen"] if isinstance(r["chosen"], str) else r["chosen"][-1]["content"] for r in records]
        self.model.train(was_training)
        return {
            "preferred_rate": float((chosen > rejected).double().mean()),
            "chosen_answer_rate": sum(a == e for a, e in zip(answers, expected)) / len(records),
        }
