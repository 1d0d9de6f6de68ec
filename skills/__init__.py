"""Skills: documented training patterns that a libcst codemod writes into a recipe.

Each skill is a folder ``skills/<name>/`` with a ``SKILL.md`` (Agent Skills format) and a
``codemod.py``. This package never imports torch: the MCP server imports it and must start fast.

    from skills import list_skills, get_skill, apply_skill
    apply_skill("gradient-checkpointing", Path("recipes/my_lm"), dry_run=True).diff
"""

from skills.apply import ApplyResult, apply_skill
from skills.errors import InvalidParams, RecipeNotFound, SkillError, SkillRefused, UnknownSkill
from skills.registry import SkillInfo, get_skill, list_skills

__all__ = [
    "ApplyResult",
    "InvalidParams",
    "RecipeNotFound",
    "SkillError",
    "SkillInfo",
    "SkillRefused",
    "UnknownSkill",
    "apply_skill",
    "get_skill",
    "list_skills",
]
