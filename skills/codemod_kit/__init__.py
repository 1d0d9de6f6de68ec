"""What the skills' codemods have in common: the parsed recipe and its index, anchors, the
order of model stages, edits and imports, helper definitions, and outcomes.

A codemod (``skills/<name>/codemod.py``) defines ``Params`` (a ``SkillParams`` model) and
``apply(recipe, params) -> Edits | AlreadyApplied``; it raises ``SkillRefused`` when it cannot
apply. ``skills.apply.plan_skill`` does the rest: validation, parsing the result and the diff
(``apply_skill`` writes the plan atomically; the MCP tool commits it).
"""

from skills.codemod_kit import anchors, gpu_guard, reach, stages, templates, vlm
from skills.codemod_kit.definitions import ensure_find_blocks, insert_definitions
from skills.codemod_kit.edits import Edits
from skills.codemod_kit.outcome import AlreadyApplied, SkillParams
from skills.codemod_kit.recipe import Recipe, dotted_name
from skills.codemod_kit.trainable import only_trainable_parameters

__all__ = [
    "AlreadyApplied",
    "Edits",
    "Recipe",
    "SkillParams",
    "anchors",
    "dotted_name",
    "gpu_guard",
    "ensure_find_blocks",
    "insert_definitions",
    "only_trainable_parameters",
    "reach",
    "stages",
    "templates",
    "vlm",
]
