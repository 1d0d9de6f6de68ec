"""mixed-precision: run the model's forward passes under ``torch.autocast`` in bfloat16.

Anchors: where the file builds a framework with a mixed-precision switch (``Accelerator``, a
Lightning ``Trainer`` or ``Fabric``, ``TrainingArguments``), that argument; else the model
construction (to know the model object) and every call of it (the forward passes, training and
evaluation alike), each wrapped in ``with torch.autocast(...)``; without a construction the codemod
can see, the model's calls in the functions that run backward.
"""

from __future__ import annotations

from typing import Literal

import libcst as cst
from pydantic import Field

from skills.codemod_kit import frameworks, loops, pointing
from skills.codemod_kit import AlreadyApplied, Edits, Recipe, SkillParams, anchors, templates
from skills.codemod_kit.anchors import keyword, positional
from skills.codemod_kit.recipe import dotted_name
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
    dtype: Literal["bfloat16"] = Field(
        "bfloat16",
        description="Compute dtype of autocast regions. Only bfloat16: it keeps float32's range, "
        "so no loss scaling is needed (float16 would need a GradScaler around backward and step).",
    )
    target: str | None = pointing.target_field()
    loop: str | None = pointing.loop_field()


def _device_type(recipe: Recipe, call: cst.Call, model: str | None) -> cst.BaseExpression:
    engine = anchors.engine_class(recipe)
    if engine is not None and recipe.is_inside(call, engine):
        return templates.expression(recipe.module, "self.device.type")
    first = positional(call, 0) or keyword(call, "input_ids") or next((a for a in call.args if a.keyword), None)
    if first is not None and not first.star and isinstance(first.value, (cst.Name, cst.Attribute, cst.Subscript)):
        return templates.expression(recipe.module, "{tensor}.device.type", tensor=first.value)
    receiver = model or dotted_name(call.func)
    if receiver:  # model(**batch): the device of the model's parameters
        return templates.expression(recipe.module, f"next({receiver}.parameters()).device.type")
    raise SkillRefused(
        f"{SKILL}: cannot tell the device of the forward call at {recipe.where(call)} (its first "
        "argument is not a tensor variable); wrap it by hand in "
        "`with torch.autocast(device_type=..., dtype=torch.bfloat16):`"
    )


def apply(recipe: Recipe, params: Params) -> Edits | AlreadyApplied:
    existing = _existing_autocast(recipe)
    if existing is not None:
        return AlreadyApplied(f"autocast at {recipe.where(existing)}")
    loop = pointing.find_loop(recipe, SKILL, params.loop)
    if params.target is None and loop is None:
        switched = _framework_switch(recipe)
        if switched is not None:
            return switched
    model, forwards = _forwards(recipe, params, loop)
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
            device=_device_type(recipe, call, model),
        )
        edits.replace(statement, lambda updated, opener=opener: _wrap(opener, updated))
    edits.add_import("torch")
    calls = ", ".join(f"`{recipe.short(call, 40)}`" for call in forwards)  # no line numbers: they cost a pass
    edits.acts_on = (
        f"runs {len(forwards)} forward call{'s' if len(forwards) != 1 else ''} of `{model or dotted_name(forwards[0].func)}` "
        f"({calls}) under {params.dtype} autocast"
    )
    return edits


def _existing_autocast(recipe: Recipe) -> cst.Call | None:
    """``torch.autocast(...)`` that is not ``enabled=False``, or a ``with`` over a context
    manager named like one (``with autocast():`` where ``autocast = get_autocast(...)``)."""
    for call in recipe.calls_to(*AUTOCAST):
        enabled = keyword(call, "enabled")
        if enabled is None or recipe.code(enabled.value) != "False":
            return call
    for call in recipe.calls():
        owner, _, name = dotted_name(call.func).rpartition(".")
        if "autocast" in name.lower() and isinstance(recipe.parent(call), cst.WithItem):
            if owner.rsplit(".", 1)[-1].lower() in ("accelerator", "fabric"):
                continue  # autocasts only as the Accelerator/Fabric's precision says: that switch decides
            return call
    return None


def _framework_switch(recipe: Recipe) -> Edits | AlreadyApplied | None:
    """``Accelerator(mixed_precision="bf16")``, ``Trainer(precision="bf16-mixed")``,
    ``TrainingArguments(bf16=True)``: the framework's switch, when the file builds one."""
    found = frameworks.switches(recipe, "bf16")
    for switch in found:
        arg = frameworks.precision_argument(recipe, switch)
        if arg is None:
            continue
        flag = frameworks.command_line_flag(recipe, arg.value)
        if flag is not None and arg.keyword is not None and arg.keyword.value == switch.name and (
            frameworks.flag_is_off(recipe, flag)
        ):
            edits = Edits(recipe)
            frameworks.set_flag_default(recipe, edits, flag, switch.value)
            edits.acts_on = (
                f"makes `{switch.value}` the default of the command-line flag at {recipe.where(flag)}, which sets "
                f"`{recipe.code(arg)}` in {switch.framework}(...) at {recipe.where(switch.call)}"
            )
            return edits
        return AlreadyApplied(
            f"{switch.framework}(...) at {recipe.where(switch.call)} sets `{recipe.code(arg)}`"
            + (f" (the command-line flag at {recipe.where(flag)})" if flag is not None else "")
        )
    usable = [s for s in found if frameworks.settable(s)]
    if not usable:
        return None
    chosen = [s for s in usable if s.framework == usable[0].framework]
    return frameworks.turn_on(recipe, chosen, ": the framework runs the forward passes under bfloat16 autocast")


def _forwards(recipe: Recipe, params: Params, loop: cst.CSTNode | None) -> tuple[str | None, list[cst.Call]]:
    """The forward calls to wrap (inside ``loop`` when given) and the model they call."""
    if params.target is not None or anchors.model_candidates(recipe) or pointing.given_models(recipe):
        model = pointing.find_model(recipe, SKILL, params.target)
        forwards = anchors.forward_calls(recipe, model, within=loop)
        if forwards:
            return model.outer or model.target_code, forwards
        if params.target is not None:
            raise SkillRefused(
                f"{SKILL}: looked for forward calls of `{model.outer or model.target_code}` (its calls, "
                f"`{model.target_code}(...)`){_in(recipe, loop)}; found none"
            )
    forwards = loops.forward_calls(recipe, loop)
    if not forwards:
        raise SkillRefused(
            f"{SKILL}: looked for the framework's switch (Accelerator, Lightning Trainer or Fabric, "
            f"TrainingArguments) and for forward calls of the model (a model construction, or calls of "
            f"a model in the function that runs {loops.LOOKED_FOR}){_in(recipe, loop)} in {recipe.name}; found none"
        )
    return None, forwards


def _in(recipe: Recipe, loop: cst.CSTNode | None) -> str:
    return f" inside the loop at {recipe.where(loop)}" if loop is not None else ""


def _wrap(opener: cst.With, statement: cst.BaseStatement) -> cst.With:
    """``statement`` inside ``opener``; the statement's leading comments move above the ``with``."""
    inner = statement.with_changes(leading_lines=[])
    body = opener.body.with_changes(body=[inner])  # type: ignore[union-attr]
    return opener.with_changes(body=body, leading_lines=statement.leading_lines)
