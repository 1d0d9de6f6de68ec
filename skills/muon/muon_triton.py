"""The Triton Newton-Schulz the muon skill writes with ``triton: true``: a symmetric-matmul kernel,
and ``newton_schulz`` choosing per matrix shape between it and torch's matmuls (it replaces
muon_optimizer.py's torch-only ``newton_schulz`` in the recipe). Copied by skills/muon/codemod.py.
"""

from typing import Callable

import torch

from skills.muon.muon_optimizer import NEWTON_SCHULZ_COEFFICIENTS, newton_schulz_torch


try:  # the Triton kernel is optional: without triton (CPUs), torch's matmuls are used
    import triton
    import triton.language as tl
except ImportError:
    triton = None

FASTER_NEWTON_SCHULZ: dict[tuple, Callable[[torch.Tensor, int], torch.Tensor]] = {}

if triton is not None:

    @triton.autotune(
        configs=[
            triton.Config({"BLOCK": 128, "BLOCK_K": 64}, num_warps=8, num_stages=3),
            triton.Config({"BLOCK": 128, "BLOCK_K": 32}, num_warps=4, num_stages=4),
            triton.Config({"BLOCK": 64, "BLOCK_K": 64}, num_warps=4, num_stages=4),
            triton.Config({"BLOCK": 64, "BLOCK_K": 32}, num_warps=4, num_stages=3),
        ],
        key=["M", "K"],
    )
    @triton.jit
    def symmetric_matmul_kernel(
        x_ptr, add_ptr, out_ptr, M, K, stride_xm, stride_xk, stride_om, stride_on, alpha, beta,
        HAS_ADD: tl.constexpr, BLOCK: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        """out = alpha * x @ xᵀ (+ beta * add): the result is symmetric, so only the tiles on and
        above the diagonal are computed, and each is stored twice (as itself and transposed)."""
        row_block = tl.program_id(0)
        col_block = tl.program_id(1)
        if row_block > col_block:
            return
        rows = row_block * BLOCK + tl.arange(0, BLOCK)
        cols = col_block * BLOCK + tl.arange(0, BLOCK)
        inner = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK, BLOCK), dtype=tl.float32)
        for k in range(0, tl.cdiv(K, BLOCK_K)):
            ks = k * BLOCK_K + inner
            left = tl.load(
                x_ptr + rows[:, None] * stride_xm + ks[None, :] * stride_xk,
                mask=(rows[:, None] < M) & (ks[None, :] < K), other=0.0,
            )
            right = tl.load(
                x_ptr + cols[:, None] * stride_xm + ks[None, :] * stride_xk,
                mask=(cols[:, None] < M) & (ks[None, :] < K), other=0.0,
            )
            acc = tl.dot(left, tl.trans(right), acc)
        acc = acc * alpha
        inside = (rows[:, None] < M) & (cols[None, :] < M)
        if HAS_ADD:
            added = tl.load(add_ptr + rows[:, None] * stride_om + cols[None, :] * stride_on, mask=inside, other=0.0)
            acc += beta * added.to(tl.float32)
        tile = acc.to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :] * stride_on, tile, mask=inside)
        if row_block < col_block:
            mirrored = out_ptr + cols[:, None] * stride_om + rows[None, :] * stride_on
            tl.store(mirrored, tl.trans(tile), mask=tl.trans(inside))


def symmetric_matmul(
    x: torch.Tensor, out: torch.Tensor, alpha: float = 1.0, beta: float = 0.0, add: torch.Tensor | None = None
) -> torch.Tensor:
    """``out = alpha * x @ x.T + beta * add`` with the Triton kernel (``add`` must be symmetric,
    of ``out``'s shape and strides). (Written by the muon skill.)"""
    rows, inner = x.shape
    grid = lambda meta: (triton.cdiv(rows, meta["BLOCK"]), triton.cdiv(rows, meta["BLOCK"]))  # noqa: E731
    symmetric_matmul_kernel[grid](
        x, add if add is not None else out, out, rows, inner, x.stride(0), x.stride(1),
        out.stride(0), out.stride(1), alpha, beta, HAS_ADD=add is not None,
    )
    return out


def newton_schulz_triton(matrix: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """``newton_schulz_torch`` with the two symmetric products (``x @ x.T`` and ``gram @ gram``)
    in the Triton kernel, which computes half of each. (Written by the muon skill.)"""
    a, b, c = NEWTON_SCHULZ_COEFFICIENTS
    x = matrix.bfloat16()
    transposed = x.size(0) > x.size(1)
    if transposed:
        x = x.T
    x = (x / x.norm().clamp(min=1e-7)).contiguous()
    gram = x.new_empty((x.size(0), x.size(0)))
    polynomial = torch.empty_like(gram)
    for _ in range(steps):
        symmetric_matmul(x, gram)
        symmetric_matmul(gram, polynomial, alpha=c, beta=b, add=gram)
        x = torch.addmm(x, polynomial, x, beta=a)
    return x.T if transposed else x


def faster_newton_schulz(matrix: torch.Tensor, steps: int) -> Callable[[torch.Tensor, int], torch.Tensor]:
    """Time torch's and the Triton Newton-Schulz on this matrix (after a warm-up that also
    autotunes the kernel) and return the faster. The timings are summed over the processes, so
    that every rank makes the same choice and computes the same update. (Written by the muon skill.)
    """
    candidates = (newton_schulz_torch, newton_schulz_triton)
    timings = []
    for candidate in candidates:
        try:
            candidate(matrix, steps)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(3):
                candidate(matrix, steps)
            end.record()
            torch.cuda.synchronize(matrix.device)
            timings.append(start.elapsed_time(end))
        except Exception as error:  # a kernel that does not compile here is not a reason to stop
            print(f"warning: muon: {candidate.__name__} failed ({error}); using torch's matmuls", flush=True)
            timings.append(float("inf"))
    total = torch.tensor(timings, device=matrix.device)
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(total)
    return candidates[int(torch.argmin(total))]


def newton_schulz(matrix: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """Orthogonalize ``matrix`` with the faster Newton-Schulz implementation for its shape on this
    device: the Triton kernel or torch's matmuls (measured once per shape on CUDA GPUs); torch's
    elsewhere. (Written by the muon skill.)
    """
    if matrix.is_cuda and triton is not None:
        key = (tuple(matrix.shape), matrix.device, steps)
        if key not in FASTER_NEWTON_SCHULZ:
            FASTER_NEWTON_SCHULZ[key] = faster_newton_schulz(matrix, steps)
        return FASTER_NEWTON_SCHULZ[key](matrix, steps)
    return newton_schulz_torch(matrix, steps)
