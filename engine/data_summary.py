"""What a run trains on, as run.json's ``data`` holds it (:class:`DataSummary`, counted by a
template's ``summarize_data``), and where the run's first phase is in tokenizing it
(:class:`DataPreparation`). Defined here, re-exported by :mod:`engine.run_dir`, whose record
carries them. Torch-free (pydantic only).

run.json is written by the run's own processes: every count read back is cut to
0..MAX_DATA_COUNT and an ETA that is not a finite, non-negative number is none, so what the
server shows stays sane whatever a run wrote.
"""

from __future__ import annotations

import math
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

MAX_DATA_COUNT, MAX_PREPARING_ETA_S = 10**15, 10**7  # a petabyte, four months


# Where the run's first phase is in tokenizing the data (DataSummary.preparing). The run writes it:
# counts are cut to 0..MAX_DATA_COUNT and a NaN or negative ETA is none, so what is shown stays sane.
class DataPreparation(BaseModel):
    model_config = ConfigDict(defer_build=True)

    documents: int = 0
    bytes_done: int = 0
    bytes_total: int = 0
    eta_s: float | None = None

    @field_validator("documents", "bytes_done", "bytes_total", "eta_s")
    @classmethod
    def _sane(cls, value: float | None) -> float | None:
        if isinstance(value, int):  # a count (eta_s is a float by now)
            return _bounded(value)
        return min(value, MAX_PREPARING_ETA_S) if value is not None and 0 <= value < math.inf else None

    def describe(self) -> str:
        eta = f", about {self.eta_s:.0f} s left" if self.eta_s is not None else ""
        return (f"tokenizing the data as the run's first phase: {_count(self.documents, 'document')}, "
                f"{self.bytes_done / 1e6:,.1f} of {self.bytes_total / 1e6:,.1f} MB{eta}")


class DataSummary(BaseModel):
    """What a run trains on, counted before it starts (Engine.summarize_data): the source and
    paths given, files read, documents and tokens (end-of-document tokens included) in all and
    per split, and the tokenizer that counted them. ``tokens`` counts every token of the
    examples as trained on (cut to the sequence length); ``loss_tokens`` those the loss is over
    (an SFT's assistant turns, a preference pair's answers), None when that is every token."""
    model_config = ConfigDict(defer_build=True)

    source: str
    paths: list[str] = []
    files: int | None = None
    # None for streamed data (``streaming``): counted only as it is read, so not known here.
    documents: int | None
    tokens: int | None
    train_documents: int | None
    eval_documents: int | None
    train_tokens: int | None
    eval_tokens: int | None
    streaming: bool = Field(False, description="Read as a stream while training: files and bytes known, not counts.")
    bytes: int | None = Field(None, description="The data files' size (a streamed run's only measure of its data).")
    tokenizer: str | None = None
    fingerprint: str | None = Field(
        None, description="SHA-256 over the data files' paths and bytes as counted; None for generated data."
    )
    format: str | None = Field(None, max_length=200, description="The records' format(s): messages, sharegpt, alpaca, ...")
    mask: str | None = Field(
        None, max_length=200,
        description="What the loss covers: generation_markers | turn_render (assistant turns) | completion | all_tokens.",
    )
    loss_tokens: int | None = Field(None, description="Tokens the loss covers (labels), after cutting to data.seq_len.")
    truncated: int | None = Field(None, description="Examples cut by data.seq_len (still trained on).")
    dropped: int | None = Field(None, description="Examples left out: nothing in them to learn.")
    dropped_why: str | None = Field(None, max_length=500, description="Why, with counts.")
    train_loss_tokens: int | None = None
    eval_loss_tokens: int | None = None
    seq_len_to_keep: int | None = Field(
        None, description="The data.seq_len at which every example dropped for its length would have tokens to learn."
    )
    skipped: list[str] = Field([], description="Files of the folders and globs given that were not read, and why.")
    preparing: DataPreparation | None = Field(
        None, description="Set while the run tokenizes the data as its first phase (the counts are 0 until it is done).",
    )

    @field_validator("files", "documents", "tokens", "train_documents", "eval_documents", "train_tokens",
                     "eval_tokens", "bytes", "loss_tokens", "truncated", "dropped", "train_loss_tokens",
                     "eval_loss_tokens", "seq_len_to_keep")
    @classmethod
    def _sane(cls, value: int | None) -> int | None:
        return None if value is None else _bounded(value)

    @model_validator(mode="after")
    def _counted_unless_streamed(self) -> DataSummary:
        """Only a streamed summary leaves its counts unknown: a run.json that says otherwise (the
        run writes it) reads as 0 for each, so nothing shown formats a None as a number."""
        if not self.streaming:
            for name in _COUNTS:
                if getattr(self, name) is None:
                    setattr(self, name, 0)
        return self

    @classmethod
    def left_to_run(cls, source: str, paths: list[str], files: int, size: int, **fields) -> DataSummary:
        """What the launch check knows of data it leaves the run to tokenize as its first phase
        (:func:`engine.token_store.leave_to_run`): its files and bytes; every count is 0 until the
        run fills the summary from the store."""
        return cls(source=source, paths=paths[:20], files=files, bytes=size, preparing=DataPreparation(bytes_total=size),
                   **dict.fromkeys(_COUNTS, 0), **fields)

    @classmethod
    def streamed(cls, source: str, paths: list[str], files: int, size: int, **fields) -> DataSummary:
        """What is known of streamed data before it is read: its files and bytes; no count."""
        return cls(source=source, paths=paths[:20], files=files, bytes=size, streaming=True,
                   **dict.fromkeys(_COUNTS, None), **fields)

    def nothing_to_train(self) -> str | None:
        """Why a run on this data would train on nothing (a launch refuses it), or None; None
        while the data is still to be tokenized (the run refuses it then, with this message) or
        is streamed (its records are read while it trains; an empty stream fails there)."""
        if self.streaming or self.preparing is not None or (self.train_documents or 0) > 0:
            return None
        read = (self.documents or 0) + (self.dropped or 0)
        if self.eval_documents:
            return (f"nothing to train on: all {_count(self.eval_documents, 'usable example')} of the data fall in "
                    f"the held-out split; lower data.eval_fraction or add data")
        if not read:
            return "nothing to train on: the data has no examples; check data.paths / data.dataset"
        advice = (f"; data.seq_len={self.seq_len_to_keep} would keep those cut by length"
                  if self.seq_len_to_keep else "")
        return (f"nothing to train on: all {_count(read, 'example')} read were left out "
                f"({self.dropped_why or 'nothing in them to learn'}){advice}")

    def describe(self) -> str:
        """One line, for the console, notes and reviews."""
        where = f" from {', '.join(self.paths[:3])}" if self.paths else ""
        files = f"{_count(self.files, 'file')}, " if self.files is not None else ""
        if self.preparing is not None:
            return f"data: {self.source}{where}: {files}{self.preparing.describe()}"
        loss = f" ({self.loss_tokens:,} of them loss tokens)" if self.loss_tokens is not None else ""
        if self.skipped:
            files += f"{len(self.skipped) if not self.skipped[-1].startswith('…') else 'many'} skipped " \
                     f"({self.skipped[0]}{'; …' if len(self.skipped) > 1 else ''}), "
        if self.streaming:
            size = f", {self.bytes / 1e6:,.1f} MB" if self.bytes is not None else ""
            return f"data: {self.source}{where}: streamed, {files.rstrip(', ')}{size} (records and tokens not counted ahead)"
        return (
            f"data: {self.source}{where}: {files}{_count(self.documents or 0, 'document')}, "
            f"{_count(self.tokens or 0, 'token')}{loss} (train {self.train_documents:,} documents / "
            f"{self.train_tokens:,} tokens, eval {self.eval_documents:,} / {self.eval_tokens:,})"
            + (f"; format {self.format}, loss on {self.mask}" if self.format and self.mask else "")
            + (f", {self.truncated:,} truncated" if self.truncated else "")
            + (f", {self.dropped:,} dropped ({self.dropped_why})" if self.dropped else "")
        )


_COUNTS = ("documents", "tokens", "train_documents", "eval_documents", "train_tokens", "eval_tokens")


def split_counts(counts: dict[bool, list[int]]) -> dict[str, int]:
    """A summary's counts from ``counts[held_out] = [documents, tokens(, loss_tokens)]`` (the training
    side under False, the held-out side under True): the totals and each side's."""
    train, held = counts[False], counts[True]
    fields = dict(documents=train[0] + held[0], tokens=train[1] + held[1], train_documents=train[0],
                  train_tokens=train[1], eval_documents=held[0], eval_tokens=held[1])
    if len(train) > 2:
        fields.update(loss_tokens=train[2] + held[2], train_loss_tokens=train[2], eval_loss_tokens=held[2])
    return fields


def added_up(parts: list[dict[Any, Any]]) -> dict[Any, Any]:
    """The counts of a store's parts built apart (:func:`engine.store_parts.build_in_parts`) as one
    build of them all counts: numbers add, lists of numbers add element by element, sets unite,
    dicts add key by key."""
    total: dict[Any, Any] = {}
    for part in parts:
        for key, value in part.items():
            if key not in total:
                total[key] = value
            elif isinstance(value, dict):
                total[key] = added_up([total[key], value])
            elif isinstance(value, list):
                total[key] = [a + b for a, b in zip(total[key], value, strict=True)]
            else:
                total[key] = total[key] | value if isinstance(value, set) else total[key] + value
    return total


def _bounded(count: int) -> int:
    return min(max(count, 0), MAX_DATA_COUNT)


def _count(n: int, noun: str) -> str:
    return f"{n:,} {noun}" + ("" if n == 1 else "s")
