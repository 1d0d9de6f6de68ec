"""Skill operations: list, show, apply (as one reviewable commit)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import skills as skill_library
from engine.errors import BadInput
from mcp_server.limits import (
    AGENT_BUDGET_CHARS, MAX_DIFF_CHARS, MAX_DOC_CHARS, MAX_RESULT_CHARS, bounded, json_chars, text_bytes,
)
from mcp_server.models import ApplySkillResult, SkillDetail, SkillList, SkillSummary
from workspace import git as workspace_git
from workspace.paths import check_name
from runner.scripts import DOCS_PAGE
from workspace.workspace import Workspace

APPLY_TOOL = "apply_skill"


def _summary(info) -> SkillSummary:
    return SkillSummary(
        name=info.name, description=info.description, version=info.version, requires_gpu=info.requires_gpu
    )


def list_skills() -> SkillList:
    return SkillList(skills=[_summary(card) for card in skill_library.list_skill_cards()])


def get_skill(name: str) -> SkillDetail:
    check_name(name, "skill")
    info = skill_library.get_skill(name)
    limit = MAX_DOC_CHARS
    while True:  # the SKILL.md is cut so that the whole result, schema included, fits an agent's budget
        text, truncated = bounded(info.skill_md, limit)
        detail = SkillDetail(**_summary(info).model_dump(), skill_md=text, params_schema=info.params_schema,
                             truncated=truncated)
        over = text_bytes(detail.model_dump()) - AGENT_BUDGET_CHARS
        if over <= 0 or limit <= 1_000:
            return detail
        limit -= over + 100


def apply_skill(
    ws: Workspace,
    skill: str,
    recipe: str,
    params: dict[str, Any] | None = None,
    dry_run: bool = False,
    commit: bool = True,
) -> ApplySkillResult:
    """Apply ``skill`` to a recipe folder or script; unless a dry run, commit the change alone.

    Refuses when the recipe has uncommitted changes, so the commit (and its review diff) holds
    exactly the skill's change. Without a git repository (``commit=False`` or none found) the
    file is changed and no commit is made. The file is replaced atomically, under the
    workspace's change lock: a server killed mid-call leaves the recipe as before or as after.
    """
    info, recipe_path = _checked(ws, skill, recipe, params)  # refuse bad input before the lock
    if dry_run:
        return _apply(ws, info, recipe_path, params, dry_run, commit)
    with ws.changing():
        return _apply(ws, info, recipe_path, params, dry_run, commit)


def apply_skill_unlocked(
    ws: Workspace,
    skill: str,
    recipe: str,
    params: dict[str, Any] | None = None,
    dry_run: bool = False,
    commit: bool = True,
) -> ApplySkillResult:
    """:func:`apply_skill` for a caller that holds the change lock (or makes a dry run)."""
    info, recipe_path = _checked(ws, skill, recipe, params)
    return _apply(ws, info, recipe_path, params, dry_run, commit)


def with_target(params: dict[str, Any] | None, target: str | None) -> dict[str, Any] | None:
    """``params`` with the ``target`` given beside them (apply_skill's own argument, the CLI's
    ``--target``): the model (``self._model``, ``file.py:LINE``) the skill should act on."""
    if target is None:
        return params
    if params is not None and not isinstance(params, dict):
        raise BadInput("params must be a mapping of parameter names to values")
    given = (params or {}).get("target")
    if given is not None and given != target:
        raise BadInput(f"target is given twice: {target!r} and params.target={given!r}; give one")
    return {**(params or {}), "target": target}


def _checked(ws: Workspace, skill: str, recipe: str, params: dict[str, Any] | None):
    check_name(skill, "skill")
    info = skill_library.get_skill(skill)
    if params is not None and not isinstance(params, dict):
        raise BadInput("params must be a mapping of parameter names to values")
    return info, ws.recipe_or_script(recipe)


def remove_interrupted_writes(target: Path) -> list[Path]:
    """Temporary files that an atomic write of ``target`` left when its process was killed.

    Only call this under the workspace's change lock: then no write is in progress.
    """
    leftovers = sorted(target.parent.glob(f".{target.name}.*.tmp"))
    for path in leftovers:
        path.unlink(missing_ok=True)
    return leftovers


def _apply(ws: Workspace, info, recipe_path: Path, params, dry_run: bool, commit: bool) -> ApplySkillResult:
    """An error means nothing changed: everything that can refuse (git state, a git-ignored
    target, a result too large to return) is checked on a dry run before the file is written,
    and a commit that fails puts the file back."""
    from skills.apply import resolve_target, write_atomically  # libcst: imported on first use

    target = resolve_target(recipe_path)
    if not dry_run:
        remove_interrupted_writes(target)
    repo = workspace_git.open_repo(ws.root) if commit else None
    if repo is not None and not dry_run:
        workspace_git.require_clean(repo, recipe_path, f"recipe {ws.label(recipe_path)}")
        workspace_git.require_not_ignored(repo, target, f"recipe {ws.label(target)}")
    diff_root = workspace_git.worktree(repo) if repo is not None else ws.root
    trial = skill_library.apply_skill(info.name, recipe_path, params or {}, dry_run=True, diff_root=diff_root)
    planned = _result(ws, info, trial, dry_run, sha="0" * 40 if trial.changed and repo is not None else None)
    size = json_chars(planned.model_dump(mode="json"))
    if size > MAX_RESULT_CHARS:
        raise BadInput(f"the result would be too large ({size:,} characters, at most {MAX_RESULT_CHARS:,}): "
                         "give shorter params; nothing was changed")
    if dry_run or not trial.changed:
        return _result(ws, info, trial, dry_run, sha=None)
    original = target.read_bytes()
    result = skill_library.apply_skill(info.name, recipe_path, params or {}, dry_run=False, diff_root=diff_root)
    if repo is None:
        result.message = (result.message + " " if result.message else "") + \
            "(no git repository: the change was not committed)"
        return _result(ws, info, result, dry_run, sha=None)
    try:
        sha = workspace_git.commit_paths(
            repo,
            [target],
            f"skill({info.name}): apply to {ws.label(recipe_path)}",
            [
                (workspace_git.TOOL_TRAILER, APPLY_TOOL),
                ("Skill-Applied", f"{info.name}@{info.version}"),
                ("Skill-Params", json.dumps(result.params, sort_keys=True, separators=(",", ":"))),
            ],
        )
    except BaseException:
        write_atomically(target, original.decode("utf-8"))  # the file as it was
        raise
    if recipe_path.is_file():  # the user's own script: say what runs it
        result.message += f"; launch_run(recipe={ws.label(recipe_path)!r}) runs the script as it is ({DOCS_PAGE})"
    return _result(ws, info, result, dry_run, sha=sha)


def _result(ws: Workspace, info, result, dry_run: bool, sha: str | None) -> ApplySkillResult:
    diff, diff_truncated = bounded(result.diff, MAX_DIFF_CHARS)
    return ApplySkillResult(
        skill=info.name,
        version=info.version,
        recipe=ws.label(Path(result.target)),
        changed=result.changed,
        already_applied=result.already_applied,
        dry_run=dry_run,
        params=result.params,
        diff=diff,
        diff_truncated=diff_truncated,
        commit=sha,
        message=result.message,
        acts_on=result.acts_on,
    )
