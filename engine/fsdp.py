"""FSDP2: ``fully_shard`` each transformer block (``engine.blocks.find_blocks``: a Hugging Face model's own
decoder layers, the blocks every skill acts on), then the root.

Sharding per block lets FSDP2 all-gather one block's parameters while the previous block
computes, and frees them after; the root call picks up what is left (embeddings, final norm,
output head). Call this last, after tensor parallelism, activation checkpointing and
``torch.compile`` have been applied to the blocks: FSDP2 must see the final modules.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor

from engine.blocks import find_blocks
from engine.config import ConfigError, ParallelConfig
from engine.distributed import DistInfo
from engine.fsdp_quantized import prepare_4bit_layers

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The blocks sharded one by one: those ``engine.blocks.find_blocks`` finds, the copy every
    block-wise skill writes into a recipe (a Hugging Face model's own layers by
    ``_no_split_modules``, else the children of its largest ``nn.ModuleList`` or same-class
    ``nn.Sequential``), so FSDP2's units are the blocks the skills checkpointed, compiled or
    sharded. A model without blocks has none: it is sharded at the root only.
    """
    return find_blocks(model, "fsdp", warn=lambda message: None)[1]


def has_tensor_parallel_params(model: nn.Module) -> bool:
    """Whether tensor parallelism turned some parameters into DTensors on a ``tp`` mesh."""
    return any(
        isinstance(p, DTensor) and "tp" in (p.device_mesh.mesh_dim_names or ()) for p in model.parameters()
    )


def cpu_offload_policy(parallel: ParallelConfig, dist_info: DistInfo) -> OffloadPolicy:
    """``parallel.cpu_offload``: FSDP2's ``CPUOffloadPolicy`` (each rank's shards of the
    parameters, their gradients and so the optimizer's state live in host memory, copied to the
    GPU a block at a time), even on one process. It needs a CUDA device to compute on."""
    if not parallel.cpu_offload:
        return OffloadPolicy()
    if dist_info.device.type != "cuda":
        raise ConfigError(
            f"parallel.cpu_offload keeps the weights in host memory while a GPU computes; this run "
            f"computes on {dist_info.device.type}, where they are in host memory already: set "
            "parallel.cpu_offload=false"
        )
    return CPUOffloadPolicy()


def apply_fsdp(model: nn.Module, dist_info: DistInfo, parallel: ParallelConfig) -> nn.Module:
    """Shard ``model`` over the data-parallel mesh dimensions, with the configured precision:
    ``dp`` and ``sp`` together (sequence-parallel ranks hold the same weights and compute
    gradients on different tokens, which FSDP2's reduce-scatter sums).

    With a single data-parallel rank and full precision, sharding only adds copies, so the model
    is returned as it is unless ``parallel.fsdp_on_one_process`` asks for it — or unless tensor
    parallelism made some parameters DTensors: then sharding over the (size-one) ``dp``
    dimension makes them all DTensors, which fused optimizers need (they refuse a mix) — or
    unless ``parallel.cpu_offload`` asks for the host to hold them (:func:`cpu_offload_policy`).
    """
    mixed = parallel.param_dtype != "float32" or parallel.reduce_dtype != "float32"
    offload = cpu_offload_policy(parallel, dist_info)
    if (
        dist_info.fsdp_size == 1
        and not mixed
        and not parallel.fsdp_on_one_process
        and not parallel.cpu_offload
        and not has_tensor_parallel_params(model)
    ):
        return model
    # bitsandbytes' 4-bit layers (the qlora skill's): their packed bytes shard, their state stays on the layer.
    prepare_4bit_layers(model, DTYPES[parallel.param_dtype])
    mp_policy = MixedPrecisionPolicy(
        param_dtype=DTYPES[parallel.param_dtype], reduce_dtype=DTYPES[parallel.reduce_dtype]
    )
    dp_mesh = dist_info.fsdp_mesh if dist_info.fsdp_mesh is not None else dist_info.mesh["dp"]
    blocks = transformer_blocks(model)
    for index, block in enumerate(blocks):
        # The last block's parameters are needed again at once by backward: keep them gathered.
        reshard = index < len(blocks) - 1
        fully_shard(block, mesh=dp_mesh, mp_policy=mp_policy, reshard_after_forward=reshard, offload_policy=offload)
    fully_shard(model, mesh=dp_mesh, mp_policy=mp_policy, offload_policy=offload)
    return model
