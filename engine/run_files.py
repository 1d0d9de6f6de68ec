"""Opening and writing files in a run directory (torch-free; the server and the supervisor
read and write run directories).

A run writes its run directory, so any name there may be a link to a host file, a FIFO or a
folder swapped for a link after it was listed. Nothing there is opened following a link or
waiting on a FIFO (:data:`NO_FOLLOW`): :func:`open_beneath` opens a path one name at a time from
a folder the server trusts, :func:`read_bounded` reads a record file whole and bounded, and
:func:`locked` / :func:`write_json_atomic` make every update of a record a locked
read-modify-write that replaces the file atomically, so a reader never sees a half-written one.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import stat
import tempfile
from pathlib import Path, PurePosixPath
from typing import Any, Iterator

NO_FOLLOW = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def open_beneath(root: Path | str, relative: Path | str, directory: bool = False) -> int | None:
    """``root/relative`` opened read-only one name at a time, following no link (``root`` itself
    included); None when any name is missing, a link, or not what is asked for. ``relative``
    must be plain: no ``..``, not absolute."""
    parts = PurePosixPath(relative).parts
    if not parts or PurePosixPath(relative).is_absolute() or any(p in ("", ".", "..") for p in parts):
        return None
    flags = os.O_RDONLY | NO_FOLLOW
    try:
        fd = os.open(root, flags | os.O_DIRECTORY)
    except (OSError, ValueError):
        return None
    try:
        for name in parts[:-1]:
            inner = os.open(name, flags | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = inner
        return os.open(parts[-1], flags | (os.O_DIRECTORY if directory else 0), dir_fd=fd)
    except (OSError, ValueError):  # ValueError: a NUL in a name the run wrote
        return None
    finally:
        os.close(fd)


@contextlib.contextmanager
def locked(run_dir: Path, lock_name: str = ".run.json.lock") -> Iterator[None]:
    lock_path = Path(run_dir) / lock_name
    with os.fdopen(open_lock_file(lock_path), "rb") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)


def open_lock_file(path: Path) -> int:
    """A descriptor of the regular lock file ``path``; anything else at its name (a link, a
    FIFO, left by the run) is removed first (unlinking never follows a link)."""
    for _ in range(3):
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | NO_FOLLOW, 0o644)
        except OSError:  # ELOOP: a link; ENXIO and the like: not a file
            fd = None
        if fd is not None:
            if stat.S_ISREG(os.fstat(fd).st_mode):
                return fd
            os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    raise OSError(f"{path.name} in {path.parent} is not a regular file and could not be replaced")


def write_json_atomic(path: Path, data: Any) -> None:
    path = Path(path)
    # A new file with a random name (mkstemp: O_EXCL, which never follows a link): a name the run
    # could predict (the writer's pid is in run.json) may be a link it planted to a host file.
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o644)
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=2, sort_keys=True)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def read_bounded(path: Path, limit: int, what: str) -> bytes:
    """The bytes of a record file, opened without following a link or waiting on a FIFO:
    OSError when it is not a regular file, ValueError when it is larger than ``limit``."""
    return read_open_bounded(os.open(path, os.O_RDONLY | NO_FOLLOW), limit, what)


def read_open_bounded(fd: int, limit: int, what: str) -> bytes:
    """The bytes of the file open at ``fd`` (closed after), as :func:`read_bounded` reads them
    (a descriptor from :func:`open_beneath`, say)."""
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{what} is not a regular file")
        data = f.read(limit + 1)
    if len(data) > limit:
        raise ValueError(f"{what} is larger than {limit} bytes")
    return data
