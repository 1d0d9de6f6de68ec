"""What the gradient-checkpointing skill writes into a recipe: skills/gradient-checkpointing/codemod.py copies these definitions
with libcst (skills/codemod_kit/copied.py). A real module, so that ruff lints it and tests import it.
"""

from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    apply_activation_checkpointing,
    checkpoint_wrapper,
)
import torch

from engine.blocks import find_blocks  # written by ensure_find_blocks


def checkpoint_blocks(
    model: torch.nn.Module, every: int = 1, target: torch.nn.Module | None = None, warn=None
) -> int:
    """Activation checkpointing: keep only each block's input in the forward pass and recompute
    the block's activations during backward (one extra forward of compute for a peak activation
    memory of about one block instead of all of them). Non-reentrant checkpointing works with
    keyword arguments, FSDP2 and torch.compile. Call it after tensor parallelism and before
    torch.compile, fully_shard and other wrappers, so that those see the wrapped blocks.
    Returns the number of wrapped blocks. (Written by the gradient-checkpointing skill.)
    """
    where, blocks = find_blocks(model, "gradient-checkpointing", target, warn)
    chosen = {id(block) for index, block in enumerate(blocks) if index % every == 0}
    if not chosen:
        return 0
    apply_activation_checkpointing(
        model,
        checkpoint_wrapper_fn=lambda block: checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT),
        check_fn=lambda module: id(module) in chosen,
    )
    print(f"gradient-checkpointing: wrapped {len(chosen)} of {len(blocks)} blocks of {where}", flush=True)
    return len(chosen)
