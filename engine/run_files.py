"""Opening what a run wrote (torch-free; the server and the supervisor read run directories).

A run writes its run directory, so any name there may be a link to a host file, a FIFO or a
folder swapped for a link after it was listed. :func:`open_beneath` opens a path one name at a
time from a folder the server trusts, following no link on the way and never blocking on a
FIFO; callers check what they opened (``fstat``) before they read it.
"""

from __future__ import annotations

import os
from pathlib import Path, PurePosixPath

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
