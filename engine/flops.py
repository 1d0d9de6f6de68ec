"""Model FLOPs per token and model FLOPs utilisation (MFU).

Training FLOPs per token follow the PaLM paper (appendix B): ``6·N`` for the matmuls of the
``N`` non-embedding parameters (forward 2, backward 4) plus ``12·L·H·S`` for attention scores
and values (``L`` layers, hidden size ``H``, sequence length ``S``; causal masking is not
discounted, as is customary). MFU = achieved FLOP/s ÷ peak FLOP/s of the devices.
"""

from __future__ import annotations

import torch
from torch import nn

# Dense peak TFLOP/s per device from the vendors' data sheets (no sparsity).
PEAK_TFLOPS = {
    # name fragment: {dtype: TFLOP/s}
    "H200": {torch.bfloat16: 989.0, torch.float16: 989.0, torch.float32: 67.0},
    "H100": {torch.bfloat16: 989.0, torch.float16: 989.0, torch.float32: 67.0},
    "A100": {torch.bfloat16: 312.0, torch.float16: 312.0, torch.float32: 19.5},
    "L4": {torch.bfloat16: 121.0, torch.float16: 121.0, torch.float32: 30.3},
}


def non_embedding_params(model: nn.Module) -> int:
    embedding_params = sum(
        p.numel() for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters()
    )
    return sum(p.numel() for p in model.parameters()) - embedding_params


def transformer_flops_per_token(
    non_embedding_params: int, num_layers: int, hidden_size: int, seq_len: int
) -> float:
    return 6.0 * non_embedding_params + 12.0 * num_layers * hidden_size * seq_len


def peak_flops(device: torch.device, dtype: torch.dtype, override_tflops: float | None) -> float | None:
    """Peak FLOP/s of one device, or None when it is not known (CPUs, unlisted GPUs)."""
    if override_tflops is not None:
        return override_tflops * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for fragment, by_dtype in PEAK_TFLOPS.items():
        if fragment in name:
            return by_dtype.get(dtype, by_dtype[torch.float32]) * 1e12
    return None
