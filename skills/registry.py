"""Discovery of the skill folders: ``skills/<name>/SKILL.md`` + ``codemod.py``.

A folder is a skill when it holds a ``SKILL.md`` whose YAML front matter names it (the Agent
Skills format: ``name`` equal to the folder name, a ``description``, optional ``metadata``).
Folder names have hyphens, so ``codemod.py`` is loaded by file path, not imported as a package;
it is loaded only when a skill is applied or its parameter schema is asked for.
"""

from __future__ import annotations

import difflib
import importlib.util
import re
import sys
from functools import lru_cache
from pathlib import Path
from types import ModuleType
from typing import Any

import yaml
from pydantic import BaseModel

from skills.errors import UnknownSkill

SKILLS_ROOT = Path(__file__).resolve().parent
NAME_PATTERN = re.compile(r"^[a-z0-9]+(-[a-z0-9]+)*$")
MAX_NAME_LENGTH = 64
MAX_DESCRIPTION_LENGTH = 1024

# libyaml's safe loader where PyYAML was built with it (10× faster: the server parses every
# SKILL.md at start), the same safe subset of YAML either way.
SAFE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class SkillCard(BaseModel):
    """What an agent needs to choose a skill: read from SKILL.md alone (no codemod is loaded)."""

    name: str
    description: str
    version: str
    requires_gpu: bool
    path: str  # the skill's folder


class SkillInfo(SkillCard):
    """A skill with everything needed to call it."""

    skill_md: str  # the full text of SKILL.md
    params_schema: dict[str, Any]  # JSON schema of the codemod's parameters


class SkillFormatError(Exception):
    """A skill folder that breaks the format: a bug in this repository, not bad user input."""


def parse_front_matter(text: str, source: Path) -> dict[str, Any]:
    """The YAML mapping between the leading ``---`` lines of a SKILL.md."""
    lines = text.splitlines()
    if not lines or lines[0].strip() != "---":
        raise SkillFormatError(f"{source}: SKILL.md must start with '---' (YAML front matter)")
    try:
        end = next(i for i in range(1, len(lines)) if lines[i].strip() == "---")
    except StopIteration:
        raise SkillFormatError(f"{source}: the front matter has no closing '---'") from None
    data = yaml.load("\n".join(lines[1:end]), Loader=SAFE_LOADER) or {}
    if not isinstance(data, dict):
        raise SkillFormatError(f"{source}: the front matter must be a mapping")
    return data


def _check_front_matter(folder: Path, data: dict[str, Any]) -> None:
    name = data.get("name")
    if name != folder.name:
        raise SkillFormatError(f"{folder}: front matter name {name!r} must equal the folder name")
    if len(name) > MAX_NAME_LENGTH or not NAME_PATTERN.match(name):
        raise SkillFormatError(f"{folder}: name must be lowercase letters, digits and single hyphens")
    description = data.get("description")
    if not isinstance(description, str) or not description.strip():
        raise SkillFormatError(f"{folder}: front matter needs a description")
    if len(description) > MAX_DESCRIPTION_LENGTH:
        raise SkillFormatError(f"{folder}: description is over {MAX_DESCRIPTION_LENGTH} characters")


class _Skill:
    """A discovered skill folder; its codemod module is loaded on first use."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.skill_md = (folder / "SKILL.md").read_text(encoding="utf-8")
        self.front_matter = parse_front_matter(self.skill_md, folder / "SKILL.md")
        _check_front_matter(folder, self.front_matter)
        metadata = self.front_matter.get("metadata") or {}
        self.name: str = self.front_matter["name"]
        self.description: str = " ".join(self.front_matter["description"].split())
        self.version = str(metadata.get("version", "0"))
        self.requires_gpu = str(metadata.get("gpu", "false")).lower() == "true"
        self._codemod: ModuleType | None = None

    @property
    def codemod(self) -> ModuleType:
        if self._codemod is None:
            self._codemod = _load_codemod(self.folder)
        return self._codemod

    def card(self) -> SkillCard:
        return SkillCard(
            name=self.name,
            description=self.description,
            version=self.version,
            requires_gpu=self.requires_gpu,
            path=str(self.folder),
        )

    def info(self) -> SkillInfo:
        return SkillInfo(
            **self.card().model_dump(),
            skill_md=self.skill_md,
            params_schema=self.codemod.Params.model_json_schema(),
        )


def _load_codemod(folder: Path) -> ModuleType:
    path = folder / "codemod.py"
    module_name = "skills._codemods." + folder.name.replace("-", "_")
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise SkillFormatError(f"{folder}: no codemod.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(module_name, None)
        raise
    for required in ("Params", "apply"):
        if not hasattr(module, required):
            raise SkillFormatError(f"{path}: a codemod must define {required}")
    return module


@lru_cache(maxsize=None)
def _discover(root: Path = SKILLS_ROOT) -> dict[str, _Skill]:
    found = {}
    for folder in sorted(root.iterdir()):
        if folder.is_dir() and (folder / "SKILL.md").is_file():
            skill = _Skill(folder)
            found[skill.name] = skill
    return found


def skill(name: str) -> _Skill:
    skills = _discover()
    if name not in skills:
        close = difflib.get_close_matches(name, list(skills), n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        raise UnknownSkill(f"no skill named '{name}'{hint}; valid skills: {', '.join(sorted(skills))}")
    return skills[name]


def list_skills() -> list[SkillInfo]:
    """Every skill, sorted by name (this loads every codemod, for the parameter schemas)."""
    return [s.info() for _, s in sorted(_discover().items())]


def list_skill_cards() -> list[SkillCard]:
    """Every skill's name, description, version and GPU need, sorted by name, from the SKILL.md
    files alone: what a listing needs, without loading libcst or any codemod."""
    return [s.card() for _, s in sorted(_discover().items())]


def get_skill_card(name: str) -> SkillCard:
    """One skill's card, from its SKILL.md alone (no codemod is loaded); raises ``UnknownSkill``."""
    return skill(name).card()


def get_skill(name: str) -> SkillInfo:
    """One skill; raises ``UnknownSkill`` (its message lists the valid names)."""
    return skill(name).info()
