"""liger-kernel: Liger's Triton kernels for the Hugging Face model family of the recipe (fused
RMSNorm, SwiGLU MLP, rotary embeddings) and its fused linear cross-entropy, guarded at run time.

Anchors: the model construction (``apply_liger_kernels(model, ...)`` goes right after it, before
any wrapper) and the loss. Where the model computes the loss itself (the forward gets
``labels=``), Liger's forward computes it fused. In an engine recipe whose ``compute_loss`` sums a
cross-entropy over ``.logits`` (the template), ``compute_loss`` gets a branch that asks the
forward for the summed loss instead (``shift_labels=``, ``num_items_in_batch=1``).
"""

from __future__ import annotations

from pathlib import Path

import libcst as cst
from pydantic import Field

from skills.codemod_kit import copied, pointing
from skills.codemod_kit import AlreadyApplied, Edits, Recipe, SkillParams, anchors, insert_definitions, templates
from skills.codemod_kit.anchors import keyword, positional
from skills.codemod_kit.gpu_guard import add_class_attribute, in_engine, insert_kernel_stage, require_hf_model, warn_argument
from skills.codemod_kit.layout import one_argument_per_line, with_keyword
from skills.codemod_kit.recipe import dotted_name

SKILL = "liger-kernel"
CROSS_ENTROPY = ("torch.nn.functional.cross_entropy", ".F.cross_entropy")
FLAG = "fused_linear_cross_entropy"


class Params(SkillParams):
    rope: bool = Field(True, description="Liger's rotary position embedding kernel.")
    swiglu: bool = Field(True, description="Liger's fused SwiGLU MLP (for families with a SwiGLU MLP).")
    rms_norm: bool = Field(True, description="Liger's fused RMSNorm.")
    fused_linear_cross_entropy: bool = Field(
        True,
        description="Compute the loss from the last hidden states and the output head's weight chunk by "
        "chunk, never materialising the logits (large vocabularies: much less memory). Needs a loss the "
        "codemod can route through the model's forward (labels= passed to the model, or an engine "
        "recipe that sums F.cross_entropy over .logits); otherwise it stays off, with a note.",
    )
    target: str | None = pointing.target_field()


# What it writes is a real module beside this file (helpers.py), copied into the recipe.
HELPERS_MODULE = Path(__file__).with_name("helpers.py")

ALREADY = ("apply_liger_kernels", "._apply_liger_kernel_to_instance", "._apply_liger_kernel")


def _existing(recipe: Recipe) -> cst.Call | None:
    calls = recipe.calls_to(*ALREADY)
    if calls:
        return calls[0]
    return next((c for c in recipe.calls() if recipe.call_name(c).startswith("liger_kernel.")), None)


def apply(recipe: Recipe, params: Params) -> Edits | AlreadyApplied:
    existing = _existing(recipe)
    if existing is not None:
        return AlreadyApplied(f"Liger kernels at {recipe.where(existing)}")
    model = pointing.find_model(recipe, SKILL, params.target)
    require_hf_model(
        recipe, SKILL, model,
        "Liger patches Hugging Face model families (model.config.model_type), not hand-written modules",
    )
    edits = Edits(recipe)
    fused = params.fused_linear_cross_entropy
    forwards = anchors.forward_calls(recipe, model)
    engine = anchors.engine_class(recipe)
    routed_through_engine = False
    if fused and not any(keyword(call, "labels") is not None for call in forwards):
        loss = _engine_logits_loss(recipe, engine) if engine is not None and in_engine(recipe, model) else None
        if loss is None:
            fused = False
            edits.notes.append(
                "the loss is computed from the logits outside an engine recipe's compute_loss, so fused "
                "linear cross-entropy stays off (norm, MLP and RoPE kernels only)"
            )
        else:
            _route_loss_through_forward(recipe, edits, *loss)
            add_class_attribute(recipe, edits, engine, f"{FLAG} = False  # Liger's fused loss: set by prepare_model")
            routed_through_engine = True

    arguments = (
        f"{{model}}, rope={params.rope}, swiglu={params.swiglu}, rms_norm={params.rms_norm}, "
        f"{FLAG}={fused}{warn_argument(recipe, model)}"
    )
    call = f"apply_liger_kernels({arguments})"
    insert_kernel_stage(recipe, edits, model, f"self.{FLAG} = {call}" if routed_through_engine else call)
    insert_definitions(recipe, edits, copied.definitions(HELPERS_MODULE), model.statement)
    for name in copied.imports(HELPERS_MODULE):
        edits.add_import(*name)
    edits.notes.append("the kernels run on CUDA GPUs with liger-kernel installed; elsewhere the run warns and continues")
    kernels = [name for name, on in (("RoPE", params.rope), ("SwiGLU", params.swiglu), ("RMSNorm", params.rms_norm)) if on]
    if fused:
        kernels.append("fused linear cross-entropy")
    edits.acts_on = f"patches {', '.join(kernels) or 'no kernel'} in `{model.target_code}` (a Hugging Face model) on CUDA"
    return edits


def _engine_logits_loss(recipe: Recipe, engine: cst.ClassDef) -> tuple[cst.Call, cst.Call] | None:
    """In ``compute_loss``: the forward call whose ``.logits`` is taken, and the summed
    ``F.cross_entropy`` call of the loss."""
    method = recipe.methods(engine).get("compute_loss")
    if method is None:
        return None
    forward = next(
        (
            c for c in recipe.calls()
            if recipe.is_inside(c, method)
            and dotted_name(c.func) == "self.model"
            and isinstance(recipe.parent(c), cst.Attribute)
            and recipe.parent(c).attr.value == "logits"  # type: ignore[union-attr]
        ),
        None,
    )
    losses = [c for c in recipe.calls_to(*CROSS_ENTROPY, within=method)]
    if forward is None or len(losses) != 1:
        return None
    reduction = keyword(losses[0], "reduction")
    if reduction is None or recipe.code(reduction.value).strip("\"'") != "sum":
        return None
    if (positional(losses[0], 1) or keyword(losses[0], "target")) is None:
        return None
    return forward, losses[0]


def _route_loss_through_forward(recipe: Recipe, edits: Edits, forward: cst.Call, loss: cst.Call) -> None:
    """Before the statement that takes the logits: ``if self.fused_linear_cross_entropy: return
    self.model(..., shift_labels=<labels>, num_items_in_batch=1).loss``. The labels are already the
    next tokens (so ``shift_labels``); ``num_items_in_batch=1`` makes the fused loss a sum, which is
    what the engine expects of compute_loss (it divides by the tokens of the global batch)."""
    target = (positional(loss, 1) or keyword(loss, "target")).value  # type: ignore[union-attr]
    arguments = [
        a.with_changes(comma=cst.MaybeSentinel.DEFAULT, whitespace_after_arg=cst.SimpleWhitespace(""))
        for a in forward.args
    ]
    extra = [("shift_labels", _without_flatten(target))]
    ignore = keyword(loss, "ignore_index")
    if ignore is not None:
        extra.append(("ignore_index", ignore.value))
    extra.append(("num_items_in_batch", cst.Integer("1")))
    fused_forward = forward.with_changes(args=arguments, whitespace_before_args=cst.SimpleWhitespace(""))
    for name, value in extra:
        fused_forward = with_keyword(fused_forward, name, value)
    branch = templates.statement(
        recipe.module,
        f"if self.{FLAG}:  # Liger: the summed loss, without the logits\n"
        "    return {forward}.loss",
        forward=one_argument_per_line(fused_forward),
    )
    edits.insert_before(recipe.statement_of(forward), [branch])


def _without_flatten(expression: cst.BaseExpression) -> cst.BaseExpression:
    """``batch["labels"].flatten()`` / ``.view(-1)`` / ``.reshape(-1)`` → ``batch["labels"]``."""
    while (
        isinstance(expression, cst.Call)
        and isinstance(expression.func, cst.Attribute)
        and expression.func.attr.value in {"flatten", "view", "reshape", "contiguous"}
    ):
        expression = expression.func.value
    return expression
