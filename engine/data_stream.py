"""A run's data read as a stream (``data.streaming: true``): for corpora that fit neither in
memory nor on the disk of the data cache.

The shards are the data files of ``data.paths`` (folders expanded, confined) in the fixed order
:func:`engine.data_files.data_files` lists them, then those of a Hub data set's split
(:func:`hub_shards`: the snapshot the server downloaded and bound), read again from the first at
each epoch. A
rank reads its own share: **record i of every shard goes to data-parallel rank i % dp_size**
(records of other ranks are skipped unparsed in a JSONL shard; a ``.txt``/``.md``/``.py`` file
is one record, so such shards go by file instead). Records are turned into pieces (the
template's ``pieces_of``: tokenized, cut into ``seq_len + 1`` tokens) in a background thread that
feeds a bounded queue, so memory holds the queue, not the corpus; nothing is written to the data
cache.

The stream's position is the reader's place *as the trainer consumed it* (:class:`StreamPosition`:
epoch, shard, the record's byte offset in a JSONL shard or its index in another, and how many of
that record's pieces are taken — the only carry-over, since pieces never cross records). It is
in the checkpoint, every rank's, so a resume on the same number of data-parallel ranks re-reads
that record and continues with the very next piece: bit for bit what an uninterrupted run reads.
Records come in shard order; with a shuffle buffer (``data.shuffle_buffer`` = n) a rank's pieces
are read n at a time and each such block is handed out in an order drawn from the seed and the
block's start (:func:`shuffle_blocks`), so the position is the block's start and how many of it
were taken: a resume reads the block again and draws the same order.

Pieces are whatever a template's ``pieces_of`` returns; :class:`PieceStream` hands them out and
:class:`StreamBatches` collates them into a rank's micro-batches and checkpoints the position.
"""

from __future__ import annotations

import itertools
import json
import queue
import random
import threading
from dataclasses import asdict, astuple, dataclass, replace
from pathlib import Path
from typing import Any, Callable, Iterator

from torch.distributed.checkpoint.stateful import Stateful

from engine.config import ConfigError
from engine.data_files import HUB_DATASETS_VARIABLE, DataListing, bound_hub_path, data_files, json_value
from engine.data_formats import READERS as RECORD_READERS

TEXT_SUFFIXES = {".txt", ".md", ".py"}  # one record each: the whole file
SHARD_SUFFIXES = TEXT_SUFFIXES | set(RECORD_READERS)
QUEUE_PIECES = 256  # pieces read ahead of the trainer (the memory a stream holds besides one record)
# The most memory a rank's shuffle buffer may hold: the bound of data.shuffle_buffer. A piece
# holds seq_len + 1 int64 tokens and about PIECE_OVERHEAD_BYTES besides (a torch tensor of 3
# tokens in a list took 546 bytes of RSS on CPython 3 with torch 2.13, 200,000 of them measured).
MAX_SHUFFLE_BUFFER_BYTES = 1 << 30
PIECE_OVERHEAD_BYTES = 512
SPLIT_NAMES = ("train", "validation", "test", "dev")  # the split names hub_shards looks for in paths
CHECK_RECORDS = 8  # records of the first shard the launch check reads


@dataclass(frozen=True)
class Shard:
    path: Path
    name: str  # relative to the folder given, as errors name it


@dataclass(frozen=True)
class StreamPosition:
    """Where a rank's stream stands: the next piece is piece ``piece`` of the record at
    ``offset`` (its byte offset in a JSONL shard; else 0) with index ``record`` in shard
    ``shard`` of epoch ``epoch``."""

    epoch: int = 0
    shard: int = 0
    offset: int = 0
    record: int = 0
    piece: int = 0
    taken: int = 0  # with a shuffle buffer: pieces of the block that starts here already handed out


def list_shards(paths: list[str], listing: DataListing | None = None) -> list[Shard]:
    """The shards of ``paths`` in the order they are read, confined to the workspace; their bytes
    are not read (nor fingerprinted): only what was skipped, and why, goes into ``listing``."""
    found = data_files(paths, suffixes=SHARD_SUFFIXES, listing=listing, fingerprint=False)
    if not found:
        raise ConfigError(f"no data files in data.paths={paths} ({', '.join(sorted(SHARD_SUFFIXES))})")
    return [Shard(path, name) for path, name in found]


def hub_shards(dataset: str, split: str) -> list[Shard]:
    """The data files (``.jsonl``, ``.parquet``, ...) of ``split`` in the snapshot of the Hub data
    set ``dataset`` that the server downloaded and bound for this run, in path order: those whose
    path has a folder named ``split`` or whose file name starts with it (``data/train-00000-of-00002.parquet``);
    for ``train``, every data file when none names a split of :data:`SPLIT_NAMES`. Named ``dataset/path`` in errors."""
    bound = bound_hub_path(HUB_DATASETS_VARIABLE, dataset)
    if bound is None:
        raise ConfigError(f"data.dataset {dataset!r} is not bound for this run: trainwright's server downloads a Hub "
                          "data set when it launches the run (outside the server, give its files in data.paths)")
    snapshot = Path(bound)  # <cache>/datasets--org--name/snapshots/<commit>: its files link to ../../blobs
    found = data_files([bound], suffixes=set(RECORD_READERS), root=snapshot.parents[1], fingerprint=False)

    def names(name: str, split: str) -> bool:
        *folders, file = name.split("/")
        return split in folders or file.startswith((f"{split}-", f"{split}.", f"{split}_"))

    chosen = [item for item in found if names(item[1], split)]
    if not chosen and split == "train" and not any(names(n, s) for _, n in found for s in SPLIT_NAMES):
        chosen = found  # one split, unnamed: what datasets calls train
    if not chosen:
        raise ConfigError(f"data.dataset {dataset!r} has no data files of split {split!r} "
                          f"(it has {', '.join(name for _, name in found[:5]) or 'none'}); set data.split")
    return [Shard(path, f"{dataset}/{name}") for path, name in chosen]


def shard_records(shard: Shard, offset: int = 0, first: int = 0) -> Iterator[tuple[int, int, str, Any]]:
    """``(record index, offset, where, record)`` from record ``first`` (at byte ``offset`` of a
    JSONL shard) on; ``record`` is ``None`` for another rank's JSONL line (skipped unparsed:
    the caller says which it wants by :func:`records`), a dict, or a text file's text."""
    suffix = shard.path.suffix
    if suffix in TEXT_SUFFIXES:
        if first == 0:
            yield 0, 0, shard.name, shard.path.read_text(errors="replace")
        return
    if suffix == ".jsonl":
        yield from _jsonl_lines(shard, offset, first)
        return
    rows = RECORD_READERS[suffix](shard.path, shard.name)
    for index, (where, record) in enumerate(itertools.islice(rows, first, None), first):
        yield index, 0, where, record


def _jsonl_lines(shard: Shard, offset: int, first: int) -> Iterator[tuple[int, int, str, Any]]:
    with open(shard.path, "rb") as f:
        f.seek(offset)
        index = first
        while line := f.readline():
            yield index, offset, f"{shard.name}:{index + 1}", line
            offset += len(line)
            index += 1


def parse_record(where: str, record: Any) -> Any:
    """A JSONL line (bytes) parsed into its object, naming ``where`` when it is not one; other
    records as they are. Blank lines are ``None``."""
    if not isinstance(record, bytes):
        return record
    if not record.strip():
        return None
    value = json_value(record, where, "a JSON object")
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: a record must be a JSON object, got {type(value).__name__}")
    return value


def first_records(shards: list[Shard], count: int = CHECK_RECORDS) -> list[tuple[str, Any]]:
    """The first ``count`` records of the first shard, parsed: what the launch check reads."""
    records = []
    for _, _, where, record in shard_records(shards[0]):
        record = parse_record(where, record)
        if record is not None:
            records.append((where, record))
        if len(records) >= count:
            break
    return records


PiecesOf = Callable[[str, Any], list[Any]]  # (where, parsed record) -> its pieces, in order


def read_pieces(shards: list[Shard], pieces_of: PiecesOf, start: StreamPosition, rank: int,
                world: int) -> Iterator[tuple[Any, StreamPosition]]:
    """This rank's pieces from ``start`` on, for ever (epoch after epoch), each with the position
    after it. Raises ``ConfigError`` naming the shard and record of a bad record, and when an
    epoch gives this rank no piece at all."""
    position = start
    while True:
        given = False
        for shard_index in range(position.shard, len(shards)):
            resuming = shard_index == position.shard
            offset, first = (position.offset, position.record) if resuming else (0, 0)
            for index, at, where, record in shard_records(shards[shard_index], offset, first):
                if index % world != rank:
                    continue
                record = parse_record(where, record)
                if record is None:
                    continue
                pieces = pieces_of(where, record)
                skip = position.piece if resuming and index == position.record else 0
                for k in range(skip, len(pieces)):
                    given = True
                    yield pieces[k], StreamPosition(position.epoch, shard_index, at, index, k + 1)
        if not given and position == StreamPosition(position.epoch):
            raise ConfigError(f"data-parallel rank {rank} of {world} got no data from {len(shards)} shard(s) "
                              f"({shards[0].name}, …): give more records, or fewer processes")
        position = StreamPosition(position.epoch + 1)


def shuffle_blocks(read: Callable[[StreamPosition], Iterator[tuple[Any, StreamPosition]]], start: StreamPosition,
                   size: int, seed: int) -> Iterator[tuple[Any, StreamPosition]]:
    """The pieces ``read(position)`` gives, ``size`` at a time, each block handed out in the order
    a generator seeded with ``seed`` and the block's start draws; the position after a piece is
    the block's start with ``taken`` = the pieces of it handed out. From a position with ``taken``
    = k the block is read again and its first k pieces skipped: what an uninterrupted stream
    hands out next."""
    block_start, skip = replace(start, taken=0), start.taken
    pieces = read(block_start)
    while True:
        block = list(itertools.islice(pieces, size))
        order = list(range(len(block)))
        random.Random(f"{seed}:{astuple(block_start)}").shuffle(order)
        for k in range(skip, len(block)):
            yield block[order[k]][0], replace(block_start, taken=k + 1)
        if len(block) < size:
            return
        block_start, skip = block[-1][1], 0


class PieceStream:
    """This rank's pieces, read and turned into pieces by a background thread into a bounded
    queue; :attr:`position` is where the consumer is (what a checkpoint keeps). Started at the
    first :meth:`take`, so a checkpoint's position can be loaded first."""

    def __init__(self, shards: list[Shard], pieces_of: PiecesOf, rank: int, world: int,
                 read_ahead: int = QUEUE_PIECES, shuffle_buffer: int = 0, seed: int = 0):
        self.shards, self.pieces_of, self.rank, self.world = shards, pieces_of, rank, world
        self.shuffle_buffer, self.seed = shuffle_buffer, seed  # 0 or 1: in order
        self.position = StreamPosition()
        self._queue: queue.Queue = queue.Queue(maxsize=read_ahead)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def take(self, n: int) -> list[Any]:
        if self._thread is None:
            self._thread = threading.Thread(target=self._produce, args=(self.position,),
                                            name="data-stream", daemon=True)
            self._thread.start()
        taken = []
        for _ in range(n):
            item = self._queue.get()
            if isinstance(item, BaseException):
                self.close()
                raise item
            piece, self.position = item
            taken.append(piece)
        return taken

    def pieces(self, start: StreamPosition) -> Iterator[tuple[Any, StreamPosition]]:
        """This rank's pieces from ``start`` on, each with the position after it, shuffled or not."""
        def read(position: StreamPosition) -> Iterator[tuple[Any, StreamPosition]]:
            return read_pieces(self.shards, self.pieces_of, position, self.rank, self.world)

        if self.shuffle_buffer > 1:
            return shuffle_blocks(read, start, self.shuffle_buffer, self.seed)
        return read(start)

    def _produce(self, start: StreamPosition) -> None:
        try:
            for item in self.pieces(start):
                if not self._put(item):
                    return
        except BaseException as error:  # handed to the trainer, which raises it
            self._put(error)

    def _put(self, item: Any) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def close(self) -> None:
        self._stop.set()

    def state(self) -> dict[str, int]:
        return asdict(self.position)

    def load_state(self, state: dict[str, Any]) -> None:
        if self._thread is not None:
            raise RuntimeError("a stream's position is loaded before it is read")
        self.position = StreamPosition(**{key: int(value) for key, value in state.items()})


def shard_bytes(shards: list[Shard]) -> int:
    return sum(shard.path.stat().st_size for shard in shards)


class StreamBatches(Stateful):
    """This rank's micro-batches from its share of the stream, for ever: ``micro_batch`` pieces
    each, collated by ``collate``. Its state is every rank's :class:`StreamPosition` (gathered,
    so the checkpoint holds the same object on every rank); a resume takes its own rank's back,
    and is refused on another number of ranks, whose shares would be other records."""

    def __init__(self, stream: PieceStream, micro_batch: int, collate: Callable[[list[Any]], Any]):
        self.stream, self.micro_batch, self.collate = stream, micro_batch, collate

    def __iter__(self) -> "StreamBatches":
        return self

    def __next__(self) -> Any:
        return self.collate(self.stream.take(self.micro_batch))

    def state_dict(self) -> dict[str, Any]:
        import torch.distributed as dist

        local = self.stream.state()
        if dist.is_initialized() and dist.get_world_size() > 1:
            gathered: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, local)
        else:
            gathered = [local]
        # One string (a single DCP value whatever the number of ranks).
        return {"streaming": json.dumps({"world": len(gathered), "per_rank": gathered,
                                         "shuffle_buffer": self.stream.shuffle_buffer})}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        import torch.distributed as dist

        if "streaming" not in state_dict:
            raise ConfigError("the checkpoint's data position is not a stream's (the run did not set "
                              "data.streaming): resume it with the data.streaming it trained with")
        saved = json.loads(state_dict["streaming"])
        world = dist.get_world_size() if dist.is_initialized() else 1
        if int(saved["world"]) != world:
            raise ConfigError(f"a streamed run resumes on the number of processes it was saved on ({saved['world']}, "
                              f"not {world}): each process's share of the records is its own")
        buffer = int(saved.get("shuffle_buffer", 0))
        if buffer != self.stream.shuffle_buffer:
            raise ConfigError(f"a streamed run resumes with the data.shuffle_buffer it was saved with ({buffer}, not "
                              f"{self.stream.shuffle_buffer}): another buffer hands out the pieces in another order")
        self.stream.load_state(saved["per_rank"][dist.get_rank() if dist.is_initialized() else 0])


def hold_out_of_stream(data: Any) -> None:
    """A data config's ``eval_fraction`` under ``streaming``: a stream holds nothing out unless
    asked to (its default becomes 0), and holds out all of it (1: evaluate on files given) or
    nothing; any other fraction is refused (records are not drawn at random from a stream)."""
    if "eval_fraction" not in data.model_fields_set:
        object.__setattr__(data, "eval_fraction", 0.0)
    if data.eval_fraction not in (0, 1):
        raise ValueError("data.streaming holds out no fraction of a stream: data.eval_fraction is 0 (train on "
                         "all) or 1 (all held out: evaluate on files given); leave it out")


def check_shuffle_buffer(data: Any) -> None:
    """Refuse a ``data.shuffle_buffer`` whose pieces (``seq_len + 1`` int64 tokens each) would
    hold more than :data:`MAX_SHUFFLE_BUFFER_BYTES` of a rank's memory, naming the largest that fits."""
    piece = 8 * (data.seq_len + 1) + PIECE_OVERHEAD_BYTES
    most = MAX_SHUFFLE_BUFFER_BYTES // piece
    if data.shuffle_buffer > most:
        raise ValueError(f"data.shuffle_buffer={data.shuffle_buffer} would hold about "
                         f"{data.shuffle_buffer * piece / 2**30:.1f} GiB of pieces of data.seq_len={data.seq_len} "
                         f"in each rank's memory; at most {MAX_SHUFFLE_BUFFER_BYTES / 2**30:.0f} GiB: set it to "
                         f"{most} or less")


def streamed_eval_batches(config, stream_batches: Callable[[], Any]) -> list | None:
    """A streamed run's evaluation batches: none, or (``data.eval_fraction=1``) the stream's first
    ``train.eval_batches``, drawn from a stream of their own (``stream_batches()``) then closed."""
    if not config.train.eval_every or config.data.eval_fraction < 1:
        return None
    batches = stream_batches()
    taken = [next(batches) for _ in range(config.train.eval_batches)]
    batches.stream.close()
    return taken
