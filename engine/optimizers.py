"""The optimizers a recipe chooses by ``optim.name`` beside torch's own AdamW.

``adamw_8bit``: bitsandbytes' ``AdamW8bit`` (Dettmers et al., 2022), whose two states are kept in
8 bits with a scale per block of 256 values: about 2 bytes a trainable value instead of AdamW's 8.
It runs on CPU and GPU. :func:`optimizer_state_bytes` is what ``estimate_run`` counts for each.
"""

from __future__ import annotations

import torch

from engine.config import ConfigError, OptimConfig

ADAMW_8BIT = "adamw_8bit"
# bitsandbytes' blockwise 8-bit states: 1 byte a value and a float32 scale per 256 values.
EIGHT_BIT_STATE_BYTES = 1 + 4 / 256
ADAMW_STATES = 2
FP32 = 4


def adamw_8bit(params, optim: OptimConfig) -> torch.optim.Optimizer:
    """AdamW with 8-bit states, with the run's learning rate, betas, eps and weight decay."""
    try:
        from bitsandbytes.optim import AdamW8bit
    except ImportError:
        raise ConfigError(
            "optim.name=adamw_8bit needs the bitsandbytes package (pip install bitsandbytes); "
            "or set optim.name=adamw"
        ) from None
    return AdamW8bit(params, lr=optim.lr, betas=(optim.beta1, optim.beta2), eps=optim.eps,
                     weight_decay=optim.weight_decay)


def is_8bit(optimizer: torch.optim.Optimizer) -> bool:
    """Whether the optimizer keeps its states in 8 bits (a bitsandbytes 8-bit optimizer)."""
    return getattr(getattr(optimizer, "args", None), "optim_bits", 32) == 8


def optimizer_state_bytes(eight_bit: bool) -> float:
    """Bytes of AdamW state per trainable value: two float32 states, or two 8-bit ones."""
    return ADAMW_STATES * (EIGHT_BIT_STATE_BYTES if eight_bit else FP32)


def check_optimizer_choice(optim: OptimConfig, optimizer: torch.optim.Optimizer) -> None:
    """``optim.name=adamw_8bit`` must have given an 8-bit optimizer: a recipe whose
    ``prepare_optimizer`` builds another one (its own, Muon) would ignore the setting."""
    if optim.name == ADAMW_8BIT and not is_8bit(optimizer):
        raise ConfigError(
            f"optim.name=adamw_8bit but prepare_optimizer() built {type(optimizer).__name__}; the recipe "
            "chooses its optimizer in prepare_optimizer(): call engine.optimizers.adamw_8bit there, or set "
            "optim.name=adamw"
        )
