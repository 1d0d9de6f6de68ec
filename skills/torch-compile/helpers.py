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
    if blocks:
        keep_attention_masks(model)
    for block in blocks:
        block.compile(mode=mode, fullgraph=fullgraph, dynamic=dynamic)
    if blocks:
        print(f"torch-compile: compiled {len(blocks)} blocks of {where}", flush=True)
    return len(blocks)


def keep_attention_masks(model: torch.nn.Module) -> bool:
    """Give a Hugging Face model's blocks an attention mask in every batch. On SDPA, transformers
    drops the mask of a batch with no padding and no packed documents (``is_causal`` instead), so
    compiled blocks see ``None`` after a tensor and recompile in the middle of training (a batch
    of full rows of one long document each does it). The same SDPA attention, registered under
    its own name with a mask that is always built and laid out alike, gives every batch one graph. Other attention
    implementations (flash-attention) are left as they are. (Written by the torch-compile skill.)
    """
    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) != "sdpa" or not hasattr(model, "set_attn_implementation"):
        return False
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    def sdpa_mask_kept(*args, **kwargs):
        kwargs["allow_is_causal_skip"] = False
        mask = sdpa_mask(*args, **kwargs)  # a causal mask alone comes expanded (batch stride 0):
        return mask.contiguous() if isinstance(mask, torch.Tensor) else mask  # laid out as any other

    AttentionInterface.register("sdpa_masked", sdpa_attention_forward)
    AttentionMaskInterface.register("sdpa_masked", sdpa_mask_kept)
    model.set_attn_implementation("sdpa_masked")
    return True
