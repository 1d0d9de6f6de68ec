"""The workspace: the one folder an agent may act on, and where its recipes and runs live.

```
<workspace>/
  recipes/<name>/          recipes scaffolded from templates (any recipe folder works)
  runs/<run_id>/           one folder per run (see engine/run_dir.py)
  .trainwright/            trainwright's own state (audit log)
```
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from engine import run_dir as rd
from sandbox.paths import PathRefused, check_name, confine

RECIPES_DIRNAME = "recipes"
STATE_DIRNAME = ".trainwright"


class NotFound(LookupError):
    """A recipe, run or checkpoint that does not exist; the message says how to list them."""


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

    def recipe(self, value: object) -> Path:
        """A recipe folder (with recipe.py) inside the workspace.

        A bare name (``my_lm``) also finds ``recipes/my_lm``.
        """
        try:
            path = confine(self.root, value, "recipe")
        except PathRefused:
            if isinstance(value, str) and "/" not in value and (self.recipes_dir / value).exists():
                path = confine(self.root, f"{RECIPES_DIRNAME}/{value}", "recipe")
            else:
                raise
        if path.is_dir() and not (path / "recipe.py").is_file():
            raise NotFound(f"recipe {value!r} is a folder without a recipe.py")
        if not path.is_dir():
            raise NotFound(f"recipe {value!r} is not a recipe folder (a folder with a recipe.py)")
        return path

    def recipe_or_script(self, value: object) -> Path:
        """A recipe folder, or a single Python training script, inside the workspace."""
        try:
            path = confine(self.root, value, "recipe")
        except PathRefused:
            if isinstance(value, str) and "/" not in value and (self.recipes_dir / value).exists():
                return self.recipe(value)
            raise
        if path.is_dir():
            return self.recipe(value)
        if path.suffix != ".py" or not path.is_file():
            raise NotFound(f"recipe {value!r} is neither a recipe folder nor a .py script")
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
        if not self.runs_dir.is_dir():
            return []
        return sorted(
            (p.name for p in self.runs_dir.iterdir() if (p / rd.RUN_JSON).is_file()), reverse=True
        )
