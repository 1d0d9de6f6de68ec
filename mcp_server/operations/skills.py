"""Skill operations: list, show, apply (as one reviewable commit)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import skills as skill_library
from engine.errors import BadInput
from mcp_server.limits import (
    AGENT_BUDGET_CHARS, MAX_DIFF_CHARS, MAX_DOC_CHARS, MAX_RESULT_CHARS, bounded, json_chars, text_bytes,
)
from mcp_server.models import ApplySkillResult, SkillDetail, SkillList, SkillSummary
from workspace import git as workspace_git
from workspace.files import remove_interrupted_writes, write_files
from workspace.paths import check_name
from runner.scripts import DOCS_PAGE
from workspace.workspace import Workspace

if TYPE_CHECKING:
    from skills.apply import SkillPlan

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
    info, recipe_path = _checked(ws, skill, recipe)  # refuse bad input before the lock
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
    info, recipe_path = _checked(ws, skill, recipe)
    return _apply(ws, info, recipe_path, params, dry_run, commit)


def with_target(params: dict[str, Any] | None, target: str | None) -> dict[str, Any] | None:
    """``params`` with the ``target`` given beside them (apply_skill's own argument, the CLI's
    ``--target``): the model (``self._model``, ``file.py:LINE``) the skill should act on."""
    if target is None:
        return params
    given = (params or {}).get("target")
    if given is not None and given != target:
        raise BadInput(f"target is given twice: {target!r} and params.target={given!r}; give one")
    return {**(params or {}), "target": target}


def _checked(ws: Workspace, skill: str, recipe: str) -> tuple[skill_library.SkillCard, Path]:
    check_name(skill, "skill")
    return skill_library.get_skill_card(skill), ws.recipe_or_script(recipe)


def _apply(ws: Workspace, info: skill_library.SkillCard, recipe_path: Path, params: dict[str, Any] | None,
           dry_run: bool, commit: bool) -> ApplySkillResult:
    """The skill's plan (the codemod, run once), then unless a dry run its files written and
    committed. An error means nothing changed: everything that can refuse (git state, a
    git-ignored target, a result too large to return) is checked before a file is written, and
    a commit that fails puts the files back (``workspace.git.commit_files``)."""
    from skills.apply import plan_skill, resolve_target  # libcst: imported on first use

    target = resolve_target(recipe_path)  # the file the plan reads: resolved here, once
    if not dry_run:
        remove_interrupted_writes(target)  # a write killed earlier; none runs now (the change lock)
    repo = workspace_git.open_repo(ws.root) if commit else None
    if repo is not None and not dry_run:
        workspace_git.require_clean(repo, recipe_path, f"recipe {ws.label(recipe_path)}")
        workspace_git.require_not_ignored(repo, target, f"recipe {ws.label(target)}")
    diff_root = workspace_git.worktree(repo) if repo is not None else ws.root
    plan = plan_skill(info.name, target, params or {}, diff_root=diff_root)
    planned = _result(ws, plan, dry_run, plan.message(written=False),
                      sha="0" * 40 if plan.changed and repo is not None else None)
    size = json_chars(planned.model_dump(mode="json"))
    if size > MAX_RESULT_CHARS:
        raise BadInput(f"the result would be too large ({size:,} characters, at most {MAX_RESULT_CHARS:,}): "
                         "give shorter params; nothing was changed")
    if dry_run or not plan.changed:
        return _result(ws, plan, dry_run, plan.message(written=False), sha=None)
    message = plan.message(written=True)
    if repo is None:
        write_files(plan.files)
        return _result(ws, plan, dry_run, f"{message} (no git repository: the change was not committed)", sha=None)
    sha = workspace_git.commit_files(
        repo,
        plan.files,
        f"skill({info.name}): apply to {ws.label(recipe_path)}",
        [
            (workspace_git.TOOL_TRAILER, APPLY_TOOL),
            (workspace_git.SKILL_APPLIED_TRAILER, workspace_git.skill_applied(plan.skill, plan.version)),
            (workspace_git.SKILL_PARAMS_TRAILER, workspace_git.compact_json(plan.params)),
        ],
    )
    if recipe_path.is_file():  # the user's own script: say what runs it
        message += f"; launch_run(recipe={ws.label(recipe_path)!r}) runs the script as it is ({DOCS_PAGE})"
    return _result(ws, plan, dry_run, message, sha=sha)


def _result(ws: Workspace, plan: SkillPlan, dry_run: bool, message: str, sha: str | None) -> ApplySkillResult:
    diff, diff_truncated = bounded(plan.diff, MAX_DIFF_CHARS)
    return ApplySkillResult(
        skill=plan.skill,
        version=plan.version,
        recipe=ws.label(plan.target),
        changed=plan.changed,
        already_applied=not plan.changed,
        dry_run=dry_run,
        params=plan.params,
        diff=diff,
        diff_truncated=diff_truncated,
        commit=sha,
        message=message,
        acts_on=plan.acts_on,
    )
