"""Gradient clipping that works with any mix of plain tensors and DTensors.

``torch.nn.utils.clip_grad_norm_`` cannot combine gradients that live on different device
meshes (FSDP2 shards on ``dp``, tensor parallelism on ``tp``, both on a 2-D mesh) or a mix of
DTensors and plain tensors. So gradients are grouped by mesh, each group's norm is taken with
``get_total_norm`` (a DTensor norm is a partial result: ``full_tensor()`` reduces it over its
mesh), the group norms are combined, and every group is scaled with ``clip_grads_with_norm_``.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Iterable

import torch
from torch.distributed.tensor import DTensor
from torch.nn.utils import clip_grads_with_norm_, get_total_norm


def _mesh_key(grad: torch.Tensor) -> object:
    if isinstance(grad, DTensor):
        return (grad.device_mesh, grad.placements)
    return None


def clip_grad_norm(parameters: Iterable[torch.nn.Parameter], max_norm: float | None) -> torch.Tensor:
    """Clip in place to ``max_norm`` (no clipping when None) and return the total 2-norm."""
    params = [p for p in parameters if p.grad is not None]
    if not params:
        return torch.tensor(0.0)
    groups: dict[object, list[torch.nn.Parameter]] = defaultdict(list)
    for p in params:
        groups[_mesh_key(p.grad)].append(p)

    squared = None
    for group in groups.values():
        norm = get_total_norm([p.grad for p in group], norm_type=2.0, foreach=True)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        norm = norm.float() ** 2
        squared = norm if squared is None else squared + norm.to(squared.device)
    total = squared.sqrt()

    if max_norm is not None and math.isfinite(max_norm):
        for group in groups.values():
            clip_grads_with_norm_(group, max_norm, total.to(group[0].grad.device), foreach=True)
    return total
