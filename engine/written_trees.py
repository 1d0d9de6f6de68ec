"""Folders a run or a recipe's code wrote (exports, a model process's output, the data cache's
stores and builds, a push's staging folder), removed however they were made: following no link,
and however deep their folders nest. ``shutil.rmtree`` recurses a level a folder and raises
RecursionError past Python's limit, leaving the tree where it was; every removal of such a tree
goes through :func:`remove_tree` (or :func:`remove_path`). Stdlib only: the server, the runner,
the workspace and the engine import it.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import stat
from pathlib import Path

DIRECTORY_NO_FOLLOW = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC  # a folder opened, never through a link


def remove_tree(dir_fd: int, name: str) -> None:
    """Remove the folder ``name`` of ``dir_fd`` and all it holds, following no link, however deep
    its folders nest: what rmtree leaves is flattened into the folder itself, a level at a time,
    and removed."""
    try:
        shutil.rmtree(name, dir_fd=dir_fd)
        return
    except RecursionError:
        pass
    top, tag, moved = os.open(name, DIRECTORY_NO_FOLLOW, dir_fd=dir_fd), secrets.token_hex(8), 0
    try:
        while entries := os.listdir(top):
            for entry in entries:
                if not stat.S_ISDIR(os.stat(entry, dir_fd=top, follow_symlinks=False).st_mode):
                    os.unlink(entry, dir_fd=top)
                    continue
                inner = os.open(entry, DIRECTORY_NO_FOLLOW, dir_fd=top)
                try:
                    for child in os.listdir(inner):
                        moved += 1
                        os.rename(child, f".removing-{tag}-{moved}", src_dir_fd=inner, dst_dir_fd=top)
                finally:
                    os.close(inner)
                os.rmdir(entry, dir_fd=top)
    finally:
        os.close(top)
    os.rmdir(name, dir_fd=dir_fd)


def remove_path(path: Path | str, ignore_errors: bool = False) -> None:
    """Remove the folder at ``path`` and all it holds (:func:`remove_tree`); a link or a file
    there is unlinked (never what a link leads to), nothing there is no error. ``ignore_errors``:
    an OSError leaves what could not be removed, as ``shutil.rmtree(ignore_errors=True)`` does."""
    path = Path(path)
    try:
        parent = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            with contextlib.suppress(FileNotFoundError):
                if stat.S_ISDIR(os.stat(path.name, dir_fd=parent, follow_symlinks=False).st_mode):
                    remove_tree(parent, path.name)
                else:
                    os.unlink(path.name, dir_fd=parent)
        finally:
            os.close(parent)
    except OSError:
        if not ignore_errors:
            raise
