"""``apply_skill``: run a skill's codemod on a recipe, check the result, diff it, write it atomically."""

from __future__ import annotations

import difflib
import os
import tempfile
from pathlib import Path
from typing import Any

import libcst as cst
from pydantic import BaseModel, ValidationError

from skills.codemod_kit.edits import Edits
from skills.codemod_kit.outcome import AlreadyApplied
from skills.codemod_kit.recipe import Recipe
from skills.errors import InvalidParams, RecipeNotFound, SkillError
from skills.registry import skill as find_skill


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


def write_atomically(path: Path, text: str) -> None:
    """Write to a temporary file in the same folder, then ``os.replace``: readers see the old file
    or the new one, never a partial one. The file's permissions are kept."""
    mode = path.stat().st_mode & 0o7777
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def apply_skill(
    name: str,
    recipe: Path,
    params: dict[str, Any] | None = None,
    dry_run: bool = False,
    diff_root: Path | None = None,
) -> ApplyResult:
    """Apply skill ``name`` to a recipe folder (its ``recipe.py``) or a ``.py`` training script.

    Idempotent: a recipe that already holds the pattern is reported with ``changed=False,
    already_applied=True``. Raises ``UnknownSkill``, ``InvalidParams`` or ``SkillRefused``
    (all ``SkillError``) with a one-line message; on any error the file is untouched. With
    ``dry_run`` only the diff is returned. The diff's paths are relative to ``diff_root``
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
    parsed = Recipe(target, source)
    outcome = codemod.apply(parsed, validated)

    result = dict(skill=name, version=found.version, target=str(target), params=validated.model_dump(mode="json"))
    if isinstance(outcome, AlreadyApplied):
        return ApplyResult(**result, changed=False, already_applied=True, diff="",
                           message=f"{name} is already applied to {target.name}: {outcome.reason}")
    assert isinstance(outcome, Edits), f"{name}: apply() must return Edits or AlreadyApplied"
    new_source = outcome.apply().code
    if new_source == source:
        return ApplyResult(**result, changed=False, already_applied=True, diff="",
                           message=f"{name} is already applied to {target.name}: nothing to change")
    _check_parses(name, target, new_source)
    diff = unified_diff(source, new_source, relative)
    if not dry_run:
        write_atomically(target, new_source)
    notes = "".join(f"; {note}" for note in ([outcome.acts_on] if outcome.acts_on else []) + outcome.notes)
    verb = "would change" if dry_run else "changed"
    added = sum(1 for line in diff.splitlines() if line.startswith("+") and not line.startswith("+++"))
    removed = sum(1 for line in diff.splitlines() if line.startswith("-") and not line.startswith("---"))
    return ApplyResult(**result, changed=True, already_applied=False, diff=diff, acts_on=outcome.acts_on,
                       message=f"{name} {verb} {target.name} (+{added} -{removed} lines){notes}")


def _check_parses(name: str, target: Path, code: str) -> None:
    """Never write a file that does not parse (libcst), or that Python would not compile."""
    try:
        cst.parse_module(code)
        compile(code, str(target), "exec", dont_inherit=True)
    except (cst.ParserSyntaxError, SyntaxError) as e:  # a codemod bug; the file stays as it was
        raise SkillError(f"{name}: the result would not parse ({e}); {target.name} was left unchanged") from None
