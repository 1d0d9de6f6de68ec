"""muon: the Muon optimizer for the 2-D weight matrices of the transformer blocks, AdamW for the
rest (embeddings, output head, norms, biases), in one optimizer.

Anchors: the ``torch.optim.AdamW`` (or ``Adam``) constructor, whose parameters argument names
the model (``model.parameters()``, filtered or not); it becomes ``MuonWithAdamW(model, ...)``
with the same learning rate, betas, eps and weight decay. An engine recipe that keeps the
engine's default optimizer gets a ``prepare_optimizer`` that returns one.
"""

from __future__ import annotations

import libcst as cst
from pydantic import Field

from skills.codemod_kit import pointing
from skills.codemod_kit import (
    AlreadyApplied,
    Edits,
    Recipe,
    SkillParams,
    anchors,
    ensure_find_blocks,
    insert_definitions,
    reach,
    templates,
)
from skills.codemod_kit.anchors import keyword, positional
from skills.codemod_kit.layout import fit_call
from skills.errors import SkillRefused

SKILL = "muon"
ADAMW = ("torch.optim.AdamW", "torch.optim.adamw.AdamW")
ADAM = ("torch.optim.Adam", "torch.optim.adam.Adam")
# AdamW's arguments in order after ``params``; those MuonWithAdamW takes over.
ADAMW_POSITIONAL = ("lr", "betas", "eps", "weight_decay")
DROPPED = ("foreach", "fused")  # performance switches of torch's AdamW; MuonWithAdamW has its own loop


class Params(SkillParams):
    momentum: float = Field(0.95, ge=0, lt=1, description="Muon's momentum coefficient.")
    nesterov: bool = Field(True, description="Nesterov momentum for the Muon matrices.")
    ns_steps: int = Field(
        5, ge=1, le=20, description="Newton-Schulz iterations that orthogonalize each update (5 is Muon's choice)."
    )
    triton: bool = Field(
        False,
        description="Also write a Triton kernel for the Newton-Schulz iteration (symmetric matmuls: "
        "half the work of X·Xᵀ), used on CUDA GPUs with triton installed for each matrix shape "
        "where it measures faster than torch's matmuls (torch's elsewhere). Off by default: about "
        "110 more lines in the recipe, for a speed-up not yet measured on a GPU (bench/gpu.py does).",
    )
    target: str | None = pointing.target_field()


NEWTON_SCHULZ = '''
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
'''

NEWTON_SCHULZ_CHOICE = '''
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
'''

NEWTON_SCHULZ_TORCH_ONLY = '''
def newton_schulz(matrix: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """Orthogonalize ``matrix`` (Muon's Newton-Schulz iteration). (Written by the muon skill.)"""
    return newton_schulz_torch(matrix, steps)
'''

TRITON_KERNEL = '''
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
'''

OPTIMIZER = '''
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
'''

METHOD = '''
class _:
    def prepare_optimizer(self, model: torch.nn.Module) -> torch.optim.Optimizer:
        """Muon for the hidden matrices, AdamW for the rest (the muon skill)."""
        optim = self.config.optim
        return MuonWithAdamW(
            model,
            lr=optim.lr,
            betas=(optim.beta1, optim.beta2),
            eps=optim.eps,
            weight_decay=optim.weight_decay,
            momentum={momentum},
            nesterov={nesterov},
            ns_steps={ns_steps},
        )
'''

ALREADY = ("MuonWithAdamW", "torch.optim.Muon", "torch.optim._muon.Muon", ".MuonWithAuxAdam", ".SingleDeviceMuonWithAuxAdam")


def _existing(recipe: Recipe) -> cst.CSTNode | None:
    calls = recipe.calls_to(*ALREADY)
    if calls:
        return calls[0]
    for cls in recipe.top_level_classes().values():
        if "muon" in cls.name.value.lower():
            return cls
    return None


def apply(recipe: Recipe, params: Params) -> Edits | AlreadyApplied:
    existing = _existing(recipe)
    if existing is not None:
        return AlreadyApplied(f"Muon at {recipe.where(existing)}")
    model = pointing.find_model(recipe, SKILL, params.target)
    found = reach.shape(recipe, model)
    reach.require_blocks(
        recipe, SKILL, found,
        "Muon steps the 2-D matrices of repeated blocks; keep the model's AdamW",
    )
    edits = Edits(recipe)
    edits.acts_on = f"Muon for the 2-D weight matrices of {reach.describe_blocks(found)}; AdamW for the rest"
    adam = [c for c in anchors.optimizer_constructors(recipe) if recipe.call_name(c) in ADAMW + ADAM]
    engine = anchors.engine_class(recipe)
    if not adam:
        others = anchors.optimizer_constructors(recipe)
        if engine is None or others or "prepare_optimizer" in recipe.methods(engine):
            found = f"found {recipe.call_name(others[0])} at {recipe.where(others[0])}" if others else "found none"
            raise SkillRefused(
                f"{SKILL}: looked for the torch.optim.AdamW (or Adam) constructor that Muon replaces, or an "
                f"Engine subclass that keeps the engine's default AdamW, in {recipe.name}; {found}"
            )
        _add_prepare_optimizer(recipe, edits, engine, params)
        anchor: cst.CSTNode = engine
    else:
        if len(adam) > 1:  # the one that gets the model's parameters
            name = model.outer or model.target_code
            mine = [c for c in adam if any(
                recipe.code(a.value) == name or f"{name}.parameters(" in recipe.code(a.value)
                or f"{name}.named_parameters(" in recipe.code(a.value) for a in c.args
            )]
            adam = mine if len(mine) == 1 else adam
        if len(adam) > 1:
            places = ", ".join(f"`{recipe.short(c, 50)}` at {recipe.where(c)}" for c in adam[: pointing.LISTED])
            raise SkillRefused(
                f"{SKILL}: found several AdamW/Adam optimizers ({places}) and cannot tell which one trains "
                f"`{model.outer or model.target_code}`; name the model whose optimizer to replace with `target`, "
                "or apply the pattern by hand (SKILL.md: Doing it by hand)"
            )
        _replace_constructor(recipe, edits, adam[0], params)
        anchor = adam[0]
    statement = recipe.top_level_statement(anchor)
    ensure_find_blocks(recipe, edits, statement)
    code = NEWTON_SCHULZ + (TRITON_KERNEL + NEWTON_SCHULZ_CHOICE if params.triton else NEWTON_SCHULZ_TORCH_ONLY)
    insert_definitions(recipe, edits, code + OPTIMIZER, statement)
    edits.add_import("math")
    edits.add_import("torch")
    edits.add_import("torch.distributed.tensor", "DTensor")
    edits.add_import("torch.distributed.tensor", "distribute_tensor")
    if params.triton:
        edits.add_import("typing", "Callable")
    return edits


def _muon_arguments(params: Params) -> list[tuple[str, str]]:
    return [("momentum", repr(params.momentum)), ("nesterov", repr(params.nesterov)), ("ns_steps", str(params.ns_steps))]


def _replace_constructor(recipe: Recipe, edits: Edits, call: cst.Call, params: Params) -> None:
    first = positional(call, 0) or keyword(call, "params")
    model = _model_of(first.value) if first is not None else None
    if model is None:
        given = f"`{recipe.short(first.value)}`" if first is not None else "no parameters"
        raise SkillRefused(
            f"{SKILL}: the optimizer at {recipe.where(call)} gets {given}; Muon needs the model itself to tell "
            "the blocks' matrices from embeddings, head and norms. Pass `model.parameters()` and apply again"
        )
    is_adam = recipe.call_name(call) in ADAM
    arguments: list[cst.Arg] = [first.with_changes(keyword=None, equal=cst.MaybeSentinel.DEFAULT, value=model)]
    positionals = [a for a in call.args if a.keyword is None and not a.star][1:]
    if len(positionals) > len(ADAMW_POSITIONAL) or any(a.star for a in call.args):
        raise SkillRefused(f"{SKILL}: the optimizer at {recipe.where(call)} has arguments the codemod cannot map")
    for name, arg in zip(ADAMW_POSITIONAL, positionals):
        arguments.append(arg.with_changes(keyword=cst.Name(name), equal=cst.AssignEqual(
            whitespace_before=cst.SimpleWhitespace(""), whitespace_after=cst.SimpleWhitespace(""))))
    for arg in call.args:
        if arg.keyword is None or arg.keyword.value == "params":
            continue
        name = arg.keyword.value
        if name in DROPPED:
            edits.notes.append(f"dropped `{name}=` (MuonWithAdamW has its own update loop)")
            continue
        if name not in ADAMW_POSITIONAL:
            raise SkillRefused(
                f"{SKILL}: the optimizer at {recipe.where(call)} sets `{name}=`, which MuonWithAdamW does not take; "
                "remove it and apply again"
            )
        if is_adam and name == "weight_decay" and not _is_zero(arg.value):
            raise SkillRefused(
                f"{SKILL}: the optimizer at {recipe.where(call)} is torch.optim.Adam with weight_decay, an L2 penalty "
                "that MuonWithAdamW (decoupled decay) does not reproduce; switch to AdamW first"
            )
        arguments.append(arg)
    extra = _muon_arguments(params)
    if is_adam and keyword(call, "weight_decay") is None:
        extra.insert(0, ("weight_decay", "0.0"))  # Adam's default; MuonWithAdamW's is AdamW's (0.01)
    for name, value in extra:
        arguments.append(cst.Arg(
            keyword=cst.Name(name),
            value=templates.expression(recipe.module, value),
            equal=cst.AssignEqual(whitespace_before=cst.SimpleWhitespace(""), whitespace_after=cst.SimpleWhitespace("")),
        ))
    new_call = _with_arguments(call, arguments)
    edits.replace(call, lambda updated: fit_call(recipe, call, new_call))


def _with_arguments(call: cst.Call, arguments: list[cst.Arg]) -> cst.Call:
    """``call`` with ``func`` MuonWithAdamW and ``arguments``, keeping the call's comma layout."""
    old = list(call.args)
    separator = next((a.comma for a in old[:-1] if isinstance(a.comma, cst.Comma)), cst.Comma(
        whitespace_after=cst.SimpleWhitespace(" ")))
    last_comma = old[-1].comma if old else cst.MaybeSentinel.DEFAULT
    laid_out = []
    for index, arg in enumerate(arguments):
        comma = last_comma if index == len(arguments) - 1 else separator
        laid_out.append(arg.with_changes(comma=comma))
    return call.with_changes(func=cst.Name("MuonWithAdamW"), args=laid_out)


def _is_zero(expression: cst.BaseExpression) -> bool:
    return isinstance(expression, (cst.Integer, cst.Float)) and float(expression.value) == 0.0


def _model_of(expression: cst.BaseExpression) -> cst.BaseExpression | None:
    """The model in ``model.parameters()``, ``[p for p in model.parameters() if ...]`` or
    ``filter(..., model.parameters())``."""
    found: list[cst.BaseExpression] = []

    class Finder(cst.CSTVisitor):
        def visit_Call(self, node: cst.Call) -> None:
            if (
                isinstance(node.func, cst.Attribute)
                and node.func.attr.value == "parameters"
                and not node.args
                and isinstance(node.func.value, (cst.Name, cst.Attribute))
            ):
                found.append(node.func.value)

    expression.visit(Finder())
    return found[0] if len(found) == 1 else None


def _add_prepare_optimizer(recipe: Recipe, edits: Edits, engine: cst.ClassDef, params: Params) -> None:
    code = METHOD.format(momentum=params.momentum, nesterov=params.nesterov, ns_steps=params.ns_steps)
    method = templates.statements(recipe.module, code)[0].body.body[0]  # type: ignore[attr-defined]
    method = method.with_changes(leading_lines=[cst.EmptyLine(indent=False)])
    edits.replace(engine.body, lambda updated: updated.with_changes(body=[*updated.body, method]))
