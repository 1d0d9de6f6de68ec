"""Writing the workspace's files: atomically, and put back as they were when a change fails.

A file is written to a temporary file beside it (``.<name>.<random>.tmp``), flushed to disk,
then renamed over it (``os.replace``): a reader, or a server killed at any moment, sees the old
file or the new one, never a partial one. :func:`remove_interrupted_writes` clears what a
killed write left; :func:`as_before_on_failure` puts every file of a change back as it was when
any step of the change (a write, the commit) fails. Standard library only.
"""

from __future__ import annotations

import contextlib
import glob
import os
import tempfile
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

NEW_FILE_MODE = 0o644
TEMPORARY_SUFFIX = ".tmp"


def _temporary_prefix(path: Path) -> str:
    return f".{path.name}."


def write_atomically(path: Path, text: str | bytes) -> None:
    """``text`` (UTF-8 when a ``str``, line endings as given) into ``path`` through a temporary
    file in the same folder and a rename. An existing file keeps its permissions; a new one gets
    ``0o644``."""
    path = Path(path)
    try:
        mode = path.stat().st_mode & 0o7777
    except FileNotFoundError:
        mode = NEW_FILE_MODE
    fd, tmp = tempfile.mkstemp(prefix=_temporary_prefix(path), suffix=TEMPORARY_SUFFIX, dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(text.encode("utf-8") if isinstance(text, str) else text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_files(files: Mapping[Path, str | bytes]) -> None:
    """Each of ``files`` (path → new content) written atomically; when one fails, every one is
    as it was before."""
    with as_before_on_failure(files):
        for path, text in files.items():
            write_atomically(path, text)


def put_back(path: Path, content: bytes | None) -> None:
    """``path`` as it was: ``content`` written atomically, or removed when it did not exist
    (``None``)."""
    if content is None:
        Path(path).unlink(missing_ok=True)
    else:
        write_atomically(path, content)


@contextlib.contextmanager
def as_before_on_failure(paths: Iterable[Path]) -> Iterator[None]:
    """Within the block ``paths`` may be written; when the block raises, every one is put back
    as it was (its bytes, or absent), and the error goes on."""
    before = {Path(p): Path(p).read_bytes() if Path(p).is_file() else None for p in paths}
    try:
        yield
    except BaseException:
        for path, content in before.items():
            put_back(path, content)
        raise


def remove_interrupted_writes(path: Path) -> list[Path]:
    """Temporary files that an atomic write of ``path`` left when its process was killed,
    removed. Only call this while no write of ``path`` is in progress (under the workspace's
    change lock)."""
    path = Path(path)
    leftovers = sorted(path.parent.glob(f"{glob.escape(_temporary_prefix(path))}*{TEMPORARY_SUFFIX}"))
    for leftover in leftovers:
        leftover.unlink(missing_ok=True)
    return leftovers
