"""The workspace: the one folder an agent may act on, and where its recipes and runs live.

```
<workspace>/
  recipes/<name>/          recipes scaffolded from templates (any recipe folder works)
  runs/<run_id>/           one folder per run (see engine/run_dir.py)
  .trainwright/            trainwright's own state: audit.jsonl, config.yaml (run limits), locks
```

No tool takes a recipe from ``.git/``, ``.trainwright/`` or ``runs/``: those hold state that
only trainwright and git write.
"""

from __future__ import annotations

import contextlib
import fcntl
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from engine import run_dir as rd
from engine.errors import NotFound
from sandbox.config import RunLimits, load_run_limits
from sandbox.paths import PathRefused, check_name, confine, refuse_reserved

RECIPES_DIRNAME = "recipes"
STATE_DIRNAME = ".trainwright"
CHANGE_LOCK = "changes.lock"


@dataclass(frozen=True)
class Workspace:
    root: Path

    @classmethod
    def open(cls, root: Path | str) -> "Workspace":
        path = Path(root).expanduser().resolve()
        if not path.is_dir():
            raise NotFound(f"workspace {root} is not a folder")
        return cls(path)

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
        """Create ``.trainwright/`` and its lock file (once, when a writable server starts)."""
        self.state_dir.mkdir(exist_ok=True)
        (self.state_dir / CHANGE_LOCK).touch(exist_ok=True)

    @contextlib.contextmanager
    def changing(self) -> Iterator[None]:
        """Hold the workspace's change lock: one recipe change (write + commit) at a time,
        across threads and server processes, so two changes never interleave."""
        self.prepare_state()
        with open(self.state_dir / CHANGE_LOCK, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def run_limits(self) -> RunLimits:
        """The limits for the next run, from ``.trainwright/config.yaml`` (see sandbox.config)."""
        return load_run_limits(self.state_dir)

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
        check_name(run_id, "run_id")
        path = self.runs_dir / str(run_id)
        if not (path / rd.RUN_JSON).is_file():
            raise NotFound(f"no run {run_id!r} in this workspace; list_runs shows the runs")
        return confine(self.root, path, "run")

    def run_ids(self) -> list[str]:
        """Ids of the runs in ``runs/``, newest first (links that lead elsewhere are not runs)."""
        if not self.runs_dir.is_dir() or self.runs_dir.is_symlink():
            return []
        return sorted(
            (
                p.name for p in self.runs_dir.iterdir()
                if not p.is_symlink() and rd.RUN_ID_PATTERN.match(p.name) and (p / rd.RUN_JSON).is_file()
            ),
            reverse=True,
        )
