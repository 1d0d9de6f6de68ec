"""A run's data tokenized once, kept on disk and mapped, not loaded.

A store is a folder of the data cache named by a key: a SHA-256 over what decides its tokens
(the data's fingerprint, the tokenizer, the template and the settings that change tokens, such
as ``seq_len``). Every split in it (``train``, ``eval``) is a flat token file (``<split>.bin``:
the pieces back to back, uint16 when every value fits, else int32) and its index
(``<split>.idx.npy``: where each piece starts, and the end); a store built with ``records``
keeps one byte string per piece beside them (``<split>.records.bin`` and
``<split>.records.idx.npy``: a record's other columns, read by index from the mapping,
:class:`Records`); ``meta.json`` holds what the builder counted and is written last, so a folder without it is no store. The first process to
need a store builds it under the store's own lock (:func:`engine.store_lock.locked_store`: runs of other data do
not wait), into a temporary folder published by a rename; every other
rank and every later run with the same key maps the same files, so a run's memory does not grow
with the corpus (what it touches of the mapping is page cache, shared and reclaimable).

The cache is ``$TRAINWRIGHT_DATA_CACHE`` (the server sets it to the workspace's
``.trainwright/data-cache``), else a folder of this user's in the system's temporary folder.
Torch-free: the pieces are numpy arrays; a template turns them into tensors.

When the store is built depends on the data's size. The launch check (:func:`launch_check`)
builds it for data up to a template's ``data.tokenize_in_check_mb`` (default
:data:`TOKENIZE_IN_CHECK_MB`), so its summary is exact and data with nothing to train is refused
before a run exists; larger data it only reads the head of (:data:`HEAD_RECORDS` records of
each file) and checks the disk space for, so ``launch_run`` answers at once whatever the size,
and the run builds the store as its first phase, reporting its progress (:func:`reporting`).
A build over the machine's cores, a part of the data each: :mod:`engine.store_parts`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import shutil
import stat
import tempfile
import time
from array import array
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import numpy as np
from pydantic import Field

from engine import store_lock
from engine.config import ConfigError, DataConfig
from engine.data_files import DATA_CACHE_VARIABLE as CACHE_VARIABLE
from engine.data_files import STORE_META_JSON as META_JSON
from engine.data_files import (
    HUB_DATASETS_VARIABLE, DataListing, bound_hub_path, data_files,
)
from engine.store_check import stored_meta, stream_agrees
from engine.written_trees import DIRECTORY_NO_FOLLOW, remove_path

STORE_FORMAT = 1  # part of every key: a store of another layout is never read as this one
SPLITS = ("train", "eval")
UINT16_LIMIT = 1 << 16
WRITE_BUFFER_VALUES = 1 << 20  # values gathered before a write (4 MiB as int32)
# A store needs about this many bytes of disk per byte of input text (uint16 tokens of a byte
# tokenizer: 2; int32 rows of tokens and targets: up to 8), checked before it is written.
DISK_BYTES_PER_INPUT_BYTE = 8
# Data up to this size (MB) is tokenized by the launch check; larger data by the run as its first
# phase (at about 1-10 MB/s a larger corpus would keep launch_run waiting).
TOKENIZE_IN_CHECK_MB = 64.0
HEAD_RECORDS = 100  # records of each file the launch check reads of data it leaves to the run
PROGRESS_EVERY_S = 1.0  # how often a build reports its progress


_in_launch_check = False
_report: Callable[[dict[str, Any]], None] | None = None


@contextlib.contextmanager
def launch_check():
    """While the launch check counts the data: :func:`left_to_run` may leave a large store to the run."""
    global _in_launch_check
    _in_launch_check = True
    try:
        yield
    finally:
        _in_launch_check = False


def left_to_run(key: str, input_bytes: int, limit_mb: float, root: Path | None = None) -> bool:
    """Whether the store of ``key`` is left for the run to build: in the launch check, for data
    over ``limit_mb`` whose store is not built yet (the check then reads only its head and
    checks the disk space, :func:`check_disk_space`)."""
    if not _in_launch_check or input_bytes <= limit_mb * 1e6:
        return False
    return stored_meta((cache_root() if root is None else root) / key, key) is None


def leave_to_run(key: str, input_bytes: int, limit_mb: float, read_head: Callable[[int], Any],
                 root: Path | None = None) -> bool:
    """Whether the launch check leaves the store of ``key`` for the run to build
    (:func:`left_to_run`); when it does, ``read_head(HEAD_RECORDS)`` has read and tokenized the
    first records of each file (a bad one is refused now, naming it) and the disk has room for
    the store (:func:`check_disk_space`). A template's ``token_store`` returns no store then, and
    its summary is :meth:`~engine.data_summary.DataSummary.left_to_run`."""
    if not left_to_run(key, input_bytes, limit_mb, root):
        return False
    read_head(HEAD_RECORDS)
    check_disk_space(input_bytes, root)
    return True


class StoredDataConfig(DataConfig):
    """The data keys of a template that tokenizes into a store, with the run's first phase for large data."""

    tokenize_in_check_mb: float = Field(
        TOKENIZE_IN_CHECK_MB, ge=0,
        description="MB; more: tokenized by the run.",
    )


def builds_here() -> bool:
    """Whether this process builds a missing store: the first process of a node (``LOCAL_RANK``
    0, or a process outside torchrun); the node's other ranks wait for it and map it."""
    return os.environ.get("LOCAL_RANK", "0") == "0"


@contextlib.contextmanager
def reporting(report: Callable[[dict[str, Any]], None]):
    """Where a build's progress goes meanwhile (the run's rank 0 writes it into run.json): a
    :class:`~engine.run_dir.DataPreparation`'s fields, at most every :data:`PROGRESS_EVERY_S`."""
    global _report
    _report = report
    try:
        yield
    finally:
        _report = None


class BuildProgress:
    """A build's documents and bytes done of its input's bytes, and the time left at that pace."""

    def __init__(self, bytes_total: int):
        self.documents, self.bytes_done, self.bytes_total = 0, 0, bytes_total
        self.started = self.reported = time.monotonic()

    def advance(self, documents: int = 0, bytes_read: int = 0) -> None:
        self.documents += documents
        self.bytes_done += bytes_read
        if self.bytes_total:  # the text read, which a record's format adds to: never past the files' size
            self.bytes_done = min(self.bytes_total, self.bytes_done)
        now = time.monotonic()
        if _report is not None and now - self.reported >= PROGRESS_EVERY_S:
            self.reported = now
            _report(self.fields(now))

    def fields(self, now: float | None = None) -> dict[str, Any]:
        elapsed = (time.monotonic() if now is None else now) - self.started
        eta = elapsed * (self.bytes_total - self.bytes_done) / self.bytes_done if self.bytes_done else None
        return {"documents": self.documents, "bytes_done": self.bytes_done, "bytes_total": self.bytes_total,
                "eta_s": math.ceil(eta * 10) / 10 if eta is not None else None}  # up: never "0 s" with work left


def text_size(record: Any) -> int:
    """The characters of the strings of a record (its messages, prompt, answers, ...): how far a
    build of records has read, for its progress (the files' other bytes, their JSON syntax, are
    not counted: the bytes done run behind the files' size, and the ETA is long rather than short)."""
    if isinstance(record, str):
        return len(record)
    if isinstance(record, dict):
        return sum(text_size(value) for value in record.values())
    if isinstance(record, (list, tuple)):
        return sum(text_size(value) for value in record)
    return 0


def cache_root() -> Path:
    """The folder the stores live in (created when missing)."""
    configured = os.environ.get(CACHE_VARIABLE)
    root = Path(configured) if configured else Path(tempfile.gettempdir()) / f"trainwright-data-cache-{os.getuid()}"
    root.mkdir(parents=True, exist_ok=True)
    return root


def store_key(**parts: Any) -> str:
    """The key of the store of these parts (JSON values: fingerprint, tokenizer, template,
    settings); equal parts, equal key."""
    text = json.dumps({"store_format": STORE_FORMAT, **parts}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def mapped(folder: Path, name: str, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """A stream of a store, mapped: ``<name>.idx.npy`` (where each piece starts, and the end) and
    ``<name>.bin`` (the pieces' values back to back)."""
    starts = np.load(folder / f"{name}.idx.npy", mmap_mode="r")
    size = int(starts[-1])
    values = np.memmap(folder / f"{name}.bin", dtype=dtype, mode="r", shape=(size,)) if size else np.zeros(0, dtype=dtype)
    return starts, values


class Pieces:
    """One split of a store: ``len(pieces)`` pieces, ``pieces[i]`` an int64 numpy array (``rows``
    × n when a piece has several rows, such as tokens and targets) copied from the mapping, or
    what ``convert`` makes of it (``torch.from_numpy``)."""

    def __init__(self, folder: Path, split: str, rows: int, dtype: str, convert: Callable[[np.ndarray], Any] | None = None):
        self.rows, self.convert = rows, convert
        self.starts, self.values = mapped(folder, split, dtype)

    def __len__(self) -> int:
        return len(self.starts) - 1

    def __getitem__(self, index: int) -> np.ndarray:
        if not 0 <= index < len(self):
            raise IndexError(index)
        values = np.array(self.values[int(self.starts[index]):int(self.starts[index + 1])], dtype=np.int64)
        values = values.reshape(self.rows, -1) if self.rows > 1 else values
        return self.convert(values) if self.convert is not None else values

    def __iter__(self) -> Iterator[Any]:
        return (self[i] for i in range(len(self)))


class Records:
    """One split's byte strings of a store built with ``records`` (one per piece, the piece's
    index): ``records[i]`` is copied from the mapping, never the whole file read."""

    def __init__(self, folder: Path, split: str):
        self.starts, self.values = mapped(folder, f"{split}.records", "uint8")

    def __len__(self) -> int:
        return len(self.starts) - 1

    def __getitem__(self, index: int) -> bytes:
        if not 0 <= index < len(self):
            raise IndexError(index)
        return self.values[int(self.starts[index]):int(self.starts[index + 1])].tobytes()


@dataclass
class TokenStore:
    """A built store: its folder, what its builder counted (``meta``), its splits."""

    folder: Path
    meta: dict[str, Any]

    def pieces(self, split: str, convert: Callable[[np.ndarray], Any] | None = None) -> Pieces:
        return Pieces(self.folder, split, self.meta["rows"], self.meta["dtype"], convert)

    def records(self, split: str) -> Records:
        """The byte string kept beside each piece of ``split`` (a store built with ``records``)."""
        if not self.meta.get("records"):
            raise ValueError(f"the store {self.folder.name} keeps no records beside its pieces")
        return Records(self.folder, split)

    @property
    def counts(self) -> dict[str, Any]:
        return self.meta["counts"]


class StoreWriter:
    """What a builder writes pieces into: ``add(split, piece, record)`` appends one piece (an
    integer array of ``rows`` rows, or one row) and, in a writer with ``records``, the byte string
    kept beside it (:class:`Records`); ``progress.advance(documents, bytes_read)`` tells how far
    the builder has read. Its folder (``parent_fd``'s entry, when given) is opened once following
    no link, each file created anew (:func:`new_file`)."""

    def __init__(self, folder: Path, rows: int, dtype: str, input_bytes: int = 0, records: bool = False, *,
                 key: str = "", parent_fd: int | None = None):
        self.folder, self.rows, self.dtype, self.records, self.key = folder, rows, dtype, records, key
        self.progress = BuildProgress(input_bytes)
        self.fd = os.open(folder.name if parent_fd is not None else folder, DIRECTORY_NO_FOLLOW, dir_fd=parent_fd)
        streams = ("", ".records") if records else ("",)
        self.files = {split + kind: self.new_file(f"{split}{kind}.bin") for split in SPLITS for kind in streams}
        self.starts = {name: array("q", [0]) for name in self.files}
        self.buffers: dict[str, list[np.ndarray]] = {name: [] for name in self.files}
        self.buffered = dict.fromkeys(self.files, 0)

    def new_file(self, name: str) -> Any:  # created in the build's folder: refused when it is there already
        return new_file(self.fd, name, self.key)

    def add(self, split: str, piece: Any, record: bytes | None = None) -> None:
        values = np.asarray(piece).reshape(-1)
        if values.size % self.rows:
            raise ValueError(f"a piece of {values.size} values does not have {self.rows} rows")
        if (record is None) == self.records:
            raise ValueError("a writer with records takes one with each piece, and a writer without takes none")
        self._append(split, values.astype(self.dtype, copy=False))
        if record is not None:
            self._append(split + ".records", np.frombuffer(record, dtype=np.uint8))

    def _append(self, name: str, values: np.ndarray) -> None:
        self.starts[name].append(self.starts[name][-1] + values.size)
        self.buffers[name].append(values)
        self.buffered[name] += values.size
        if self.buffered[name] >= WRITE_BUFFER_VALUES:
            self._flush(name)

    def _flush(self, name: str) -> None:
        if self.buffers[name]:
            np.concatenate(self.buffers[name]).tofile(self.files[name])
        self.buffers[name], self.buffered[name] = [], 0

    def append_part(self, name: str) -> None:
        """Append the pieces (and records) of a part that another writer built into the folder
        ``name`` of this one (closed), read following no link."""
        part = os.open(name, DIRECTORY_NO_FOLLOW, dir_fd=self.fd)
        try:
            for stream in self.files:
                self._flush(stream)
                with built_file(part, f"{stream}.idx.npy", self.key) as index:
                    starts = np.load(index, allow_pickle=False)
                self.starts[stream].frombytes((starts[1:] + self.starts[stream][-1]).astype(np.int64).tobytes())
                with built_file(part, f"{stream}.bin", self.key) as values:
                    shutil.copyfileobj(values, self.files[stream], 1 << 24)
        finally:
            os.close(part)

    def close(self, meta: dict[str, Any] | None = None) -> None:
        """The splits' indexes written, then ``meta`` as meta.json when given (last: a folder
        without it is no store)."""
        try:
            for name in self.files:
                self._flush(name)
                self.files[name].close()
                with self.new_file(f"{name}.idx.npy") as index:
                    np.save(index, np.frombuffer(self.starts[name], dtype=np.int64))
            if meta is not None:
                with self.new_file(META_JSON) as meta_file:
                    meta_file.write(json.dumps(meta).encode())
        finally:
            for file in self.files.values():
                file.close()
            os.close(self.fd)



def new_file(folder_fd: int, name: str, key: str) -> Any:
    """The file ``name`` created in the folder ``folder_fd`` of a build of store ``key``, for writing, following
    no link; a name there already (planted by another process) is refused (:func:`planted`), written through never."""
    try:
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644, dir_fd=folder_fd)
    except FileExistsError:
        raise planted(key, name) from None
    return open(fd, "wb")


def planted(key: str, name: str) -> ConfigError:
    """The refusal of a build of store ``key`` that finds ``name`` in its folder, which it did not write."""
    return ConfigError(f"the data cache's build of store {key} holds {name}, which it did not write: a run writes "
                       "into the data cache; stop it and launch again")


def built_file(folder_fd: int, name: str, key: str) -> Any:
    """The file ``name`` of the folder ``folder_fd`` (a build of store ``key``), for reading: a regular file,
    opened following no link (anything else: :func:`planted`)."""
    fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=folder_fd)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise planted(key, name)
    return open(fd, "rb")


def tokenizer_identity(tokenizer: Any) -> str:
    """What a store is keyed by for a Hugging Face tokenizer: its whole definition (the backend's
    JSON, or the vocabulary), its chat template and its special tokens."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    parts = [backend.to_str() if backend is not None else repr(sorted(tokenizer.get_vocab().items())),
             repr(getattr(tokenizer, "chat_template", None)), repr(getattr(tokenizer, "special_tokens_map", None))]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


def data_identity(paths: list[str], suffixes: Iterable[str], listing: DataListing,
                  dataset: str | None = None) -> tuple[list[Any], int]:
    """What the data of ``paths`` (and ``dataset``) is, for a store's key, and its size in bytes:
    the fingerprint of its files, listed into ``listing`` as the readers list them (nothing is
    parsed). A Hub data set is named by the snapshot the server bound (its folder names the
    revision)."""
    from engine.data_formats import is_saved_dataset

    identity: list[Any] = []
    for raw in [*paths, *([dataset] if dataset and Path(dataset).exists() else [])]:
        saved = is_saved_dataset(Path(raw))
        data_files([raw], suffixes={".arrow", ".json"} if saved else suffixes, listing=listing)
    identity.append(listing.fingerprint())
    if dataset and not Path(dataset).exists():
        identity.append([dataset, bound_hub_path(HUB_DATASETS_VARIABLE, dataset)])
    return identity, sum(path.stat().st_size for path in listing.files)


def value_dtype(max_value: int, signed: bool = False) -> str:
    """The narrowest dtype of the store's values: uint16 when every value is below 65,536 and
    none is negative, else int32."""
    return "uint16" if max_value < UINT16_LIMIT and not signed else "int32"


def open_or_build(key: str, rows: int, dtype: str, build: Callable[[StoreWriter], dict[str, Any]],
                  input_bytes: int = 0, root: Path | None = None, records: bool = False,
                  whole_size: bool = True) -> TokenStore:
    """The store of ``key``: mapped when it is built, else built now by ``build`` (which adds the
    pieces and returns the counts kept in ``meta.json``), under the store's lock
    (:func:`engine.store_lock.locked_store`) so that the ranks of a run, and runs at once, build it once: the node's
    first process (:func:`builds_here`) builds it, the others wait until it is there; ``records``:
    a byte string is kept beside each piece (:class:`StoreWriter`). ``input_bytes``
    (the size of the data read) decides the disk space checked first and, when it is the data's
    ``whole_size`` (no Hub data set uncounted), how long another run's build is waited for
    (:func:`engine.store_lock.locked_store`; this run's own ranks wait for theirs as long as it writes). An error of
    ``build`` leaves nothing behind."""
    root = cache_root() if root is None else root
    folder = root / key
    while not builds_here():  # another process of this node builds it: wait for it, without building
        with store_lock.locked_store(root, key):
            if (store := built_store(folder, key, rows, dtype, records)) is not None:
                return store
        time.sleep(store_lock.WAIT_POLL_S)
    with store_lock.locked_store(root, key, input_bytes=input_bytes if whole_size else 0):
        if (store := built_store(folder, key, rows, dtype, records)) is not None:
            return store
        # Builds left by a builder killed meanwhile (it held the lock), and a folder that is no store.
        for stale in [*root.glob(f"{key}.building-*"), folder]:
            remove_path(stale, ignore_errors=True)  # a link planted by a run goes, never what it leads to
        check_disk_space(input_bytes, root)
        building = Path(tempfile.mkdtemp(prefix=f"{key}.building-", dir=root))
        try:
            writer, meta = StoreWriter(building, rows, dtype, input_bytes, records, key=key), None
            try:
                counts = build(writer)
                meta = {"key": key, "rows": rows, "dtype": dtype, "counts": counts, **({"records": True} if records else {})}
            finally:
                writer.close(meta)
            remove_path(folder, ignore_errors=True)  # a folder a run made meanwhile (it ignored the lock)
            os.replace(building, folder)
        except BaseException:
            remove_path(building, ignore_errors=True)
            raise
    return TokenStore(folder, meta)


def built_store(folder: Path, key: str, rows: int, dtype: str, records: bool) -> TokenStore | None:
    """The store of ``key`` in ``folder`` when it is the one this build would write
    (:func:`stored_meta`, with these ``rows``, ``dtype`` and ``records``) and each of its streams'
    index agrees with its values' file (:func:`stream_agrees`); None otherwise."""
    meta = stored_meta(folder, key)
    if meta is None or (meta["rows"], meta["dtype"], meta.get("records", False)) != (rows, dtype, records):
        return None
    streams = [(split, dtype) for split in SPLITS] + [(f"{split}.records", "uint8") for split in SPLITS if records]
    return TokenStore(folder, meta) if all(stream_agrees(folder, *stream) for stream in streams) else None


def check_disk_space(input_bytes: int, root: Path | None = None) -> None:
    """Refuse, with the numbers, a store of ``input_bytes`` of data that the cache's disk has no room for."""
    root = cache_root() if root is None else root
    needed = input_bytes * DISK_BYTES_PER_INPUT_BYTE
    free = shutil.disk_usage(root).free
    if needed > free:
        raise ConfigError(f"the tokenized data needs up to {needed / 1e9:.2f} GB in {root}, which has "
                          f"{free / 1e9:.2f} GB free; free space there, or set {CACHE_VARIABLE} to a larger disk")
