"""The estimate counts attention as the kernel a run uses keeps it: what SDPA saves for backward
on meta tensors (under :func:`engine.estimate.fused_attention`) is what the CPU kernel saves on
real ones, measured here, not the S×S weights of the math path the meta device takes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.estimate import SavedBytes, fused_attention

B, H, S, D = 2, 4, 256, 32


def saved_bytes(device: str, fused: bool, **kwargs) -> int:
    q, k, v = (torch.randn(B, H, S, D, device=device, requires_grad=True) for _ in range(3))
    counter = SavedBytes()
    with torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda t: t):
        if fused:
            with fused_attention():
                F.scaled_dot_product_attention(q, k, v, **kwargs)
        else:
            F.scaled_dot_product_attention(q, k, v, **kwargs)
    return counter.total


@pytest.mark.parametrize("kwargs", [
    {"is_causal": True},
    {"attn_mask": torch.ones(B, 1, S, S, dtype=torch.bool).tril()},
    {"attn_mask": torch.zeros(B, 1, S, S)},
], ids=["causal", "bool mask", "float mask"])
def test_sdpa_on_meta_is_counted_as_the_cpu_kernel_keeps_it(kwargs):
    meta_kwargs = {k: (v.to("meta") if isinstance(v, torch.Tensor) else v) for k, v in kwargs.items()}
    real = saved_bytes("cpu", fused=False, **kwargs)
    assert saved_bytes("meta", fused=True, **meta_kwargs) == real
    # Without it the meta device's math path keeps attention weights (S × S per head): here 1.8× more.
    assert saved_bytes("meta", fused=False, **meta_kwargs) > 1.5 * real
