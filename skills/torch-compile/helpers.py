"""What the torch-compile skill writes into a recipe: skills/torch-compile/codemod.py copies these definitions
with libcst (skills/codemod_kit/copied.py). A real module, so that ruff lints it and tests import it.
"""

import torch

from engine.blocks import find_blocks  # written by ensure_find_blocks


def compile_blocks(
    model: torch.nn.Module,
    mode: str = "default",
    fullgraph: bool = False,
    dynamic: bool | None = None,
    target: torch.nn.Module | None = None,
    warn=None,
) -> int:
    """Compile every transformer block with torch.compile, in place (``Module.compile``), so
    parameter names and checkpoints stay as they are. Identical blocks share one compiled graph,
    and FSDP2 still shards and overlaps block by block. The first steps are slow while the
    graphs compile. Call it after activation checkpointing and before fully_shard and other
    wrappers. Returns the number of compiled blocks. (Written by the torch-compile skill.)
    """
    where, blocks = find_blocks(model, "torch-compile", target, warn)
    for block in blocks:
        block.compile(mode=mode, fullgraph=fullgraph, dynamic=dynamic)
    if blocks:
        print(f"torch-compile: compiled {len(blocks)} blocks of {where}", flush=True)
    return len(blocks)
