"""Keep frozen parameters out of the optimizer (shared by the freeze and lora skills).

A parameter with ``requires_grad=False`` gets no gradient, but an optimizer that was handed it
still holds it (and, with weight decay in some optimizers, may still change it). So every
``torch.optim`` constructor must receive only trainable parameters.
"""

from __future__ import annotations

import libcst as cst

from skills.codemod_kit import templates
from skills.codemod_kit.anchors import SKILL_OPTIMIZERS, engine_class, keyword, optimizer_constructors, positional
from skills.codemod_kit.edits import Edits
from skills.codemod_kit.layout import fit_call
from skills.codemod_kit.recipe import Recipe
from skills.errors import SkillRefused


def _reads_requires_grad(recipe: Recipe, node: cst.CSTNode) -> bool:
    return "requires_grad" in recipe.code(node)


def only_trainable_parameters(recipe: Recipe, edits: Edits, skill: str) -> None:
    """Rewrite ``torch.optim.X(model.parameters(), ...)`` into
    ``torch.optim.X([p for p in model.parameters() if p.requires_grad], ...)``.

    An argument that already filters on ``requires_grad`` is left alone; anything else that the
    codemod cannot see through (param groups built elsewhere) is refused, naming the line.
    """
    constructors = optimizer_constructors(recipe)
    engine = engine_class(recipe)
    if not constructors:
        if engine is not None:
            edits.notes.append(
                "the recipe keeps the engine's default optimizer, which is handed every parameter; "
                "frozen ones get no gradient and are never updated"
            )
            return
        raise SkillRefused(
            f"{skill}: looked for the optimizer (a torch.optim.* constructor) in {recipe.name}; found "
            "none, so frozen parameters could not be kept out of it"
        )
    for call in constructors:
        if recipe.call_name(call) in SKILL_OPTIMIZERS:
            continue  # it takes the model and keeps only its trainable parameters itself
        arg = positional(call, 0) or keyword(call, "params")
        if arg is None:
            raise SkillRefused(f"{skill}: the optimizer at {recipe.where(call)} gets no parameters argument")
        value = arg.value
        if _reads_requires_grad(recipe, value) or _assigned_with_requires_grad(recipe, value):
            continue
        if (
            isinstance(value, cst.Call)
            and isinstance(value.func, cst.Attribute)
            and value.func.attr.value == "parameters"
            and not value.args
        ):
            filtered = templates.expression(
                recipe.module, "[p for p in {parameters} if p.requires_grad]", parameters=value
            )
            edits.replace(value, filtered)
            edits.replace(call, lambda updated, original=call: fit_call(recipe, original, updated))
            continue
        raise SkillRefused(
            f"{skill}: the optimizer at {recipe.where(call)} gets `{recipe.short(value)}`, which the "
            "codemod cannot filter; pass `[p for p in model.parameters() if p.requires_grad]` (or "
            "filter your groups on requires_grad) and apply again"
        )


def _assigned_with_requires_grad(recipe: Recipe, value: cst.BaseExpression) -> bool:
    """``groups = [...requires_grad...]`` then ``AdamW(groups)``."""
    if not isinstance(value, (cst.Name, cst.Attribute)):
        return False
    name = recipe.code(value)
    for assign in recipe.assigns():
        if any(recipe.code(t.target) == name for t in assign.targets) and _reads_requires_grad(recipe, assign.value):
            return True
    return False
