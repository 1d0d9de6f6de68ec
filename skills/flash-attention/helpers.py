"""What the flash-attention skill writes into a recipe: skills/flash-attention/codemod.py copies these definitions
with libcst (skills/codemod_kit/copied.py). A real module, so that ruff lints it and tests import it.
"""

import importlib.util

import torch
from typing import Callable


def use_flash_attention(
    model: torch.nn.Module,
    compute_dtype: torch.dtype,
    packed_sequences: bool = True,
    warn: Callable[[str], None] | None = None,
) -> bool:
    """FlashAttention 2 for a Hugging Face model (``attn_implementation="flash_attention_2"``)
    where it can run: a CUDA GPU of the Ampere generation or newer, the flash_attn package, and
    bfloat16 or float16 compute (``compute_dtype``). Otherwise the model keeps its attention (sdpa)
    and ``warn`` says why, once. With ``packed_sequences``, forwards that pass position ids and no
    attention mask get FlashAttention's variable-length arguments (``document_boundaries``), so
    packed documents do not attend to each other. Returns whether FlashAttention 2 is on.
    (Written by the flash-attention skill.)
    """
    warn = warn or (lambda message: print(f"warning: {message}", flush=True))
    reason = None
    if not torch.cuda.is_available():
        reason = "no CUDA GPU"
    elif importlib.util.find_spec("flash_attn") is None:
        reason = "the flash_attn package is not installed (pip install flash-attn --no-build-isolation)"
    elif torch.cuda.get_device_capability()[0] < 8:
        reason = f"{torch.cuda.get_device_name()} is older than Ampere"
    elif compute_dtype not in (torch.bfloat16, torch.float16):
        reason = (
            f"the model computes in {compute_dtype}, and FlashAttention needs bfloat16 or float16 "
            "(set parallel.param_dtype=bfloat16, or apply the mixed-precision skill first)"
        )
    if reason is not None:
        current = getattr(getattr(model, "config", None), "_attn_implementation", None) or "its own"
        warn(f"flash-attention: {reason}; training continues with {current} attention")
        return False
    model.set_attn_implementation("flash_attention_2")
    if packed_sequences:
        model.register_forward_pre_hook(document_boundaries, with_kwargs=True)
    return True


def document_boundaries(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """Forward pre-hook: rows whose position ids restart at 0 at each document (packed rows, no
    attention mask) get FlashAttention 2's variable-length arguments over the flattened batch:
    ``cu_seq_lens_q/k``, where each document (and each row) starts, and ``max_length_q/k``, the
    row length (an upper bound that stays the same from batch to batch). transformers then calls
    ``flash_attn_varlen_func``: each token attends only to its own document. (From position ids
    alone it does so only for a batch of one row.) (Written by the flash-attention skill.)
    """
    position_ids = kwargs.get("position_ids")
    if position_ids is None or kwargs.get("attention_mask") is not None or "cu_seq_lens_q" in kwargs:
        return None
    starts = position_ids == 0
    starts[..., 0] = True
    starts = starts.flatten().nonzero().flatten()
    end = torch.tensor([position_ids.numel()], device=starts.device)
    boundaries = torch.cat([starts, end]).to(torch.int32)
    row = position_ids.size(-1)
    return args, {
        **kwargs,
        "cu_seq_lens_q": boundaries,
        "cu_seq_lens_k": boundaries,
        "max_length_q": row,
        "max_length_k": row,
    }
