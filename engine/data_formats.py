"""Data in the forms users have: the file kinds `datasets` reads, the formats the common tools
write, and the one place each is told apart.

File kinds (``data.paths``; a folder gives its files of these kinds):

- ``.jsonl``, and ``.json`` holding one object a line: :func:`engine.data_files.jsonl_records`
  (the one JSONL reader); a ``.json`` array is parsed whole (JSON has no row boundaries to
  stream by; give JSON lines for large data);
- ``.parquet``: pyarrow, a row group batch at a time; ``.csv`` / ``.tsv``: pyarrow's streaming
  CSV reader, every column read as text (a prompt "7" stays a string);
- a folder written by ``datasets``' ``save_to_disk`` (a ``Dataset``, or a ``DatasetDict`` whose
  ``data.split`` is read): memory-mapped by ``datasets.load_from_disk``.

``data.dataset`` (with ``data.subset``, ``data.split``) names a data set for
``datasets.load_dataset``: a workspace folder (its data files, or a ``save_to_disk`` folder), or a
Hub id: the snapshot trainwright's server downloaded and bound for the run (runner/hub.py), or
outside the server one found in the local Hugging Face datasets cache (``HF_DATASETS_OFFLINE`` honoured; a run's
sandbox has no network). Every workspace file read is confined and fingerprinted as
:func:`engine.data_files.data_files` does.

Formats, per template (:data:`FORMATS`): recognised from a file's columns, in the order listed,
or forced with ``data.format``; ``data.columns`` renames a file's columns to the names below.
Each record becomes one example of the template's canonical form (:func:`normalise`).
Torch-free.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from engine.chat_messages import conversation, sharegpt_conversation, tool_schemas
from engine.config import ConfigError
from engine.errors import MAX_QUOTED_CHARS
from engine.data_files import (
    HUB_DATASETS_VARIABLE, DataListing, LineRange, bound_hub_path, data_files, json_value, jsonl_records,
)

FILE_SUFFIXES = {".jsonl", ".json", ".parquet", ".csv", ".tsv"}

# template -> {format: the columns that tell it}, in the order formats are recognised.
FORMATS: dict[str, dict[str, tuple[str, ...]]] = {
    "sft": {
        "messages": ("messages",),
        "sharegpt": ("conversations",),
        "alpaca": ("instruction", "output"),
        "prompt_completion": ("prompt", "completion"),
        "text": ("text",),
    },
    "dpo": {
        "prompt_chosen_rejected": ("prompt", "chosen", "rejected"),
        "chosen_rejected": ("chosen", "rejected"),
    },
    "causal_lm": {"text": ("text",)},
}


@dataclass
class Examples:
    """The examples of one source (a file, a saved folder, a data set) in one format."""

    name: str
    format: str
    records: Iterator[tuple[str, dict[str, Any]]]


# ---------------------------------------------------------------------------------------------
# Reading rows
# ---------------------------------------------------------------------------------------------


def is_saved_dataset(folder: Path) -> bool:
    """A folder written by ``Dataset.save_to_disk`` or ``DatasetDict.save_to_disk``."""
    return folder.is_dir() and (
        (folder / "dataset_dict.json").is_file()
        or ((folder / "state.json").is_file() and (folder / "dataset_info.json").is_file())
    )


def _json_rows(path: Path, name: str) -> Iterator[tuple[str, dict[str, Any]]]:
    with open(path, "rb") as f:
        head = f.read(4096).lstrip()
    if not head.startswith(b"["):
        yield from jsonl_records(path, name)
        return
    array = json_value(path.read_bytes(), name, "a JSON array", line_numbers=True)
    for index, record in enumerate(array, 1):
        if not isinstance(record, dict):
            raise ConfigError(f"{name}:[{index}]: a record must be a JSON object, got {type(record).__name__}")
        yield f"{name}:{index}", record


@dataclass(frozen=True)
class RowGroups:
    """Row groups ``start`` up to ``end`` (exclusive) of a parquet file, whose first row is row
    ``first_row`` of the file."""

    start: int
    end: int
    first_row: int = 1


def _parquet_file(path: Path, name: str):
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(path)
    except Exception as e:  # pyarrow's errors for a file that is not parquet
        raise ConfigError(f"{name}: not a parquet file ({e})") from None


def row_group_ranges(path: Path, name: str, count: int) -> list[RowGroups]:
    """A parquet file's row groups cut into at most ``count`` runs of about equal bytes, in
    order: what workers read apart, as one reader reads the whole file (the same rows, numbered
    the same)."""
    metadata = _parquet_file(path, name).metadata
    groups = [metadata.row_group(i) for i in range(metadata.num_row_groups)]
    total = sum(group.total_byte_size for group in groups) or 1
    ranges, start, first_row, done = [], 0, 1, 0
    for index, group in enumerate(groups):
        done += group.total_byte_size
        if index + 1 < len(groups) and done * count >= total * (len(ranges) + 1):
            ranges.append(RowGroups(start, index + 1, first_row))
            first_row += sum(groups[i].num_rows for i in range(start, index + 1))
            start = index + 1
    return [*ranges, RowGroups(start, len(groups), first_row)]


def parquet_rows(path: Path, name: str, groups: RowGroups | None = None) -> Iterator[tuple[str, dict[str, Any]]]:
    """``(name:row, record)`` for each row of a parquet file (of its row ``groups``: those only)."""
    parquet = _parquet_file(path, name)
    row = 0 if groups is None else groups.first_row - 1
    selected = None if groups is None else list(range(groups.start, groups.end))
    for batch in parquet.iter_batches(batch_size=512, row_groups=selected):
        for record in batch.to_pylist():
            row += 1
            yield f"{name}:{row}", record


def _csv_rows(path: Path, name: str) -> Iterator[tuple[str, dict[str, Any]]]:
    import pyarrow as pa
    import pyarrow.csv as pcsv

    parse = pcsv.ParseOptions(delimiter="\t" if path.suffix == ".tsv" else ",", newlines_in_values=True)
    try:
        with pcsv.open_csv(path, parse_options=parse) as reader:
            columns = reader.schema.names
        text = pcsv.ConvertOptions(column_types={c: pa.string() for c in columns}, strings_can_be_null=False)
        reader = pcsv.open_csv(path, parse_options=parse, convert_options=text)
    except pa.ArrowInvalid as e:
        raise ConfigError(f"{name}: not a CSV file with a header row ({e})") from None
    row = 0
    with reader:
        for batch in reader:
            for record in batch.to_pylist():
                row += 1
                yield f"{name}:{row}", record


def _dataset_rows(dataset: Iterable[dict[str, Any]], name: str, first_row: int = 1) -> Iterator[tuple[str, dict[str, Any]]]:
    for row, record in enumerate(dataset, first_row):
        yield f"{name}:{row}", dict(record)


def _load_saved(raw: str, split: str | None, listing: DataListing | None = None):
    import datasets

    data_files([raw], suffixes={".arrow", ".json"}, listing=listing)  # confined and fingerprinted
    saved = datasets.load_from_disk(str(Path(raw).resolve()))
    if isinstance(saved, datasets.DatasetDict):
        split = split or "train"
        if split not in saved:
            raise ConfigError(f"{raw}: no split {split!r} in this saved data set (it has {sorted(saved)}); set data.split")
        return saved[split]
    return saved


READERS: dict[str, Callable[[Path, str], Iterator[tuple[str, dict[str, Any]]]]] = {
    ".jsonl": jsonl_records, ".json": _json_rows, ".parquet": parquet_rows, ".csv": _csv_rows, ".tsv": _csv_rows,
}


def data_sources(paths: list[str], suffixes: Iterable[str] = FILE_SUFFIXES, dataset: str | None = None,
                 subset: str | None = None, split: str | None = None,
                 listing: DataListing | None = None) -> Iterator[tuple[Path, str, Any]]:
    """``(path, name, data set)`` for each data source, in the order they are read: each file of
    ``paths`` with one of ``suffixes`` (data set None), a saved folder as one (loaded by
    ``datasets``), then ``dataset`` (its loaded data set; ``path`` is ``Path(dataset)``). Loaded
    lazily; the files are fingerprinted into ``listing``."""
    for raw in paths:
        if is_saved_dataset(Path(raw)):
            yield Path(raw), Path(raw).name, _load_saved(raw, split, listing)
            continue
        for path, name in data_files([raw], suffixes=suffixes, listing=listing):
            yield path, name, None
    if dataset:
        yield Path(dataset), dataset, _load_dataset(dataset, subset, split, listing)


def sources(paths: list[str], dataset: str | None = None, subset: str | None = None, split: str | None = None,
            listing: DataListing | None = None):
    """``(name, rows)`` for each data source of :func:`data_sources`. Rows are ``(where,
    record)``, read lazily."""
    for path, name, loaded in data_sources(paths, FILE_SUFFIXES, dataset, subset, split, listing):
        yield name, file_rows(path, name) if loaded is None else _dataset_rows(loaded, name)


@dataclass(frozen=True)
class DatasetRows:
    """Some rows of a data set ``datasets`` loaded (``whole``: a saved folder's, data.dataset's):
    ``rows``, a contiguous range of a map-style data set or contiguous shards of a streamed one,
    numbered from ``first_row`` as one reader of ``whole`` numbers them."""

    whole: Any
    rows: Any
    first_row: int = 1


def dataset_parts(loaded: Any, count: int) -> list[DatasetRows]:
    """A loaded data set cut into at most ``count`` parts, in order: what workers read apart, as
    one reader reads the whole (the same records, numbered the same). A map-style data set (a
    saved folder) by rows; a streamed one (a Hub data set's files) by its shards, a parquet file's
    row groups each (``reshard``), whose rows are counted first (as Arrow tables, not records)
    to number each part's."""
    import datasets

    if isinstance(loaded, datasets.Dataset):
        count = max(1, min(count, len(loaded)))
        bounds = [len(loaded) * i // count for i in range(count + 1)]
        return [DatasetRows(loaded, loaded.select(range(a, b)), a + 1) for a, b in zip(bounds, bounds[1:])]
    shards = loaded.reshard() if loaded.num_shards < count else loaded
    count = min(count, shards.num_shards)
    parts, first_row = [], 1
    for index in range(count):
        part = shards.shard(count, index, contiguous=True)
        parts.append(DatasetRows(loaded, part, first_row))
        first_row += sum(table.num_rows for table in part.with_format("arrow").iter(batch_size=COUNT_BATCH_ROWS))
    return parts


COUNT_BATCH_ROWS = 8192  # rows of a streamed data set's part counted at a time


def dataset_bytes(loaded: Any) -> int | None:
    """The bytes of a loaded data set's files: a map-style one's Arrow files; None for a streamed
    one (its size unknown until read)."""
    files = getattr(loaded, "cache_files", None)  # a map-style data set's (a streamed one has none)
    return None if files is None else sum(Path(file["filename"]).stat().st_size for file in files)


def file_rows(path: Path, name: str, part: LineRange | RowGroups | DatasetRows | None = None
              ) -> Iterator[tuple[str, dict[str, Any]]]:
    """``(where, record)`` for each record of one data file, or of one ``part`` of it (lines of a
    JSONL file, row groups of a parquet file: what :func:`engine.store_parts.file_parts` cuts; rows
    of a data set: :func:`dataset_parts`)."""
    if isinstance(part, DatasetRows):
        return _dataset_rows(part.rows, name, part.first_row)
    if isinstance(part, LineRange):
        return jsonl_records(path, name, part)
    if isinstance(part, RowGroups):
        return parquet_rows(path, name, part)
    reader = READERS.get(path.suffix)
    if reader is None:
        raise ConfigError(f"{name}: not a data file trainwright reads (give one of {sorted(FILE_SUFFIXES)})")
    return reader(path, name)


def record_rows(paths: list[str], **where) -> Iterator[tuple[str, dict[str, Any]]]:
    """Every ``(where, record)`` of :func:`sources`, in order, format untold."""
    for _, rows in sources(paths, **where):
        yield from rows


def _load_dataset(dataset: str, subset: str | None, split: str | None, listing: DataListing | None = None):
    """A data set by ``datasets.load_dataset``: a workspace folder, or a Hub id in the cache."""
    import datasets

    bound = bound_hub_path(HUB_DATASETS_VARIABLE, dataset)
    if bound is not None:  # a Hub data set the server downloaded, bound read-only (runner/hub.py)
        try:
            return datasets.load_dataset(bound, subset, split=split or "train", streaming=True)
        except (FileNotFoundError, ValueError) as e:
            raise ConfigError(f"data.dataset {dataset!r} (subset {subset!r}, split {split or 'train'!r}) could not be "
                              f"read: {str(e)[:MAX_QUOTED_CHARS]}") from None
    if Path(dataset).exists():
        if is_saved_dataset(Path(dataset)):
            return _load_saved(dataset, split, listing)
        data_files([dataset], suffixes=FILE_SUFFIXES, listing=listing)  # confined and fingerprinted
        target = str(Path(dataset).resolve())
    else:
        target = dataset
    try:
        return datasets.load_dataset(target, subset, split=split or "train", streaming=Path(dataset).exists())
    except (FileNotFoundError, ConnectionError, ValueError, datasets.exceptions.DatasetNotFoundError) as e:
        offline = " (HF_DATASETS_OFFLINE is set: only the local cache is looked at)" if datasets.config.HF_HUB_OFFLINE else ""
        raise ConfigError(
            f"data.dataset {dataset!r} (subset {subset!r}, split {split or 'train'!r}) could not be loaded{offline}: "
            f"{str(e).splitlines()[0][:MAX_QUOTED_CHARS] if str(e) else type(e).__name__}; give a workspace folder, or a Hub id "
            "already in the local Hugging Face datasets cache"
        ) from None


# ---------------------------------------------------------------------------------------------
# Formats
# ---------------------------------------------------------------------------------------------


def _known(template: str) -> str:
    return "; ".join(f"{fmt} ({', '.join(cols)})" for fmt, cols in FORMATS[template].items())


def detect_format(template: str, columns: Iterable[str], name: str, forced: str | None = None) -> str:
    """The format of a source from its columns (or ``forced``, checked). A source whose format
    cannot be told is a :class:`ConfigError` naming the columns seen and the formats known."""
    formats = FORMATS[template]
    seen = sorted(columns)
    if forced is not None:
        if forced not in formats:
            raise ConfigError(f"data.format={forced!r} is not a format of the {template} template; known: {_known(template)}")
        missing = [c for c in formats[forced] if c not in seen]
        if missing:
            raise ConfigError(
                f"{name}: data.format={forced} needs the columns {list(formats[forced])}, missing {missing} "
                f"(columns seen: {seen}); map them with data.columns, e.g. {{\"{missing[0]}\": \"<your column>\"}}"
            )
        return forced
    for fmt, needed in formats.items():
        if all(c in seen for c in needed):
            return fmt
    raise ConfigError(
        f"{name}: cannot tell the data format from its columns {seen[:20]}; the {template} template knows: "
        f"{_known(template)}. Set data.format, and data.columns to map your column names "
        "(e.g. data.columns={\"messages\": \"dialog\"})"
    )


def _as_messages(value: Any, role: str, where: str, key: str) -> list[dict[str, Any]]:
    """A string as one message of ``role``; a list of messages as it is."""
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    if isinstance(value, dict):
        value = [value]
    return conversation(value, where, key)


def _string(record: dict[str, Any], key: str, where: str, required: bool = True) -> str:
    value = record.get(key)
    if value is None and not required:
        return ""
    if not isinstance(value, str):
        raise ConfigError(f"{where}: {key!r} must be a string, got {type(value).__name__}")
    return value


def _common_prefix(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def normalise(fmt: str, record: dict[str, Any], where: str) -> dict[str, Any]:
    """One record in its template's canonical form:

    - sft: ``{"messages": [...]}`` (messages, sharegpt, alpaca), ``{"prompt": [...],
      "completion": [...]}`` (prompt_completion) or ``{"text": str}``;
    - dpo: ``{"prompt": [...], "chosen": [...], "rejected": [...]}``; whole chosen/rejected
      conversations are split at the last message they share;
    - causal_lm: ``{"text": str}``.

    Messages are in :mod:`engine.chat_messages`' form (reasoning, tool calls and tool results
    kept); a conversation with a ``tools`` column carries ``"tools"``: its function schemas.
    """
    example = _example(fmt, record, where)
    tools = tool_schemas(record.get("tools"), where) if fmt not in ("text", "alpaca") else None
    if tools:
        example["tools"] = tools
    return example


def _example(fmt: str, record: dict[str, Any], where: str) -> dict[str, Any]:
    if fmt == "messages":
        return {"messages": conversation(record["messages"], where, "messages")}
    if fmt == "sharegpt":
        return {"messages": sharegpt_conversation(record["conversations"], where)}
    if fmt == "alpaca":
        instruction, extra = _string(record, "instruction", where), _string(record, "input", where, required=False)
        system = _string(record, "system", where, required=False)
        user = f"{instruction}\n{extra}" if extra else instruction
        messages = [{"role": "system", "content": system}] if system else []
        return {"messages": messages + [
            {"role": "user", "content": user}, {"role": "assistant", "content": _string(record, "output", where)}
        ]}
    if fmt == "prompt_completion":
        return {
            "prompt": _as_messages(record["prompt"], "user", where, "prompt"),
            "completion": _as_messages(record["completion"], "assistant", where, "completion"),
        }
    if fmt == "text":
        return {"text": _string(record, "text", where)}
    if fmt == "prompt_chosen_rejected":
        return {
            "prompt": _as_messages(record["prompt"], "user", where, "prompt"),
            "chosen": _as_messages(record["chosen"], "assistant", where, "chosen"),
            "rejected": _as_messages(record["rejected"], "assistant", where, "rejected"),
        }
    if fmt == "chosen_rejected":
        chosen = conversation(record["chosen"], where, "chosen")
        rejected = conversation(record["rejected"], where, "rejected")
        shared = _common_prefix(chosen, rejected)
        while shared and chosen[shared - 1]["role"] == "assistant":
            shared -= 1
        if shared == 0 or shared >= min(len(chosen), len(rejected)):
            raise ConfigError(
                f"{where}: chosen and rejected conversations must share their prompt messages and differ after "
                "them; give prompt, chosen and rejected columns instead"
            )
        return {"prompt": chosen[:shared], "chosen": chosen[shared:], "rejected": rejected[shared:]}
    raise AssertionError(f"unknown format {fmt}")


def _renamed(record: dict[str, Any], columns: dict[str, str]) -> dict[str, Any]:
    if not columns:
        return record
    renamed = {k: v for k, v in record.items() if k not in columns.values()}
    for standard, given in columns.items():
        if given in record:
            renamed[standard] = record[given]
    return renamed


def record_example(template: str, record: dict[str, Any], where: str, format: str | None = None,
                   columns: dict[str, str] | None = None) -> tuple[str, dict[str, Any]]:
    """``(format, example)`` of a record read on its own (a streamed one, engine/data_stream.py):
    its format told from its own columns (or forced), the example in the template's form."""
    renamed = _renamed(record, columns or {})
    fmt = detect_format(template, renamed, where, format)
    return fmt, normalise(fmt, renamed, where)


def read_examples(
    template: str,
    paths: list[str],
    *,
    format: str | None = None,
    columns: dict[str, str] | None = None,
    dataset: str | None = None,
    subset: str | None = None,
    split: str | None = None,
    listing: DataListing | None = None,
) -> Iterator[Examples]:
    """Each source's examples, its format told from its first record's columns (or forced); the
    files read are fingerprinted into ``listing``."""
    for name, rows in sources(paths, dataset, subset, split, listing):
        first = next(rows, None)
        if first is not None:
            yield _examples(template, name, first, itertools.chain([first], rows), format, columns or {})


def part_examples(template: str, path: Path, name: str, part: LineRange | RowGroups | DatasetRows | None = None, *,
                  format: str | None = None, columns: dict[str, str] | None = None) -> Examples | None:
    """The examples of one data file, or of one ``part`` of it or of a data set (:func:`file_rows`),
    its format told from the source's first record: the parts of a source, read apart, are the
    examples :func:`read_examples` reads of the whole. None for a source without records."""
    rows = file_rows(path, name, part)
    if part is None:
        first = next(rows, None)
    else:  # the first record of the whole source
        first = next(_dataset_rows(part.whole, name) if isinstance(part, DatasetRows) else file_rows(path, name), None)
    if first is None:
        return None
    return _examples(template, name, first, itertools.chain([first], rows) if part is None else rows, format, columns or {})


def _examples(template: str, name: str, first: tuple[str, dict[str, Any]], rows: Iterator[tuple[str, dict[str, Any]]],
              format: str | None, columns: dict[str, str]) -> Examples:
    fmt = detect_format(template, _renamed(first[1], columns), name, format)
    return Examples(name, fmt, ((where, normalise(fmt, _renamed(record, columns), where)) for where, record in rows))
