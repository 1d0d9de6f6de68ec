"""Reinforcement learning from rewards with GRPO: the model samples answers, code scores them.

Read it top to bottom: configuration, the reward functions (plain Python: edit them, add yours),
the built-in prompts, data, generation, the GRPO loss, then the recipe class. It runs as it is
(``trainwright run recipes/<name>``): on generated arithmetic prompts ("What is 3 + 4?") the
policy samples ``grpo.num_generations`` answers per prompt, ``correct_answer`` and ``near_answer`` score
them, and the policy moves towards the answers that scored above their group's mean.

Supports:
- prompts in JSONL, JSON, parquet, CSV/TSV files, ``save_to_disk`` folders (``data.paths``) or a
  data set ``datasets`` loads (``data.dataset``): a ``prompt`` column (``data.prompt_column``) as
  text or as chat messages without the final assistant turn; every other column (``answer``, ...)
  is handed to the reward functions by name, as TRL's ``GRPOTrainer`` does. Prompts are tokenized
  once into a store every rank and later run maps (``engine/token_store.py``; large data as the
  run's first phase), each record kept beside its tokens and read per batch. Prompts are rendered
  by the tokenizer's own chat template, messages as the sft template reads them (tool calls, tool
  results, reasoning) and a ``tools`` column's function schemas with them
- rewards as code: ``grpo.reward_functions`` names functions of this module
  (``def f(prompts, completions, answer, **_) -> list[float]``), ``grpo.reward_weights`` weighs
  them; one that raises, returns the wrong count or a non-finite value stops the run with an
  error naming the function and the prompt
- GRPO (Shao et al., 2024) and its fixes, each a key of ``grpo``: group-relative advantages with
  or without the group's std (``scale_rewards``), the clipped surrogate (``epsilon``,
  ``epsilon_high``: DAPO's clip-higher), the loss normalised per sequence (``loss_type=grpo``),
  per token of the step (``dapo``, the default, as in TRL) or by a constant (``dr_grpo``),
  ``num_iterations`` updates per generation against the kept old log-probabilities, a KL penalty
  to the frozen starting model (``beta``, default 0), truncated completions masked or not
- generation batched with a KV cache (``generate``), each prompt read once for its group; under
  FSDP2 the full parameters are gathered once per generation, not per token. The loss's forward
  reads a group's prompt once too (``completion_logits``). ``grpo.generation_engine=vllm`` is
  refused, naming what is missing (vLLM, a CUDA GPU) or, with both, that it is not wired yet
- starting from a local Hugging Face folder (``model.pretrained_path``) or a tiny model built here
- everything the engine does: FSDP2 over N processes, checkpoints resumable bit for bit (the
  sampling RNG and any generation not yet used up are in the checkpoint); ``sample``,
  ``evaluate`` (mean reward per function of greedy answers to held-out prompts, and their count),
  ``export``; the skills that act on the model (LoRA, gradient checkpointing, compile)
"""

from __future__ import annotations

import hashlib
import inspect
import io
import json
import math
import random
import re
import time
from contextlib import contextmanager
from functools import cached_property
from itertools import islice
from typing import Any, Callable, Iterable, Iterator, Literal

import numpy as np
import torch
import torch.distributed as dist
from pydantic import Field, model_validator
from torch.distributed.checkpoint.stateful import Stateful
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from engine.chat import CHAT_TEMPLATE, byte_chat_tokenizer, load_chat_tokenizer, template_messages  # noqa: F401 (the chat format)
from engine.chat_messages import conversation, tool_schemas
from engine.config import ConfigError, EngineConfig, Section
from engine.data_files import DataListing, confined_path
from engine.data_formats import FILE_SUFFIXES, file_rows, sources
from engine.data_summary import added_up, split_counts
from engine.distributed import dp_all_reduce_sum
from engine.engine import Engine, StepContext, Window, is_compiled
from engine.flops import non_embedding_params, transformer_flops_per_token
from engine.fsdp import apply_fsdp
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
    vocab_size: int | None = Field(
        None, ge=3, description="Embedding rows of the model built here; default: the tokenizer's. With "
        "model.pretrained_path: the model's own."
    )
    tie_word_embeddings: bool = Field(
        False, description="The output layer shares the embedding matrix (a model built here; a pretrained one keeps its own)."
    )
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2"] | None = Field(
        None, description="Attention kernel; default: sdpa, or with model.pretrained_path the model's own default."
    )
    pretrained_path: str | None = Field(
        None, description="A local Hugging Face model folder (or a Hub id the server bound) to start from."
    )

    @model_validator(mode="after")
    def _built_shape_only(self) -> "ModelConfig":
        if self.pretrained_path and (self.vocab_size is not None or self.tie_word_embeddings):
            raise ValueError("model.vocab_size and model.tie_word_embeddings describe a model built here; "
                             "model.pretrained_path brings its own: leave them out")
        return self


class GRPODataConfig(StoredDataConfig):
    batch_size: int = Field(
        16, ge=1, description="Completions per optimizer step (prompts × grpo.num_generations), over all processes."
    )
    seq_len: int = Field(96, ge=2, description="Prompt plus completion tokens at most; longer prompts are left out.")
    source: Literal["builtin", "files"] | None = Field(
        None, description="builtin: generated arithmetic prompts; files: data.paths or data.dataset (the default when set)."
    )
    paths: list[str] = Field(
        default_factory=list, description="Data files (.jsonl, .json, .parquet, .csv, .tsv), folders, or save_to_disk folders."
    )
    dataset: str | None = Field(
        None, description="A data set for datasets.load_dataset: a workspace folder, or a Hub id in the local cache."
    )
    subset: str | None = Field(None, description="data.dataset: its configuration (subset) name.")
    split: str | None = Field(None, description="data.dataset or a saved DatasetDict: the split (default train).")
    prompt_column: str = Field("prompt", description="The column holding the prompt (text, or chat messages).")
    chat_template: str | None = Field(None, description="A Jinja chat template instead of the tokenizer's own.")
    eval_fraction: float = Field(0.05, ge=0, le=1, description="Prompts held out for evaluate (1: all).")
    builtin_prompts: int = Field(4000, ge=10, description="data.source=builtin: how many prompts.")
    eval_prompts: int = Field(64, ge=1, description="Held-out prompts evaluate answers (greedy) and scores.")

    @model_validator(mode="after")
    def _source_matches_paths(self) -> "GRPODataConfig":
        given = bool(self.paths or self.dataset)
        if self.source is None:
            object.__setattr__(self, "source", "files" if given else "builtin")
        elif given and self.source != "files":
            raise ValueError(f"data.paths is set but data.source={self.source} would ignore it; drop data.source")
        elif self.source == "files" and not given:
            raise ValueError("data.source=files needs data.paths (data files, relative to the workspace) or data.dataset")
        return self


class GRPOSection(Section):
    num_generations: int = Field(8, description="G: completions sampled per prompt (at least 2: a group needs a mean).")
    max_completion_length: int = Field(16, ge=1, description="Tokens generated per completion at most.")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature (the loss's log-probabilities use it too, as TRL's).")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling: the smallest set of tokens holding this probability.")
    reward_functions: list[str] = Field(
        ["correct_answer", "near_answer"], min_length=1,
        description="Names of reward functions defined in this recipe.py, each f(prompts, completions, **columns) -> list[float].",
    )
    reward_weights: list[float] | None = Field(
        [1.0, 0.5], description="One weight per reward function; None: 1 each."
    )
    scale_rewards: Literal["group", "none"] = Field(
        "group", description="group: advantages divided by the group's reward std (GRPO); none: not (Dr. GRPO)."
    )
    loss_type: Literal["grpo", "dapo", "dr_grpo"] = Field(
        "dapo", description="grpo: mean per sequence, then over sequences; dapo: mean over the step's completion tokens; "
        "dr_grpo: sum over tokens / (completions × max_completion_length). TRL's names and formulas.",
    )
    epsilon: float = Field(0.2, gt=0, lt=1, description="Clip range of the probability ratio: [1 - epsilon, 1 + epsilon_high].")
    epsilon_high: float | None = Field(None, gt=0, description="Upper clip (DAPO's clip-higher recommends 0.28); default: epsilon.")
    num_iterations: int = Field(1, ge=1, description="Optimizer steps per generation (μ), each on the whole generation.")
    beta: float = Field(0.0, ge=0, description="KL penalty to the frozen starting model (k3 estimator); 0: no reference kept.")
    kl_ratio_correction: bool = Field(
        True, description="With beta: the KL estimate weighted by the probability ratio to the generating policy, unbiased "
        "when num_iterations > 1 (DeepSeek-V3.2; TRL's use_bias_correction_kl, on by default there too).",
    )
    mask_truncated_completions: bool = Field(
        False, description="Completions cut by max_completion_length (no end of turn) are left out of the loss (DAPO)."
    )
    generation_engine: Literal["transformers", "vllm"] = Field(
        "transformers", description="transformers: the policy's own generation with a KV cache; vllm: refused (not wired yet)."
    )

    @model_validator(mode="after")
    def _groups_need_two(self) -> "GRPOSection":
        if self.num_generations < 2:
            raise ValueError(f"grpo.num_generations={self.num_generations}: a group needs at least 2 completions "
                             "(advantages are relative to the group's mean); set grpo.num_generations=2 or more")
        if self.reward_weights is not None and len(self.reward_weights) != len(self.reward_functions):
            raise ValueError(f"grpo.reward_weights has {len(self.reward_weights)} weights for "
                             f"{len(self.reward_functions)} grpo.reward_functions; give one each")
        return self


class GRPOConfig(EngineConfig):
    model: ModelConfig = ModelConfig()
    data: GRPODataConfig = GRPODataConfig()
    grpo: GRPOSection = GRPOSection()


# =============================================================================================
# Reward functions: plain code. Each gets the prompts, the completions (text, or a one-message
# list for chat prompts, as TRL does), the completions' token ids and every other column of the
# data by name, one entry per completion; it returns one float per completion.
# =============================================================================================

NUMBER = re.compile(r"-?\d+")


def completion_text(completion: str | list[dict[str, str]]) -> str:
    return completion if isinstance(completion, str) else completion[-1]["content"]


def correct_answer(prompts, completions, answer, **_) -> list[float]:
    """1 when the first number of the completion is the answer, else 0 (a verifiable reward)."""
    scores = []
    for completion, expected in zip(completions, answer):
        found = NUMBER.search(completion_text(completion))
        scores.append(float(found is not None and found.group() == str(expected).strip()))
    return scores


def near_answer(prompts, completions, answer, **_) -> list[float]:
    """Partial credit: 1 - |first number - answer| / 5, at least 0 (a graded reward gives a group
    signal long before the first exact answer; no number: 0)."""
    scores = []
    for completion, expected in zip(completions, answer):
        found = NUMBER.search(completion_text(completion))
        distance = abs(int(found.group()) - int(expected)) if found and len(found.group()) < 10 else 5
        scores.append(max(0.0, 1 - distance / 5))
    return scores


def digits_only(prompts, completions, **_) -> list[float]:
    """The share of the completion's characters that are digits (a format reward: answer bare). Not
    in the default grpo.reward_functions: alone, a policy learns to fill its completions with digits."""
    return [sum(c.isdigit() for c in text) / max(1, len(text)) for text in map(completion_text, completions)]


def reward_function(name: str) -> Callable[..., list[float]]:
    function = globals().get(name)
    if not callable(function):
        defined = sorted(n for n, f in globals().items() if inspect.isfunction(f) and f.__module__ == __name__
                         and list(inspect.signature(f).parameters)[:2] == ["prompts", "completions"])
        raise ConfigError(f"grpo.reward_functions names {name!r}, which recipe.py does not define; define "
                          f"def {name}(prompts, completions, **columns) -> list[float] there, or name one of {defined}")
    return function


def score(names: list[str], prompts: list[Any], completions: list[Any], columns: dict[str, list[Any]],
          completion_ids: list[list[int]]) -> torch.Tensor:
    """``[completions, functions]`` rewards; a function that raises, returns the wrong count or
    a non-finite value stops the run with an error naming it and the prompt."""
    table = torch.zeros(len(completions), len(names), dtype=torch.float32)
    for column, name in enumerate(names):
        try:
            values = reward_function(name)(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns)
        except Exception as e:
            raise ConfigError(f"reward function {name} raised {type(e).__name__}: {e} (prompts from {prompts[0]!r})") from e
        if not isinstance(values, (list, tuple)) or len(values) != len(completions):
            count = len(values) if isinstance(values, (list, tuple)) else type(values).__name__
            raise ConfigError(f"reward function {name} returned {count} values for {len(completions)} completions "
                              f"(prompts from {prompts[0]!r}); return one float per completion")
        for row, value in enumerate(values):
            if not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ConfigError(f"reward function {name} returned {value!r} for the prompt {prompts[row]!r}; "
                                  "return a finite float per completion")
            table[row, column] = float(value)
    return table


# =============================================================================================
# The built-in prompts: sums of two numbers, answered with the number
# =============================================================================================


def builtin_prompts(count: int, seed: int = 0) -> list[tuple[str, dict[str, Any]]]:
    rng = random.Random(seed)
    records = []
    for i in range(count):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        records.append((f"builtin-{i}", {"prompt": f"What is {a} + {b}?", "answer": str(a + b)}))
    return records


# =============================================================================================
# Data: records → rendered prompt tokens; rollouts → micro-batches
# =============================================================================================


def prompt_record(prompt_column: str, where: str, record: dict[str, Any]) -> dict[str, Any]:
    """A record with its prompt under ``prompt`` (its other columns as they are)."""
    if prompt_column not in record:
        raise ConfigError(f"{where}: no prompt column {prompt_column!r} (columns: {sorted(record)[:20]}); "
                          "name the prompt's column with data.prompt_column")
    return {k: v for k, v in record.items() if k != prompt_column} | {"prompt": record[prompt_column]}


def read_prompts(cfg: GRPODataConfig, listing: DataListing | None = None,
                 head: int | None = None) -> Iterator[tuple[str, dict[str, Any]]]:
    """``(where, record)`` of every prompt, read one at a time (``head``: the first of each
    source); the name decides the split. The files read are fingerprinted into ``listing``."""
    if cfg.source == "builtin":
        yield from builtin_prompts(cfg.builtin_prompts)
        return
    for _, rows in sources(cfg.paths, cfg.dataset, cfg.subset, cfg.split, listing):
        for where, record in islice(rows, head):
            yield where, prompt_record(cfg.prompt_column, where, record)


def stored_columns(record: dict[str, Any], where: str) -> bytes:
    """A record as the store keeps it beside its prompt's tokens: one JSON object (ints stay
    ints, lists lists), read back per batch for the reward functions. A value JSON cannot hold
    is refused, naming the record and the column."""

    def refuse(value: Any) -> Any:
        column = next((f"column {k!r}" for k, v in record.items() if v is value), "a column")
        raise ConfigError(f"{where}: {column} holds a {type(value).__name__}, which the prompt store cannot keep for "
                          "the reward functions; give it as text, a number, a list or a mapping")

    try:
        return json.dumps(record, ensure_ascii=False, default=refuse).encode("utf-8", "surrogatepass")  # text as read
    except RecursionError:
        raise ConfigError(f"{where}: a column is nested too deeply to keep for the reward functions; flatten it") from None


class StoredPrompts:
    """A split's prompts in the store, read by index from the mapping (the corpus is never held
    in memory): ``prompts[i]`` is ``(record, prompt tokens)``, the record as the data holds it."""

    def __init__(self, store: TokenStore, split: str):
        self.tokens, self.records = store.pieces(split), store.records(split)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> tuple[dict[str, Any], list[int]]:
        return json.loads(self.records[index].decode("utf-8", "surrogatepass")), self.tokens[index].tolist()

    def head(self, count: int) -> list[tuple[dict[str, Any], list[int]]]:
        return [self[i] for i in range(min(count, len(self)))]


NO_PROMPTS = "no prompts in data.paths={paths} data.dataset={dataset}"


def prompt_store(config: GRPOConfig, tokenizer, listing: DataListing) -> TokenStore | None:
    """Every prompt rendered and tokenized once (:func:`prompt_tokens`), train and held-out apart,
    each with its record beside it (:func:`stored_columns`), in the store of the data's
    fingerprint, the tokenizer (chat template included) and the settings that change what is
    kept; mapped by every rank and later run. Prompts that leave no room for a completion are
    left out and counted; data with no prompt left is refused and no store kept. None in the
    launch check for data left to the run (:func:`engine.token_store.leave_to_run`)."""
    cfg, room = config.data, config.data.seq_len - config.grpo.max_completion_length
    if cfg.source == "builtin":
        identity, size = ["builtin", cfg.builtin_prompts], 0
    else:
        identity, size = data_identity(cfg.paths, FILE_SUFFIXES, listing, cfg.dataset)
    key = store_key(template="grpo", data=identity, tokenizer=tokenizer_identity(tokenizer), room=room,
                    eval_fraction=cfg.eval_fraction, prompt_column=cfg.prompt_column, subset=cfg.subset, split=cfg.split)

    def read_head(records: int) -> None:
        for where, record in read_prompts(cfg, DataListing(hashing=False), head=records):  # hashed just now
            prompt_tokens(tokenizer, record, where)
            stored_columns(record, where)

    if leave_to_run(key, size, cfg.tokenize_in_check_mb, read_head):
        return None

    def add_prompts(store, rows: Iterable[tuple[str, dict[str, Any]]], raw: bool) -> dict[str, Any]:
        counts = {True: [0, 0], False: [0, 0]}  # held out? -> [prompts, prompt tokens]
        names, dropped, longest = set(), 0, 0
        for where, record in rows:
            record = prompt_record(cfg.prompt_column, where, record) if raw else record
            ids = prompt_tokens(tokenizer, record, where)
            store.progress.advance(documents=1, bytes_read=text_size(record))
            names.add(where.split(":", 1)[0])
            longest = max(longest, len(ids))
            if len(ids) > room:
                dropped += 1
                continue
            held_out = is_eval_document(where, cfg.eval_fraction)
            store.add("eval" if held_out else "train", np.array(ids, dtype=np.int64), stored_columns(record, where))
            counts[held_out][0] += 1
            counts[held_out][1] += len(ids)
        return dict(counts=counts, names=names, dropped=dropped, longest={longest})

    def build(store) -> dict[str, Any]:
        read = DataListing()
        if cfg.source == "files":  # files, saved folders and data.dataset in parts (a large one: several)
            files = source_parts(cfg.paths, FILE_SUFFIXES, read, cfg.dataset, cfg.subset, cfg.split)
            parts = build_in_parts(store, len(files), lambda part, i: add_prompts(part, file_rows(*files[i]), raw=True))
            total = added_up([add_prompts(store, [], raw=True), *parts])  # nothing's counts, then each part's
        else:
            total = add_prompts(store, read_prompts(cfg, read), raw=False)
        if read.fingerprint() != listing.fingerprint() or read.changed():
            raise ConfigError("the data changed while it was tokenized; launch again once it is written")
        return prompt_counts(config, total)

    return open_or_build(key, rows=1, dtype=value_dtype(len(tokenizer) - 1), build=build, input_bytes=size, records=True)


def prompt_counts(config: GRPOConfig, total: dict[str, Any]) -> dict[str, Any]:
    """The data summary's counts of a store's build; data with no prompt that fits is refused."""
    cfg, g = config.data, config.grpo
    kept, dropped, longest = sum(n for n, _ in total["counts"].values()), total["dropped"], max(total["longest"])
    if not kept and not dropped:
        raise ConfigError(NO_PROMPTS.format(paths=cfg.paths, dataset=cfg.dataset))
    if not kept:
        raise ConfigError(f"no prompt to train on: all {dropped:,} prompts read are longer than the "
                          f"{cfg.seq_len - g.max_completion_length} tokens data.seq_len={cfg.seq_len} leaves beside "
                          f"grpo.max_completion_length={g.max_completion_length} (the longest: {longest:,} tokens); set "
                          f"data.seq_len={longest + g.max_completion_length} or lower grpo.max_completion_length")
    return dict(
        files=len(total["names"]) if cfg.source == "files" else None, **split_counts(total["counts"]),
        format="prompt", mask="completion", loss_tokens=0, train_loss_tokens=0, eval_loss_tokens=0, dropped=dropped,
        dropped_why=(f"{dropped}: the prompt leaves no room for grpo.max_completion_length={g.max_completion_length} "
                     f"in data.seq_len={cfg.seq_len}" if dropped else None),
        seq_len_to_keep=longest + g.max_completion_length if dropped else None,
    )


def as_messages(prompt: Any, where: str) -> list[dict[str, Any]]:
    """A prompt as chat messages: a string is the user's; a list is read as the sft template reads
    a conversation (tool calls, tool results, an earlier answer's reasoning)."""
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    if not isinstance(prompt, list) or not prompt:
        raise ConfigError(f"{where}: a prompt must be a string or a list of {{'role': ..., 'content': ...}} messages")
    return conversation(prompt, where, "prompt")


def is_eval_document(name: str, eval_fraction: float) -> bool:
    bucket = int(hashlib.sha1(name.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF
    return eval_fraction >= 1 or bucket < eval_fraction


def prompt_tokens(tokenizer, record: dict[str, Any], where: str = "a record") -> list[int]:
    """The prompt rendered by the chat template with its generation prompt, and with the record's
    ``tools`` (a list of function schemas) where it has them."""
    messages = template_messages(tokenizer, as_messages(record["prompt"], where))
    tools = tool_schemas(record.get("tools"), where)
    return tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True,
                                         return_dict=True)["input_ids"]


def left_padded(rows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.int64)
    mask = torch.zeros((len(rows), width), dtype=torch.int64)
    for i, row in enumerate(rows):
        ids[i, width - len(row):] = torch.tensor(row, dtype=torch.int64)
        mask[i, width - len(row):] = 1
    return ids, mask


def completion_mask(completion_ids: torch.Tensor, eos_id: int, mask_truncated: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(mask, truncated)``: tokens up to and including the first end of turn; rows without one
    are truncated, and all-zero with ``mask_truncated``."""
    is_eos = completion_ids == eos_id
    width = completion_ids.shape[1]
    first = torch.where(is_eos.any(1), is_eos.int().argmax(1), torch.full_like(is_eos[:, 0], width, dtype=torch.int64))
    mask = (torch.arange(width).expand_as(completion_ids) <= first.unsqueeze(1)).long()
    truncated = ~is_eos.any(1)
    if mask_truncated:
        mask = mask * (~truncated).long().unsqueeze(1)
    return mask, truncated


def group_advantages(rewards: torch.Tensor, group: int, scale: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(advantages, group std)``: each reward less its group's mean, divided by the group's
    (unbiased) std + 1e-4 when ``scale``; rows are groups of ``group`` consecutive completions."""
    grouped = rewards.view(-1, group)
    std = grouped.std(dim=1).repeat_interleave(group)
    advantages = rewards - grouped.mean(dim=1).repeat_interleave(group)
    return (advantages / (std + 1e-4) if scale else advantages), std


class RolloutStream(Stateful):
    """This rank's micro-batches, forever. Every ``num_iterations`` optimizer steps it takes the
    next prompts of the global stream (indices into the prompt store, in a seeded order per
    epoch), has the recipe generate and
    score a rollout (``make_rollout``) with this rank's own sampling RNG (seeded by the seed and
    the rank: ranks sample apart), and hands out its micro-batches ``num_iterations`` times. The
    state is the prompts consumed, the sampling RNG and the micro-batches not yet used, each
    rank's, so a checkpoint resumes with the very next batch."""

    def __init__(self, prompts, seed, prompts_per_rank, micro_batches, num_iterations, dp_rank, dp_size, make_rollout,
                 device: torch.device):
        self.prompts, self.seed = prompts, seed  # (record, prompt tokens) by index: the store's StoredPrompts
        self.prompts_per_rank, self.micro_batches, self.num_iterations = prompts_per_rank, micro_batches, num_iterations
        self.dp_rank, self.dp_size, self.make_rollout = dp_rank, dp_size, make_rollout
        self.position = 0
        self.pending: list[dict[str, torch.Tensor]] = []
        self.sampling_rng = torch.Generator(device=device).manual_seed(seed * 1_000_003 + 7919 * (dp_rank + 1))
        self._order: tuple[int, torch.Tensor] | None = None  # (epoch, its order of indices into the store)

    def _prompt_at(self, index: int) -> tuple[dict[str, Any], list[int]]:
        epoch, offset = divmod(index, len(self.prompts))
        if self._order is None or self._order[0] != epoch:
            generator = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
            self._order = (epoch, torch.randperm(len(self.prompts), generator=generator))
        return self.prompts[int(self._order[1][offset])]

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        if not self.pending:
            start = self.position + self.dp_rank * self.prompts_per_rank
            prompts = [self._prompt_at(i) for i in range(start, start + self.prompts_per_rank)]
            self.position += self.prompts_per_rank * self.dp_size
            rollout = self.make_rollout(prompts, self.sampling_rng)
            rows = rollout["input_ids"].shape[0] // self.micro_batches
            split = [{k: v[i * rows:(i + 1) * rows] for k, v in rollout.items()} for i in range(self.micro_batches)]
            self.pending = split * self.num_iterations
        return self.pending.pop(0)

    def state_dict(self) -> dict[str, Any]:
        buffer = io.BytesIO()
        torch.save({"pending": self.pending, "sampling_rng": self.sampling_rng.get_state()}, buffer)
        local = buffer.getvalue()
        gathered: list[Any] = [local]
        if dist.is_initialized() and dist.get_world_size() > 1:  # each rank's, the same object on every rank
            gathered = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, local)
        return {"position": self.position, "pending": gathered}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.position = int(state_dict["position"])
        pending = state_dict["pending"]
        rank = dist.get_rank() if dist.is_initialized() else 0
        if len(pending) != (dist.get_world_size() if dist.is_initialized() else 1):
            raise ConfigError(f"this checkpoint holds generations of {len(pending)} processes; resume it on as many")
        saved = torch.load(io.BytesIO(pending[rank]), weights_only=True)
        self.pending = saved["pending"]
        self.sampling_rng.set_state(saved["sampling_rng"])


# =============================================================================================
# Model, generation and the GRPO loss
# =============================================================================================


def build_model(cfg: ModelConfig, vocab_size: int, seq_len: int) -> torch.nn.Module:
    if cfg.pretrained_path:
        chosen = {"attn_implementation": cfg.attn_implementation} if cfg.attn_implementation else {}
        return AutoModelForCausalLM.from_pretrained(confined_path(cfg.pretrained_path), dtype=torch.float32, **chosen)
    rows = cfg.vocab_size or vocab_size
    if rows < vocab_size:
        raise ConfigError(f"model.vocab_size={rows} is below the tokenizer's {vocab_size} tokens: every token needs a row")
    config = LlamaConfig(
        vocab_size=rows, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=2 * seq_len, rope_theta=cfg.rope_theta, tie_word_embeddings=cfg.tie_word_embeddings,
        attn_implementation=cfg.attn_implementation or "sdpa",
    )
    return LlamaForCausalLM(config)


@contextmanager
def full_parameters(model: torch.nn.Module):
    """Under FSDP2, every parameter gathered once for the whole of a generation (each forward
    would otherwise all-gather and free each block again, once per token); elsewhere nothing."""
    from torch.distributed.fsdp import FSDPModule

    sharded = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not sharded:
        yield
        return
    for module in sharded:
        module.set_reshard_after_forward(False, recurse=False)
        module.unshard()
    try:
        yield
    finally:
        for module in sharded:
            module.reshard()
            module.set_reshard_after_forward(True, recurse=False)


def token_logps(model, batch: dict[str, torch.Tensor], temperature: float, with_entropy: bool = False):
    """Per completion token: the log-probability of the sampled token (logits / temperature),
    and the entropy of the distribution it came from (detached)."""
    width = batch["completion_mask"].shape[1]
    logits = completion_logits(model, batch["input_ids"], batch["attention_mask"], width)
    log_probs = (logits.float() / temperature).log_softmax(-1)
    picked = torch.gather(log_probs, 2, batch["input_ids"][:, -width:].unsqueeze(-1)).squeeze(-1)
    entropy = None
    if with_entropy:
        with torch.no_grad():
            entropy = -(log_probs.exp() * log_probs).sum(-1)
    return picked, entropy


def completion_logits(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, width: int) -> torch.Tensor:
    """``[rows, width, vocab]``: the logits that predict each of the last ``width`` tokens (the
    completion) of each row. Consecutive rows with the same prompt (a group's G completions) read
    it once: the prompt's forward runs on one row of each group and its keys and values, with
    their gradients, are handed to each completion, which reads only its own tokens. The same
    function as reading every row whole (TRL does), for a G-th of the prompt's compute. Blocks
    that run their forward again in backward (activation checkpointing) would run the cache's
    updates again, and compiled blocks would compile two more graphs: there every row is read
    whole (``reads_rows_whole``)."""
    from transformers import DynamicCache

    positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)  # left-padded prompts start at 0, as in generate()

    def every_row_whole() -> torch.Tensor:
        return model(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions, use_cache=False,
                     logits_to_keep=width + 1).logits[:, :-1]

    if input_ids.device.type == "meta":  # estimate_run's tensors hold no values to group by: whole rows, the upper bound
        return every_row_whole()
    start = input_ids.shape[1] - width
    prompts = torch.cat([input_ids[:, :start], attention_mask[:, :start]], 1)
    _, row_group, group_rows = torch.unique_consecutive(prompts, dim=0, return_inverse=True, return_counts=True)
    if len(group_rows) == len(prompts) or reads_rows_whole(model):
        return every_row_whole()
    first = group_rows.cumsum(0) - group_rows
    cache = DynamicCache(config=getattr(model, "config", None))
    last_prompt = model(input_ids=input_ids[first, :start], attention_mask=attention_mask[first, :start],
                        position_ids=positions[first, :start], past_key_values=cache, use_cache=True, logits_to_keep=1).logits
    if cache.get_seq_length() != start:  # a model that keeps no cache in training
        return every_row_whole()
    if width == 1:
        return last_prompt[row_group]
    cache.batch_select_indices(row_group)
    completion = model(input_ids=input_ids[:, start:-1], attention_mask=attention_mask[:, :-1],
                       position_ids=positions[:, start:-1], past_key_values=cache, use_cache=True).logits
    return torch.cat([last_prompt[row_group], completion], 1)


def reads_rows_whole(model: torch.nn.Module) -> bool:
    """Whether the loss's forward reads each row whole: where some block runs its forward again
    in backward (activation checkpointing: the gradient-checkpointing skill's wrapped blocks, or
    transformers' own) or is compiled (the torch-compile skill: the prompt's and the completions'
    passes with a cache are two more graphs per block, past torch's recompilation limit)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import ActivationWrapper

    return bool(getattr(model, "is_activation_checkpointing", False)) or is_compiled(model) or any(
        isinstance(m, ActivationWrapper) for m in model.modules())


def grpo_loss(logps, old_logps, ref_logps, advantages, mask, cfg: GRPOSection):
    """The clipped surrogate (plus ``beta`` × k3 KL to the reference), as a *sum* the engine
    divides by ``loss_units``: per-sequence means (grpo) or masked token sums (dapo, dr_grpo).
    Also ``(kl, clipped)`` per token for the metrics."""
    ratio = torch.exp(logps - old_logps)
    high = cfg.epsilon if cfg.epsilon_high is None else cfg.epsilon_high
    clipped_ratio = torch.clamp(ratio, 1 - cfg.epsilon, 1 + high)
    advantages = advantages.unsqueeze(1)
    per_token = -torch.min(ratio * advantages, clipped_ratio * advantages)
    kl = torch.zeros_like(logps)
    if cfg.beta:
        kl = torch.exp(ref_logps - logps) - (ref_logps - logps) - 1
        if cfg.kl_ratio_correction:
            kl = kl * ratio
        per_token = per_token + cfg.beta * kl
    mask = mask.to(per_token.dtype)
    if cfg.loss_type == "grpo":
        loss = ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1)).sum()
    else:
        loss = (per_token * mask).sum()
    clipped = ((ratio * advantages) > (clipped_ratio * advantages)).detach()
    return loss, kl.detach(), clipped


def loss_units(mask: torch.Tensor, cfg: GRPOSection) -> int:
    """What ``grpo_loss``'s sum is over in a micro-batch."""
    if cfg.loss_type == "grpo":
        return mask.shape[0]
    if cfg.loss_type == "dr_grpo":
        return mask.shape[0] * cfg.max_completion_length
    return int(mask.sum())


def pick_tokens(logits: torch.Tensor, temperature: float | None, top_p: float, generator=None) -> torch.Tensor:
    """The next token of each row: sampled from softmax(logits / temperature) cut to its top-p
    nucleus, or the most likely one with ``temperature=None``."""
    if not temperature:
        return logits.argmax(-1)
    probs = (logits.float() / temperature).softmax(-1)
    if top_p < 1:
        sorted_probs, order = probs.sort(-1, descending=True)
        outside = sorted_probs.cumsum(-1) - sorted_probs > top_p  # the most likely token always stays
        probs = probs.scatter(-1, order, sorted_probs.masked_fill(outside, 0))
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@torch.no_grad()
def generate(model, tokenizer, prompt_ids, prompt_mask, max_new_tokens: int, temperature: float | None, top_p: float = 1.0,
             generator: torch.Generator | None = None, repeats: int = 1):
    """Completion token ids ``[rows × repeats, width]`` (end of turn, then padding): ``repeats``
    completions of each prompt row, in a row's consecutive rows. One token per forward with a KV
    cache, stopping when every row has ended; the full parameters gathered once. Each prompt is
    read once and its cache copied for its ``repeats`` completions (a group's G samples share
    their prompt), and only the last position's logits are computed. A loop of its own rather
    than ``generate()``: at this size the per-token bookkeeping of ``generate()`` costs more than
    the model (bench/grpo_throughput.py)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=getattr(model, "config", None))
    prompt_positions = (prompt_mask.cumsum(-1) - 1).clamp(min=0)  # left padding: each prompt starts at 0
    positions = prompt_positions[:, -1:].repeat_interleave(repeats, 0)
    # The mask of every position a completion may reach, sliced as the completions grow.
    attention = torch.cat([prompt_mask, prompt_mask.new_ones(prompt_mask.shape[0], max_new_tokens)], 1)
    attention = attention.repeat_interleave(repeats, 0)
    ended = torch.zeros(attention.shape[0], dtype=torch.bool, device=prompt_ids.device)
    width = prompt_ids.shape[1]
    completion = []
    with full_parameters(model):
        logits = model(input_ids=prompt_ids, attention_mask=prompt_mask, position_ids=prompt_positions,
                       past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1]
        cache.batch_repeat_interleave(repeats)
        logits = logits.repeat_interleave(repeats, 0)
        for step in range(max_new_tokens):
            chosen = pick_tokens(logits, temperature, top_p, generator).masked_fill(ended, tokenizer.pad_token_id)
            completion.append(chosen)
            ended |= chosen == tokenizer.eos_token_id
            if step + 1 == max_new_tokens or bool(ended.all()):
                break
            positions = positions + 1
            logits = model(input_ids=chosen.unsqueeze(1), attention_mask=attention[:, :width + step + 1],
                           position_ids=positions, past_key_values=cache, use_cache=True).logits[:, -1]
    return torch.stack(completion, 1)


def vllm_refusal() -> str:
    """Why ``grpo.generation_engine=vllm`` cannot run here: what is missing (vLLM, a CUDA GPU),
    or, with both, that this template does not drive vLLM yet."""
    import importlib.util

    missing = [what for what, present in (("vllm is not installed in the run's environment", importlib.util.find_spec("vllm")),
                                          ("no CUDA GPU is visible", torch.cuda.is_available())) if not present]
    if missing:
        return (f"grpo.generation_engine=vllm needs vLLM on a CUDA GPU, but {' and '.join(missing)}; "
                "set grpo.generation_engine=transformers (the default: the policy's own generation with a KV cache)")
    return "grpo.generation_engine=vllm is not wired in this template yet; set grpo.generation_engine=transformers"


# =============================================================================================
# The recipe
# =============================================================================================

ROLLOUT_METRICS = ("completions", "completion_tokens", "truncated", "groups", "zero_signal_groups",
                   "reward", "reward_sq", "group_std", "generation_s", "reward_s")
STEP_METRICS = ("kl", "clipped", "entropy", "tokens")


class GRPO(Engine):
    """GRPO: sampled groups of completions, scored by the reward functions, pushed up or down by
    their reward relative to their group's."""

    config_class = GRPOConfig

    @cached_property
    def tokenizer(self):
        return load_chat_tokenizer(self.config.model.pretrained_path, self.config.data.chat_template)

    @classmethod
    def validate_config(cls, config: GRPOConfig, world_size: int) -> None:
        super().validate_config(config, world_size)
        g, data = config.grpo, config.data
        for name in g.reward_functions:
            reward_function(name)
        if g.generation_engine == "vllm":
            raise ConfigError(vllm_refusal())
        dp = world_size // (config.parallel.tp * config.parallel.sp)
        if data.batch_size % (g.num_generations * dp):
            raise ConfigError(f"data.batch_size={data.batch_size} completions must be whole groups on each process: a "
                              f"multiple of grpo.num_generations × data-parallel ranks = {g.num_generations} × {dp}")
        if g.max_completion_length >= data.seq_len:
            raise ConfigError(f"grpo.max_completion_length={g.max_completion_length} leaves no room for a prompt in "
                              f"data.seq_len={data.seq_len}; raise data.seq_len or lower grpo.max_completion_length")

    def prepare_model(self) -> torch.nn.Module:
        if self.config.grpo.beta:  # the frozen reference: the starting model, built from the same seed
            with torch.random.fork_rng():
                reference = build_model(self.config.model, len(self.tokenizer), self.config.data.seq_len)
            self.reference = reference.eval().to(self.device).requires_grad_(False)
        model = build_model(self.config.model, len(self.tokenizer), self.config.data.seq_len).to(self.device)
        model = apply_fsdp(model, self.dist, self.config.parallel)
        return model

    def prepare_optimizer(self, model: torch.nn.Module) -> torch.optim.Optimizer:
        optim = self.config.optim
        return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=optim.lr,
                                 betas=(optim.beta1, optim.beta2), eps=optim.eps, weight_decay=optim.weight_decay, fused=True)

    @cached_property
    def store(self) -> TokenStore:
        """The prompts' tokens and records, mapped (built by the launch check, or now when it was not)."""
        return prompt_store(self.config, self.tokenizer, self.data_listing)

    @cached_property
    def prompts(self) -> tuple[StoredPrompts, StoredPrompts]:
        """(train, held-out) prompts, ``(record, prompt tokens)`` each, read from the store by index."""
        return StoredPrompts(self.store, "train"), StoredPrompts(self.store, "eval")

    def prepare_data(self) -> RolloutStream:
        g = self.config.grpo
        # The window's sums for log_step: rollouts' (on the CPU) and the optimisation's.
        self.rollout_sums = torch.zeros(len(ROLLOUT_METRICS) + 2 * len(g.reward_functions), dtype=torch.float64)
        self.step_sums = torch.zeros(len(STEP_METRICS), dtype=torch.float64, device=self.device)
        self.longest_completion = 0
        completions = self.config.data.batch_size // self.dist.dp_size
        return RolloutStream(
            self.prompts[0], self.config.train.seed, completions // g.num_generations, self.config.train.grad_accum,
            g.num_iterations, self.dist.dp_rank, self.dist.dp_size, self.make_rollout, self.device,
        )

    def make_rollout(self, prompts: list[tuple[dict[str, Any], list[int]]], generator: torch.Generator) -> dict[str, torch.Tensor]:
        """G completions per prompt, scored; advantages, and the old (and reference) log-probabilities."""
        g, G = self.config.grpo, self.config.grpo.num_generations
        start = time.perf_counter()
        prompt_ids, prompt_mask = left_padded([ids for _, ids in prompts], self.tokenizer.pad_token_id)
        if "model" in self.__dict__:
            was_training = self.model.training
            self.model.eval()
            completion_ids = generate(self.model, self.tokenizer, prompt_ids.to(self.device), prompt_mask.to(self.device),
                                      g.max_completion_length, g.temperature, g.top_p, generator, repeats=G).cpu()
            self.model.train(was_training)
        else:  # estimate_run reads a batch's shapes before any model exists: the longest completions
            completion_ids = torch.zeros((len(prompt_ids) * G, g.max_completion_length), dtype=torch.int64)
        prompt_ids, prompt_mask = prompt_ids.repeat_interleave(G, 0), prompt_mask.repeat_interleave(G, 0)
        mask, truncated = completion_mask(completion_ids, self.tokenizer.eos_token_id, g.mask_truncated_completions)
        generated = time.perf_counter()
        rewards_table = self.rewards([r for r, _ in prompts for _ in range(G)], completion_ids, mask)
        rewards = (rewards_table * self.reward_weights).sum(1)
        advantages, std = group_advantages(rewards, G, g.scale_rewards == "group")
        rollout = {
            "input_ids": torch.cat([prompt_ids, completion_ids], 1), "attention_mask": torch.cat([prompt_mask, mask], 1),
            "completion_mask": mask, "advantages": advantages,
        }
        rollout_device = self.to_device(rollout)
        with torch.no_grad():
            if g.num_iterations > 1:
                rollout["old_logps"] = token_logps(self.model, rollout_device, g.temperature)[0].cpu()
            if g.beta:
                rollout["ref_logps"] = token_logps(self.reference, rollout_device, g.temperature)[0].cpu()
        scored = time.perf_counter()
        lengths = completion_mask(completion_ids, self.tokenizer.eos_token_id, False)[0].sum(1)  # masked or not
        self.longest_completion = max(self.longest_completion, int(lengths.max()))
        groups = rewards.view(-1, G)
        self.rollout_sums += torch.tensor([
            len(rewards), float(lengths.sum()), float(truncated.sum()), len(groups),
            float((groups == groups[:, :1]).all(1).sum()), float(rewards.sum()), float((rewards ** 2).sum()),
            float(std[::G].sum()), generated - start, scored - generated,
            *rewards_table.sum(0).tolist(), *(rewards_table ** 2).sum(0).tolist(),
        ], dtype=torch.float64)
        return rollout

    def rewards(self, records: list[dict[str, Any]], completion_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The reward table of completions (one record per completion)."""
        ids = [row[: int(n)].tolist() for row, n in zip(completion_ids, mask.sum(1))] if mask.any() else completion_ids.tolist()
        texts = self.tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
        chat = not isinstance(records[0]["prompt"], str)
        completions = [[{"role": "assistant", "content": t}] for t in texts] if chat else texts
        columns = {k: [r.get(k) for r in records] for k in records[0] if k != "prompt"}
        return score(self.config.grpo.reward_functions, [r["prompt"] for r in records], completions, columns, ids)

    def count_loss_tokens(self, batch: dict[str, torch.Tensor]) -> int:
        """Completion tokens the loss is over (none in held-out prompts: their completions are generated)."""
        return int(batch["completion_mask"].sum()) if "completion_mask" in batch else 0

    def count_padding(self, batch: dict[str, torch.Tensor]) -> int:
        return int((batch["attention_mask"] == 0).sum())

    def count_loss_units(self, batch: dict[str, torch.Tensor]) -> int:
        if "advantages" not in batch:  # held-out prompts: a mean over prompts
            return batch["input_ids"].shape[0]
        return loss_units(batch["completion_mask"], self.config.grpo)

    def compute_loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        if "advantages" not in batch:  # evaluation: minus the total reward of greedy answers
            return -(self.held_out_rewards(batch) * self.reward_weights).sum()
        g = self.config.grpo
        logps, entropy = token_logps(self.model, batch, g.temperature, with_entropy=True)
        old = batch["old_logps"] if "old_logps" in batch else logps.detach()
        loss, kl, clipped = grpo_loss(logps, old, batch.get("ref_logps"), batch["advantages"], batch["completion_mask"], g)
        mask = batch["completion_mask"]
        if mask.device == self.step_sums.device:  # not on the meta device of estimate_run
            self.step_sums += torch.stack([(kl * mask).sum(), (clipped * mask).sum(), (entropy * mask).sum(),
                                           mask.sum()]).double()
        return loss

    @property
    def reward_weights(self) -> torch.Tensor:
        g = self.config.grpo
        return torch.tensor(g.reward_weights or [1.0] * len(g.reward_functions))

    def held_out_rewards(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The ``[prompts, functions]`` rewards of greedy answers to held-out prompts."""
        g = self.config.grpo
        records = [self.prompts[1][int(i)][0] for i in batch["record_index"]]
        completion_ids = generate(self.model, self.tokenizer, batch["input_ids"], batch["attention_mask"],
                                  g.max_completion_length, None).cpu()
        mask, _ = completion_mask(completion_ids, self.tokenizer.eos_token_id, False)
        return self.rewards(records, completion_ids, mask)

    def held_out_batches(self) -> list[dict[str, torch.Tensor]]:
        held_out = self.prompts[1].head(self.config.data.eval_prompts)
        size = max(1, self.config.data.batch_size // self.config.grpo.num_generations)
        batches = []
        for start in range(self.dist.dp_rank * size, len(held_out), size * self.dist.dp_size):
            ids, mask = left_padded([ids for _, ids in held_out[start:start + size]], self.tokenizer.pad_token_id)
            batches.append({"input_ids": ids, "attention_mask": mask, "record_index": torch.arange(start, start + len(ids))})
        return batches

    def prepare_eval_data(self) -> list[dict[str, torch.Tensor]] | None:
        """Held-out prompts; their ``eval_loss`` is minus the mean total reward of greedy answers."""
        return self.held_out_batches() or None

    def log_step(self, ctx: StepContext, window: Window) -> None:
        """The engine's record, then the window's GRPO record: the optimisation's KL, clipping,
        entropy and training time every time; the rollouts' rewards, lengths and generation and
        scoring times when the window generated (with num_iterations > 1 some steps do not)."""
        super().log_step(ctx, window)
        rollout = dp_all_reduce_sum(self.rollout_sums.to(self.device, copy=True), self.dist).cpu()
        steps = dp_all_reduce_sum(self.step_sums.clone(), self.dist).cpu()
        longest = torch.tensor(float(self.longest_completion), device=self.device)
        if dist.is_initialized():
            dist.all_reduce(longest, op=dist.ReduceOp.MAX)
        self.rollout_sums.zero_(), self.step_sums.zero_()
        self.longest_completion = 0
        r = dict(zip(ROLLOUT_METRICS, rollout.tolist()))
        tokens = max(1.0, steps[3].item())
        # The times are summed over the ranks, which generate side by side: their mean is the wall time.
        generation_s, reward_s = r["generation_s"] / self.dist.dp_size, r["reward_s"] / self.dist.dp_size
        training_s = max(1e-9, window.elapsed - generation_s - reward_s)
        record = {
            "step": self.state.step, "kl": steps[0].item() / tokens, "clip_frac": steps[1].item() / tokens,
            "entropy": steps[2].item() / tokens, "training_s": training_s, "training_tokens_per_s": window.tokens / training_s,
        }
        if r["completions"]:
            record |= self.rollout_record(r, rollout[len(ROLLOUT_METRICS):].tolist(), float(longest))
            record |= {"generation_s": generation_s, "reward_s": reward_s,
                       "generation_tokens_per_s": r["completion_tokens"] / max(1e-9, generation_s),
                       "reward_tokens_per_s": r["completion_tokens"] / max(1e-9, reward_s)}
        self.logger.log(record)

    def rollout_record(self, r: dict[str, float], per_function: list[float], longest: float) -> dict[str, float]:
        n, names = r["completions"], self.config.grpo.reward_functions
        record = {
            "reward": r["reward"] / n, "reward_std": math.sqrt(max(0.0, r["reward_sq"] / n - (r["reward"] / n) ** 2)),
            "group_reward_std": r["group_std"] / r["groups"], "zero_signal_groups": r["zero_signal_groups"] / r["groups"],
            "completion_length": r["completion_tokens"] / n, "completion_length_max": longest,
            "truncated_frac": r["truncated"] / n,
        }
        for i, name in enumerate(names):
            mean = per_function[i] / n
            record[f"reward_{name}"] = mean
            record[f"reward_{name}_std"] = math.sqrt(max(0.0, per_function[len(names) + i] / n - mean ** 2))
        return record

    def flops_per_token(self) -> float:
        cfg = self.model.config
        return transformer_flops_per_token(non_embedding_params(self.model), cfg.num_hidden_layers, cfg.hidden_size,
                                           self.config.data.seq_len)

    # Looking at the model: export, sample, evaluate ------------------------------------------

    def hf_model(self):
        return self.model

    def hf_processing(self):
        return self.tokenizer

    @torch.no_grad()
    def task_metrics(self) -> dict[str, float]:
        """On held-out prompts, greedy answers: the mean of each reward function, the weighted
        total (``reward``) and how many prompts were scored (``prompts``)."""
        names = self.config.grpo.reward_functions
        totals = torch.zeros(len(names) + 1, dtype=torch.float64)
        for batch in self.held_out_batches():
            table = self.held_out_rewards(self.to_device(batch))
            totals += torch.cat([table.sum(0), torch.tensor([len(table)])]).double()
        totals = dp_all_reduce_sum(totals.to(self.device), self.dist).cpu()
        count = max(1.0, float(totals[-1]))
        metrics = {f"reward_{name}": float(totals[i]) / count for i, name in enumerate(names)}
        return {"reward": float((totals[:-1].float() * self.reward_weights).sum()) / count, **metrics, "prompts": float(totals[-1])}

    @classmethod
    def summarize_data(cls, config: GRPOConfig) -> DataSummary:
        cfg = config.data
        tokenizer = f"from {config.model.pretrained_path}" if config.model.pretrained_path else "bytes (chat)"
        listing = DataListing()
        store = prompt_store(config, load_chat_tokenizer(config.model.pretrained_path, cfg.chat_template), listing)
        if store is None:  # the run tokenizes it as its first phase
            return DataSummary.left_to_run(cfg.source, cfg.paths, len(listing.files),
                                           sum(path.stat().st_size for path in listing.files), tokenizer=tokenizer,
                                           **listing.summary_fields())
        return DataSummary(source=cfg.source, paths=cfg.paths[:20], tokenizer=tokenizer, **store.counts,
                           **listing.summary_fields())
