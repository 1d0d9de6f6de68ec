"""A skill applied to a recipe: :func:`plan_skill` runs the codemod, checks that the result parses
and diffs it, writing nothing; :func:`apply_skill` writes the plan's files (atomically)."""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import libcst as cst
from pydantic import BaseModel, ValidationError

from skills.codemod_kit.edits import Edits
from skills.codemod_kit.outcome import AlreadyApplied
from skills.codemod_kit.recipe import Recipe
from skills.errors import InvalidParams, RecipeNotFound, SkillError
from skills.registry import skill as find_skill
from workspace.files import write_files


class ApplyResult(BaseModel):
    skill: str
    version: str
    changed: bool
    already_applied: bool
    target: str  # the file the codemod worked on
    diff: str  # unified diff, a/ b/ paths relative to diff_root ("" when nothing changed)
    params: dict[str, Any]  # validated, with defaults
    message: str
    acts_on: str = ""  # what the change acts on ("wraps 4 blocks of `model.layers`"); "" when unchanged


def resolve_target(recipe: Path) -> Path:
    """A recipe folder's ``recipe.py``, or the ``.py`` file itself."""
    recipe = Path(recipe)
    if recipe.is_dir():
        target = recipe / "recipe.py"
        if not target.is_file():
            raise RecipeNotFound(f"{recipe} is not a recipe folder: it has no recipe.py")
        return target
    if recipe.is_file() and recipe.suffix == ".py":
        return recipe
    raise RecipeNotFound(f"{recipe} is neither a recipe folder (with recipe.py) nor a .py file")


def validate_params(name: str, params_class: type[BaseModel], params: dict[str, Any] | None):
    valid = ", ".join(
        f"{field}: {_type_name(info.annotation)} = {info.default!r}" if not info.is_required() else field
        for field, info in params_class.model_fields.items()
    ) or "none"
    if params is not None and not isinstance(params, dict):
        raise InvalidParams(f"{name}: params must be a mapping of name → value; valid params: {valid}")
    try:
        return params_class.model_validate(params or {})
    except ValidationError as e:
        problems = []
        for error in e.errors():
            key = ".".join(str(p) for p in error["loc"]) or "params"
            if error["type"] == "extra_forbidden":
                problems.append(f"unknown param '{key}'")
            else:
                problems.append(f"bad value for '{key}' ({error.get('input')!r}): {error['msg']}")
        raise InvalidParams(f"{name}: {'; '.join(problems)}; valid params: {valid}") from None


def _type_name(annotation: Any) -> str:
    text = getattr(annotation, "__name__", None) or str(annotation)
    return text.replace("typing.", "")


def unified_diff(old: str, new: str, relative: str) -> str:
    """A unified diff that ``git apply`` accepts (including files without a final newline)."""
    old_lines = old.splitlines(keepends=True)
    new_lines = new.splitlines(keepends=True)
    out = []
    for line in difflib.unified_diff(old_lines, new_lines, f"a/{relative}", f"b/{relative}"):
        if line.startswith(("---", "+++")):
            out.append(line.rstrip("\n") + "\n")
        elif line.endswith("\n"):
            out.append(line)
        else:
            out.append(line + "\n\\ No newline at end of file\n")
    return "".join(out)


@dataclass(frozen=True)
class SkillPlan:
    """What applying a skill to a recipe would do, computed without writing anything (as LibCST's
    ``transform_module`` returns a result): the caller decides whether to write it."""

    skill: str
    version: str
    target: Path  # the file the codemod worked on
    params: dict[str, Any]  # validated, with defaults
    files: dict[Path, str]  # the new source of each file the skill changes ({} when it changes nothing)
    diff: str  # unified diff, a/ b/ paths relative to diff_root ("" when nothing changes)
    reason: str = ""  # why nothing changes (the skill is already applied)
    acts_on: str = ""  # what the change acts on ("wraps 4 blocks of `model.layers`"); "" when unchanged
    notes: tuple[str, ...] = ()  # the codemod's notes on the change

    @property
    def changed(self) -> bool:
        return bool(self.files)

    def message(self, written: bool) -> str:
        """One line on the plan: what changed (``written``) or would change, or why nothing does."""
        if not self.changed:
            return f"{self.skill} is already applied to {self.target.name}: {self.reason}"
        lines = self.diff.splitlines()
        added = sum(1 for line in lines if line.startswith("+") and not line.startswith("+++"))
        removed = sum(1 for line in lines if line.startswith("-") and not line.startswith("---"))
        notes = "".join(f"; {note}" for note in ([self.acts_on] if self.acts_on else []) + list(self.notes))
        verb = "changed" if written else "would change"
        return f"{self.skill} {verb} {self.target.name} (+{added} -{removed} lines){notes}"

    def result(self, written: bool) -> ApplyResult:
        return ApplyResult(skill=self.skill, version=self.version, changed=self.changed,
                           already_applied=not self.changed, target=str(self.target), diff=self.diff,
                           params=self.params, message=self.message(written), acts_on=self.acts_on)


def plan_skill(name: str, recipe: Path, params: dict[str, Any] | None = None,
               diff_root: Path | None = None) -> SkillPlan:
    """What skill ``name`` would change in a recipe folder (its ``recipe.py``) or a ``.py``
    training script, and the diff; reads the recipe, writes nothing. A target that
    :func:`resolve_target` gave (the file itself) is taken as it is.

    A recipe that already holds the pattern gives a plan that changes nothing. Raises
    ``UnknownSkill``, ``InvalidParams``, ``RecipeNotFound`` or ``SkillRefused`` (all
    ``SkillError``) with a one-line message. The diff's paths are relative to ``diff_root``
    (default: the target's folder), so ``git apply`` run there accepts it.
    """
    found = find_skill(name)
    codemod = found.codemod
    validated = validate_params(name, codemod.Params, params)
    target = resolve_target(Path(recipe))
    root = Path(diff_root) if diff_root is not None else target.parent
    try:
        relative = target.resolve().relative_to(root.resolve()).as_posix()
    except ValueError:
        raise SkillError(f"diff_root {root} does not contain the recipe {target}") from None

    with open(target, encoding="utf-8", newline="") as f:
        source = f.read()
    outcome = codemod.apply(Recipe(target, source), validated)

    plan = dict(skill=name, version=found.version, target=target, params=validated.model_dump(mode="json"))
    if isinstance(outcome, AlreadyApplied):
        return SkillPlan(**plan, files={}, diff="", reason=outcome.reason)
    assert isinstance(outcome, Edits), f"{name}: apply() must return Edits or AlreadyApplied"
    new_source = outcome.apply().code
    if new_source == source:
        return SkillPlan(**plan, files={}, diff="", reason="nothing to change")
    _check_parses(name, target, new_source)
    return SkillPlan(**plan, files={target: new_source}, diff=unified_diff(source, new_source, relative),
                     acts_on=outcome.acts_on, notes=tuple(outcome.notes))


def apply_skill(
    name: str,
    recipe: Path,
    params: dict[str, Any] | None = None,
    dry_run: bool = False,
    diff_root: Path | None = None,
) -> ApplyResult:
    """Apply skill ``name`` to a recipe folder (its ``recipe.py``) or a ``.py`` training script:
    :func:`plan_skill`, then (unless ``dry_run``) each changed file written atomically, with no
    commit (the ``apply_skill`` tool commits through ``workspace.git.commit_files``).

    Idempotent: a recipe that already holds the pattern is reported with ``changed=False,
    already_applied=True``. Raises ``UnknownSkill``, ``InvalidParams`` or ``SkillRefused``
    (all ``SkillError``) with a one-line message; on any error the file is untouched. With
    ``dry_run`` only the diff is returned. The diff's paths are relative to ``diff_root``
    (default: the target's folder), so ``git apply`` run there accepts it.
    """
    plan = plan_skill(name, recipe, params, diff_root)
    if not dry_run:
        write_files(plan.files)
    return plan.result(written=not dry_run)


def _check_parses(name: str, target: Path, code: str) -> None:
    """Never write a file that does not parse (libcst), or that Python would not compile."""
    try:
        cst.parse_module(code)
        compile(code, str(target), "exec", dont_inherit=True)
    except (cst.ParserSyntaxError, SyntaxError) as e:  # a codemod bug; the file stays as it was
        raise SkillError(f"{name}: the result would not parse ({e}); {target.name} was left unchanged") from None
