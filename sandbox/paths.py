"""Path confinement: every path or name a caller gives is resolved inside the workspace or refused.

Agents are untrusted callers: a path may carry ``..``, be absolute, contain a NUL byte, or pass
through a symlink that leads out of the workspace. Every tool resolves what it is given with
:func:`confine` (paths) or :func:`check_name` (plain names: run ids, skill and template names),
so there is exactly one place where that is decided.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

MAX_PATH_CHARS = 1024
MAX_NAME_CHARS = 128
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


class PathRefused(ValueError):
    """A path or name that may not be used; the message says why and what is allowed."""


def check_name(value: object, kind: str) -> str:
    """A plain name (no separators, no leading dot): letters, digits, ``_ . -``."""
    if not isinstance(value, str):
        raise PathRefused(f"{kind} must be a string, got {type(value).__name__}")
    if "\x00" in value:
        raise PathRefused(f"{kind} contains a NUL byte")
    if len(value) > MAX_NAME_CHARS:
        raise PathRefused(f"{kind} is longer than {MAX_NAME_CHARS} characters")
    if not _NAME.match(value) or ".." in value:
        raise PathRefused(
            f"{kind} {value!r} is not a plain name: use letters, digits, '_', '.', '-' "
            "(no '/', no '..', not starting with '.' or '-')"
        )
    return value


def confine(root: Path, value: object, kind: str = "path", must_exist: bool = True) -> Path:
    """Resolve ``value`` (relative to ``root``, or absolute inside it) to a real path in ``root``.

    Symlinks are resolved before the check, so a link that points outside is refused. With
    ``must_exist=False`` the deepest existing ancestor is resolved and the rest appended.
    """
    if not isinstance(value, (str, os.PathLike)):
        raise PathRefused(f"{kind} must be a string path, got {type(value).__name__}")
    text = os.fspath(value)
    if not isinstance(text, str):
        raise PathRefused(f"{kind} must be a text path")
    if "\x00" in text:
        raise PathRefused(f"{kind} contains a NUL byte")
    if not text.strip():
        raise PathRefused(f"{kind} is empty")
    if len(text) > MAX_PATH_CHARS:
        raise PathRefused(f"{kind} is longer than {MAX_PATH_CHARS} characters")
    root = Path(root).resolve()
    candidate = Path(text).expanduser() if text.startswith("~") else Path(text)
    if not candidate.is_absolute():
        candidate = root / candidate
    try:
        resolved = candidate.resolve(strict=must_exist)
    except FileNotFoundError:
        raise PathRefused(f"{kind} {text!r} does not exist in the workspace") from None
    except (OSError, RuntimeError) as e:  # symlink loops, over-long names
        raise PathRefused(f"{kind} {text!r} cannot be resolved: {e}") from None
    if resolved != root and root not in resolved.parents:
        raise PathRefused(
            f"{kind} {text!r} resolves outside the workspace ({root}); "
            "give a path inside the workspace, relative to it"
        )
    return resolved


def relative_to_root(root: Path, path: Path) -> str:
    return Path(path).resolve().relative_to(Path(root).resolve()).as_posix()
