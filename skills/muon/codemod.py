"""muon: the Muon optimizer for the 2-D weight matrices of the transformer blocks, AdamW for the
rest (embeddings, output head, norms, biases), in one optimizer.

Anchors: the ``torch.optim.AdamW`` (or ``Adam``) constructor, whose parameters argument names
the model (``model.parameters()``, filtered or not); it becomes ``MuonWithAdamW(model, ...)``
with the same learning rate, betas, eps and weight decay. An engine recipe that keeps the
engine's default optimizer gets a ``prepare_optimizer`` that returns one.
"""

from __future__ import annotations

from pathlib import Path

import libcst as cst
from pydantic import Field

from skills.codemod_kit import copied, pointing
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


# The optimizer and the Triton kernel are real modules beside this file, copied into the recipe.
OPTIMIZER_MODULE = Path(__file__).with_name("muon_optimizer.py")
TRITON_MODULE = Path(__file__).with_name("muon_triton.py")

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
    if params.triton:  # the kernel's newton_schulz, which chooses per shape, for the torch-only one
        code = (copied.definitions(OPTIMIZER_MODULE, ["NEWTON_SCHULZ_COEFFICIENTS", "newton_schulz_torch"])
                + copied.definitions(TRITON_MODULE)
                + copied.definitions(OPTIMIZER_MODULE, ["orthogonalize", "local_part", "MuonWithAdamW"]))
    else:
        code = copied.definitions(OPTIMIZER_MODULE)
    insert_definitions(recipe, edits, code, statement)
    for module in (OPTIMIZER_MODULE, TRITON_MODULE) if params.triton else (OPTIMIZER_MODULE,):
        for name in copied.imports(module):
            edits.add_import(*name)
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
