"""FSDP2 over bitsandbytes' 4-bit layers (the qlora skill's ``Linear4bit``): the packed weights
shard like any frozen parameter, and each layer keeps its quantisation state to itself.

``fully_shard`` replaces every parameter by a sharded DTensor and, while a block computes, by a
plain all-gathered tensor: a ``Params4bit`` handed over as it is loses its ``quant_state`` (the
per-block scales, the code book, the shape the values had), and bitsandbytes then fails with
"quant_state is required". So before sharding, :func:`prepare_4bit_layers` moves each layer's
state onto the layer (``Linear4bit.quant_state``, where bitsandbytes itself looks for it when
the weight has none), makes its weight a plain frozen parameter of the packed bytes (shape
``(values / 2 / storage bytes, 1)``: FSDP2 shards it along dim 0) and registers a forward
pre-hook that gives the gathered weight its state back before the layer computes
(:func:`attach_quant_state`).

What shards: the packed values (half a byte each), and a 4-bit layer's bias like any parameter.
What every rank keeps whole: the scales (about 0.016 bytes a value with double quantisation,
``engine.estimate.NF4_BYTES``).

The packed storage dtype (the skill's ``quant_storage``, transformers' ``bnb_4bit_quant_storage``)
matters to FSDP2's mixed precision: a floating-point parameter is cast to ``parallel.param_dtype``
before its all-gather, which would scramble packed bytes held as another float dtype. ``uint8``
(the default) is never cast; a float storage must be ``parallel.param_dtype`` itself, else
:func:`prepare_4bit_layers` refuses before it changes anything.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.config import ConfigError


def attach_quant_state(layer: nn.Module, args: tuple) -> None:
    """Forward pre-hook of a prepared 4-bit layer: the weight it computes with (FSDP2's gathered
    tensor, the same object every step) carries the layer's ``quant_state``, as bitsandbytes'
    ``matmul_4bit`` reads it from the weight."""
    weight = layer.weight
    if getattr(weight, "quant_state", None) is not layer.quant_state:
        weight.quant_state = layer.quant_state


def four_bit_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The layers whose own ``weight`` is a bitsandbytes 4-bit parameter with its state."""
    return [
        (name, module) for name, module in model.named_modules()
        if getattr(module._parameters.get("weight"), "quant_state", None) is not None
    ]


def prepare_4bit_layers(model: nn.Module, param_dtype: torch.dtype) -> int:
    """Make ``model``'s 4-bit layers shardable by FSDP2 (see the module docstring); returns how
    many. Call it right before ``fully_shard``. A packed storage that FSDP2 would cast is refused
    with nothing changed."""
    layers = four_bit_layers(model)
    for name, layer in layers:
        storage = layer.weight.dtype
        if storage.is_floating_point and storage != param_dtype:
            raise ConfigError(
                f"{name}: its 4-bit values are packed as {storage}, which FSDP2 casts to parallel.param_dtype "
                f"({param_dtype}) before gathering them, scrambling the packed bytes: give the qlora skill "
                f"quant_storage='uint8' (never cast) or {str(param_dtype).removeprefix('torch.')!r}"
            )
    for _, layer in layers:
        weight = layer.weight
        layer.quant_state = weight.quant_state
        layer.weight = nn.Parameter(weight.detach().as_subclass(torch.Tensor), requires_grad=False)
        # bitsandbytes repacks a CPU weight in place for inference on AVX512-BF16 machines: a
        # gathered weight must keep the layout that was sharded.
        layer.support_avx512bf16_for_cpu = False
        layer.register_forward_pre_hook(attach_quant_state)
    return len(layers)
