"""What ran: the snapshot of a recipe's code that a run executes, and where that code came from.

A run never executes the recipe folder itself. Its code is copied into ``runs/<id>/recipe/``
when it is launched, and the engine imports it from there, so

- what ran is on disk beside its metrics, whatever happens to the recipe afterwards;
- a resume runs the code of the checkpoint it continues (``code="checkpoint"``, the default),
  or the recipe as it is now (``code="head"``), and says which;
- nothing a run does can leave bytecode, caches or outputs in the recipe folder.

The run records the commit the code was taken at and whether the recipe had uncommitted
changes; those changes are saved as ``uncommitted.patch`` beside the snapshot's files. A run
may also execute the recipe as an earlier commit holds it (:func:`code_at_commit`: an A/B of a
skill runs its commit and the commit before it), with nothing uncommitted.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Iterator

from engine import run_dir as rd
from engine.errors import BadInput, NotFound
from workspace import git as workspace_git

# The snapshot holds code and configuration. Data belongs in data.paths (read from the
# workspace); large files are not copied, so a recipe folder that keeps data is not duplicated
# into every run.
MAX_SNAPSHOT_FILE_BYTES = 2 * 2**20
MAX_SNAPSHOT_BYTES = 32 * 2**20
MAX_SNAPSHOT_FILES = 2000
MAX_SNAPSHOT_DEPTH = 32
MAX_DIRTY_SHOWN = 20
_SKIPPED_DIRS = {"__pycache__", ".git", ".ipynb_checkpoints", ".mypy_cache", ".pytest_cache", ".ruff_cache"}


@dataclass
class CodeOrigin:
    """Where a run's code comes from, as recorded in its RunRecord."""

    git_commit: str | None
    recipe_dirty: bool | None  # None: the workspace is not a git repository
    dirty_files: list[str] = field(default_factory=list)
    patch: str = ""

    @property
    def description(self) -> str:
        if self.git_commit is None:
            return "not in a git repository"
        text = f"commit {self.git_commit[:10]}"
        if self.recipe_dirty:
            text += f" + uncommitted changes ({', '.join(_short(f) for f in self.dirty_files[:5])})"
        return text


def recipe_origin(workspace: Path, recipe_dir: Path) -> CodeOrigin:
    """HEAD and the recipe's uncommitted changes, now (``recipe_dir``: a recipe or script
    folder, or a script file run alone)."""
    repo = workspace_git.open_repo(workspace)
    if repo is None:
        return CodeOrigin(git_commit=None, recipe_dirty=None)
    commit = workspace_git.head_commit(workspace)
    dirty = workspace_git.uncommitted(repo, recipe_dir)
    # The snapshot copies what git ignores too (a .gitignore or .git/info/exclude rule): code and
    # config among those run, and no commit holds them. (Ignored data is not code: not counted.)
    if Path(recipe_dir).is_file():  # a script run of the file alone
        copied = {Path(recipe_dir).resolve()}
    else:
        copied = {(Path(recipe_dir) / f).resolve() for f in snapshot_files(recipe_dir)
                  if f.suffix == ".py" or f.name == "config.yaml"}
    root = workspace_git.worktree(repo)
    dirty += [name for name in workspace_git.ignored_files(repo, recipe_dir) if (root / name).resolve() in copied]
    patch = workspace_git.diff_against_head(repo, recipe_dir, dirty) if dirty else ""
    return CodeOrigin(git_commit=commit, recipe_dirty=bool(dirty), dirty_files=dirty[:MAX_DIRTY_SHOWN], patch=patch)


@contextlib.contextmanager
def code_at_commit(workspace: Path, recipe_dir: Path, rev: str, entry: str = "recipe.py",
                   alone: bool = False) -> Iterator[tuple[Path, CodeOrigin]]:
    """The files of ``recipe_dir`` as commit ``rev`` holds them, in a temporary folder of the
    recipe's name (removed afterwards), and their origin: that commit, nothing uncommitted.
    ``entry`` is the file the commit must hold there (a script's ``train.py``, or the script
    itself); with ``alone`` that file is the only one written (a script run from its file alone).

    Only what a snapshot would hold is written (:func:`snapshot_files`' rules: a link or an
    oversized file among the code is refused, other links and large files are left out), within
    the snapshot's bounds, and never outside the folder."""
    repo = workspace_git.open_repo(workspace)
    if repo is None:
        raise workspace_git.GitRefused("the workspace is not a git repository, so no commit holds the recipe's code")
    sha = workspace_git.resolve_commit(repo, rev)
    if alone:
        found = workspace_git.tree_file(repo, sha, Path(recipe_dir) / entry)
        files = None if found is None else [found]
    else:
        files = workspace_git.tree_files(repo, sha, recipe_dir)
    name = Path(recipe_dir).name
    if files is None or not any(f.path == entry and not f.link for f in files):
        missing = f"no recipe at {name!r} (no recipe.py there)" if entry == "recipe.py" else \
            f"no script {entry!r} in {name!r}"
        raise NotFound(f"commit {sha[:10]} holds {missing}; "
                       "`git log -- RECIPE` lists the commits that do")
    folder = Path(tempfile.mkdtemp(prefix="trainwright-commit-"))
    try:
        destination = folder / name
        destination.mkdir()
        total = 0
        if len(files) > MAX_SNAPSHOT_FILES:
            raise BadInput(f"the recipe at commit {sha[:10]} holds more than {MAX_SNAPSHOT_FILES} files; keep data "
                           "outside it (data.paths)")
        for item in files:
            parts = PurePosixPath(item.path).parts
            if any(part in ("", ".", "..") for part in parts) or len(parts) > MAX_SNAPSHOT_DEPTH:
                raise BadInput(f"commit {sha[:10]} holds a file the snapshot cannot (a path of {len(parts)} parts "
                               f"or a '..' in {item.path[:120]!r})")
            code = item.path.endswith(".py") or parts[-1] == "config.yaml"
            if code and (item.link or item.size > MAX_SNAPSHOT_FILE_BYTES):
                raise BadInput(f"{item.path} in the recipe at commit {sha[:10]} is a link or larger than "
                               f"{MAX_SNAPSHOT_FILE_BYTES // 2**20} MiB, so a run's snapshot cannot hold it")
            if item.link or item.size > MAX_SNAPSHOT_FILE_BYTES:
                continue  # a snapshot of the folder leaves it out too
            total += item.size
            if total > MAX_SNAPSHOT_BYTES:
                raise BadInput(f"the recipe at commit {sha[:10]} holds more than {MAX_SNAPSHOT_BYTES // 2**20} MiB of "
                               "small files; keep data outside it (data.paths)")
            target = destination.joinpath(*parts)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(item.read())
        yield destination, CodeOrigin(git_commit=sha, recipe_dirty=False)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def snapshot_files(source: Path) -> list[Path]:
    """The files of ``source`` a snapshot holds (relative paths): code and configuration, not
    caches, links or large files. A Python file or ``config.yaml`` that is a link or too large
    is refused: the run would not have it."""
    chosen: list[Path] = []
    total = 0
    for folder, dirs, files in os.walk(source):
        dirs[:] = sorted(d for d in dirs if d not in _SKIPPED_DIRS and not os.path.islink(os.path.join(folder, d)))
        if dirs and len(Path(folder).relative_to(source).parts) >= MAX_SNAPSHOT_DEPTH:
            raise BadInput(f"the recipe folder nests folders deeper than {MAX_SNAPSHOT_DEPTH} levels; "
                           "keep code in a shallow tree and data outside it (data.paths)")
        for name in sorted(files):
            path = Path(folder) / name
            code = name.endswith(".py") or name == "config.yaml"
            if code and (path.is_symlink() or (path.is_file() and path.stat().st_size > MAX_SNAPSHOT_FILE_BYTES)):
                # The check would import it, the run would not find it (or find another module).
                raise BadInput(
                    f"{path.relative_to(source)} in the recipe is a link or larger than "
                    f"{MAX_SNAPSHOT_FILE_BYTES // 2**20} MiB, so a run's snapshot cannot hold it; "
                    "make it a real, smaller file in the recipe folder"
                )
            if path.is_symlink() or not path.is_file() or name.endswith((".pyc", ".pyo")):
                continue
            size = path.stat().st_size
            if size > MAX_SNAPSHOT_FILE_BYTES:
                continue
            total += size
            chosen.append(path.relative_to(source))
            if total > MAX_SNAPSHOT_BYTES or len(chosen) > MAX_SNAPSHOT_FILES:
                raise BadInput(
                    f"the recipe folder holds more than {MAX_SNAPSHOT_FILES} files or "
                    f"{MAX_SNAPSHOT_BYTES // 2**20} MiB of small files; keep data outside it (data.paths)"
                )
    return chosen


def write_snapshot(
    source: Path, run_dir: Path, origin: CodeOrigin | None = None, files: list[Path] | None = None
) -> Path:
    """Copy ``source`` (a recipe folder, or another run's snapshot) to ``run_dir/recipe``;
    ``files``: :func:`snapshot_files` of ``source``, when the caller checked it first."""
    destination = Path(run_dir) / rd.SNAPSHOT_DIRNAME
    destination.mkdir()
    for relative in snapshot_files(source) if files is None else files:
        target = destination / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source / relative, target)
    if origin is not None and origin.patch:
        (destination / rd.UNCOMMITTED_PATCH).write_text(origin.patch)
    return destination


def snapshot_digest(folder: Path) -> str:
    """sha256 over the names and contents of the files a snapshot of ``folder`` holds."""
    digest = hashlib.sha256()
    for relative in snapshot_files(folder):
        digest.update(relative.as_posix().encode() + b"\0")
        digest.update(hashlib.sha256((folder / relative).read_bytes()).digest())
    return digest.hexdigest()


def check_snapshot_unchanged(record: rd.RunRecord, folder: Path) -> None:
    """Refuse to run ``record``'s snapshot as that run's code if it changed since it was written."""
    if record.snapshot_digest and snapshot_digest(folder) != record.snapshot_digest:
        raise BadInput(
            f"the code snapshot of run {record.id} ({rd.SNAPSHOT_DIRNAME}/ in its run directory) was changed "
            "after the run started, so it is not the code its checkpoints were trained with; resume with "
            "code='head' to run the recipe as it is now"
        )


def code_description(record: rd.RunRecord) -> str:
    """Which code ran, in words: for notes, reviews and the console."""
    if record.resumed_from is not None:
        source = record.resumed_from
        text = f"resumed from {source.run_id} step {source.step} with " + (
            "that run's code" if record.code_from == "checkpoint" else "the recipe as at resume time"
        )
    else:
        text = "code"
    if record.git_commit:
        text += f" at commit {record.git_commit[:10]}"
    if record.recipe_dirty:
        files = ", ".join(_short(f) for f in record.dirty_files[:5]) or "the recipe"
        text += f" + uncommitted changes ({files}; the diff: runs/{record.id}/recipe/{rd.UNCOMMITTED_PATCH})"
    return text


def _short(name: str, limit: int = 120) -> str:
    """A file name as shown in one line (a recipe may nest folders deep)."""
    return name if len(name) <= limit else "…" + name[-(limit - 1):]
