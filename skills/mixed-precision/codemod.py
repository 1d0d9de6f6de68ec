"""mixed-precision: run the model's forward passes under ``torch.autocast`` in bfloat16.

Anchors: the model construction (to know the model object) and every call of it (the forward
passes, training and evaluation alike), each wrapped in ``with torch.autocast(...)``.
"""

from __future__ import annotations

from typing import Literal

import libcst as cst
from pydantic import Field

from skills.codemod_kit import pointing
from skills.codemod_kit import AlreadyApplied, Edits, Recipe, SkillParams, anchors, templates
from skills.codemod_kit.anchors import keyword, positional
from skills.errors import SkillRefused

SKILL = "mixed-precision"

AUTOCAST = (
    "torch.autocast",
    "torch.amp.autocast",
    "torch.cuda.amp.autocast",
    "torch.cpu.amp.autocast",
    "torch.amp.autocast_mode.autocast",
)


class Params(SkillParams):
    target: str | None = pointing.target_field()
    loop: str | None = pointing.loop_field()
    dtype: Literal["bfloat16"] = Field(
        "bfloat16",
        description="Compute dtype of autocast regions. Only bfloat16: it keeps float32's range, "
        "so no loss scaling is needed (float16 would need a GradScaler around backward and step).",
    )


def _device_type(recipe: Recipe, call: cst.Call) -> cst.BaseExpression:
    engine = anchors.engine_class(recipe)
    if engine is not None and recipe.is_inside(call, engine):
        return templates.expression(recipe.module, "self.device.type")
    first = positional(call, 0) or keyword(call, "input_ids") or next((a for a in call.args if a.keyword), None)
    if first is not None and isinstance(first.value, (cst.Name, cst.Attribute, cst.Subscript)):
        return templates.expression(recipe.module, "{tensor}.device.type", tensor=first.value)
    raise SkillRefused(
        f"{SKILL}: cannot tell the device of the forward call at {recipe.where(call)} (its first "
        "argument is not a tensor variable); wrap it by hand in "
        "`with torch.autocast(device_type=..., dtype=torch.bfloat16):`"
    )


def apply(recipe: Recipe, params: Params) -> Edits | AlreadyApplied:
    existing = recipe.calls_to(*AUTOCAST)
    if existing:
        return AlreadyApplied(f"autocast at {recipe.where(existing[0])}")
    model = pointing.find_model(recipe, SKILL, params.target)
    forwards = anchors.forward_calls(recipe, model)
    if not forwards:
        raise SkillRefused(
            f"{SKILL}: looked for forward calls of the model (`{model.target_code}(...)`) in "
            f"{recipe.name}; found none"
        )
    edits = Edits(recipe)
    wrapped: set[cst.CSTNode] = set()
    for call in forwards:
        statement = recipe.statement_of(call)
        if statement in wrapped:
            continue
        wrapped.add(statement)
        opener = templates.statement(
            recipe.module,
            f"with torch.autocast(device_type={{device}}, dtype=torch.{params.dtype}):\n    pass",
            device=_device_type(recipe, call),
        )
        edits.replace(statement, lambda updated, opener=opener: _wrap(opener, updated))
    edits.add_import("torch")
    calls = ", ".join(f"`{recipe.short(call, 40)}`" for call in forwards)  # no line numbers: they cost a pass
    edits.acts_on = (
        f"runs {len(forwards)} forward call{'s' if len(forwards) != 1 else ''} of `{model.target_code}` "
        f"({calls}) under {params.dtype} autocast"
    )
    return edits


def _wrap(opener: cst.With, statement: cst.BaseStatement) -> cst.With:
    """``statement`` inside ``opener``; the statement's leading comments move above the ``with``."""
    inner = statement.with_changes(leading_lines=[])
    body = opener.body.with_changes(body=[inner])  # type: ignore[union-attr]
    return opener.with_changes(body=body, leading_lines=statement.leading_lines)
