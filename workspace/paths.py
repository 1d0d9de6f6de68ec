"""Path confinement: every path or name a caller gives is resolved inside the workspace or refused.

Agents are untrusted callers: a path may carry ``..``, be absolute, contain a NUL byte or other
control characters, or pass through a symlink that leads out of the workspace. Every tool
resolves what it is given here — :func:`confine` for paths, :func:`check_name` for plain names
(run ids, skill, template and recipe names), :func:`confine_config` for config values
that name files — so there is exactly one place where that is decided.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Mapping

from engine.errors import BadInput

MAX_PATH_CHARS = 1024
MAX_NAME_CHARS = 128
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
# Folders of the workspace that hold trainwright's or git's own state: no tool reads a recipe
# from them or writes into them.
RESERVED_DIRS = (".git", ".trainwright", "runs")


class PathRefused(BadInput):
    """A path or name that may not be used; the message says why and what is allowed."""


def _shown(value: str, limit: int = 80) -> str:
    """``value`` for an error message: quoted, and cut so a huge input is not echoed back."""
    return repr(value) if len(value) <= limit else repr(value[:limit]) + f"… ({len(value)} characters)"


def check_name(value: object, kind: str) -> str:
    """A plain name (no separators, no leading dot or dash): letters, digits, ``_ . -``."""
    if not isinstance(value, str):
        raise PathRefused(f"{kind} must be a string, got {type(value).__name__}")
    if "\x00" in value:
        raise PathRefused(f"{kind} contains a NUL byte")
    if len(value) > MAX_NAME_CHARS:
        raise PathRefused(f"{kind} is longer than {MAX_NAME_CHARS} characters")
    if not _NAME.fullmatch(value) or ".." in value:
        raise PathRefused(
            f"{kind} {_shown(value)} is not a plain name: use letters, digits, '_', '.', '-' "
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
    if _CONTROL.search(text):
        raise PathRefused(f"{kind} {_shown(text)} contains control characters (newline, tab, ...)")
    root = Path(root).resolve()
    # "~" is a folder name like any other: expanding it would point into the user's home.
    candidate = Path(text)
    if not candidate.is_absolute():
        candidate = root / candidate
    try:
        resolved = candidate.resolve(strict=must_exist)
    except FileNotFoundError:
        raise PathRefused(f"{kind} {_shown(text)} does not exist in the workspace") from None
    except (OSError, RuntimeError, ValueError) as e:  # symlink loops, over-long names
        raise PathRefused(f"{kind} {_shown(text)} cannot be resolved: {type(e).__name__}") from None
    if resolved != root and root not in resolved.parents:
        raise PathRefused(
            f"{kind} {_shown(text)} resolves outside the workspace; "
            "give a path inside the workspace, relative to it"
        )
    return resolved


def refuse_reserved(root: Path, path: Path, kind: str) -> Path:
    """Refuse ``path`` (already confined) when it lies in git's or trainwright's own folders."""
    relative = Path(path).relative_to(Path(root).resolve())
    if relative.parts and relative.parts[0] in RESERVED_DIRS:
        raise PathRefused(
            f"{kind} {relative.as_posix()!r} is inside {relative.parts[0]}/, which holds "
            "trainwright's or git's own state; recipes live elsewhere (e.g. recipes/<name>)"
        )
    return path


def is_path_key(key: str) -> bool:
    """Config keys whose values name files: ``model.pretrained_path``, ``data.paths``, ..."""
    leaf = key.rsplit(".", 1)[-1]
    return leaf.endswith("path") or leaf.endswith("paths") or leaf.endswith("_dir") or leaf.endswith("_file")


def confine_config(root: Path, config: Mapping[str, Any]) -> None:
    """Every config value that names files (see :func:`is_path_key`) must lie inside the workspace.

    ``config`` is a config at any stage — the merged, resolved config of a run, a nested section
    (``{"data": {"paths": [...]}}``), dotted keys (``{"data.paths": [...]}``) or a mix: the walk
    goes through every mapping and list, whatever the nesting. ``~`` is refused (the engine
    would read the user's home), as are links that lead out.
    """
    _confine_config_node(Path(root), config, "", 0)


def _confine_config_node(root: Path, node: Any, key: str, depth: int) -> None:
    if depth > 32:
        raise PathRefused(f"config {key or 'value'} is nested too deeply")
    if isinstance(node, Mapping):
        for name, value in node.items():
            _confine_config_node(root, value, f"{key}.{name}" if key else str(name), depth + 1)
        return
    if isinstance(node, (list, tuple)) and not is_path_key(key):
        for item in node:
            _confine_config_node(root, item, key, depth + 1)
        return
    if not key or not is_path_key(key) or node is None:
        return
    for item in node if isinstance(node, (list, tuple)) else [node]:
        if isinstance(item, (Mapping, list, tuple)):
            _confine_config_node(root, item, key, depth + 1)
            continue
        if isinstance(item, str) and item.lstrip().startswith("~"):
            raise PathRefused(
                f"config {key} {_shown(item)} starts with '~' (a home folder); "
                "give a path inside the workspace, relative to it"
            )
        try:
            confine(root, item, f"config {key}", must_exist=False)
        except PathRefused as e:
            raise PathRefused(f"{e} (config values that name files must be inside the workspace)") from None


def relative_to_root(root: Path, path: Path) -> str:
    return Path(path).resolve().relative_to(Path(root).resolve()).as_posix()
