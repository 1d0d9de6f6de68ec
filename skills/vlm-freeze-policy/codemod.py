"""vlm-freeze-policy: which parts of a vision-language model train in each stage.

Anchors: the model construction (the ``apply_vlm_stage(...)`` call goes with the freeze stage:
after LoRA and tensor parallelism, before activation checkpointing, ``torch.compile`` and FSDP2)
and every ``torch.optim`` constructor (handed only trainable parameters). A recipe with its own
stage setting (a ``stage`` field beside code that sets ``requires_grad``) is reported as applied,
naming both; other hand-written freezing is refused, since the policy would overrule it.
"""

from __future__ import annotations

from typing import Literal

import libcst as cst
from pydantic import Field

from skills.codemod_kit import (
    AlreadyApplied,
    Edits,
    Recipe,
    SkillParams,
    insert_definitions,
    only_trainable_parameters,
    reach,
    stages,
    templates,
    vlm,
)
from skills.codemod_kit.recipe import dotted_name
from skills.errors import SkillRefused

SKILL = "vlm-freeze-policy"


class Params(SkillParams):
    stage: Literal["align", "finetune"] = Field(
        "align",
        description="align: only the projector trains; finetune: the projector and the language model "
        "(with lm_head) train.",
    )
    unfreeze_vision: bool = Field(False, description="Train the vision tower too (it is frozen in both stages by default).")
    target: str | None = Field(
        None,
        description="The model, when the file builds several: an expression ('self.model') or the line "
        "that builds it ('train.py:42').",
    )


HELPER = '''
def apply_vlm_stage(model: torch.nn.Module, stage: str, unfreeze_vision: bool = False) -> int:
    """Stage-wise training of a vision-language model (LLaVA's two stages). ``align``: only the
    projector trains, learning to map the image features into the language model's embeddings;
    ``finetune``: the projector and the language model (with its output head) train. The vision
    tower stays frozen in both unless ``unfreeze_vision``; every other parameter is frozen. Call it
    after the model is built and before torch.compile, fully_shard and the optimizer (which must
    get only parameters with ``requires_grad``). Returns the number of trained values.
    (Written by the vlm-freeze-policy skill.)
    """
    if stage not in ("align", "finetune"):
        raise ValueError(f"vlm-freeze-policy: stage must be 'align' or 'finetune', not {stage!r}")
    vision_language_parts(model, "vlm-freeze-policy", ["vision_tower", "projector", "language_model"])
    trained = ["projector"] + ["language_model"] * (stage == "finetune") + ["vision_tower"] * unfreeze_vision
    chosen = {id(p) for p in vision_language_parameters(model, "vlm-freeze-policy", trained)}
    for parameter in model.parameters():
        parameter.requires_grad_(id(parameter) in chosen)
    values = sum(p.numel() for p in model.parameters() if id(p) in chosen)
    total = sum(p.numel() for p in model.parameters())
    print(f"vlm-freeze-policy: stage {stage}: trains {' + '.join(trained)} ({values:,} of {total:,} parameter values)", flush=True)
    return values
'''


def _fields(cls: cst.ClassDef) -> list[cst.AnnAssign]:
    return [
        small
        for statement in cls.body.body if isinstance(statement, cst.SimpleStatementLine)
        for small in statement.body if isinstance(small, cst.AnnAssign)
    ]


def _stage_setting(recipe: Recipe) -> tuple[cst.AnnAssign, str, str | None] | None:
    """A ``stage`` field of a configuration class (``stage: Literal["align", "finetune"] = ...``):
    the field, its key as a setting (``model.stage`` when a section of another class holds the
    class), and a boolean field about the vision tower beside it (``train_vision_tower``)."""
    classes = recipe.top_level_classes()
    for name, cls in classes.items():
        stage = next((f for f in _fields(cls) if dotted_name(f.target) == "stage"), None)
        if stage is None:
            continue
        section = next((
            dotted_name(f.target) for other in classes.values() for f in _fields(other)
            if dotted_name(f.annotation.annotation) == name
        ), None)
        prefix = f"{section}." if section else ""
        vision = next((
            dotted_name(f.target) for f in _fields(cls)
            if "vision" in dotted_name(f.target) and dotted_name(f.annotation.annotation) == "bool"
        ), None)
        return stage, f"{prefix}stage", f"{prefix}{vision}" if vision else None
    return None


def _sets_requires_grad(recipe: Recipe) -> cst.CSTNode | None:
    for call in recipe.calls_to("freeze_parameters") or recipe.method_calls("requires_grad_"):
        return call
    for assign in recipe.assigns():  # `<anything>.requires_grad = ...`, subscripts on the way included
        if any(isinstance(t.target, cst.Attribute) and t.target.attr.value == "requires_grad" for t in assign.targets):
            return assign
    for call in recipe.calls_to("setattr"):  # setattr(p, "requires_grad", ...)
        if len(call.args) > 1 and isinstance(call.args[1].value, cst.SimpleString) and (
                call.args[1].value.evaluated_value == "requires_grad"):
            return call
    return None


def apply(recipe: Recipe, params: Params) -> Edits | AlreadyApplied:
    existing = recipe.calls_to("apply_vlm_stage")
    if existing:
        return AlreadyApplied(f"the stage policy is applied at {recipe.where(existing[0])}")
    freezing = _sets_requires_grad(recipe)
    setting = _stage_setting(recipe)
    if freezing is not None and setting is not None:
        field, key, vision = setting
        choose = f"--set {key}={params.stage}"
        if vision is not None:
            choose += f" --set {vision}={str(params.unfreeze_vision).lower()}"
        elif params.unfreeze_vision:
            choose += " (it has no setting to train the vision tower: use the freeze skill's parts the other way round, or edit the stage code)"
        return AlreadyApplied(
            f"the recipe has its own stage policy: the setting `{key}` ({recipe.where(field)}) and "
            f"requires_grad set at {recipe.where(freezing)}; choose the stage with `{choose}`"
        )
    if freezing is not None:
        raise SkillRefused(
            f"{SKILL}: the recipe already sets requires_grad at {recipe.where(freezing)}, and the stage policy "
            "would overrule it; remove that freezing and apply again (or keep it and use the freeze skill's parts)"
        )
    model = reach.find_target_model(recipe, SKILL, params.target)
    found = reach.shape(recipe, model)
    parts = vlm.check_parts(
        recipe, SKILL, found, ["vision_tower", "projector", "language_model"],
        "the stage policy needs a vision-language model (for a text model use the freeze skill)",
    )
    edits = Edits(recipe)
    only_trainable_parameters(recipe, edits, SKILL)
    vlm.ensure_helper(recipe, edits, model.statement)
    insert_definitions(recipe, edits, HELPER, model.statement)
    edits.add_import("torch")
    call = templates.statement(
        recipe.module,
        f'apply_vlm_stage({{model}}, stage="{params.stage}", unfreeze_vision={params.unfreeze_vision})',
        model=model.target,
    )
    stages.insert_stage(recipe, edits, model, stages.FREEZE, [call])
    trained = ["the projector"] + ["the language model"] * (params.stage == "finetune") + \
        ["the vision tower"] * params.unfreeze_vision
    checked = "" if parts.endswith(found.name) else " (its parts found by name at run time)"
    edits.acts_on = f"stage {params.stage}: trains {' and '.join(trained)} of {found.name}; freezes the rest{checked}"
    return edits
