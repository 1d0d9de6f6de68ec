"""freeze: stop training part of the model (embeddings, the first blocks, or parameters by name).

Anchors: the model construction (the ``freeze_parameters(...)`` call goes after LoRA and tensor
parallelism, which create new parameters, and before activation checkpointing, which renames
them) and every ``torch.optim`` constructor (handed only trainable parameters).
"""

from __future__ import annotations

from pathlib import Path

from typing import Literal

import libcst as cst
from pydantic import Field, model_validator

from skills.codemod_kit import copied, vlm
from skills.codemod_kit import (
    AlreadyApplied,
    Edits,
    Recipe,
    SkillParams,
    ensure_find_blocks,
    gpu_guard,
    insert_definitions,
    only_trainable_parameters,
    reach,
    stages,
    templates,
)
from skills.codemod_kit.recipe import dotted_name

from skills.errors import SkillRefused

SKILL = "freeze"


class Params(SkillParams):
    embeddings: bool = Field(True, description="Freeze every nn.Embedding (token and position embeddings).")
    first_blocks: int = Field(0, ge=0, description="Freeze the first N transformer blocks.")
    patterns: list[str] = Field(
        default_factory=list,
        description="fnmatch patterns of parameter names to freeze, as model.named_parameters() "
        "gives them (e.g. 'lm_head.*', '*.norm.weight').",
    )
    target: str | None = Field(
        None,
        description="With first_blocks, the module whose first children are frozen, as an expression "
        "on the model (e.g. 'model.encoder.layers'). Default: the model's repeated blocks. A model "
        "expression or line ('netG', 'train.py:42') picks the model when the file builds several.",
    )

    parts: list[Literal["vision_tower", "projector", "language_model"]] = Field(
        default_factory=list,
        description="Parts of a vision-language model to freeze (transformers' vision_tower, "
        "multi_modal_projector, language_model + lm_head; also visual, mm_projector, llm). With parts, "
        "embeddings defaults to false.",
    )

    @model_validator(mode="after")
    def _freezes_something(self) -> "Params":
        if self.parts and "embeddings" not in self.model_fields_set:
            self.embeddings = False  # the parts say what to freeze; the embeddings are in the language model
        if not self.embeddings and not self.first_blocks and not self.patterns and not self.parts:
            raise ValueError("nothing to freeze: set embeddings, first_blocks, patterns or parts")
        return self


# What it writes is a real module beside this file (helpers.py), copied into the recipe.
HELPERS_MODULE = Path(__file__).with_name("helpers.py")


def _existing_freeze(recipe: Recipe):
    """The skill's call, or hand-written ``p.requires_grad_(False)`` / ``p.requires_grad = False``."""
    found = recipe.calls_to("freeze_parameters")
    if found:
        return found[0]
    for call in recipe.method_calls("requires_grad_"):
        if call.args and isinstance(call.args[0].value, cst.Name) and call.args[0].value.value == "False":
            return call
    for assign in recipe.assigns():
        for target in assign.targets:
            if (
                dotted_name(target.target).endswith(".requires_grad")
                and recipe.code(assign.value) == "False"
            ):
                return assign
    return None


def apply(recipe: Recipe, params: Params) -> Edits | AlreadyApplied:
    existing = _existing_freeze(recipe)
    if existing is not None:
        return AlreadyApplied(f"parameters are frozen at {recipe.where(existing)}")
    model = reach.find_target_model(recipe, SKILL, params.target)
    found = reach.shape(recipe, model)
    acts = []
    if params.embeddings:
        if found.cls is not None and not found.hf and not _builds_embeddings(recipe, found):
            raise SkillRefused(
                f"{SKILL}: embeddings=True, but {found.name} ({recipe.where(model.statement)}) builds no "
                f"nn.Embedding; set embeddings=false and name what to freeze with first_blocks or patterns"
            )
        acts.append("every nn.Embedding")
    target = None
    if params.first_blocks:
        target = reach.resolve_target(recipe, SKILL, found, params.target)
        if target is None:
            reach.require_blocks(
                recipe, SKILL, found,
                "name the parameters with `patterns` (e.g. [\"conv1.*\"]), or give `target` naming the module "
                f"whose first children to freeze (one of {reach.submodules(found)})",
            )
        acts.append(f"the first {params.first_blocks} of {reach.describe_blocks(found, target)}")
    if params.patterns:
        acts.append(f"parameters matching {', '.join(params.patterns)} (checked at run time)")
    if params.parts:
        acts.append("the " + vlm.check_parts(
            recipe, SKILL, found, params.parts,
            "name what to freeze with embeddings, first_blocks or patterns",
        ))
    edits = Edits(recipe)
    only_trainable_parameters(recipe, edits, SKILL)
    extra = ""
    if params.first_blocks:  # a script that freezes no blocks gets no find_blocks
        ensure_find_blocks(recipe, edits, model.statement)
        target_arg = f", {reach.target_code(found, target)}" if target is not None else ""
        extra = f', found_blocks=find_blocks({{model}}, "{SKILL}"{target_arg}{gpu_guard.warn_argument(recipe, model)})'
    insert_definitions(recipe, edits, copied.definitions(HELPERS_MODULE), model.statement)
    for name in copied.imports(HELPERS_MODULE):
        edits.add_import(*name)
    calls = []
    if params.parts:
        vlm.ensure_helper(recipe, edits, model.statement)
        calls.append(templates.statement(
            recipe.module,
            f'frozen_parts = vision_language_parameters({{model}}, "{SKILL}", {templates.literal(params.parts)})',
            model=model.target,
        ))
        extra += ", parameters=frozen_parts"
    calls.append(templates.statement(
        recipe.module,
        f"freeze_parameters({{model}}, embeddings={params.embeddings}, "
        f"first_blocks={params.first_blocks}, patterns={templates.literal(params.patterns)}{extra})",
        model=model.target,
    ))
    stages.insert_stage(recipe, edits, model, stages.FREEZE, calls)
    edits.acts_on = "freezes " + "; ".join(acts)
    own = recipe.method_calls("requires_grad_")
    if own:  # a stage policy, say: what it froze already stays frozen, and is not counted again
        edits.acts_on += (f" (the recipe also sets requires_grad at {recipe.where(own[0])}: the run prints how many "
                          "values this newly froze)")
    return edits


def _builds_embeddings(recipe: Recipe, found: reach.ModelShape) -> bool:
    """Does the model's class (or a class of the file) build an nn.Embedding?"""
    return bool(recipe.calls_to("torch.nn.Embedding"))
