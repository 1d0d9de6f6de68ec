"""Recipe operations: list templates, scaffold a recipe from one (one commit, then one per skill)."""

from __future__ import annotations

import ast
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import yaml

import recipes_template
from engine.config import deep_merge, nest, override_args, overrides_to_dict
from engine.errors import BadInput, NotFound
import skills as skill_library
from mcp_server.models import AppliedSkill, ScaffoldResult, TemplateInfo, TemplateList
from mcp_server.operations import skills as skill_ops
from workspace import git as workspace_git
from workspace.files import put_back
from workspace.paths import PathRefused, check_name, confine, confine_config
from runner import hub
from runner.lifecycle import check_launch
from workspace.workspace import RECIPES_DIRNAME, Workspace, open_real_dir

TEMPLATES_ROOT = Path(recipes_template.__file__).resolve().parent
SCAFFOLD_TOOL = "scaffold_recipe"


def _templates() -> dict[str, Path]:
    return {
        p.name: p for p in sorted(TEMPLATES_ROOT.iterdir())
        if p.is_dir() and (p / "recipe.py").is_file()
    }


def _description(template_dir: Path) -> str:
    """The first paragraph of the template recipe's module docstring."""
    tree = ast.parse((template_dir / "recipe.py").read_text())
    doc = ast.get_docstring(tree) or ""
    return doc.split("\n\n")[0].replace("\n", " ").strip()


def list_templates() -> TemplateList:
    return TemplateList(
        templates=[TemplateInfo(name=name, description=_description(path)) for name, path in _templates().items()]
    )


def template_dir(name: str) -> Path:
    check_name(name, "template")
    templates = _templates()
    if name not in templates:
        raise NotFound(f"unknown template {name!r}; templates: {', '.join(templates)}")
    return templates[name]


def write_config(recipe_dir: Path, flat: dict[str, Any]) -> None:
    path = recipe_dir / "config.yaml"
    existing = yaml.safe_load(path.read_text()) if path.is_file() else None
    merged = deep_merge(existing or {}, nest(flat))
    header = "# Values here override the defaults in recipe.py; `--set key=value` overrides both.\n"
    path.write_text(header + yaml.safe_dump(merged, sort_keys=False))


def _write_recipe(recipes: Path, source: Path, name: str, flat: dict[str, Any]) -> None:
    """Copy the template to ``recipes/<name>`` through a staging folder: the recipe appears whole,
    or not at all."""
    for leftover in recipes.glob(f".{name}-*"):  # a scaffold killed before its rename
        if leftover.is_dir() and not leftover.is_symlink():
            shutil.rmtree(leftover, ignore_errors=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=recipes))
    try:
        shutil.copytree(source, staging, dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__"))
        write_config(staging, flat)
        if os.path.lexists(recipes / name):
            raise BadInput(f"recipes/{name} already exists; choose another name")
        staging.rename(recipes / name)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _same_folder(path: Path, fd: int) -> bool:
    """Whether ``path`` (not followed if a link) is still the folder open as ``fd``."""
    try:
        now = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino)


def _skill_specs(skills: list[Any] | None) -> list[tuple[str, dict[str, Any]]]:
    """``["freeze", {"name": "lora", "params": {...}}]`` → ``[("freeze", {}), ("lora", {...})]``."""
    specs = []
    for item in skills or []:
        params: dict[str, Any]
        if isinstance(item, str):
            name, params = item, {}
        elif isinstance(item, dict) and isinstance(item.get("name"), str):
            name, params = item["name"], item.get("params") or {}
            if not isinstance(params, dict):
                raise BadInput(f"params of skill {name!r} must be a mapping")
        else:
            raise BadInput("skills must be skill names or {name, params} objects")
        check_name(name, "skill")
        skill_library.get_skill(name)  # unknown skill → error before anything is written
        specs.append((name, params))
    return specs


def scaffold_recipe(
    ws: Workspace,
    template: str,
    name: str,
    config: dict[str, Any] | None = None,
    skills: list[Any] | None = None,
    progress: hub.Progress | None = None,
) -> ScaffoldResult:
    """Copy a template to ``recipes/<name>/``, write ``config``, commit; then apply each skill.

    Everything is checked first — the name, the config (by the engine itself), that each
    skill exists and applies — on a scratch copy, so a bad request writes nothing. A
    ``model.pretrained_path`` that is a Hub id is downloaded for the check (``progress`` called
    on the way).
    """
    source = template_dir(template)
    check_name(name, "recipe name")
    if "." in name:
        raise PathRefused(f"recipe name {name!r} must not contain '.'")
    confine(ws.root, f"{RECIPES_DIRNAME}/{name}", "recipe", must_exist=False)  # recipes/ may be a link
    destination = ws.recipes_dir / name
    if destination.exists():
        raise BadInput(f"recipes/{name} already exists; choose another name")
    flat = overrides_to_dict(config)
    confine_config(ws.root, flat)
    specs = _skill_specs(skills)
    items = override_args(flat)

    # The skills first (fast, on a scratch copy), then the engine's check (a torch import).
    with tempfile.TemporaryDirectory(prefix="trainwright-scaffold-") as scratch:
        trial = Path(scratch) / name
        shutil.copytree(source, trial, ignore=shutil.ignore_patterns("__pycache__"))
        write_config(trial, flat)
        for skill, params in specs:
            try:
                skill_library.apply_skill(skill, trial, params)
            except skill_library.SkillError as e:
                raise BadInput(f"skill {skill} cannot be applied to this recipe: {e}") from None
    limits = ws.run_limits()
    models = hub.bind(ws.root, hub.model_value(flat), dataset=hub.config_value(flat, hub.DATASET_KEY),
                      allow_pickled=limits.allow_pickled_weights,
                      remote_code=limits.trust_remote_code, progress=progress)
    confine_config(ws.root, check_launch(ws.root, source, 1, items, limits=limits, models=models).config)

    with ws.changing():
        return _scaffold_locked(ws, source, template, name, flat, specs)


def _scaffold_locked(ws: Workspace, source: Path, template: str, name: str, flat: dict[str, Any],
                     specs: list[tuple[str, dict[str, Any]]]) -> ScaffoldResult:
    destination = ws.recipes_dir / name
    if destination.exists():
        raise BadInput(f"recipes/{name} already exists; choose another name")
    repo = workspace_git.ensure_repo(ws.root)
    # Everything is written through a descriptor of the real recipes/ folder (a link there is
    # refused), so a recipes/ swapped for a link meanwhile never receives the files.
    recipes_fd = open_real_dir(ws.recipes_dir, create=True)
    held = Path(f"/proc/self/fd/{recipes_fd}")
    ignore = None
    try:
        _write_recipe(held, source, name, flat)
        try:
            if not _same_folder(ws.recipes_dir, recipes_fd):
                raise PathRefused("recipes/ was replaced while the recipe was being written; nothing was committed")
            gitignore = ws.root / ".gitignore"
            before = gitignore.read_bytes() if gitignore.is_file() and not gitignore.is_symlink() else None
            ignore = workspace_git.ignore_own_folders(repo, ws.root)  # runs/, exports/ stay out of commits
            sha = workspace_git.commit_paths(
                repo,
                [destination, *([ignore] if ignore else [])],
                f"recipe({name}): scaffold from template {template}",
                [
                    (workspace_git.TOOL_TRAILER, SCAFFOLD_TOOL),
                    (workspace_git.SCAFFOLDED_FROM_TRAILER, template),
                    (workspace_git.RECIPE_CONFIG_TRAILER, workspace_git.compact_json(flat)),
                ],
            )
        except BaseException:
            shutil.rmtree(held / name, ignore_errors=True)  # an error means nothing changed
            if ignore is not None:
                put_back(gitignore, before)
            raise
    finally:
        os.close(recipes_fd)
    applied = []
    for skill, params in specs:
        result = skill_ops.apply_skill_unlocked(ws, skill, ws.label(destination), params)
        applied.append(AppliedSkill(skill=skill, changed=result.changed, commit=result.commit))
    return ScaffoldResult(
        path=ws.label(destination),
        commit=sha,
        config=flat,
        skills=applied,
    )
