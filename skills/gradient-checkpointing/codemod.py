"""gradient-checkpointing: wrap the model's transformer blocks with ``checkpoint_wrapper``.

Anchor: the model construction. The call ``checkpoint_blocks(model)`` goes into the model
stages after tensor parallelism and before ``torch.compile`` and FSDP2; the helper goes next to
the file's other top-level definitions.
"""

from __future__ import annotations

from pydantic import Field

from skills.codemod_kit import (
    AlreadyApplied,
    Edits,
    Recipe,
    SkillParams,
    anchors,
    ensure_transformer_blocks,
    insert_definitions,
    stages,
    templates,
)

SKILL = "gradient-checkpointing"
WRAPPER_MODULE = "torch.distributed.algorithms._checkpoint.checkpoint_wrapper"


class Params(SkillParams):
    every: int = Field(
        1,
        ge=1,
        description="Checkpoint every N-th block: 1 checkpoints all blocks (least memory); 2 "
        "checkpoints half of them (less recomputation, more memory).",
    )


# Hand-written activation checkpointing counts as applied.
CHECKPOINT_CALLS = (
    ".checkpoint_wrapper",
    ".apply_activation_checkpointing",
    "torch.utils.checkpoint.checkpoint",
    "torch.utils.checkpoint.checkpoint_sequential",
    "torch.distributed._composable.checkpoint",
    "torch.distributed._composable.checkpoint_activation.checkpoint",
    "checkpoint_blocks",
)
CHECKPOINT_METHODS = ("gradient_checkpointing_enable", "activation_checkpointing_enable")

HELPER = '''
def checkpoint_blocks(model: torch.nn.Module, every: int = 1) -> None:
    """Activation checkpointing: keep only each block's input in the forward pass and recompute
    the block's activations during backward (one extra forward of compute for a peak activation
    memory of about one block instead of all of them). Non-reentrant checkpointing works with
    keyword arguments, FSDP2 and torch.compile. Call it after tensor parallelism and before
    torch.compile and fully_shard, so that those see the wrapped blocks.
    (Written by the gradient-checkpointing skill.)
    """
    chosen = {id(block) for index, block in enumerate(transformer_blocks(model)) if index % every == 0}
    apply_activation_checkpointing(
        model,
        checkpoint_wrapper_fn=lambda block: checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT),
        check_fn=lambda module: id(module) in chosen,
    )
'''


def apply(recipe: Recipe, params: Params) -> Edits | AlreadyApplied:
    existing = recipe.calls_to(*CHECKPOINT_CALLS) or [
        c for m in CHECKPOINT_METHODS for c in recipe.method_calls(m)
    ]
    if existing:
        return AlreadyApplied(f"activation checkpointing at {recipe.where(existing[0])}")
    model = anchors.find_model(recipe, SKILL)
    edits = Edits(recipe)
    ensure_transformer_blocks(recipe, edits, model.statement)
    insert_definitions(recipe, edits, HELPER, model.statement)
    for name in ("CheckpointImpl", "apply_activation_checkpointing", "checkpoint_wrapper"):
        edits.add_import(WRAPPER_MODULE, name)
    edits.add_import("torch")
    arguments = "{model}" if params.every == 1 else f"{{model}}, every={params.every}"
    call = templates.statement(recipe.module, f"checkpoint_blocks({arguments})", model=model.target)
    stages.insert_stage(recipe, edits, model, stages.ACTIVATION_CHECKPOINTING, [call])
    return edits
