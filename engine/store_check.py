"""What the data cache's folder of a store must be to be read as one (:mod:`engine.token_store`).

A run writes into the data cache (its first phase builds stores there), so a folder named by a
store's key may hold anything: a ``meta.json`` that is not JSON or not the builder's, an index
that claims more pieces than its file holds, a token file cut short, links. Such a folder is no
store: :func:`engine.token_store.open_or_build` builds over it under the store's lock, as it
builds over one without ``meta.json`` (the run's data is tokenized again; nothing fails), rather
than map it and fail in the middle of a run or a launch check with an internal error.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

import numpy as np

from engine.data_files import STORE_META_JSON as META_JSON

MAX_META_BYTES = 1 << 20  # a store's meta.json: a few counts


def stored_meta(folder: Path, key: str) -> dict[str, Any] | None:
    """What ``folder/meta.json`` says when ``folder`` (not a link) holds one the builder of store
    ``key`` wrote: a regular file of JSON with the builder's fields (``key``, ``rows``, ``dtype``,
    ``counts``); None for anything else."""
    try:
        if not stat.S_ISDIR(os.lstat(folder).st_mode):
            return None
        fd = os.open(folder / META_JSON, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        with open(fd, "rb") as file:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or info.st_size > MAX_META_BYTES:
                return None
            text = file.read(info.st_size + 1)  # not a buffer of the cap: a few counts are read
        meta = json.loads(text) if len(text) <= MAX_META_BYTES else None
    except (OSError, ValueError, RecursionError):  # not there, a link, not JSON, nested past the parser's depth
        return None
    fields_agree = (isinstance(meta, dict) and meta.get("key") == key and type(meta.get("rows")) is int
                    and meta.get("dtype") in ("uint16", "int32") and isinstance(meta.get("counts"), dict))
    return meta if fields_agree else None


INDEX_CHUNK = 1 << 22  # starts of an index compared at a time (32 MiB)


def stream_agrees(folder: Path, name: str, dtype: str) -> bool:
    """Whether ``<name>.idx.npy`` and ``<name>.bin`` of ``folder`` are regular files (not links)
    that :func:`mapped` reads as written: an int64 index from 0, never decreasing, whose end is
    the count of values the file holds (an index that claims more rows than its file holds, or
    pieces past the values' end, is no store's)."""
    try:
        index, values = (os.lstat(folder / f"{name}{kind}") for kind in (".idx.npy", ".bin"))
        if not (stat.S_ISREG(index.st_mode) and stat.S_ISREG(values.st_mode)):
            return False
        starts = np.load(folder / f"{name}.idx.npy", mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError):  # not there; not an .npy file, or one claiming more than it holds
        return False
    if starts.dtype != np.int64 or starts.ndim != 1 or not len(starts) or starts[0] != 0:
        return False
    if int(starts[-1]) * np.dtype(dtype).itemsize != values.st_size:
        return False
    return all((np.diff(starts[at:at + INDEX_CHUNK + 1]) >= 0).all() for at in range(0, len(starts), INDEX_CHUNK))
