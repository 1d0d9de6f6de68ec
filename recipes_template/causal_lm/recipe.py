"""Causal language model: a Llama-style decoder, trained with the trainwright engine.

Read it top to bottom: configuration, tokenizer, data, model, then the recipe class that ties
them together. It runs as it is (``trainwright run recipes/<name>``) and trains a tiny model
on the CPython standard library's sources, byte by byte, in a few minutes on a laptop CPU.

Supports:
- data parallelism with FSDP2 (``--nproc N``), mixed precision (``parallel.param_dtype``)
- gradient accumulation and clipping, warm-up + cosine LR, periodic evaluation
- checkpoints every ``checkpoint.every`` steps, resumable on any number of processes
- a tiny model built from a ``transformers`` config, or local weights (``model.pretrained_path``)
- export as a Hugging Face folder (``trainwright export``), the byte tokenizer included
- the CPython standard library as a corpus, or local .txt/.md/.py files and .jsonl documents
  (``data.source=files``, ``data.paths=[...]``), or random tokens for throughput benchmarks
  (``data.source=random``, ``data.vocab_size=...``)

Skills (``trainwright skills list``) write more techniques into this file as reviewable code.
"""

from __future__ import annotations

import hashlib
import sysconfig
from functools import cached_property
from itertools import islice
from pathlib import Path
from typing import Any, Iterator, Literal

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import Field, model_validator
from torch.distributed.checkpoint.stateful import Stateful
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
from transformers.convert_slow_tokenizer import bytes_to_unicode

from engine.config import ConfigError, EngineConfig, Section
from engine.data_files import DataListing, LineRange, confined_path, data_files
from engine.data_formats import READERS as RECORD_READERS
from engine.data_formats import DatasetRows, RowGroups, file_rows, is_saved_dataset, record_rows
from engine.data_stream import (
    PieceStream,
    Shard,
    StreamBatches,
    check_shuffle_buffer,
    first_records,
    hold_out_of_stream,
    streamed_eval_batches,
    hub_shards,
    list_shards,
    shard_bytes,
)
from engine.engine import IGNORE_INDEX, Engine, is_compiled
from engine.data_summary import added_up, split_counts
from engine.run_dir import DataSummary
from engine.flops import non_embedding_params, transformer_flops_per_token
from engine.fsdp import apply_fsdp
from engine.optimizers import adamw_8bit
from engine.store_parts import build_in_parts, source_parts
from engine.token_store import (
    StoredDataConfig,
    TokenStore,
    data_identity,
    leave_to_run,
    open_or_build,
    store_key,
    tokenizer_identity,
    value_dtype,
)

# =============================================================================================
# Configuration (defaults are the benchmark's reference point; override with --set or
# config.yaml)
# =============================================================================================


class ModelConfig(Section):
    hidden_size: int = Field(256, ge=8, description="Model width.")
    intermediate_size: int = Field(688, ge=8, description="MLP width.")
    num_layers: int = Field(4, ge=1, description="Decoder layers.")
    num_heads: int = Field(4, ge=1, description="Attention heads.")
    num_kv_heads: int = Field(2, ge=1, description="Key/value heads (GQA).")
    rope_theta: float = Field(10000.0, gt=0, description="RoPE base frequency.")
    vocab_size: int | None = Field(None, ge=3, description="Embedding rows (default: tokenizer's).")
    tie_word_embeddings: bool = Field(False, description="Output layer = embeddings.")
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2"] = Field(
        "sdpa", description="Kernel (flash_attention_2: CUDA)."
    )
    pretrained_path: str | None = Field(
        None, description="A model folder, Hub id or run:RUN_ID@STEP."
    )

    @model_validator(mode="after")
    def _built_shape_only(self) -> "ModelConfig":
        # A pretrained model's shape is its own: a key that would not act is refused, not ignored.
        if self.pretrained_path and (self.vocab_size is not None or self.tie_word_embeddings):
            raise ValueError("model.vocab_size and model.tie_word_embeddings describe a model built here; "
                             "model.pretrained_path brings its own: leave them out")
        return self


class CausalLMDataConfig(StoredDataConfig):
    source: Literal["stdlib", "files", "random"] | None = Field(
        None,
        description="files: data.paths (default if set); stdlib: CPython's; random: ids.",
    )
    paths: list[str] = Field(
        default_factory=list,
        description=".txt/.md/.py (a document each), .jsonl/.json/.parquet/.csv/.tsv, dirs.",
    )
    text_field: str = Field("text", description="Records' text column.")
    eval_fraction: float = Field(
        0.05, ge=0, le=1, description="Held out (1: all, for evaluate)."
    )
    vocab_size: int = Field(32000, ge=3, description="source=random: ids < this.")
    random_documents: int = Field(10000, ge=1, description="source=random: documents.")
    streaming: bool = Field(False, description="Read data as it trains (README).")
    pad_to_longest: bool | None = Field(None, description="Pad to longest (README).")
    shuffle_buffer: int = Field(0, ge=0, description="Streamed: shuffle N pieces at once.")
    dataset: str | None = Field(None, description="Streamed: a Hub dataset's train split.")

    @model_validator(mode="after")
    def _source_matches_paths(self) -> "CausalLMDataConfig":
        # No combination of keys may train on other data than asked for.
        if self.dataset is not None and not self.streaming:
            raise ValueError("data.dataset is read as a stream: set data.streaming=true")
        if self.source is None:
            object.__setattr__(self, "source", "files" if self.paths or self.dataset else "stdlib")
        elif self.paths and self.source != "files":
            raise ValueError(
                f"data.paths is set but data.source={self.source} would ignore it; "
                "drop data.source (or set it to files) to train on data.paths"
            )
        elif self.source == "files" and not self.paths and not self.dataset:
            raise ValueError("data.source=files needs data.paths (files or folders, relative to the workspace)")
        if self.shuffle_buffer and not self.streaming:
            raise ValueError("data.shuffle_buffer shuffles a stream (data.streaming=true); without it every "
                             "epoch is shuffled whole already: leave it out")
        if self.streaming and self.source != "files":
            raise ValueError(f"data.streaming reads data.paths; data.source={self.source} has none to stream")
        if self.streaming:
            hold_out_of_stream(self)
            check_shuffle_buffer(self)
        return self


class CausalLMConfig(EngineConfig):
    model: ModelConfig = ModelConfig()
    data: CausalLMDataConfig = CausalLMDataConfig()


# =============================================================================================
# Tokenizer: bytes are tokens (0-255), plus end-of-document and padding
# =============================================================================================


class ByteTokenizer:
    eos_token_id = 256
    pad_token_id = 257
    vocab_size = 258

    def encode(self, text: str) -> torch.Tensor:
        return torch.from_numpy(np.frombuffer(text.encode("utf-8", errors="replace"), dtype=np.uint8).astype(np.int64))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    identity = "bytes"

    def to_hf(self) -> PreTrainedTokenizerFast:
        """The same tokenizer as a ``tokenizers``-backed Hugging Face tokenizer (saved beside an
        exported model; ``AutoTokenizer`` loads it): a byte-level BPE without merges, so id b is
        byte b, and the end-of-document and padding tokens as ids 256 and 257."""
        byte_char = bytes_to_unicode()  # the byte-level alphabet: a printable character per byte
        backend = Tokenizer(models.BPE(vocab={byte_char[b]: b for b in range(256)}, merges=[]))
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        backend.decoder = decoders.ByteLevel()
        return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>", pad_token="<|pad|>")


class PretrainedTokenizer:
    """The tokenizer that came with local weights, behind the same small interface."""

    def __init__(self, path: str):
        self.tokenizer = AutoTokenizer.from_pretrained(confined_path(path))
        self.eos_token_id = self.tokenizer.eos_token_id
        pad = self.tokenizer.pad_token_id
        self.pad_token_id = pad if pad is not None else self.eos_token_id
        self.vocab_size = len(self.tokenizer)

    def encode(self, text: str) -> torch.Tensor:
        return torch.tensor(self.tokenizer.encode(text, add_special_tokens=False), dtype=torch.int64)

    @cached_property
    def identity(self) -> str:
        """What the tokenized data store is keyed by: the tokenizer's whole definition."""
        return tokenizer_identity(self.tokenizer)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)


class RandomTokens:
    """data.source=random: the documents are token ids already; end-of-document and padding are
    the last two ids of the vocabulary."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self.eos_token_id = vocab_size - 2
        self.pad_token_id = vocab_size - 1

    def encode(self, ids: torch.Tensor) -> torch.Tensor:
        return ids

    @property
    def identity(self) -> str:
        return f"random ids below {self.vocab_size}"

    def decode(self, ids: list[int]) -> str:
        return " ".join(str(i) for i in ids)


def data_tokenizer(config: "CausalLMConfig"):
    """The tokenizer of the config's data: random ids, the pretrained model's, or bytes."""
    if config.data.source == "random":
        return RandomTokens(config.data.vocab_size)
    path = config.model.pretrained_path
    return PretrainedTokenizer(path) if path else ByteTokenizer()


# =============================================================================================
# Data: documents → token pieces of at most seq_len + 1 tokens (tokenized once, into a store
# that every rank and later run maps) → padded batches
# =============================================================================================

_STDLIB_SKIP = {"site-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__"}


def stdlib_files() -> list[Path]:
    """The CPython standard library's ``.py`` files (without its tests), in a fixed order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files: list[Path] = []
    stack = [root]
    while stack:
        folder = stack.pop()
        for entry in sorted(folder.iterdir()):
            if entry.is_dir() and entry.name not in _STDLIB_SKIP:
                stack.append(entry)
            elif entry.suffix == ".py" and entry.is_file():
                files.append(entry)
    return sorted(files)


def load_documents(cfg: CausalLMDataConfig, listing: DataListing | None = None) -> list[tuple[str, Any]]:
    """``(name, text)`` pairs (token ids for data.source=random), all in memory; a run reads
    them one at a time (:func:`read_documents`) into its token store."""
    return list(read_documents(cfg, listing))


def read_documents(cfg: CausalLMDataConfig, listing: DataListing | None = None,
                   head: int | None = None) -> Iterator[tuple[str, Any]]:
    """``(name, text)`` pairs, read one at a time, the files fingerprinted into ``listing``. The
    name decides the train/eval split, so it must be stable. ``head``: only the first records of
    each file (and of a saved data set)."""
    if cfg.source == "random":
        yield from random_documents(cfg)
        return
    if cfg.source == "stdlib":
        root = Path(sysconfig.get_paths()["stdlib"])
        for p in stdlib_files():
            yield str(p.relative_to(root)), p.read_text(errors="replace")
        return
    found = False
    for where, record in islice(record_rows([p for p in cfg.paths if is_saved_dataset(Path(p))], listing=listing), head):
        found = True
        yield where, _text(record, cfg.text_field, where)
    for path, name in _expand_paths([p for p in cfg.paths if not is_saved_dataset(Path(p))], listing):
        for document in file_documents(cfg, path, name, head=head):
            found = True
            yield document
    if not found:
        raise ConfigError(NO_DOCUMENTS.format(paths=cfg.paths))


DOCUMENT_SUFFIXES = {".txt", ".md", ".py", *RECORD_READERS}  # a document each, or a record each
NO_DOCUMENTS = "no documents in data.paths={paths} (.txt, .md, .py files, .jsonl lines)"


def file_documents(cfg: CausalLMDataConfig, path: Path, name: str, part: LineRange | RowGroups | DatasetRows | None = None,
                   head: int | None = None) -> Iterator[tuple[str, str]]:
    """The ``(name, text)`` pairs of one data file (``name``: as :func:`_expand_paths` names it;
    ``part``: of a JSONL or parquet file, those lines or row groups only; of a saved folder, those rows)."""
    if part is not None or path.suffix in RECORD_READERS:  # a text column of each record
        for where, record in islice(file_rows(path, name, part), head):
            yield where, _text(record, cfg.text_field, where)
    else:
        yield name, path.read_text(errors="replace")


def _text(record: dict[str, Any], field: str, where: str) -> str:
    if not isinstance(record.get(field), str):
        raise ConfigError(f"{where}: no text under {field!r} (columns: {sorted(record)[:20]}; set data.text_field)")
    return record[field]


def random_documents(cfg: CausalLMDataConfig) -> list[tuple[str, torch.Tensor]]:
    """``(name, token ids)`` pairs: ``random_documents`` documents of uniformly random tokens,
    16 to 2 × seq_len long (so rows are padded, or packed), always the same ones."""
    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(16, 2 * cfg.seq_len + 1, (cfg.random_documents,), generator=generator)
    return [
        (f"random-{i}", torch.randint(0, cfg.vocab_size - 2, (int(n),), generator=generator))
        for i, n in enumerate(lengths)
    ]


def _expand_paths(paths: list[str], listing: DataListing | None = None) -> list[tuple[Path, str]]:
    """``(file, name)`` for each file; the name (relative to the folder given, or the file's own
    name) keeps the train/eval split the same wherever the data is stored. Files outside the
    workspace (also through a link) are refused."""
    return data_files(paths, suffixes=DOCUMENT_SUFFIXES, listing=listing)


def document_identity(cfg: CausalLMDataConfig, listing: DataListing) -> tuple[Any, int]:
    """What the documents are, for the token store's key, and their size in bytes: the files'
    fingerprint (listed into ``listing``), the standard library's files with their sizes and
    times, or the random documents' settings."""
    if cfg.source == "random":
        return ["random", cfg.vocab_size, cfg.random_documents, cfg.seq_len], 0
    if cfg.source == "stdlib":
        files = [(str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in stdlib_files()]
        return ["stdlib", hashlib.sha256(repr(files).encode()).hexdigest()], sum(f[1] for f in files)
    identity, size = data_identity(cfg.paths, DOCUMENT_SUFFIXES, listing)
    return ["files", identity, cfg.text_field], size


def _refuse_unused_data_folder() -> None:
    """A data/ folder beside this recipe, while the run would train on the standard library by
    default, is almost surely data meant for the run: say so rather than ignore it."""
    folder = Path(__file__).resolve().parent / "data"
    if folder.is_dir() and any(p.is_file() for p in folder.rglob("*")):
        raise ConfigError(
            "the recipe has a data/ folder, but data.paths is not set, so the run would train on the "
            "CPython standard library; set data.paths to the files to train on (relative to the "
            "workspace), or data.source=stdlib to train on the standard library anyway"
        )


def is_eval_document(name: str, eval_fraction: float) -> bool:
    bucket = int(hashlib.sha1(name.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF
    return eval_fraction >= 1 or bucket < eval_fraction


def tokenize_documents(texts: list[str], tokenizer, seq_len: int) -> list[torch.Tensor]:
    """Each document, ended by EOS, cut into pieces of at most ``seq_len + 1`` tokens.

    A piece of n tokens gives n - 1 (input, next-token) pairs; pieces never cross documents.
    """
    return [piece for text in texts for piece in document_pieces(text, tokenizer, seq_len)]


def document_pieces(text, tokenizer, seq_len: int) -> list[torch.Tensor]:
    ids = torch.cat([tokenizer.encode(text), torch.tensor([tokenizer.eos_token_id])])
    return [ids[start : start + seq_len + 1] for start in range(0, len(ids) - 1, seq_len)]


def token_store(cfg: CausalLMDataConfig, tokenizer, listing: DataListing) -> TokenStore | None:
    """The data tokenized into pieces (:func:`document_pieces`), train and held-out apart, in
    the store of its fingerprint, tokenizer and settings: built on first use (one document in
    memory at a time), mapped by every rank and every later run. The data files are listed into
    ``listing``; a file that changes while it is tokenized fails the build, which keeps nothing.
    None in the launch check for data left to the run (:func:`engine.token_store.left_to_run`),
    once the head of each file reads and tokenizes and the disk has room for the store."""
    identity, size = document_identity(cfg, listing)
    key = store_key(template="causal_lm", data=identity, tokenizer=tokenizer.identity, seq_len=cfg.seq_len,
                    eval_fraction=cfg.eval_fraction)

    def read_head(records: int) -> None:
        for _, text in read_documents(cfg, DataListing(hashing=False), head=records):  # hashed just now
            tokenizer.encode(text)

    if leave_to_run(key, size, cfg.tokenize_in_check_mb, read_head):
        return None

    def add_documents(store, documents) -> dict[str, Any]:
        counts = {"train": [0, 0], "eval": [0, 0], "names": set()}  # [documents, tokens]
        for name, text in documents:
            split = "eval" if is_eval_document(name, cfg.eval_fraction) else "train"
            ids = np.append(tokenizer.encode(text).numpy(), tokenizer.eos_token_id)  # as document_pieces cuts it
            for start in range(0, len(ids) - 1, cfg.seq_len):
                store.add(split, ids[start : start + cfg.seq_len + 1])
            counts[split][0] += 1
            counts[split][1] += len(ids)
            counts["names"].add(name.split(":", 1)[0])
            store.progress.advance(documents=1, bytes_read=len(text) if isinstance(text, str) else 0)
        return counts

    def build(store) -> dict[str, Any]:
        read = DataListing()
        if cfg.source == "files":  # a part per file and saved folder (a large one: several), over the cores
            saved = [p for p in cfg.paths if is_saved_dataset(Path(p))]  # read first, as read_documents reads them
            paths = saved + [p for p in cfg.paths if not is_saved_dataset(Path(p))]
            files = source_parts(paths, DOCUMENT_SUFFIXES, read)
            parts = build_in_parts(store, len(files), lambda part, i: add_documents(part, file_documents(cfg, *files[i])))
        else:
            parts = [add_documents(store, read_documents(cfg, read))]
        if read.fingerprint() != listing.fingerprint() or read.changed():
            raise ConfigError(f"data.paths changed while it was tokenized ({', '.join(p.name for p in read.changed()[:3])}"
                              "); launch again once it is written")
        total = added_up([add_documents(store, []), *parts])  # nothing's counts, then each part's
        if not total["train"][0] + total["eval"][0]:
            raise ConfigError(NO_DOCUMENTS.format(paths=cfg.paths))
        return {"files": len(total["names"]), "train": total["train"], "eval": total["eval"]}

    return open_or_build(key, rows=1, dtype=value_dtype(tokenizer.vocab_size - 1), build=build, input_bytes=size)


def stream_pieces(cfg: CausalLMDataConfig, tokenizer):
    """data.streaming: a record's pieces as :func:`token_store` cuts them (the text of a
    ``.txt``/``.md``/``.py`` shard, or of a record's ``data.text_field``)."""

    def pieces_of(where: str, record: Any) -> list[torch.Tensor]:
        text = record if isinstance(record, str) else _text(record, cfg.text_field, where)
        return document_pieces(text, tokenizer, cfg.seq_len)

    return pieces_of


def stream_shards(cfg: CausalLMDataConfig, listing: DataListing | None = None) -> list[Shard]:
    """data.streaming: the shards of data.paths, then those of data.dataset's train split."""
    return ((list_shards(cfg.paths, listing) if cfg.paths else [])
            + (hub_shards(cfg.dataset, "train") if cfg.dataset else []))


def stream_summary(cfg: CausalLMDataConfig, tokenizer, described: str) -> DataSummary:
    """What is known of streamed data before it is read: its files and bytes (nothing else is
    counted); the first records of the first shard are read and tokenized, so a bad format or a
    missing text column is refused now, naming the file and record."""
    listing = DataListing()
    shards = stream_shards(cfg, listing)
    pieces_of = stream_pieces(cfg, tokenizer)
    for where, record in first_records(shards):
        pieces_of(where, record)
    return DataSummary.streamed("files", [*cfg.paths, *([cfg.dataset] if cfg.dataset else [])], len(shards),
                                shard_bytes(shards), tokenizer=described, **listing.summary_fields())


def collate(pieces: list[torch.Tensor], seq_len: int, pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad pieces to ``seq_len``. Padding comes after every real token, so causal
    attention never lets a real token see it; its labels are ignored by the loss."""
    input_ids = torch.full((len(pieces), seq_len), pad_id, dtype=torch.int64)
    labels = torch.full((len(pieces), seq_len), IGNORE_INDEX, dtype=torch.int64)
    for row, piece in enumerate(pieces):
        n = len(piece) - 1
        input_ids[row, :n] = piece[:-1]
        labels[row, :n] = piece[1:]
    position_ids = torch.arange(seq_len).expand(len(pieces), seq_len).clone()
    return {"input_ids": input_ids, "labels": labels, "position_ids": position_ids}


def cut_after_last_label(batch: dict[str, torch.Tensor], multiple: int = 1) -> dict[str, torch.Tensor]:
    """``data.pad_to_longest``: the batch without its columns after the last position any row
    learns from (padding, as the Trainer's default collator pads to the longest row), its width
    rounded up to a ``multiple`` (parallel.sp: sequence parallelism splits each row in as many
    parts). Under causal attention no learnt position sees them, so the loss and gradients are
    the same sums over fewer positions: the same math, rounded in other places (the last bits differ)."""
    learnt = (batch["labels"] != IGNORE_INDEX).any(0).nonzero()
    width = int(learnt[-1]) + 1 if len(learnt) else 1
    width = min(-(-width // multiple) * multiple, batch["labels"].shape[1])
    for key, value in batch.items():
        batch[key] = value[:, :width].contiguous()
    return batch


class BatchStream(Stateful):
    """This rank's micro-batches, forever: each epoch visits the pieces in a new seeded order.

    The data position is the number of sequences of the *global* batch stream consumed so far,
    so a checkpoint resumes with the very next batch on any number of processes.
    """

    def __init__(self, pieces, seq_len, pad_id, seed, micro_batch, dp_rank, dp_size, pad_to_longest=False,
                 width_multiple=1):
        self.pieces, self.seq_len, self.pad_id, self.seed = pieces, seq_len, pad_id, seed
        self.pad_to_longest, self.width_multiple = pad_to_longest, width_multiple
        self.micro_batch = micro_batch
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.position = 0  # global sequences consumed
        self._order: tuple[int, torch.Tensor] | None = None

    def _piece_at(self, index: int) -> torch.Tensor:
        epoch, offset = divmod(index, len(self.pieces))
        if self._order is None or self._order[0] != epoch:
            generator = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
            self._order = (epoch, torch.randperm(len(self.pieces), generator=generator))
        return self.pieces[int(self._order[1][offset])]

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        # Micro-batch k of the global stream is split across the dp ranks: rank r takes rows
        # [r*micro, (r+1)*micro) of it.
        start = self.position + self.dp_rank * self.micro_batch
        batch = [self._piece_at(i) for i in range(start, start + self.micro_batch)]
        self.position += self.micro_batch * self.dp_size
        rows = collate(batch, self.seq_len, self.pad_id)
        if self.pad_to_longest:
            cut_after_last_label(rows, self.width_multiple)
        return rows

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.position = int(state_dict["position"])


# =============================================================================================
# Model
# =============================================================================================


def build_model(cfg: ModelConfig, vocab_size: int, seq_len: int) -> torch.nn.Module:
    if cfg.pretrained_path:
        return AutoModelForCausalLM.from_pretrained(
            confined_path(cfg.pretrained_path), attn_implementation=cfg.attn_implementation, dtype=torch.float32
        )
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
        max_position_embeddings=seq_len,
        rope_theta=cfg.rope_theta,
        tie_word_embeddings=cfg.tie_word_embeddings,
        attn_implementation=cfg.attn_implementation,
    )
    return LlamaForCausalLM(config)


# =============================================================================================
# The recipe
# =============================================================================================


class CausalLM(Engine):
    """Next-token prediction with a Llama-style decoder."""

    config_class = CausalLMConfig

    @cached_property
    def tokenizer(self):
        return data_tokenizer(self.config)

    def prepare_model(self) -> torch.nn.Module:
        model = build_model(self.config.model, self.tokenizer.vocab_size, self.config.data.seq_len)
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
    def summarize_data(cls, config: CausalLMConfig) -> DataSummary:
        cfg = config.data
        if cfg.source == "stdlib" and "source" not in cfg.model_fields_set:
            _refuse_unused_data_folder()
        path = config.model.pretrained_path
        if cfg.streaming:
            return stream_summary(cfg, data_tokenizer(config), f"from {path}" if path else "bytes")
        listing = DataListing()
        store = token_store(cfg, data_tokenizer(config), listing)
        if store is None:  # the run tokenizes it as its first phase
            return DataSummary.left_to_run(cfg.source, cfg.paths, len(listing.files),
                                           sum(path.stat().st_size for path in listing.files), **listing.summary_fields())
        counts = {False: store.counts["train"], True: store.counts["eval"]}  # held out? -> [documents, tokens]
        if not counts[False][0]:
            raise ConfigError(f"no training documents: data.eval_fraction={cfg.eval_fraction} holds out all of them")
        return DataSummary(
            source=cfg.source,
            paths=cfg.paths[:20],
            files=store.counts["files"] if cfg.source != "random" else None,
            bytes=sum(path.stat().st_size for path in listing.files) if listing.files else None,
            **split_counts(counts),
            tokenizer="random ids" if cfg.source == "random" else (f"from {path}" if path else "bytes"),
            **listing.summary_fields(),
        )

    @cached_property
    def store(self) -> TokenStore:
        """The tokenized data, mapped (built by the launch check, or now when it was not)."""
        return token_store(self.config.data, self.tokenizer, self.data_listing)

    @property
    def pads_to_longest(self) -> bool:
        """Whether a batch ends at its last labelled position (``data.pad_to_longest``; unset: yes,
        unless some of the model is compiled, whose graphs want one width: rows of data.seq_len)."""
        if self.config.data.pad_to_longest is not None:
            return self.config.data.pad_to_longest
        return not is_compiled(self.__dict__.get("model"))

    def stream_batches(self) -> StreamBatches:
        """data.streaming: this rank's batches from its share of data.paths, read as they go."""
        cfg = self.config.data
        stream = PieceStream(stream_shards(cfg), stream_pieces(cfg, self.tokenizer), self.dist.dp_rank,
                             self.dist.dp_size, shuffle_buffer=cfg.shuffle_buffer, seed=self.config.train.seed)
        pad_id = self.tokenizer.pad_token_id
        sp = self.config.parallel.sp
        cut = (lambda rows: cut_after_last_label(rows, sp)) if self.pads_to_longest else (lambda rows: rows)
        return StreamBatches(stream, self.micro_batch_size, lambda pieces: cut(collate(pieces, cfg.seq_len, pad_id)))

    def prepare_data(self) -> BatchStream | StreamBatches:
        cfg = self.config.data
        if cfg.streaming:
            if cfg.eval_fraction >= 1:
                raise ConfigError("no training data: data.streaming with data.eval_fraction=1 holds out all of it")
            return self.stream_batches()
        if not self.store.counts["train"][0]:
            raise ConfigError(f"no training documents: data.eval_fraction={cfg.eval_fraction} holds out all of them")
        pieces = self.store.pieces("train", torch.from_numpy)
        return BatchStream(
            pieces,
            cfg.seq_len,
            self.tokenizer.pad_token_id,
            seed=self.config.train.seed,
            micro_batch=self.micro_batch_size,
            dp_rank=self.dist.dp_rank,
            dp_size=self.dist.dp_size,
            pad_to_longest=self.pads_to_longest,
            width_multiple=self.config.parallel.sp,
        )

    def prepare_eval_data(self) -> list[dict[str, torch.Tensor]] | None:
        if self.config.data.streaming:
            return streamed_eval_batches(self.config, self.stream_batches)
        if not self.config.train.eval_every or not self.store.counts["eval"][0]:
            return None
        cfg = self.config.data
        pieces = self.store.pieces("eval", torch.from_numpy)
        stream = BatchStream(
            pieces, cfg.seq_len, self.tokenizer.pad_token_id, seed=0,
            micro_batch=self.micro_batch_size,
            dp_rank=self.dist.dp_rank, dp_size=self.dist.dp_size, pad_to_longest=self.pads_to_longest,
            width_multiple=self.config.parallel.sp,
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

    def hf_processing(self):
        """The tokenizer an exported model is saved with: the pretrained one, or the bytes."""
        if isinstance(self.tokenizer, PretrainedTokenizer):
            return self.tokenizer.tokenizer
        if isinstance(self.tokenizer, ByteTokenizer):
            return self.tokenizer.to_hf()
        return None  # data.source=random: ids without text

    def task_metrics(self) -> dict[str, float]:
        """Next-token accuracy on the evaluation batches (greedy: the most likely token)."""
        correct = total = 0
        for batch in self.eval_batches or []:
            batch = self.to_device(batch)
            logits = self.model(
                input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False
            ).logits
            supervised = batch["labels"] != IGNORE_INDEX
            correct += int((logits.argmax(-1) == batch["labels"])[supervised].sum())
            total += int(supervised.sum())
        return {"next_token_accuracy": correct / total} if total else {}

    def flops_per_token(self) -> float:
        cfg = self.model.config
        return transformer_flops_per_token(
            non_embedding_params(self.model), cfg.num_hidden_layers, cfg.hidden_size, self.config.data.seq_len
        )
