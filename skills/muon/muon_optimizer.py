"""The Muon optimizer the muon skill writes into a recipe (skills/muon/codemod.py copies these
definitions with libcst; imports and this docstring stay here). A real module, so that ruff
lints it and tests/skills/test_muon_module.py runs it on its own.
"""

import math

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from engine.blocks import find_blocks  # written by ensure_find_blocks


NEWTON_SCHULZ_COEFFICIENTS = (3.4445, -4.7750, 2.0315)


def newton_schulz_torch(matrix: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """Muon's orthogonalization: the quintic Newton-Schulz iteration of torch.optim.Muon (same
    coefficients, bfloat16, the same operations), which maps a matrix ``U S Vᵀ`` to about
    ``U S' Vᵀ`` with ``S'`` near 1: the nearest semi-orthogonal matrix, every direction scaled
    alike. (Written by the muon skill.)
    """
    a, b, c = NEWTON_SCHULZ_COEFFICIENTS
    x = matrix.bfloat16()
    transposed = x.size(0) > x.size(1)
    if transposed:
        x = x.T
    x = x / x.norm().clamp(min=1e-7)  # spectral norm at most 1
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if transposed else x


def newton_schulz(matrix: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """Orthogonalize ``matrix`` (Muon's Newton-Schulz iteration). (Written by the muon skill.)"""
    return newton_schulz_torch(matrix, steps)


def orthogonalize(update: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """Muon's orthogonalized update. A DTensor (an FSDP2 or tensor-parallel shard) is gathered
    whole first and the result is sharded like it again: Newton-Schulz needs the whole matrix,
    and each process then computes what one process would. (Written by the muon skill.)"""
    if isinstance(update, DTensor):
        whole = newton_schulz(update.full_tensor(), steps)
        return distribute_tensor(whole, update.device_mesh, update.placements, src_data_rank=None)
    return newton_schulz(update, steps)


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """What this process holds of a tensor: a DTensor's local shard (in-place updates of it reach
    the DTensor), any other tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class MuonWithAdamW(torch.optim.Optimizer):
    """Muon for the 2-D weight matrices of the transformer blocks, AdamW for every other
    parameter (embeddings, output head, norms, biases), in one optimizer: one state dict for
    checkpoints and one learning rate for schedules.

    Muon (Jordan et al., 2024) keeps a Nesterov momentum of each matrix's gradient and steps
    along its orthogonalization (``newton_schulz``), so that every direction of the update moves
    by the same amount. The step is scaled by ``0.2 * sqrt(max(rows, cols))``, which gives it the
    RMS of an AdamW step (Liu et al., 2025, "Muon is Scalable for LLM Training"), so both kinds
    of parameters share ``lr`` and ``weight_decay`` (decoupled), and schedules that set
    ``group["lr"]`` drive both. The Muon step is torch.optim.Muon's with
    ``adjust_lr_fn="match_rms_adamw"``; the AdamW step is torch.optim.AdamW's. Under FSDP2 or
    tensor parallelism each matrix is gathered before it is orthogonalized (``orthogonalize``).
    Only trainable parameters are optimized. (Written by the muon skill.)
    """

    def __init__(
        self,
        model: torch.nn.Module,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = 5,
    ):
        where, blocks = find_blocks(model, "muon")
        matrices = {id(p) for block in blocks for p in block.parameters() if p.ndim == 2}
        if not matrices:
            raise ValueError(f"muon: the blocks of {where} hold no 2-D weight matrix; keep AdamW")
        trainable = [p for p in model.parameters() if p.requires_grad]
        groups = [
            {"params": [p for p in trainable if id(p) in matrices], "algorithm": "muon"},
            {"params": [p for p in trainable if id(p) not in matrices], "algorithm": "adamw"},
        ]
        defaults = dict(
            lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
            ns_steps=ns_steps,
        )
        super().__init__([group for group in groups if group["params"]], defaults)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group["algorithm"] == "muon":
                self._muon_step(group)
            else:
                self._adamw_step(group)
        return loss

    def _muon_step(self, group: dict) -> None:
        lr, momentum = group["lr"], group["momentum"]
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if not state:
                state["momentum_buffer"] = torch.zeros_like(p)
            buffer = state["momentum_buffer"]
            buffer.lerp_(p.grad, 1 - momentum)
            update = p.grad.lerp(buffer, momentum) if group["nesterov"] else buffer
            update = orthogonalize(update, group["ns_steps"])
            rms_like_adamw = 0.2 * math.sqrt(max(p.shape))
            p.mul_(1 - lr * group["weight_decay"])
            p.add_(update, alpha=-lr * rms_like_adamw)

    def _adamw_step(self, group: dict) -> None:
        lr, (beta1, beta2), eps = group["lr"], group["betas"], group["eps"]
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if not state:
                state["step"] = torch.tensor(0.0)
                state["exp_avg"] = torch.zeros_like(p)
                state["exp_avg_sq"] = torch.zeros_like(p)
            state["step"] += 1
            step = float(state["step"])
            # Element-wise: each process updates its own shard, without DTensor dispatch.
            param, grad = local_part(p), local_part(p.grad)
            exp_avg, exp_avg_sq = local_part(state["exp_avg"]), local_part(state["exp_avg_sq"])
            param.mul_(1 - lr * group["weight_decay"])
            exp_avg.lerp_(grad, 1 - beta1)
            exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            bias_correction1, bias_correction2 = 1 - beta1**step, 1 - beta2**step
            denominator = (exp_avg_sq.sqrt() / bias_correction2**0.5).add_(eps)
            param.addcdiv_(exp_avg, denominator, value=-lr / bias_correction1)
