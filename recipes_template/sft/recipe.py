"""Supervised fine-tuning (SFT): a causal language model learns to answer chat conversations.

Read it top to bottom: configuration, the chat tokenizer, the built-in instruction set, data,
model, then the recipe class. It runs as it is (``trainwright run recipes/<name>``): a tiny
byte-level model learns a generated instruction set (add, compare, next letter, parity) on a
laptop CPU in a few minutes, and ``task_metrics()`` checks its greedy answers on held-out prompts.

Supports:
- the data users have (``engine/data_formats.py``): JSONL, JSON, parquet, CSV/TSV files and
  ``datasets`` ``save_to_disk`` folders (``data.paths``), or a data set ``datasets`` loads
  (``data.dataset``), encoded once into a store every rank and later run maps
  (``engine/token_store.py``; large data as the run's first phase), or files read as a stream
  while training (``data.streaming``, ``engine/data_stream.py``); OpenAI ``messages``, ShareGPT ``conversations``, Alpaca, prompt/completion
  and plain ``text``, recognised from the columns (``data.format``, ``data.columns`` to force and
  rename)
- the tokenizer's own chat template as it is (``engine/chat.py``): the loss is taken on the
  assistant turns only, as ``{% generation %}`` markers mark them or, in a template without
  markers (ChatML, Llama 3, Gemma), as rendering the conversation turn by turn finds them, or
  (Qwen3, which rewrites earlier turns) as they lie in the whole conversation's rendering; on a
  completion after its prompt; on every token of plain text
- reasoning and tool calls (``engine/chat_messages.py``): ``reasoning_content``/``thinking``/
  ``<think>`` as the template reads it (``data.reasoning_loss``), a ``tools`` column, ``tool_calls``
  and ``tool`` results (ShareGPT's ``function_call``/``observation`` too); the loss never covers a
  tool's result
- starting from a local Hugging Face folder (``model.pretrained_path``, e.g. a ``causal_lm``
  run exported with ``trainwright export``) or from a tiny model built from a config
- everything the engine does: FSDP2 over N processes, checkpoints resumable bit for bit,
  gradient accumulation and clipping, periodic evaluation
- the ``sequence-packing`` skill (examples are short: packing removes most padding) and the
  ``lora`` skill (only adapters train), like every skill that applies to ``causal_lm``
"""

from __future__ import annotations

import hashlib
import random
from functools import cached_property
from itertools import islice
from typing import Any, Iterator, Literal

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import Field, model_validator
from torch.distributed.checkpoint.stateful import Stateful
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from engine.chat import CHAT_TEMPLATE, byte_chat_tokenizer  # noqa: F401 (the template's chat format)
from engine.chat import conversation_mask_method, encode_completion, load_chat_tokenizer
from engine.chat import encode_conversation as encode_chat
from engine.config import ConfigError, EngineConfig, Section
from engine.data_files import DataListing, confined_path
from engine.data_formats import part_examples, read_examples, record_example
from engine.data_stream import PieceStream, Shard, StreamBatches, first_records, hold_out_of_stream, hub_shards, list_shards, shard_bytes, streamed_eval_batches
from engine.engine import IGNORE_INDEX, Engine
from engine.flops import non_embedding_params, transformer_flops_per_token
from engine.fsdp import apply_fsdp
from engine.optimizers import adamw_8bit
from engine.data_summary import added_up, split_counts
from engine.run_dir import DataSummary
from engine.data_formats import FILE_SUFFIXES
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
    vocab_size: int | None = Field(None, ge=3, description="Embedding rows; default: the tokenizer's (more: never targets).")
    tie_word_embeddings: bool = Field(False, description="The output layer is the embedding matrix.")
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2"] | None = Field(
        None, description="Attention kernel; default: sdpa, or with model.pretrained_path the model's own default."
    )
    pretrained_path: str | None = Field(
        None, description="A Hugging Face model folder, Hub id, or run:RUN_ID@STEP: an earlier run's checkpoint."
    )

    @model_validator(mode="after")
    def _built_shape_only(self) -> "ModelConfig":
        # A pretrained model's shape is its own: a key that would not act is refused, not ignored.
        if self.pretrained_path and (self.vocab_size is not None or self.tie_word_embeddings):
            raise ValueError("model.vocab_size and model.tie_word_embeddings describe a model built here; "
                             "model.pretrained_path brings its own: leave them out")
        return self


class SFTDataConfig(StoredDataConfig):
    source: Literal["builtin", "files"] | None = Field(
        None, description="builtin: the generated instruction set; files: data.paths (the default when set)."
    )
    paths: list[str] = Field(
        default_factory=list,
        description="Data files (.jsonl, .json, .parquet, .csv, .tsv), folders of them, or save_to_disk folders.",
    )
    dataset: str | None = Field(
        None, description="A data set for datasets.load_dataset: a workspace folder, or a Hub id in the local cache."
    )
    subset: str | None = Field(None, description="data.dataset: its configuration (subset) name.")
    split: str | None = Field(None, description="data.dataset or a saved DatasetDict: the split (default train).")
    format: Literal["messages", "sharegpt", "alpaca", "prompt_completion", "text"] | None = Field(
        None, description="The records' format; default: recognised from the columns."
    )
    columns: dict[str, str] = Field(
        default_factory=dict, description='Renames columns to the format\'s names, e.g. {"messages": "dialog"}.'
    )
    messages_field: str = Field("messages", description="The column of the message lists (same as data.columns.messages).")
    chat_template: str | None = Field(
        None,
        description="A Jinja chat template instead of the tokenizer's own ({% generation %} markers optional).",
    )
    reasoning_loss: bool = Field(
        True,
        description="The loss covers the assistant's <think> reasoning where the template renders it (Qwen3: after "
        "the last user message); false: never.",
    )
    eval_fraction: float = Field(
        0.05, ge=0, le=1, description="Conversations held out for evaluation (1: all, as `evaluate` with data does)."
    )
    builtin_conversations: int = Field(6000, ge=10, description="data.source=builtin: how many conversations.")
    max_turns: int = Field(3, ge=1, description="data.source=builtin: at most this many user turns each.")
    eval_prompts: int = Field(100, ge=1, description="Held-out prompts task_metrics() answers.")
    max_new_tokens: int = Field(16, ge=1, description="task_metrics(): tokens generated per answer at most.")
    streaming: bool = Field(
        False, description="Read data.paths, then a Hub data.dataset's split, as a stream while training, nothing cached (README)."
    )

    @model_validator(mode="after")
    def _source_matches_paths(self) -> "SFTDataConfig":
        given = bool(self.paths or self.dataset)
        if self.source is None:
            object.__setattr__(self, "source", "files" if given else "builtin")
        elif given and self.source != "files":
            raise ValueError(f"data.paths is set but data.source={self.source} would ignore it; drop data.source")
        elif self.source == "files" and not given:
            raise ValueError("data.source=files needs data.paths (data files, relative to the workspace) or data.dataset")
        if self.streaming and (not given or self.subset):
            raise ValueError("data.streaming reads the files of data.paths and of a Hub data.dataset's split; the "
                             "built-in set and a data.subset are read whole: leave data.streaming out, or data.subset")
        if self.streaming:
            hold_out_of_stream(self)
        return self


class SFTConfig(EngineConfig):
    model: ModelConfig = ModelConfig()
    data: SFTDataConfig = SFTDataConfig()


# =============================================================================================
# Tokenizer: the model's own chat template, and the tokens each example teaches
# =============================================================================================

# CHAT_TEMPLATE (engine/chat.py) is the byte tokenizer's: its {% generation %} markers enclose
# the assistant's content and end-of-turn token, what turn-by-turn rendering finds as well.


def load_tokenizer(model_path: str | None, chat_template: str | None):
    """The tokenizer beside the weights (the byte tokenizer when there is none), with its own
    chat template or ``data.chat_template``."""
    return load_chat_tokenizer(model_path, chat_template)


def as_example(conversation) -> dict[str, Any]:
    """A list of messages as a ``{"messages": ...}`` example; an example as it is."""
    return {"messages": conversation} if isinstance(conversation, list) else conversation


def mask_method(tokenizer, example: dict[str, Any]) -> str:
    """Which tokens of ``example`` the loss covers: the assistant's (by the template's markers, by
    rendering turn by turn, or found in the whole rendering), a completion's, or all of a plain text's."""
    if "messages" in example:
        return conversation_mask_method(tokenizer, example["messages"] or None, example.get("tools"))
    return "completion" if "completion" in example else "all_tokens"


def encode_conversation(
    tokenizer, conversation, where: str = "a conversation", reasoning: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(tokens, loss_mask)`` of an example (or a list of messages) as the chat template renders it
    (with the example's ``tools``); ``reasoning=False``: the ``<think>`` blocks are not learnt."""
    example = as_example(conversation)
    tools = example.get("tools")
    if "messages" in example:
        tokens, mask = encode_chat(tokenizer, example["messages"], where, tools, reasoning)
    elif "completion" in example:
        tokens, mask = encode_completion(tokenizer, example["prompt"], example["completion"], where, tools, reasoning)
    else:
        tokens = tokenizer(example["text"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        mask = [True] * len(tokens)
    # Through numpy: torch.tensor of a list of thousands of ids costs 3-4 times as much (7% of preparing the data).
    return torch.from_numpy(np.array(tokens, dtype=np.int64)), torch.from_numpy(np.array(mask, dtype=np.bool_))


def encode_example(tokenizer, conversation, seq_len: int, where: str = "a conversation", reasoning: bool = True):
    """``(piece, dropped_why, truncated)``: the example as a ``2 × n`` piece (tokens, and targets:
    the same tokens where the loss covers them, ``IGNORE_INDEX`` elsewhere) cut to ``seq_len + 1``
    tokens, or None and why when there is nothing to learn from it."""
    example = as_example(conversation)
    answers = example.get("messages", example.get("completion"))
    if answers is not None and not any(
        m["content"].strip() or m.get("tool_calls") or m.get("reasoning_content") for m in answers if m["role"] == "assistant"
    ):
        return None, "no assistant answer (empty or missing)", False
    tokens, mask = encode_conversation(tokenizer, example, where, reasoning)
    targets = torch.where(mask, tokens, IGNORE_INDEX)
    piece = torch.stack([tokens, targets])[:, : seq_len + 1]
    if not (piece[1, 1:] != IGNORE_INDEX).any():
        return None, f"every assistant token lies past data.seq_len={seq_len}", True
    return piece, None, tokens.shape[0] > seq_len + 1


def seq_len_to_learn(tokenizer, conversation, where: str = "a conversation", reasoning: bool = True) -> int:
    """The smallest ``data.seq_len`` at which the example keeps a token to learn."""
    tokens, mask = encode_conversation(tokenizer, as_example(conversation), where, reasoning)
    return int(mask[1:].nonzero()[0, 0]) + 1


# =============================================================================================
# The built-in instruction set: generated tasks whose answers can be checked
# =============================================================================================

LETTERS = "abcdefghijklmnopqrstuvwxyz"
SYSTEM_PROMPT = "You answer with the result only."


def make_task(rng: random.Random) -> tuple[str, str, int]:
    """One ``(question, answer, number of possible answers)``: the last says what guessing scores."""
    kind = rng.choice(("add", "larger", "next", "parity"))
    if kind == "add":
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        return f"What is {a} + {b}?", str(a + b), 19
    if kind == "larger":
        a, b = rng.sample(range(10, 100), 2)
        return f"Which is larger, {a} or {b}?", str(max(a, b)), 2
    if kind == "next":
        letter = rng.choice(LETTERS[:-1])
        return f"Which letter comes after {letter}?", LETTERS[LETTERS.index(letter) + 1], 25
    number = rng.randint(10, 99)
    return f"Is {number} even or odd?", "odd" if number % 2 else "even", 2


def builtin_conversations(count: int, max_turns: int, seed: int = 0) -> list[tuple[str, list[dict[str, str]]]]:
    """``(name, messages)``: conversations of 1 to ``max_turns`` tasks, some with a system prompt.
    Always the same ones for the same arguments."""
    rng = random.Random(seed)
    conversations = []
    for i in range(count):
        messages = [{"role": "system", "content": SYSTEM_PROMPT}] if rng.random() < 0.3 else []
        for _ in range(rng.randint(1, max_turns)):
            question, answer, _ = make_task(rng)
            messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        conversations.append((f"builtin-{i}", messages))
    return conversations


def chance_accuracy(count: int = 2000, seed: int = 1) -> float:
    """The accuracy of guessing uniformly among each task's possible answers."""
    rng = random.Random(seed)
    return sum(1 / make_task(rng)[2] for _ in range(count)) / count


# =============================================================================================
# Data: conversations → (tokens, targets) pieces → padded batches
# =============================================================================================


def load_conversations(
    cfg: SFTDataConfig, listing: DataListing | None = None
) -> tuple[list[tuple[str, dict[str, Any]]], list[str]]:
    """``(examples, formats)``: ``(name, example)`` pairs — the name decides the train/eval split,
    so it must be stable — and the formats the sources were read in. The files read are
    fingerprinted into ``listing``."""
    formats: list[str] = []
    return list(read_conversations(cfg, listing, formats)), sorted(set(formats))


def read_conversations(cfg: SFTDataConfig, listing: DataListing | None = None, formats: list[str] | None = None,
                       head: int | None = None) -> Iterator[tuple[str, dict[str, Any]]]:
    """The ``(name, example)`` pairs of :func:`load_conversations`, read one at a time; the
    format of each source is appended to ``formats``. ``head``: only the first examples of each
    source."""
    if cfg.source == "builtin":
        if formats is not None:
            formats.append("messages")
        for name, m in builtin_conversations(cfg.builtin_conversations, cfg.max_turns):
            yield name, {"messages": m}
        return
    found = False
    for source in read_examples(
        "sft", cfg.paths, format=cfg.format, columns=record_columns(cfg), dataset=cfg.dataset, subset=cfg.subset,
        split=cfg.split, listing=listing,
    ):
        if formats is not None:
            formats.append(source.format)
        for example in islice(source.records, head):
            found = True
            yield example
    if not found:
        raise ConfigError(NO_EXAMPLES.format(paths=cfg.paths, dataset=cfg.dataset))


NO_EXAMPLES = "no examples in data.paths={paths} data.dataset={dataset}"


def record_columns(cfg: SFTDataConfig) -> dict[str, str]:
    """The renames of data.columns, with data.messages_field's."""
    columns = dict(cfg.columns)
    if cfg.messages_field != "messages":
        columns.setdefault("messages", cfg.messages_field)
    return columns


def token_store(cfg: SFTDataConfig, tokenizer, listing: DataListing) -> TokenStore | None:
    """Every example encoded once (:func:`encode_example`: a ``2 × n`` piece of tokens and
    targets), train and held-out apart, with the data summary's counts, in the store of the
    data's fingerprint, the tokenizer (chat template included) and the settings that change
    tokens; built on first use (one example in memory at a time), mapped by every rank and
    later run. A file that changes while it is encoded fails the build, which keeps nothing.
    None in the launch check for data left to the run (:func:`engine.token_store.leave_to_run`),
    once the first examples of each file encode and the disk has room for the store."""
    if cfg.source == "builtin":
        identity, size = ["builtin", cfg.builtin_conversations, cfg.max_turns], 0
    else:
        identity, size = data_identity(cfg.paths, FILE_SUFFIXES, listing, cfg.dataset)
    key = store_key(template="sft", data=identity, tokenizer=tokenizer_identity(tokenizer), seq_len=cfg.seq_len,
                    eval_fraction=cfg.eval_fraction, format=cfg.format, columns=cfg.columns,
                    messages_field=cfg.messages_field, subset=cfg.subset, split=cfg.split,
                    reasoning_loss=cfg.reasoning_loss)

    def read_head(examples: int) -> None:
        for name, example in read_conversations(cfg, DataListing(hashing=False), head=examples):  # hashed just now
            encode_example(tokenizer, example, cfg.seq_len, name, cfg.reasoning_loss)

    if leave_to_run(key, size, cfg.tokenize_in_check_mb, read_head):
        return None

    def add_examples(store, examples, formats: set[str]) -> dict[str, Any]:
        counts = {True: [0, 0, 0], False: [0, 0, 0]}  # held out? -> [conversations, tokens, loss tokens]
        names, masks, dropped = set(), set(), {}
        truncated, keep = 0, {0}
        for name, example in examples:
            piece, why, cut = encode_example(tokenizer, example, cfg.seq_len, name, cfg.reasoning_loss)
            store.progress.advance(documents=1, bytes_read=text_size(example))
            truncated += cut
            names.add(name.split(":", 1)[0])
            if piece is None:
                dropped[why] = dropped.get(why, 0) + 1
                keep.add(seq_len_to_learn(tokenizer, example, name, cfg.reasoning_loss) if cut else 0)
                continue
            masks.add(mask_method(tokenizer, example))
            held_out = is_eval_document(name, cfg.eval_fraction)
            store.add("eval" if held_out else "train", piece.numpy())
            counted = counts[held_out]
            counted[0] += 1
            counted[1] += int(piece.shape[1])  # every token of the example, as cut to data.seq_len
            counted[2] += int((piece[1, 1:] != IGNORE_INDEX).sum())  # the labels: what the loss is over
        return dict(counts=counts, names=names, masks=masks, dropped=dropped, formats=formats, truncated=truncated,
                    keep=keep)

    def add_part(store, files, index: int) -> dict[str, Any]:
        source = part_examples("sft", *files[index], format=cfg.format, columns=record_columns(cfg))
        return add_examples(store, source.records if source else [], {source.format} if source else set())

    def build(store) -> dict[str, Any]:
        read = DataListing()
        if cfg.source == "files":  # files, saved folders and data.dataset in parts (a large one: several)
            files = source_parts(cfg.paths, FILE_SUFFIXES, read, cfg.dataset, cfg.subset, cfg.split)
            parts = build_in_parts(store, len(files), lambda part, i: add_part(part, files, i))
            total = added_up([add_examples(store, [], set()), *parts])  # nothing's counts, then each part's
            if not sum(counted[0] for counted in total["counts"].values()) + sum(total["dropped"].values()):
                raise ConfigError(NO_EXAMPLES.format(paths=cfg.paths, dataset=cfg.dataset))
        else:
            formats: list[str] = []  # each source's, told as read_conversations reads it
            total = add_examples(store, read_conversations(cfg, read, formats), set())
            total["formats"].update(formats)
        if read.fingerprint() != listing.fingerprint() or read.changed():
            raise ConfigError("the data changed while it was tokenized; launch again once it is written")
        dropped = total["dropped"]
        return dict(
            files=len(total["names"]) if cfg.source == "files" else None,
            **split_counts(total["counts"]),
            format=", ".join(sorted(total["formats"])),
            mask=", ".join(sorted(total["masks"])) or None,
            truncated=total["truncated"],
            dropped=sum(dropped.values()),
            dropped_why="; ".join(f"{n}: {why}" for why, n in sorted(dropped.items())) or None,
            seq_len_to_keep=max(total["keep"]) or None,
        )

    return open_or_build(key, rows=2, dtype="int32", build=build, input_bytes=size, whole_size=not cfg.dataset)


def stream_shards(cfg: SFTDataConfig, listing: DataListing | None = None) -> list[Shard]:
    """data.streaming: the record files of data.paths (.jsonl, .json, .parquet, .csv, .tsv), then
    those of data.dataset's split (default train) in the Hub snapshot the server bound, in the
    order they are read."""
    shards = [shard for shard in list_shards(cfg.paths, listing) if shard.path.suffix in FILE_SUFFIXES] if cfg.paths else []
    if cfg.paths and not shards:
        raise ConfigError(f"no data files in data.paths={cfg.paths} ({', '.join(sorted(FILE_SUFFIXES))})")
    return shards + (hub_shards(cfg.dataset, cfg.split or "train") if cfg.dataset else [])


def stream_pieces(cfg: SFTDataConfig, tokenizer):
    """data.streaming: a record's pieces: its example (its format told from its own columns, or
    data.format) encoded as :func:`token_store` encodes it; none when it has nothing to learn."""
    columns = record_columns(cfg)

    def pieces_of(where: str, record: dict[str, Any]) -> list[torch.Tensor]:
        _, example = record_example("sft", record, where, cfg.format, columns)
        piece, _, _ = encode_example(tokenizer, example, cfg.seq_len, where, cfg.reasoning_loss)
        return [] if piece is None else [piece]

    return pieces_of


def stream_summary(cfg: SFTDataConfig, tokenizer, described: str) -> DataSummary:
    """What is known of streamed data before it is read: its files and bytes; the first records
    of the first file are read and encoded, so a bad record is refused now, naming it."""
    listing = DataListing()
    shards = stream_shards(cfg, listing)
    pieces_of = stream_pieces(cfg, tokenizer)
    for where, record in first_records(shards):
        pieces_of(where, record)
    return DataSummary.streamed("files", [*cfg.paths, *([cfg.dataset] if cfg.dataset else [])], len(shards),
                                shard_bytes(shards), tokenizer=described, **listing.summary_fields())


def is_eval_document(name: str, eval_fraction: float) -> bool:
    bucket = int(hashlib.sha1(name.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF
    return eval_fraction >= 1 or bucket < eval_fraction


def tokenize_conversations(conversations, tokenizer, seq_len: int, reasoning: bool = True) -> list[torch.Tensor]:
    """Each conversation as a ``2 × n`` piece (:func:`encode_example`); those with nothing to
    learn are left out (the data summary counts them as dropped)."""
    pieces = []
    for conversation in conversations:
        piece, _, _ = encode_example(tokenizer, conversation, seq_len, reasoning=reasoning)
        if piece is not None:
            pieces.append(piece)
    return pieces


def collate(pieces: list[torch.Tensor], seq_len: int, pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad pieces to the longest of the batch (at most ``seq_len``): the input is a piece's
    tokens, the label at each position the next token's target (so only the assistant's tokens
    are learnt)."""
    seq_len = min(seq_len, max(piece.shape[-1] - 1 for piece in pieces))
    input_ids = torch.full((len(pieces), seq_len), pad_id, dtype=torch.int64)
    labels = torch.full((len(pieces), seq_len), IGNORE_INDEX, dtype=torch.int64)
    for row, piece in enumerate(pieces):
        n = piece.shape[-1] - 1
        input_ids[row, :n] = piece[0, :-1]
        labels[row, :n] = piece[1, 1:]
    position_ids = torch.arange(seq_len).expand(len(pieces), seq_len).clone()
    return {"input_ids": input_ids, "labels": labels, "position_ids": position_ids}


class BatchStream(Stateful):
    """This rank's micro-batches, forever: each epoch visits the pieces in a new seeded order.

    The data position counts the sequences of the *global* batch stream consumed so far, so a
    checkpoint resumes with the very next batch on any number of processes.
    """

    def __init__(self, pieces, seq_len, pad_id, seed, micro_batch, dp_rank, dp_size):
        self.pieces, self.seq_len, self.pad_id, self.seed = pieces, seq_len, pad_id, seed
        self.micro_batch = micro_batch
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.position = 0  # global sequences consumed
        self._order: tuple[int, torch.Tensor] | None = None

    def _piece_at(self, index: int):
        epoch, offset = divmod(index, len(self.pieces))
        if self._order is None or self._order[0] != epoch:
            generator = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
            self._order = (epoch, torch.randperm(len(self.pieces), generator=generator))
        return self.pieces[int(self._order[1][offset])]

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        start = self.position + self.dp_rank * self.micro_batch
        batch = [self._piece_at(i) for i in range(start, start + self.micro_batch)]
        self.position += self.micro_batch * self.dp_size
        return collate(batch, self.seq_len, self.pad_id)

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.position = int(state_dict["position"])


# =============================================================================================
# Model, and greedy answers for the task metric
# =============================================================================================


def build_model(cfg: ModelConfig, vocab_size: int, seq_len: int) -> torch.nn.Module:
    if cfg.pretrained_path:
        # The family's own attention unless one is asked for (Gemma 2 has no sdpa, for one).
        chosen = {"attn_implementation": cfg.attn_implementation} if cfg.attn_implementation else {}
        return AutoModelForCausalLM.from_pretrained(confined_path(cfg.pretrained_path), dtype=torch.float32, **chosen)
    rows = cfg.vocab_size or vocab_size
    if rows < vocab_size:
        raise ConfigError(f"model.vocab_size={rows} is below the tokenizer's {vocab_size} tokens: every token needs a row")
    config = LlamaConfig(
        vocab_size=rows,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=2 * seq_len,  # room for generated answers after a full prompt
        rope_theta=cfg.rope_theta,
        tie_word_embeddings=cfg.tie_word_embeddings,
        attn_implementation=cfg.attn_implementation or "sdpa",
    )
    return LlamaForCausalLM(config)


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


class SFT(Engine):
    """Supervised fine-tuning on chat conversations; the loss covers the assistant's tokens only."""

    config_class = SFTConfig

    @cached_property
    def tokenizer(self):
        return load_tokenizer(self.config.model.pretrained_path, self.config.data.chat_template)

    def prepare_model(self) -> torch.nn.Module:
        model = build_model(self.config.model, len(self.tokenizer), self.config.data.seq_len)
        model = model.to(self.device)
        model = apply_fsdp(model, self.dist, self.config.parallel)
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
    def summarize_data(cls, config: SFTConfig) -> DataSummary:
        cfg = config.data
        tokenizer = f"from {config.model.pretrained_path}" if config.model.pretrained_path else "bytes (chat)"
        if cfg.streaming:
            return stream_summary(cfg, load_tokenizer(config.model.pretrained_path, cfg.chat_template), tokenizer)
        listing = DataListing()
        store = token_store(cfg, load_tokenizer(config.model.pretrained_path, cfg.chat_template), listing)
        paths = cfg.paths + ([cfg.dataset] if cfg.dataset else [])
        if store is None:  # the run tokenizes it as its first phase
            return DataSummary.left_to_run(cfg.source, paths, len(listing.files),
                                           sum(path.stat().st_size for path in listing.files), tokenizer=tokenizer,
                                           **listing.summary_fields())
        return DataSummary(source=cfg.source, paths=paths[:20], tokenizer=tokenizer, **store.counts,
                           **listing.summary_fields())

    @cached_property
    def store(self) -> TokenStore:
        """The encoded examples, mapped (built by the launch check, or now when it was not)."""
        return token_store(self.config.data, self.tokenizer, self.data_listing)

    @cached_property
    def held_out_examples(self) -> list[dict[str, Any]]:
        """The first ``data.eval_prompts`` held-out examples, for the task metric (none of a
        stream, unless all of it is held out)."""
        cfg, examples = self.config.data, []
        if cfg.streaming and cfg.eval_fraction < 1:
            return examples
        for name, example in read_conversations(cfg):
            if len(examples) == cfg.eval_prompts:
                break
            if is_eval_document(name, cfg.eval_fraction):
                examples.append(example)
        return examples

    def stream_batches(self) -> StreamBatches:
        """data.streaming: this rank's batches from its share of the stream's shards, read as they go."""
        cfg = self.config.data
        stream = PieceStream(stream_shards(cfg), stream_pieces(cfg, self.tokenizer), self.dist.dp_rank,
                             self.dist.dp_size)
        return StreamBatches(stream, self.micro_batch_size,
                             lambda pieces: collate(pieces, cfg.seq_len, self.tokenizer.pad_token_id))

    def prepare_data(self) -> BatchStream | StreamBatches:
        cfg = self.config.data
        if cfg.streaming:
            if cfg.eval_fraction >= 1:
                raise ConfigError("no training data: data.streaming with data.eval_fraction=1 holds out all of it")
            return self.stream_batches()
        pieces = self.store.pieces("train", torch.from_numpy)
        return BatchStream(
            pieces,
            cfg.seq_len,
            self.tokenizer.pad_token_id,
            seed=self.config.train.seed,
            micro_batch=self.micro_batch_size,
            dp_rank=self.dist.dp_rank,
            dp_size=self.dist.dp_size,
        )

    def prepare_eval_data(self) -> list[dict[str, torch.Tensor]] | None:
        if self.config.data.streaming:
            return streamed_eval_batches(self.config, self.stream_batches)
        if not self.config.train.eval_every or not self.store.counts["eval_documents"]:
            return None
        cfg = self.config.data
        pieces = self.store.pieces("eval", torch.from_numpy)
        stream = BatchStream(
            pieces, cfg.seq_len, self.tokenizer.pad_token_id, seed=0,
            micro_batch=self.micro_batch_size,
            dp_rank=self.dist.dp_rank, dp_size=self.dist.dp_size,
        )
        return [next(stream) for _ in range(self.config.train.eval_batches)]

    def compute_loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        logits = self.model(
            input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False
        ).logits
        return F.cross_entropy(
            logits.flatten(0, 1).float(),
            batch["labels"].flatten(),
            ignore_index=IGNORE_INDEX,
            reduction="sum",
        )

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

    def held_out_prompts(self) -> list[tuple[list[dict[str, str]], str]]:
        """``(conversation up to its last user turn, the expected last answer)``, held out."""
        examples = []
        for example in self.held_out_examples:
            messages = example.get("messages", example.get("prompt", []) + example.get("completion", []))
            answers = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
            if answers:  # plain text has no prompt to answer
                examples.append((messages[: answers[-1]], messages[answers[-1]]["content"]))
        return examples

    def task_metrics(self) -> dict[str, float]:
        """``answer_accuracy``: the share of held-out prompts whose greedy answer is exactly right."""
        examples = self.held_out_prompts()
        if not examples:
            return {}
        was_training = self.model.training
        self.model.eval()
        answers = greedy_answers(self.model, self.tokenizer, [p for p, _ in examples], self.config.data.max_new_tokens)
        self.model.train(was_training)
        correct = sum(answer == expected for answer, (_, expected) in zip(answers, examples))
        return {"answer_accuracy": correct / len(examples)}
