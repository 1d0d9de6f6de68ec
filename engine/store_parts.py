"""A token store built over the machine's cores: the data cut into parts (:func:`file_parts`: a
file each, a large JSONL or parquet file cut at line starts or by row groups;
:func:`source_parts`: so are a ``save_to_disk`` folder and a Hub data set, by rows or shards), a
forked worker per core building each part into a folder of its own, the parts appended in order
(:func:`build_in_parts`): the very store one process builds, byte for byte. The ``causal_lm``,
``sft``, ``dpo`` and ``grpo`` templates build theirs so; what a part counts, they add up
(:func:`engine.data_summary.added_up`). Each worker writes the documents and bytes it has read
into an array shared with the parent, which reports their sum as the build's progress meanwhile.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
from pathlib import Path
from multiprocessing.pool import IMapIterator
from typing import Any, Callable, Iterable

from engine import token_store
from engine.data_files import DataListing, line_ranges
from engine.token_store import StoreWriter, planted, reporting
from engine.written_trees import remove_tree

# Parts per worker of a build over the cores: more parts than workers share the work evenly (a part
# that reads slowly holds up one worker a while, not the whole build at its end).
PARTS_PER_WORKER = 4

POLL_MIN_S = 0.05  # the parent looks at its workers' progress at most this often

_part_builder: Callable[[StoreWriter, int], dict[str, Any]] | None = None  # what a forked worker builds
_part_progress: Any = None  # a shared array: per part, the documents and bytes its worker has read so far


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
    return _cut([(path, name, None) for path, name in files], workers)


def source_parts(paths: list[str], suffixes: Iterable[str], listing: DataListing, dataset: str | None = None,
                 subset: str | None = None, split: str | None = None,
                 workers: int | None = None) -> list[tuple[Path, str, Any]]:
    """The parts of every data source (:func:`engine.data_formats.data_sources`: the files of
    ``paths``, a ``save_to_disk`` folder, then ``dataset``), in the order one reader reads them:
    files as :func:`file_parts` cuts them, a data set by its bytes' share alike (a streamed one,
    of unknown size: :data:`PARTS_PER_WORKER` parts a worker) into rows or shards (a
    :class:`~engine.data_formats.DatasetRows`, :func:`~engine.data_formats.dataset_parts`). The
    files read are fingerprinted into ``listing``."""
    from engine.data_formats import data_sources

    return _cut(list(data_sources(paths, suffixes, dataset, subset, split, listing)), workers)


def _cut(sources: list[tuple[Path, str, Any]], workers: int | None) -> list[tuple[Path, str, Any]]:
    from engine.data_formats import dataset_bytes, dataset_parts, row_group_ranges

    wanted = (workers or build_workers()) * PARTS_PER_WORKER
    sizes = [path.stat().st_size if loaded is None else dataset_bytes(loaded) for path, _, loaded in sources]
    share = max(1, sum(size or 0 for size in sizes) // wanted)
    parts: list[tuple[Path, str, Any]] = []
    for (path, name, loaded), size in zip(sources, sizes):
        count = wanted if size is None else min(wanted, -(-size // share))
        if loaded is not None:
            parts += [(path, name, rows) for rows in dataset_parts(loaded, count)]
        elif count > 1 and path.suffix == ".jsonl":
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
    them one after another. An error of a part is raised here (its message names its record).
    Meanwhile ``writer.progress`` counts the documents and bytes the workers have read so far,
    whichever part they are in (each writes its own into an array the parent reads)."""
    global _part_builder, _part_progress
    workers = min(count, workers or build_workers())
    if workers <= 1:
        return [build_part(writer, index) for index in range(count)]
    context = multiprocessing.get_context("fork")
    _part_builder, _part_progress = build_part, context.RawArray("q", 2 * count)  # before the fork: the workers find them
    try:
        pool = context.Pool(workers)
    except OSError:  # no process to spare (the run's runs.max_processes): one after another here
        _part_builder = _part_progress = None
        return [build_part(writer, index) for index in range(count)]
    counts, shown = [], [0, 0]  # the documents and bytes of the workers' that writer.progress has
    try:
        with pool:
            jobs = [(writer.folder, writer.fd, writer.key, index, writer.rows, writer.dtype, writer.records)
                    for index in range(count)]
            results = pool.imap(_build_part, jobs)
            for index in range(count):
                counts.append(_next_part(results, writer, shown))
                writer.append_part(f"part-{index}")
                remove_tree(writer.fd, f"part-{index}")  # the disk holds the store, not it twice
    finally:
        _part_builder = _part_progress = None
        for index in range(count):
            with contextlib.suppress(OSError):
                remove_tree(writer.fd, f"part-{index}")
    return counts


def _next_part(results: IMapIterator, writer: StoreWriter, shown: list[int]) -> dict[str, Any]:
    """The next part's counts, once its worker is done; meanwhile, what the workers have read, into
    ``writer.progress`` (which reports it)."""
    while True:
        try:
            return results.next(timeout=max(token_store.PROGRESS_EVERY_S, POLL_MIN_S))
        except multiprocessing.TimeoutError:
            continue
        finally:  # the part just done included: its worker wrote its last figures before returning
            done = [sum(_part_progress[0::2]), sum(_part_progress[1::2])]
            writer.progress.advance(done[0] - shown[0], done[1] - shown[1])
            shown[:] = done


def _build_part(job: tuple[Path, int, str, int, int, str, bool]) -> dict[str, Any]:
    folder, folder_fd, key, index, rows, dtype, records = job  # the build's folder, and its fd opened before the fork
    try:
        os.mkdir(f"part-{index}", dir_fd=folder_fd)
    except FileExistsError:
        raise planted(key, f"part-{index}") from None
    writer = StoreWriter(folder / f"part-{index}", rows, dtype, records=records, key=key, parent_fd=folder_fd)

    def show(fields: dict[str, Any]) -> None:  # this part's progress, where the parent reads it
        _part_progress[2 * index], _part_progress[2 * index + 1] = fields["documents"], fields["bytes_done"]

    try:
        assert _part_builder is not None
        with reporting(show):
            counts = _part_builder(writer, index)
    finally:
        writer.close()
    show(writer.progress.fields())
    return counts
