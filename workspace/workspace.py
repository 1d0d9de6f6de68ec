"""The workspace: the one folder an agent may act on, and where its recipes and runs live.

```
<workspace>/
  recipes/<name>/          recipes scaffolded from templates (any recipe folder works)
  runs/<run_id>/           one folder per run (see engine/run_dir.py)
  .trainwright/            trainwright's own state: audit.jsonl, config.yaml (run limits), locks,
                           runs/<run_id>/record.json (the server's record of each run)
```

No tool takes a recipe from ``.git/``, ``.trainwright/`` or ``runs/``: those hold state that
only trainwright and git write.

State cannot be redirected: ``.trainwright/``, ``runs/`` and ``recipes/`` must be real folders
(a symlink in their place is refused when the workspace is opened, and again at each write),
and state files are opened without following links, relative to a descriptor of their folder
(:func:`open_real_dir`, :meth:`Workspace.open_state_file`).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from engine import run_dir as rd
from engine.data_files import holding_store_lock, store_key_of
from engine.errors import MAX_QUOTED_CHARS, BadInput, NotFound
from engine.written_trees import remove_tree
from workspace.settings import RunLimits, effective_limits
from workspace.paths import PathRefused, check_name, confine, refuse_reserved
from runner.provenance import MAX_SNAPSHOT_FILE_BYTES
from runner.scripts import SCRIPT_NAME, neither_recipe_nor_script

RECIPES_DIRNAME = "recipes"
STATE_DIRNAME = ".trainwright"
# <workspace>/.trainwright/runs/<id>/record.json: the server's record of each run
# (runner.server_record), where no run's sandbox can write.
RECORDS_DIRNAME = "runs"
RECORD_JSON = "record.json"
# <workspace>/.trainwright/data-cache/<key>/: the tokenized data runs share (engine.token_store),
# the one folder of the state a run's sandbox may write; never part of a run's snapshot.
DATA_CACHE_DIRNAME = "data-cache"
CHANGE_LOCK = "changes.lock"


STATE_FILES = ("audit.jsonl", CHANGE_LOCK, "config.yaml")


def open_real_dir(path: Path, create: bool = False) -> int:
    """A descriptor of the folder ``path``, refused when ``path`` is a symlink (or not a folder).

    Writes made relative to the descriptor land in that folder even if ``path`` is swapped for
    a link afterwards.
    """
    path = Path(path)
    if create:
        with contextlib.suppress(FileExistsError):
            os.mkdir(path)
    try:
        return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            raise PathRefused(
                f"{path.name}/ in the workspace is a symbolic link or not a folder; trainwright keeps "
                f"its state, runs and recipes in real folders: replace {path} by a folder"
            ) from None
        raise


def open_state_file(dir_fd: int, name: str, flags: int, mode: int = 0o600) -> int:
    """Open ``name`` in the folder ``dir_fd`` without following a link in its place (and without
    blocking on a FIFO put there): only a regular file is accepted."""
    try:
        fd = os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, mode, dir_fd=dir_fd)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENXIO):
            raise PathRefused(
                f".trainwright/{name} is a symbolic link or a special file; trainwright keeps its state "
                "only in regular files: remove it"
            ) from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise PathRefused(f".trainwright/{name} is not a regular file; remove it")
    return fd


@dataclass(frozen=True)
class RunSource:
    """Where a run's code comes from: ``code_dir`` (a recipe folder; for a script, its folder),
    and for a script its file name there (``script``) and whether the file alone is the code
    (``alone``: a ``.py`` file was given) or the folder is (its ``train.py``)."""

    code_dir: Path
    script: str | None = None
    alone: bool = False

    @property
    def code(self) -> Path:
        """What holds the code: the script file when it alone is the code, else the folder."""
        return self.code_dir / self.script if self.alone and self.script else self.code_dir


@dataclass(frozen=True)
class Workspace:
    root: Path
    settings: Path | None = None  # the trusted settings file (serve --config); None: the user's default

    @classmethod
    def open(cls, root: Path | str, settings: Path | str | None = None) -> "Workspace":
        path = Path(root).expanduser().resolve()
        if not path.is_dir():
            raise NotFound(f"workspace {root} is not a folder")
        workspace = cls(path, Path(settings).expanduser().resolve() if settings is not None else None)
        workspace.check_state()
        return workspace

    def check_state(self) -> None:
        """Refuse a workspace whose state folders or files are links (see the module docstring)."""
        for folder in (self.state_dir, self.runs_dir, self.recipes_dir):
            if os.path.lexists(folder):
                os.close(open_real_dir(folder))
        for name in STATE_FILES:
            if (self.state_dir / name).is_symlink():
                raise PathRefused(
                    f".trainwright/{name} is a symbolic link; trainwright writes its state only to "
                    "real files: remove the link"
                )

    @property
    def runs_dir(self) -> Path:
        return self.root / rd.RUNS_DIRNAME

    @property
    def recipes_dir(self) -> Path:
        return self.root / RECIPES_DIRNAME

    @property
    def state_dir(self) -> Path:
        return self.root / STATE_DIRNAME

    def prepare_state(self) -> None:
        """Create ``.trainwright/``, its lock file and the data cache (once, when a writable
        server starts: a launch then changes nothing there but the stores it builds)."""
        data_cache_dir(self.root, create=True)
        dir_fd = open_real_dir(self.state_dir, create=True)
        try:
            os.close(open_state_file(dir_fd, CHANGE_LOCK, os.O_RDWR | os.O_CREAT))
        finally:
            os.close(dir_fd)

    @contextlib.contextmanager
    def changing(self) -> Iterator[None]:
        """Hold the workspace's change lock: one recipe change (write + commit) at a time,
        across threads and server processes, so two changes never interleave."""
        dir_fd = open_real_dir(self.state_dir, create=True)
        try:
            lock = open_state_file(dir_fd, CHANGE_LOCK, os.O_RDWR | os.O_CREAT)
        finally:
            os.close(dir_fd)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)
            yield
        finally:
            os.close(lock)  # closing releases the lock

    def real_dir(self, path: Path) -> Path:
        """``path`` (``runs/``, ``recipes/``), created if missing, refused if it is a link."""
        os.close(open_real_dir(path, create=True))
        return path

    def run_limits(self) -> RunLimits:
        """The limits for the next run (see :func:`run_limits_and_warnings`)."""
        return self.run_limits_and_warnings()[0]

    def run_limits_and_warnings(self) -> tuple[RunLimits, list[str]]:
        """The limits for the next run: the trusted settings, tightened by the workspace's
        ``.trainwright/config.yaml``, and a warning for each setting there that was ignored
        because it would loosen them (see workspace.settings)."""
        return effective_limits(self.settings, self.state_dir)

    def _confine_recipe(self, value: object) -> Path:
        """``value`` as a path in the workspace; a bare name (``my_lm``) also finds ``recipes/my_lm``."""
        path = confine(self.root, value, "recipe", must_exist=False)
        if not path.exists():
            try:
                name = check_name(value, "recipe")
            except PathRefused:
                name = None
            if name is None or not (self.recipes_dir / name).exists():
                raise NotFound(
                    f"no recipe {value!r} in the workspace; list_recipes shows the recipes, "
                    "scaffold_recipe makes one"
                )
            path = confine(self.root, f"{RECIPES_DIRNAME}/{name}", "recipe")
        return refuse_reserved(self.root, path, "recipe")

    def recipe(self, value: object) -> Path:
        """A recipe folder (with recipe.py) inside the workspace."""
        path = self._confine_recipe(value)
        if path.is_dir() and not (path / "recipe.py").is_file():
            raise NotFound(f"recipe {self.label(path)!r} is a folder without a recipe.py")
        if not path.is_dir():
            raise NotFound(f"recipe {self.label(path)!r} is not a recipe folder (a folder with a recipe.py)")
        return path

    def run_source(self, value: object) -> RunSource:
        """What ``launch_run`` starts from: a recipe folder, or a training script (a ``.py``
        file, or a folder with a ``train.py`` and no ``recipe.py``), inside the workspace and not
        reached through a link."""
        path = self._confine_recipe(value)
        label = self.label(path)
        if path.is_dir():
            if (path / "recipe.py").is_file():
                return RunSource(path)
            if not (path / SCRIPT_NAME).is_file():
                raise NotFound(neither_recipe_nor_script(label))
            script = path / SCRIPT_NAME
            alone = False
        elif path.suffix == ".py" and path.is_file():
            script, alone = path, True
        else:
            raise BadInput(f"{label!r} is not a Python script (.py) nor a folder; " + neither_recipe_nor_script(label))
        given = Path(os.path.normpath(self.root / str(value)))
        if os.path.islink(script) or (alone and given != path):
            raise BadInput(f"the script {str(value)!r} is a link or reached through one; give the script's real "
                           f"path ({label!r}): a run's snapshot copies files, not links")
        if script.stat().st_size > MAX_SNAPSHOT_FILE_BYTES:
            raise BadInput(f"the script {label!r} is larger than {MAX_SNAPSHOT_FILE_BYTES // 2**20} MiB; keep data outside it")
        return RunSource(path.parent if alone else path, script.name, alone)

    def recipe_or_script(self, value: object) -> Path:
        """A recipe folder, or a single Python training script, inside the workspace."""
        path = self._confine_recipe(value)
        if path.is_dir():
            return self.recipe(value)
        if path.suffix != ".py" or not path.is_file():
            raise NotFound(f"recipe {self.label(path)!r} is neither a recipe folder nor a .py script")
        return path

    def label(self, path: Path) -> str:
        """A path as shown to users and recorded in run.json: relative to the workspace."""
        return Path(path).resolve().relative_to(self.root).as_posix() or "."

    def run_dir(self, run_id: object) -> Path:
        """The run's directory: one the server's records name (whatever the run did to its
        run.json), or one with a run.json (a run the engine made alone)."""
        check_name(run_id, "run_id")
        path = self.runs_dir / str(run_id)
        if not (path.is_dir() and not path.is_symlink()
                and (has_record(self.root, str(run_id)) or (path / rd.RUN_JSON).is_file())):
            raise NotFound(f"no run {run_id!r} in this workspace; list_runs shows the runs")
        return confine(self.root, path, "run")

    def record_dir(self, run_id: str) -> Path:
        """The folder of the server's record of a run (runner.server_record)."""
        return record_dir(self.root, run_id)

    def run_ids(self) -> list[str]:
        """Ids of the runs in ``runs/``, newest first (links that lead elsewhere are not runs)."""
        if not self.runs_dir.is_dir() or self.runs_dir.is_symlink():
            return []
        return sorted(
            (
                p.name for p in self.runs_dir.iterdir()
                if not p.is_symlink() and rd.RUN_ID_PATTERN.fullmatch(p.name) and p.is_dir()
                and (has_record(self.root, p.name) or (p / rd.RUN_JSON).is_file())
            ),
            reverse=True,
        )


def records_root(workspace: Path | str) -> Path:
    """``<workspace>/.trainwright/runs``: the server's records of the workspace's runs."""
    return Path(workspace) / STATE_DIRNAME / RECORDS_DIRNAME


def data_cache_dir(workspace: Path | str, create: bool = False) -> Path:
    """``<workspace>/.trainwright/data-cache``: where runs keep their tokenized data; with
    ``create``, made when missing (a link there is refused, as for every state folder)."""
    folder = Path(workspace) / STATE_DIRNAME / DATA_CACHE_DIRNAME
    if create:
        os.close(open_real_dir(folder.parent, create=True))
        os.close(open_real_dir(folder, create=True))
    return folder


def cached_data(workspace: Path | str) -> list[tuple[str, int]]:
    """``(name, bytes)`` of every tokenized data store in the workspace's data cache: the
    folders that hold a complete store (``meta.json``), and those a build left unfinished."""
    folder = data_cache_dir(workspace)
    found = []
    for store in sorted(folder.iterdir()) if folder.is_dir() and not folder.is_symlink() else []:
        if store.is_dir() and not store.is_symlink():
            found.append((store.name, sum(f.stat().st_size for f in store.iterdir() if f.is_file() and not f.is_symlink())))
    return found


def remove_cached_data(workspace: Path | str, names: list[str]) -> list[tuple[str, int]]:
    """Remove the named stores (``all``: every one) from the data cache; returns what was removed.
    A name that is not there is refused before anything is removed; while one of them is being
    built (its lock, ``<key>.lock``, held) nothing is removed. A run that maps a removed store keeps
    reading it."""
    there = dict(cached_data(workspace))
    chosen = list(there) if names == ["all"] else names
    missing = [name for name in chosen if name not in there]
    if missing:  # the names are the runs' (a run may write thousands): the first ones, bounded
        listed = ", ".join(there) or "none"
        cut = "…" if len(listed) > MAX_QUOTED_CHARS else ""
        raise NotFound(f"no cached data {missing[0][:MAX_QUOTED_CHARS]!r}; cached: {listed[:MAX_QUOTED_CHARS]}{cut}"
                       + (f" ({len(there)} stores; `trainwright data-cache` lists them)" if cut else ""))
    folder = data_cache_dir(workspace)
    if not chosen and not folder.is_symlink():  # ``all`` of an empty cache (or of none yet); a link is refused below
        return []
    fd = open_real_dir(folder)  # a link refused
    try:
        with contextlib.ExitStack() as held:
            for key in dict.fromkeys(store_key_of(name) for name in chosen):  # the locks engine.token_store builds under
                held.enter_context(holding_store_lock(fd, key, functools.partial(_take_now, key=key)))
            for name in chosen:
                remove_tree(fd, name)  # a run wrote it, nested as it liked
    finally:
        os.close(fd)
    return [(name, there[name]) for name in chosen]


def _take_now(lock: int, key: str) -> None:
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise BadInput(f"a run is tokenizing its data into the cache (store {key}); remove once it has started "
                       "training") from None


def record_dir(workspace: Path | str, run_id: str) -> Path:
    return records_root(workspace) / run_id


def has_record(workspace: Path | str, run_id: str) -> bool:
    try:
        return stat.S_ISREG(os.lstat(record_dir(workspace, run_id) / RECORD_JSON).st_mode)
    except OSError:
        return False
