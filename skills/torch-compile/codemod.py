"""torch-compile: compile the transformer blocks (or the whole model) in place with torch.compile.

Anchors: ``TrainingArguments(...)`` (its ``torch_compile=True`` switch) when the file builds one;
else the model construction; the call goes after activation checkpointing and before FSDP2.
"""

from __future__ import annotations

from pathlib import Path

from typing import Literal

from pydantic import Field

from skills.codemod_kit import copied, frameworks
from skills.codemod_kit.anchors import keyword
from skills.codemod_kit import (
    AlreadyApplied,
    Edits,
    Recipe,
    SkillParams,
    ensure_find_blocks,
    gpu_guard,
    insert_definitions,
    reach,
    stages,
    templates,
)

from skills.errors import SkillRefused

SKILL = "torch-compile"


class Params(SkillParams):
    scope: Literal["blocks", "model"] = Field(
        "blocks",
        description="'blocks': compile each transformer block (identical blocks share one graph; "
        "works with FSDP2 per-block sharding); 'model': compile the whole model.",
    )
    mode: Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"] = Field(
        "default", description="torch.compile mode."
    )
    fullgraph: bool = Field(False, description="Fail on graph breaks instead of falling back to eager.")
    dynamic: bool | None = Field(None, description="Dynamic shapes: None lets torch decide.")
    target: str | None = Field(
        None,
        description="With scope 'blocks', the module whose blocks to compile, as an expression on the "
        "model (e.g. 'model.encoder'): the children of an nn.ModuleList/nn.Sequential, or the module "
        "itself. Default: the model's repeated blocks. A model expression or line ('netG', 'train.py:42') "
        "picks the model when the file builds several.",
    )


# What it writes is a real module beside this file (helpers.py), copied into the recipe.
HELPERS_MODULE = Path(__file__).with_name("helpers.py")

def _existing(recipe: Recipe):
    """``torch.compile(...)``, our helper, a library's ``compile_model``, or ``<module>.compile(...)``
    (but not ``re.compile``)."""
    found = recipe.calls_to("torch.compile", "compile_blocks", ".compile_model")
    if found:
        return found[0]
    for call in recipe.method_calls("compile"):
        if not recipe.call_name(call).startswith(("re.", "regex.")):
            return call
    return None


def apply(recipe: Recipe, params: Params) -> Edits | AlreadyApplied:
    existing = _existing(recipe)
    if existing is not None:
        default = frameworks.off_config_default(recipe, ("compile",))
        if default is not None and frameworks.behind(recipe, existing):
            edits = Edits(recipe)
            edits.acts_on = frameworks.turn_on_default(recipe, edits, default) + f": torch.compile at {recipe.where(existing)}"
            return edits
        return AlreadyApplied(f"torch.compile at {recipe.where(existing)}{frameworks.behind(recipe, existing)}")
    switch = frameworks.config_switch(recipe, "compile")
    if switch is not None and params.target is None:
        return AlreadyApplied(
            f"the framework takes its torch.compile switch, `{recipe.code(switch)}` at {recipe.where(switch)}: "
            "turn it on in that configuration"
        )
    if params.target is None:
        switched = _framework_switch(recipe)
        if switched is not None:
            return switched
    model = reach.find_target_model(recipe, SKILL, params.target)
    if params.scope == "model" and reach.resolve_target(recipe, SKILL, reach.shape(recipe, model), params.target):
        raise SkillRefused(f"{SKILL}: target names blocks to compile; it needs scope='blocks', not 'model'")
    edits = Edits(recipe)
    options = [f"mode={templates.literal(params.mode)}"]
    if params.fullgraph:
        options.append("fullgraph=True")
    if params.dynamic is not None:
        options.append(f"dynamic={params.dynamic}")
    found = reach.shape(recipe, model)
    named = reach.resolve_target(recipe, SKILL, found, params.target)
    unseen = (  # a class the codemod cannot see may have no repeated blocks; torch.nn's own layers
        named is None and not found.hf and (  # are skipped by dynamo when compiled one by one
            found.cls is None or (bool(found.containers) and all(c.builtin for c in found.containers))
        )
    )
    if params.scope == "model" or unseen:
        call = templates.statement(recipe.module, f"{{model}}.compile({', '.join(options)})", model=model.target)
        edits.acts_on = f"compiles the whole model `{model.target_code}` ({model.builder})" + (
            (f": its class is not visible to the codemod (built by {model.builder}(...)), so it may have no "
             "repeated blocks; name its blocks with `target` to compile them one by one" if found.cls is None else
             ": its blocks are torch.nn's own layers, which torch.compile does not trace one by one") if unseen else ""
        )
    else:
        target = reach.resolve_target(recipe, SKILL, found, params.target)
        if target is not None:
            options.append(f"target={reach.target_code(found, target)}")
        else:
            reach.require_blocks(
                recipe, SKILL, found,
                "use scope=\"model\" to compile the whole model, or give `target` naming a submodule to "
                f"compile (one of {reach.submodules(found)})",
            )
        ensure_find_blocks(recipe, edits, model.statement)
        insert_definitions(recipe, edits, copied.definitions(HELPERS_MODULE), model.statement)
        for name in copied.imports(HELPERS_MODULE):
            edits.add_import(*name)
        call = templates.statement(
            recipe.module,
            f"compile_blocks({{model}}, {', '.join(options)}{gpu_guard.warn_argument(recipe, model)})",
            model=model.target,
        )
        edits.acts_on = f"compiles {reach.describe_blocks(found, target)}"
    stages.insert_stage(recipe, edits, model, stages.COMPILE, [call])
    edits.notes.append("the first steps include compilation (tens of seconds on CPU)")
    return edits


def _framework_switch(recipe: Recipe) -> Edits | AlreadyApplied | None:
    """``TrainingArguments(torch_compile=True)``; an ``Accelerator(dynamo_backend=...)`` compiles
    the prepared model already."""
    for call in frameworks.accelerators(recipe):
        arg = keyword(call, "dynamo_backend") or keyword(call, "dynamo_plugin")
        if arg is not None and recipe.code(arg.value) not in ('"no"', "'no'", "None", '"NO"'):
            return AlreadyApplied(f"Accelerator(...) at {recipe.where(call)} sets `{recipe.code(arg)}`")
    switches = frameworks.switches(recipe, "compile")
    already = frameworks.set_already(recipe, switches)
    if already is not None:
        return AlreadyApplied(already)
    usable = [s for s in switches if frameworks.settable(s)]
    if not usable:
        return None
    edits = frameworks.turn_on(recipe, usable, ": the Trainer compiles the model with torch.compile")
    edits.notes.append("the first steps include compilation")
    return edits
