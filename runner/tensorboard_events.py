"""A script run's TensorBoard event files, read as metrics by its supervisor.

A script that logs with ``SummaryWriter.add_scalar`` (or any writer of TensorBoard's format)
writes ``*tfevents*`` files somewhere under its working directory, its run directory. The
supervisor reads their scalars as they come and records them like the script's JSON lines
(:class:`runner.scripts.ScriptMetrics`): one record per step, each tag a key (``loss/train``
becomes ``loss_train``).

The files are the run's, so they are untrusted input read outside the sandbox: found without
following links, at most ``MAX_EVENT_FILES`` of them, no record over ``MAX_EVENT_RECORD_BYTES``,
at most ``MAX_READ_BYTES`` read per look, and parsed here by a few lines of protobuf decoding
of the only fields used (an event's step, its summary values' tag and ``simple_value``), with
no protobuf library: anything else in a record is skipped, a malformed record ends that file.
Scalars come as ``simple_value`` (``add_scalar``) or as a one-element float or double tensor
(``add_scalar(new_style=True)``, ``tf.summary.scalar`` in Keras and JAX writers); a tensor under
the scalars plugin that is not one float or double is counted as unread, never guessed at.

A look reads at most ``MAX_READ_BYTES`` and ``MAX_EVENTS_PER_LOOK`` events in all (the rest wait
for the next look), so the work of one look is bounded whatever the run writes; the supervisor
looks from a thread of its own, apart from the limits it enforces.
"""

from __future__ import annotations

import os
import re
import stat
import struct
from pathlib import Path
from typing import Iterator

from engine.run_files import open_beneath

MAX_EVENT_FILES = 16
MAX_SEARCH_DEPTH = 4
MAX_SCANNED_ENTRIES = 10_000  # names looked at per look, in all folders
MAX_EVENT_RECORD_BYTES = 1 << 20
MAX_READ_BYTES = 4 << 20
MAX_EVENTS_PER_LOOK = 20_000
_EVENT_FILE = re.compile(r"tfevents")
_TAG_CHARACTERS = re.compile(r"[^A-Za-z0-9_]+")


class Malformed(ValueError):
    """Bytes that are not the protobuf they should be."""


def _varint(data: bytes, at: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        if at >= len(data) or shift > 63:
            raise Malformed("a varint runs past its message")
        byte = data[at]
        at += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value, at


def _fields(message: bytes) -> Iterator[tuple[int, int, int | bytes]]:
    """(field number, wire type, value) of each field of a protobuf message."""
    at = 0
    while at < len(message):
        key, at = _varint(message, at)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, at = _varint(message, at)
            yield number, wire, value
        elif wire == 1:
            if at + 8 > len(message):
                raise Malformed("a 64-bit field runs past its message")
            yield number, wire, message[at:at + 8]
            at += 8
        elif wire == 2:
            length, at = _varint(message, at)
            if at + length > len(message):
                raise Malformed("a field runs past its message")
            yield number, wire, message[at:at + length]
            at += length
        elif wire == 5:
            if at + 4 > len(message):
                raise Malformed("a 32-bit field runs past its message")
            yield number, wire, message[at:at + 4]
            at += 4
        else:
            raise Malformed(f"wire type {wire} is not used by event files")


DT_FLOAT, DT_DOUBLE = 1, 2
UNREAD = "\0unread"  # the key under which event_scalars counts scalar tensors it cannot read


def _tensor_scalar(tensor: bytes) -> float | None:
    """The value of a one-element float or double ``TensorProto`` (``dtype`` field 1,
    ``tensor_content`` 4, ``float_val`` 5, ``double_val`` 6), or None."""
    dtype, values = None, []
    for number, wire, value in _fields(tensor):
        if number == 1 and wire == 0:
            dtype = value
        elif number == 4 and wire == 2 and isinstance(value, bytes):
            values.append(("content", value))
        elif number == 5 and isinstance(value, bytes):  # packed (wire 2) or one (wire 5) float
            values.append(("<f", value))
        elif number == 6 and isinstance(value, bytes):
            values.append(("<d", value))
    if dtype not in (DT_FLOAT, DT_DOUBLE) or len(values) != 1:
        return None
    kind, raw = values[0]
    fmt = {"content": "<f" if dtype == DT_FLOAT else "<d"}.get(kind, kind)
    return struct.unpack(fmt, raw)[0] if len(raw) == struct.calcsize(fmt) else None


def _plugin(metadata: bytes) -> str | None:
    """``SummaryMetadata.plugin_data.plugin_name`` (fields 1 and 1)."""
    for number, wire, plugin_data in _fields(metadata):
        if number == 1 and wire == 2 and isinstance(plugin_data, bytes):
            for inner, inner_wire, name in _fields(plugin_data):
                if inner == 1 and inner_wire == 2 and isinstance(name, bytes):
                    return name.decode("utf-8", errors="replace")
    return None


def _summary_value(summary_value: bytes) -> tuple[str | None, float | None, bool]:
    """``(tag, scalar, unread)`` of one ``Summary.Value`` (``tag`` 1, ``simple_value`` 2,
    ``metadata`` 9, ``tensor`` 8); ``unread``: a scalar tensor that is not one float or double."""
    tag, scalar, tensor, plugin = None, None, None, None
    for field, field_wire, item in _fields(summary_value):
        if field == 1 and field_wire == 2 and isinstance(item, bytes):
            tag = item.decode("utf-8", errors="replace")
        elif field == 2 and field_wire == 5 and isinstance(item, bytes):
            scalar = struct.unpack("<f", item)[0]
        elif field == 8 and field_wire == 2 and isinstance(item, bytes):
            tensor = item
        elif field == 9 and field_wire == 2 and isinstance(item, bytes):
            plugin = _plugin(item)
    if scalar is None and tensor is not None and plugin in (None, "scalars"):
        scalar = _tensor_scalar(tensor)
        return tag, scalar, scalar is None and plugin == "scalars"
    return tag, scalar, False


def event_scalars(event: bytes) -> tuple[int, dict[str, float]] | None:
    """The step of a TensorBoard ``Event`` and its scalar values by tag (``Event.step`` is field
    2, ``Event.summary`` field 5; ``Summary.value`` field 1), or None when it has none; scalar
    tensors it cannot read are counted under :data:`UNREAD`."""
    step, values = 0, {}  # type: tuple[int, dict[str, float]]
    for number, wire, value in _fields(event):
        if number == 2 and wire == 0 and isinstance(value, int):
            step = value - (1 << 64) if value >= 1 << 63 else value
        elif number == 5 and wire == 2 and isinstance(value, bytes):
            for inner, inner_wire, summary_value in _fields(value):
                if inner == 1 and inner_wire == 2 and isinstance(summary_value, bytes):
                    tag, scalar, unread = _summary_value(summary_value)
                    if unread:
                        values[UNREAD] = values.get(UNREAD, 0) + 1
                    elif tag is not None and scalar is not None:
                        values[_TAG_CHARACTERS.sub("_", tag).strip("_")[:64] or "value"] = scalar
    return (step, values) if values else None


class EventFiles:
    """The event files under a run directory, read from where the last look stopped."""

    def __init__(self, run_dir: Path):
        self.run_dir = Path(run_dir)
        self.offsets: dict[Path, int] = {}
        self.ended: set[Path] = set()

    def _find(self) -> list[Path]:
        """At most MAX_EVENT_FILES event files, among the first MAX_SCANNED_ENTRIES names of the
        run directory's tree (a run can fill it with files that are not event files)."""
        found: list[Path] = []
        seen = 0
        folders = [(self.run_dir, 0)]  # breadth first, each folder's names in order
        while folders and len(found) < MAX_EVENT_FILES and seen < MAX_SCANNED_ENTRIES:
            folder, depth = folders.pop(0)
            entries = []
            try:
                with os.scandir(folder) as listing:
                    for entry in listing:
                        seen += 1
                        if seen > MAX_SCANNED_ENTRIES:
                            break
                        entries.append(entry)
            except OSError:
                continue
            for entry in sorted(entries, key=lambda e: e.name):
                try:
                    is_folder = entry.is_dir(follow_symlinks=False)
                    is_file = entry.is_file(follow_symlinks=False)
                except OSError:
                    continue
                if is_folder and depth < MAX_SEARCH_DEPTH and not entry.name.startswith("."):
                    folders.append((Path(entry.path), depth + 1))
                elif is_file and _EVENT_FILE.search(entry.name):
                    found.append(Path(entry.path))
        return found[:MAX_EVENT_FILES]

    def new_scalars(self) -> list[tuple[int, dict[str, float]]]:
        """The scalar events written since the last call, file by file, oldest first."""
        events: list[tuple[int, dict[str, float]]] = []
        budget = MAX_READ_BYTES
        for path in self._find():
            if path in self.ended or budget <= 0 or len(events) >= MAX_EVENTS_PER_LOOK:
                continue
            data = self._read(path, budget)
            budget -= len(data)
            used = 0
            while used + 12 <= len(data) and len(events) < MAX_EVENTS_PER_LOOK:
                (length,) = struct.unpack("<Q", data[used:used + 8])
                if length > MAX_EVENT_RECORD_BYTES:
                    self.ended.add(path)
                    break
                end = used + 12 + length + 4
                if end > len(data):
                    break  # a record still being written: read again next time
                try:
                    scalars = event_scalars(data[used + 12:used + 12 + length])
                except Malformed:
                    self.ended.add(path)
                    break
                if scalars is not None:
                    events.append(scalars)
                used = end
            self.offsets[path] = self.offsets.get(path, 0) + used
        return events

    def _read(self, path: Path, limit: int) -> bytes:
        fd = open_beneath(self.run_dir, path.relative_to(self.run_dir))
        if fd is None:
            return b""
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return b""
            os.lseek(fd, self.offsets.get(path, 0), os.SEEK_SET)
            return os.read(fd, min(limit, MAX_EVENT_RECORD_BYTES + 16))
        finally:
            os.close(fd)
