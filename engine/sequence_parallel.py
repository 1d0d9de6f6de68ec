"""Sequence parallelism, Ulysses style (DeepSpeed-Ulysses, as LMMs-Engine and verl use it).

The ``sp`` ranks of one group read the same sequences and each keeps one contiguous part of
every sequence (``shard_sequences``): embeddings, norms, MLPs, the output head and the loss
see ``s / sp`` positions. Attention needs the whole sequence, so around it one all-to-all
trades the split: ``[b, h, s/sp, d]`` (all heads, part of the sequence) becomes
``[b, h/sp, s, d]`` (part of the heads, the whole sequence); attention runs on that, and a
second all-to-all trades back. The backward of an all-to-all is the reverse all-to-all.

What a rank holds at its peak falls with ``sp``: every activation but attention's inner one
is ``1/sp`` as long, and attention holds ``1/sp`` of the heads. The price is four all-to-alls
per layer (q, k, v and the output) and an all-gather of the position ids per forward.

The attention is torch's ``scaled_dot_product_attention``, plugged into a ``transformers``
model through its ``AttentionInterface`` under the name ``"sequence_parallel"``: causal, and,
when the position ids restart inside a row (sequence packing), causal within each document,
from the position ids of the *whole* row (gathered over the group). A padding
``attention_mask`` is refused: right padding after every real token needs none.

Gradients: the sp ranks compute the weights' gradients on different tokens, so FSDP2 shards
and reduces over ``dp`` and ``sp`` together (``engine.distributed``), and the engine's loss
normalisation counts supervised tokens over the same ranks.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from engine.config import ConfigError

ATTENTION_NAME = "sequence_parallel"
STATE_ATTRIBUTE = "_sequence_parallel"


# ---------------------------------------------------------------------------------------------
# The all-to-all and its backward
# ---------------------------------------------------------------------------------------------


def _exchange(x: torch.Tensor, group: dist.ProcessGroup, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """Cut ``x`` into ``size`` pieces along ``scatter_dim``, send piece ``j`` to rank ``j``,
    and join the pieces received (rank ``i``'s at slot ``i``) along ``gather_dim``."""
    size = dist.get_world_size(group)
    if x.shape[scatter_dim] % size:
        raise ValueError(f"all-to-all: dimension {scatter_dim} of {tuple(x.shape)} does not divide by {size}")
    sent = torch.stack(x.chunk(size, dim=scatter_dim)).contiguous()
    received = torch.empty_like(sent)
    dist.all_to_all_single(received, sent, group=group)
    return torch.cat(received.unbind(0), dim=gather_dim)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup, scatter_dim: int, gather_dim: int) -> torch.Tensor:
        ctx.group, ctx.scatter_dim, ctx.gather_dim = group, scatter_dim, gather_dim
        return _exchange(x, group, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        # The piece that came from rank i along gather_dim goes back to rank i, into the slot
        # it left along scatter_dim: the reverse all-to-all.
        return _exchange(grad, ctx.group, ctx.gather_dim, ctx.scatter_dim), None, None, None


def all_to_all(x: torch.Tensor, group: dist.ProcessGroup, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """Autograd-aware all-to-all over ``group``: ``scatter_dim`` shrinks by the group's size,
    ``gather_dim`` grows by it."""
    return _AllToAll.apply(x, group, scatter_dim, gather_dim)


def gather_sequence(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """The whole rows of a ``[b, s/sp]`` tensor that the group holds in parts (no gradient)."""
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=1)


# ---------------------------------------------------------------------------------------------
# The attention
# ---------------------------------------------------------------------------------------------


class SequenceParallelState:
    """What the attention of one model needs: the group, and the document mask of the current
    forward (built once from the gathered position ids, shared by every layer)."""

    def __init__(self, group: dist.ProcessGroup, size: int):
        self.group, self.size = group, size
        self._cached: tuple[torch.Tensor, torch.Tensor | None] | None = None

    def document_mask(self, position_ids: torch.Tensor | None) -> torch.Tensor | None:
        """None for plain causal attention (one sequence per row); else a boolean
        ``[b, 1, s, s]`` mask: causal, and only within the document (a document starts where
        the position ids of the whole row do not go up by one)."""
        if position_ids is None:
            return None
        if self._cached is not None and self._cached[0] is position_ids:
            return self._cached[1]
        positions = gather_sequence(position_ids, self.group)
        starts = torch.diff(positions, prepend=positions[:, :1] - 1, dim=1) != 1
        documents = starts.cumsum(dim=1)
        mask = None
        if bool((documents[:, -1] != 0).any()):
            length = positions.shape[1]
            causal = torch.ones(length, length, dtype=torch.bool, device=positions.device).tril()
            mask = ((documents[:, :, None] == documents[:, None, :]) & causal)[:, None]
        self._cached = (position_ids, mask)
        return mask


def sequence_parallel_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The ``AttentionInterface`` function: ``[b, h, s/sp, d]`` in, ``[b, s/sp, h, d]`` out."""
    state: SequenceParallelState = getattr(module, STATE_ATTRIBUTE)
    if attention_mask is not None:
        raise ValueError("sequence parallel: attention masks are not supported; pass position_ids instead")
    heads, kv_heads = query.shape[1], key.shape[1]
    if kv_heads % state.size:  # fewer key/value heads than ranks: each rank gets whole groups
        key = key.repeat_interleave(heads // kv_heads, dim=1)
        value = value.repeat_interleave(heads // kv_heads, dim=1)
    query, key, value = (all_to_all(t, state.group, scatter_dim=1, gather_dim=2) for t in (query, key, value))
    mask = state.document_mask(kwargs.get("position_ids"))
    output = F.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=mask,
        dropout_p=dropout,
        is_causal=mask is None,
        scale=scaling,
        enable_gqa=key.shape[1] != query.shape[1],
    )
    # [b, h/sp, s, d] → [b, s, h/sp, d] → this rank's part of the sequence, all heads.
    return all_to_all(output.transpose(1, 2), state.group, scatter_dim=1, gather_dim=2), None


def check_heads(num_heads: int | None, sp: int, where: str = "the model") -> None:
    if num_heads is not None and num_heads % sp:
        raise ConfigError(
            f"sequence parallel: the {num_heads} attention heads of {where} do not divide by "
            f"parallel.sp={sp} (each rank attends with heads / sp of them); choose a parallel.sp "
            f"that divides {num_heads}"
        )


def apply_sequence_parallel(model: nn.Module, sp_mesh: Any) -> int:
    """Make the attention of a ``transformers`` decoder sequence parallel over ``sp_mesh``
    (before ``fully_shard``). Returns the number of attention modules; 0 when the mesh has
    one rank (nothing changes)."""
    size = sp_mesh.size()
    if size == 1:
        return 0
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "_attn_implementation"):
        raise ConfigError(
            f"sequence parallel: {type(model).__name__} is not a transformers model; its attention "
            "cannot be swapped (see the sequence-parallel skill's SKILL.md: Doing it by hand)"
        )
    check_heads(getattr(config, "num_attention_heads", None), size, type(model).__name__)
    attention = [m for m in model.modules() if hasattr(m, "head_dim") and hasattr(m, "layer_idx")]
    if not attention:
        raise ConfigError(f"sequence parallel: found no attention modules in {type(model).__name__}")
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, sequence_parallel_attention)
    state = SequenceParallelState(sp_mesh.get_group(), size)
    for module in attention:
        setattr(module, STATE_ATTRIBUTE, state)
    config._attn_implementation = ATTENTION_NAME
    model.register_forward_pre_hook(_global_positions(sp_mesh), with_kwargs=True)
    if dist.get_rank() == 0:
        print(f"sequence-parallel: {len(attention)} attention modules of {type(model).__name__} over sp={size}", flush=True)
    return len(attention)


def _global_positions(sp_mesh: Any):
    """A forward pre-hook: refuse an attention mask, and give a forward without position ids
    the global ones of this rank's part (RoPE must see where the part sits in the sequence)."""

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if kwargs.get("attention_mask") is not None:
            raise ValueError(
                "sequence parallel: the forward passes attention_mask, which cannot be split with "
                "the sequence; pass position_ids (padding after the real tokens needs no mask)"
            )
        if kwargs.get("position_ids") is None:
            ids = kwargs.get("input_ids", args[0] if args else None)
            if ids is None:
                raise ValueError("sequence parallel: pass position_ids (or input_ids) to the forward")
            length = ids.shape[1]
            start = sp_mesh.get_local_rank() * length
            kwargs["position_ids"] = torch.arange(start, start + length, device=ids.device).unsqueeze(0)
            return args, kwargs
        return None

    return hook


def has_sequence_parallel_attention(model: nn.Module) -> bool:
    return any(hasattr(m, STATE_ATTRIBUTE) for m in model.modules())


# ---------------------------------------------------------------------------------------------
# The batch
# ---------------------------------------------------------------------------------------------


def shard_sequences(batch: dict[str, torch.Tensor], sp_mesh: Any) -> dict[str, torch.Tensor]:
    """This rank's contiguous part of every sequence: tensors of two or more dimensions are cut
    along dimension 1 (input ids, labels, position ids — which keep their global values, so
    RoPE and the document mask see the whole row's positions); others pass as they are."""
    size = sp_mesh.size()
    if size == 1:
        return batch
    rank = sp_mesh.get_local_rank()
    parts = {}
    for key, tensor in batch.items():
        if tensor.dim() < 2:
            parts[key] = tensor
            continue
        if tensor.shape[1] % size:
            raise ConfigError(
                f"sequence parallel: batch['{key}'] has {tensor.shape[1]} positions, which do not "
                f"divide by parallel.sp={size}; set data.seq_len to a multiple of {size}"
            )
        length = tensor.shape[1] // size
        parts[key] = tensor[:, rank * length : (rank + 1) * length].contiguous()
    return parts


def check_sequence_parallel_config(config: Any, world_size: int) -> None:
    """The launch check of ``parallel.sp > 1`` (``Engine.validate_config``)."""
    tp, sp = config.parallel.tp, config.parallel.sp
    if tp > 1:
        raise ConfigError(
            f"parallel.sp={sp} with parallel.tp={tp}: sequence and tensor parallelism together are "
            "not supported; set one of them to 1"
        )
    if world_size % sp:
        raise ConfigError(f"parallel.sp={sp} does not divide the number of processes ({world_size})")
    if config.data.seq_len % sp:
        raise ConfigError(f"data.seq_len={config.data.seq_len} must be a multiple of parallel.sp={sp}")
    model = getattr(config, "model", None)  # a recipe that configures its heads (the template)
    if model is not None and not getattr(model, "pretrained_path", None):
        check_heads(getattr(model, "num_heads", None), sp, "model.num_heads")
