"""The errors of the skills library. Each message is one line that says what to do next."""

from __future__ import annotations

from engine.errors import BadInput


class SkillError(BadInput):
    """Base of every error that ``apply_skill`` and friends raise on bad input; nothing was written."""


class UnknownSkill(SkillError):
    """No skill has that name; the message lists the valid names."""

    kind = "not_found"


class InvalidParams(SkillError):
    """A parameter is unknown or has a bad value; the message names it and the valid ones."""


class SkillRefused(SkillError):
    """The codemod cannot apply to this recipe; the message names the anchor it looked for and where."""


class RecipeNotFound(SkillRefused):
    """The recipe path is neither a recipe folder (with a ``recipe.py``) nor a ``.py`` file."""

    kind = "not_found"
