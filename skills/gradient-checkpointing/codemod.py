"""gradient-checkpointing: wrap the model's transformer blocks with ``checkpoint_wrapper``.

Anchors: ``TrainingArguments(...)`` (its ``gradient_checkpointing=True`` switch) when the file
builds one; else the model construction: a Hugging Face model (the templates' too) gets its own
``gradient_checkpointing_enable``, which checkpoints the family's decoder layers (both towers of
a vision-language model) and keeps them the classes FSDP2 shards by (``_no_split_modules``);
any other model, or ``every``/``target``, ``checkpoint_blocks(model)``. The call goes
into the model stages after tensor parallelism and before ``torch.compile`` and FSDP2; the
helper goes next to the file's other top-level definitions.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field

from skills.codemod_kit import copied, frameworks, vlm
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

SKILL = "gradient-checkpointing"


class Params(SkillParams):
    every: int = Field(
        1,
        ge=1,
        description="Checkpoint every N-th block: 1 checkpoints all blocks (least memory); 2 "
        "checkpoints half of them (less recomputation, more memory).",
    )
    target: str | None = Field(
        None,
        description="The module to checkpoint, as an expression on the model (e.g. 'model.encoder', "
        "'model.features'): the children of an nn.ModuleList/nn.Sequential, or the module itself as "
        "one block. Default: the model's repeated blocks (its largest nn.ModuleList, or nn.Sequential "
        "of modules of one class). A model expression or line ('netG', 'train.py:42') picks the model "
        "when the file builds several.",
    )


# Hand-written activation checkpointing counts as applied.
CHECKPOINT_CALLS = (
    ".set_activation_checkpointing",
    ".checkpoint_wrapper",
    ".apply_activation_checkpointing",
    "torch.utils.checkpoint.checkpoint",
    "torch.utils.checkpoint.checkpoint_sequential",
    "torch.distributed._composable.checkpoint",
    "torch.distributed._composable.checkpoint_activation.checkpoint",
    "checkpoint_blocks",
)
CHECKPOINT_METHODS = ("gradient_checkpointing_enable", "activation_checkpointing_enable")

# What it writes is a real module beside this file (helpers.py), copied into the recipe.
HELPERS_MODULE = Path(__file__).with_name("helpers.py")


def apply(recipe: Recipe, params: Params) -> Edits | AlreadyApplied:
    existing = recipe.calls_to(*CHECKPOINT_CALLS) or [
        c for m in CHECKPOINT_METHODS for c in recipe.method_calls(m)
    ]
    if existing:
        default = frameworks.off_config_default(recipe, ("activation_checkpointing", "gradient_checkpointing"))
        if default is not None and frameworks.behind(recipe, existing[0]):
            edits = Edits(recipe)
            edits.acts_on = frameworks.turn_on_default(recipe, edits, default) + (
                f": activation checkpointing at {recipe.where(existing[0])}"
            )
            return edits
        return AlreadyApplied(
            f"activation checkpointing at {recipe.where(existing[0])}{frameworks.behind(recipe, existing[0])}"
        )
    switch = frameworks.config_switch(recipe, "checkpointing")
    if switch is not None and params.target is None:
        return AlreadyApplied(
            f"the framework takes its activation checkpointing switch, `{recipe.code(switch)}` at "
            f"{recipe.where(switch)}: turn it on in that configuration"
        )
    if params.target is None:
        switched = _training_arguments(recipe)
        if switched is not None:
            return switched
    model = reach.find_target_model(recipe, SKILL, params.target)
    found = reach.shape(recipe, model)
    target = reach.resolve_target(recipe, SKILL, found, params.target)
    edits = Edits(recipe)
    if target is None and found.hf and params.every == 1:
        gpu_guard.insert_kernel_stage(
            recipe, edits, model,
            '{model}.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})',
            stage=stages.ACTIVATION_CHECKPOINTING,
        )
        layers = "every layer of the vision tower and of the language model" if vlm.is_vision_language(found) \
            else "every decoder layer"
        edits.acts_on = (
            f"turns on {found.name}'s own activation checkpointing (`gradient_checkpointing_enable`) "
            f"on `{model.target_code}`: {layers}"
        )
        return edits
    if target is None and vlm.is_vision_language(found):
        return _both_towers(recipe, params, model, found)
    if target is None:
        reach.require_blocks(
            recipe, SKILL, found,
            f"give `target` naming the submodule to checkpoint as one block (one of {reach.submodules(found)}), "
            "or leave activation memory as it is: checkpointing pays off on deep stacks of blocks",
        )
    ensure_find_blocks(recipe, edits, model.statement)
    insert_definitions(recipe, edits, copied.definitions(HELPERS_MODULE), model.statement)
    for name in copied.imports(HELPERS_MODULE):
        edits.add_import(*name)
    # torch.nn.Transformer has two stacks of built-in layers: checkpoint both
    targets = [target] if target is not None or not found.containers or not all(c.builtin for c in found.containers) \
        else found.containers
    calls = []
    for each in targets:
        arguments = ["{model}"]
        if params.every != 1:
            arguments.append(f"every={params.every}")
        if each is not None:
            arguments.append(f"target={reach.target_code(found, each)}")
        calls.append(templates.statement(
            recipe.module,
            f"checkpoint_blocks({', '.join(arguments)}{gpu_guard.warn_argument(recipe, model)})",
            model=model.target,
        ))
    stages.insert_stage(recipe, edits, model, stages.ACTIVATION_CHECKPOINTING, calls)
    every = "" if params.every == 1 else f"every {params.every}th of "
    edits.acts_on = f"wraps {every}" + " and ".join(reach.describe_blocks(found, each) for each in targets)
    return edits


def _training_arguments(recipe: Recipe) -> Edits | AlreadyApplied | None:
    """``TrainingArguments(gradient_checkpointing=True)``: the Hugging Face Trainer's switch."""
    switches = frameworks.switches(recipe, "checkpointing")
    already = frameworks.set_already(recipe, switches)
    if already is not None:
        return AlreadyApplied(already)
    usable = [s for s in switches if frameworks.settable(s)]
    if not usable:
        return _parsed_arguments(recipe)
    return frameworks.turn_on(recipe, usable, ": the Trainer checkpoints every decoder layer of the model")


def _parsed_arguments(recipe: Recipe) -> Edits | AlreadyApplied | None:
    """Training arguments parsed from the command line (``HfArgumentParser``, ``TrlParser``):
    ``training_args.gradient_checkpointing = True`` right after the parse (the Trainer reads it
    when it trains; the command line flag is overridden)."""
    parsed = frameworks.parsed_training_arguments(recipe)
    if not parsed:
        return None
    for assign in recipe.assigns():
        if any(recipe.code(t.target) == f"{name}.gradient_checkpointing" for t in assign.targets for _, name in parsed):
            return AlreadyApplied(f"`{recipe.code(assign)}` at {recipe.where(assign)}")
    edits = Edits(recipe)
    for statement, name in parsed:  # transformers ≥ 5 reads activation_checkpointing, earlier ones the alias
        edits.insert_after(statement, templates.statements(
            recipe.module, f"{name}.gradient_checkpointing = True\n{name}.activation_checkpointing = True\n"
        ))
    edits.acts_on = (
        f"sets `{parsed[0][1]}.gradient_checkpointing = True` (and `activation_checkpointing`, its name in "
        "transformers 5) after the arguments are parsed "
        f"({', '.join(recipe.where(s) for s, _ in parsed)}): the Trainer checkpoints every decoder layer"
    )
    return edits


def _both_towers(recipe: Recipe, params: Params, model, found: reach.ModelShape) -> Edits:
    """A vision-language model: the blocks of the vision tower and of the language model, each
    found in its tower at run time (the largest block list of the whole model is only one)."""
    towers = vlm.check_parts(recipe, SKILL, found, ["vision_tower", "language_model"], "give `target`")
    edits = Edits(recipe)
    ensure_find_blocks(recipe, edits, model.statement)
    insert_definitions(recipe, edits, copied.definitions(HELPERS_MODULE), model.statement)
    vlm.ensure_helper(recipe, edits, SKILL, model.statement)
    for name in copied.imports(HELPERS_MODULE):
        edits.add_import(*name)
    every = f", every={params.every}" if params.every != 1 else ""
    find = templates.statement(
        recipe.module,
        f'towers = vision_language_parts({{model}}, "{SKILL}", ["vision_tower", "language_model"])',
        model=model.target,
    )
    loop = templates.statement(
        recipe.module,
        f"for tower in towers.values():\n    checkpoint_blocks(tower{every}{gpu_guard.warn_argument(recipe, model)})\n",
    )
    stages.insert_stage(recipe, edits, model, stages.ACTIVATION_CHECKPOINTING, [find, loop])
    every_text = "" if params.every == 1 else f"every {params.every}th of "
    edits.acts_on = f"wraps {every_text}the blocks of the {towers} (each tower's largest block list, counted at run time)"
    return edits
