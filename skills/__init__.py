"""Skills: documented training patterns that a libcst codemod writes into a recipe.

Each skill is a folder ``skills/<name>/`` with a ``SKILL.md`` (Agent Skills format) and a
``codemod.py``. This package never imports torch: the MCP server imports it and must start fast.

    from skills import list_skills, get_skill, plan_skill, apply_skill
    plan_skill("gradient-checkpointing", Path("recipes/my_lm")).diff   # writes nothing
    apply_skill("gradient-checkpointing", Path("recipes/my_lm"))       # the plan, written
"""

from typing import TYPE_CHECKING, Any

from skills.errors import InvalidParams, RecipeNotFound, SkillError, SkillRefused, UnknownSkill
from skills.registry import SkillCard, SkillInfo, get_skill, get_skill_card, list_skill_cards, list_skills

if TYPE_CHECKING:
    from skills.apply import ApplyResult, SkillPlan, apply_skill, plan_skill

__all__ = [
    "ApplyResult",
    "InvalidParams",
    "RecipeNotFound",
    "SkillCard",
    "SkillError",
    "SkillInfo",
    "SkillPlan",
    "SkillRefused",
    "UnknownSkill",
    "apply_skill",
    "get_skill",
    "get_skill_card",
    "list_skill_cards",
    "list_skills",
    "plan_skill",
]


def __getattr__(name: str) -> Any:
    # ``skills.apply`` imports libcst (~0.15 s); the MCP server imports this package at start and
    # needs libcst only when a skill is applied, so it is imported on first use.
    if name in ("ApplyResult", "SkillPlan", "apply_skill", "plan_skill"):
        from skills import apply

        return getattr(apply, name)
    raise AttributeError(f"module 'skills' has no attribute {name!r}")
