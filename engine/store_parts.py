"""A token store built over the machine's cores: the data's files cut into parts
(:func:`file_parts`: a file each, a large JSONL or parquet file cut at line starts or by row
groups), a forked worker per core building each part into a folder of its own, the parts appended
in order (:func:`build_in_parts`): the very store one process builds, byte for byte. The
``causal_lm``, ``sft`` and ``dpo`` templates build theirs so; what a part counts, they add up
(:func:`engine.data_summary.added_up`).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any, Callable

from engine.data_files import line_ranges
from engine.token_store import StoreWriter, reporting

# Parts per worker of a build over the cores: reported as each is appended, in order, so more parts
# than workers show progress before the end (and share the work more evenly).
PARTS_PER_WORKER = 4

_part_builder: Callable[[StoreWriter, int], dict[str, Any]] | None = None  # what a forked worker builds


def build_workers() -> int:
    """The processes a build runs on: one per core this process may use."""
    return len(os.sched_getaffinity(0))


def file_parts(files: list[tuple[Path, str]], workers: int | None = None) -> list[tuple[Path, str, Any]]:
    """The parts a build reads apart, in order (``(file, name, part)``): each file whole (``part``
    None), and a JSONL or parquet file larger than a part's share of all the bytes
    (:data:`PARTS_PER_WORKER` parts a worker) cut into parts of about that share — at line starts
    (a :class:`~engine.data_files.LineRange`) or by row groups (a
    :class:`~engine.data_formats.RowGroups`) —, so that one large file keeps every core busy; read
    in this order, the parts are the files' records in theirs."""
    from engine.data_formats import row_group_ranges

    wanted = (workers or build_workers()) * PARTS_PER_WORKER
    sizes = [path.stat().st_size for path, _ in files]
    share = max(1, sum(sizes) // wanted)
    parts: list[tuple[Path, str, Any]] = []
    for (path, name), size in zip(files, sizes):
        count = min(wanted, -(-size // share))
        if count > 1 and path.suffix == ".jsonl":
            parts += [(path, name, lines) for lines in line_ranges(path, count)]
        elif count > 1 and path.suffix == ".parquet":
            parts += [(path, name, groups) for groups in row_group_ranges(path, name, count)]
        else:
            parts.append((path, name, None))
    return parts


def build_in_parts(writer: StoreWriter, count: int, build_part: Callable[[StoreWriter, int], dict[str, Any]],
                   workers: int | None = None) -> list[dict[str, Any]]:
    """Build ``count`` parts of a store (``build_part(part_writer, i)`` adds part i's pieces and
    returns its counts) over the machine's cores, a forked worker per core, each part into a
    folder of its own, appended to ``writer`` in order as it comes: the same store as building
    them one after another. An error of a part is raised here (its message names its record)."""
    global _part_builder
    workers = min(count, workers or build_workers())
    if workers <= 1:
        return [build_part(writer, index) for index in range(count)]
    import multiprocessing

    _part_builder = build_part  # before the fork: the workers find it there
    try:
        pool = multiprocessing.get_context("fork").Pool(workers)
    except OSError:  # no process to spare (the run's runs.max_processes): one after another here
        _part_builder = None
        return [build_part(writer, index) for index in range(count)]
    counts = []
    try:
        with pool:
            jobs = [(writer.folder, index, writer.rows, writer.dtype) for index in range(count)]
            for index, (part_counts, documents, bytes_read) in enumerate(pool.imap(_build_part, jobs)):
                writer.append_part(writer.folder / f"part-{index}")
                shutil.rmtree(writer.folder / f"part-{index}")  # the disk holds the store, not it twice
                writer.progress.advance(documents, bytes_read)
                counts.append(part_counts)
    finally:
        _part_builder = None
        for part in writer.folder.glob("part-*"):
            shutil.rmtree(part, ignore_errors=True)
    return counts


def _build_part(job: tuple[Path, int, int, str]) -> tuple[dict[str, Any], int, int]:
    folder, index, rows, dtype = job
    part = folder / f"part-{index}"
    part.mkdir()
    writer = StoreWriter(part, rows, dtype)
    try:
        assert _part_builder is not None
        with reporting(lambda fields: None):  # the parent reports the parts as they come
            counts = _part_builder(writer, index)
    finally:
        writer.close()
    return counts, writer.progress.documents, writer.progress.bytes_done
