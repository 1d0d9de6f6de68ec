"""loss-guard: skip optimizer steps with a non-finite loss or gradient norm, or a loss spike;
stop after K bad steps in a row.

Anchors: in an engine recipe, the ``Engine.before_optimizer_step`` hook (overridden in the
recipe class); elsewhere, each ``<optimizer>.step()`` call (guarded by an ``if``), the
``.backward()`` before it (the loss), ``clip_grad_norm_`` (the gradient norm) and the optimizer's
construction (the guard is created next to it).
"""

from __future__ import annotations

import libcst as cst
from pydantic import Field

from skills.codemod_kit import pointing
from skills.codemod_kit import AlreadyApplied, Edits, Recipe, SkillParams, anchors, insert_definitions, templates
from skills.codemod_kit.recipe import dotted_name
from skills.errors import SkillRefused

SKILL = "loss-guard"


class Params(SkillParams):
    target: str | None = pointing.target_field()
    loop: str | None = pointing.loop_field()
    max_bad_steps: int = Field(5, ge=1, description="Stop the run after this many bad steps in a row.")
    spike_factor: float | None = Field(
        3.0,
        gt=1,
        description="A loss above spike_factor × the running mean of recent good losses is a "
        "spike (a bad step); null disables spike detection.",
    )
    warmup_steps: int = Field(
        10, ge=0, description="Good steps to see before spikes are judged (early losses fall fast)."
    )


GUARD_CLASS = '''
class LossGuard:
    """Skip optimizer steps that would damage the model, and stop a run that keeps making them.

    A step is bad when its loss or gradient norm is not finite, or when its loss is a spike:
    above ``spike_factor`` times the running mean of recent good losses (judged after
    ``warmup_steps`` good steps). A bad step is skipped: the optimizer does not step, so the
    parameters stay as they were, and training goes on with the next batch. ``max_bad_steps`` bad
    steps in a row raise an error: by then the cause is not one bad batch. The guard decides
    from the global loss and norm, so every rank decides the same. (Written by the loss-guard
    skill.)
    """

    def __init__(self, max_bad_steps: int = 5, spike_factor: float | None = 3.0, warmup_steps: int = 10):
        self.max_bad_steps = max_bad_steps
        self.spike_factor = spike_factor
        self.warmup_steps = warmup_steps
        self.mean_loss: float | None = None
        self.good_steps = 0
        self.bad_in_a_row = 0
        self.skipped = 0

    def check(self, loss, grad_norm=None) -> bool:
        """True when the optimizer may step."""
        loss = float(loss)
        norm = float(grad_norm) if grad_norm is not None else 0.0
        problem = None
        if not math.isfinite(loss):
            problem = f"loss is {loss}"
        elif not math.isfinite(norm):
            problem = f"gradient norm is {norm}"
        elif (
            self.spike_factor is not None
            and self.good_steps >= self.warmup_steps
            and loss > self.spike_factor * self.mean_loss
        ):
            problem = f"loss {loss:.4g} is over {self.spike_factor} x the running mean {self.mean_loss:.4g}"
        if problem is None:
            self.good_steps += 1
            self.bad_in_a_row = 0
            self.mean_loss = loss if self.mean_loss is None else 0.9 * self.mean_loss + 0.1 * loss
            return True
        self.bad_in_a_row += 1
        self.skipped += 1
        print(f"loss-guard: skipped an optimizer step: {problem} ({self.bad_in_a_row} in a row)", flush=True)
        if self.bad_in_a_row >= self.max_bad_steps:
            raise RuntimeError(
                f"loss-guard: {self.bad_in_a_row} bad steps in a row (last: {problem}); stopping. "
                "Lower the learning rate, check the data, or resume from an earlier checkpoint"
            )
        return False
'''

HOOK = '''
class _:
    def before_optimizer_step(self, ctx: StepContext) -> bool:
        """Skip this step when its loss or gradient norm is bad (the loss-guard skill)."""
        return self.loss_guard.check(ctx.loss, ctx.grad_norm)

    @cached_property
    def loss_guard(self) -> LossGuard:
        return LossGuard({arguments})
'''

GUARD_NAMES = ("LossGuard", "loss_guard", "isfinite", "isnan", "isinf")


def _arguments(params: Params) -> str:
    return (
        f"max_bad_steps={params.max_bad_steps}, spike_factor={params.spike_factor}, "
        f"warmup_steps={params.warmup_steps}"
    )


def apply(recipe: Recipe, params: Params) -> Edits | AlreadyApplied:
    engine = anchors.engine_class(recipe)
    if engine is not None:
        return _apply_to_engine(recipe, params, engine)
    return _apply_to_loop(recipe, params)


def _apply_to_engine(recipe: Recipe, params: Params, engine: cst.ClassDef) -> Edits | AlreadyApplied:
    hook = recipe.methods(engine).get("before_optimizer_step")
    if hook is not None:
        if any(recipe.references(name, hook) for name in GUARD_NAMES):
            return AlreadyApplied(f"{engine.name.value}.before_optimizer_step guards the step ({recipe.where(hook)})")
        raise SkillRefused(
            f"{SKILL}: {engine.name.value} already overrides before_optimizer_step "
            f"({recipe.where(hook)}); add `LossGuard(...).check(ctx.loss, ctx.grad_norm)` to it by hand"
        )
    if "loss_guard" in recipe.methods(engine):
        raise SkillRefused(f"{SKILL}: {engine.name.value} already has a loss_guard member; rename it first")
    edits = Edits(recipe)
    if not recipe.defines("LossGuard"):
        insert_definitions(recipe, edits, GUARD_CLASS, engine)
    methods = templates.statements(recipe.module, HOOK.replace("{arguments}", _arguments(params)))[0]
    new_members = [
        m.with_changes(leading_lines=[cst.EmptyLine(indent=False)])
        for m in methods.body.body  # type: ignore[attr-defined]
    ]
    body = engine.body
    edits.replace(body, lambda updated: updated.with_changes(body=[*updated.body, *new_members]))
    edits.add_import("math")
    edits.add_import("functools", "cached_property")
    edits.add_import("engine.engine", "StepContext")
    edits.acts_on = (
        f"guards every optimizer step of {engine.name.value} (before_optimizer_step: the loss from "
        "compute_loss and the gradient norm)"
    )
    return edits


def _apply_to_loop(recipe: Recipe, params: Params) -> Edits | AlreadyApplied:
    steps = anchors.optimizer_step_calls(recipe)
    if not steps:
        raise SkillRefused(
            f"{SKILL}: looked for an Engine subclass (its before_optimizer_step hook) or an "
            f"`optimizer.step()` call on a torch.optim optimizer in {recipe.name}; found neither"
        )
    guarded = [call for call, _ in steps if _is_guarded(recipe, call)]
    if guarded:
        return AlreadyApplied(f"the optimizer step at {recipe.where(guarded[0])} is already guarded")
    edits = Edits(recipe)
    guard_created: set[str] = set()
    for call, receiver in steps:
        statement = recipe.statement_of(call)
        if not (isinstance(statement, cst.SimpleStatementLine) and len(statement.body) == 1):
            raise SkillRefused(f"{SKILL}: the optimizer step at {recipe.where(call)} is not a statement of its own")
        guard = "self.loss_guard" if receiver.startswith("self.") else "loss_guard"
        if guard not in guard_created:
            _create_guard(recipe, edits, params, receiver, guard)
            guard_created.add(guard)
        loss = _loss_name(recipe, call)
        norm = _grad_norm(recipe, edits, statement, receiver)
        guarded_step = templates.statement(
            recipe.module,
            f"if {guard}.check({{loss}}, {norm}):\n    pass",
            loss=loss,
        )
        edits.replace(
            statement,
            lambda updated, opener=guarded_step: opener.with_changes(
                body=opener.body.with_changes(body=[updated.with_changes(leading_lines=[])]),
                leading_lines=updated.leading_lines,
            ),
        )
    edits.add_import("math")
    places = ", ".join(f"`{receiver}.step()` at line {recipe.line(call)}" for call, receiver in steps)
    edits.acts_on = f"guards {places} with the loss that `.backward()` was called on"
    return edits


def _is_guarded(recipe: Recipe, call: cst.Call) -> bool:
    for node in recipe.ancestors(call):
        if isinstance(node, cst.If) and any(recipe.references(n, node.test) for n in GUARD_NAMES):
            return True
    return False


def _create_guard(recipe: Recipe, edits: Edits, params: Params, receiver: str, guard: str) -> None:
    for optimizer in anchors.optimizer_constructors(recipe):
        target = anchors.assignment_target(recipe, optimizer)
        if target is not None and dotted_name(target) == receiver:
            statement = recipe.statement_of(optimizer)
            if not recipe.defines("LossGuard"):
                insert_definitions(recipe, edits, GUARD_CLASS, statement)
            edits.insert_after(
                statement, [templates.statement(recipe.module, f"{guard} = LossGuard({_arguments(params)})")]
            )
            return
    raise SkillRefused(f"{SKILL}: could not find where `{receiver}` is created")


def _loss_name(recipe: Recipe, step: cst.Call) -> cst.BaseExpression:
    """The tensor that ``.backward()`` was last called on before the step, in the same function."""
    scope = recipe.enclosing_function(step) or recipe.module
    candidates = [c for c in recipe.method_calls("backward", within=scope)]
    before = [c for c in candidates if _comes_before(recipe, c, step)]
    if not before:
        raise SkillRefused(
            f"{SKILL}: looked for `loss.backward()` before the optimizer step at {recipe.where(step)}; found none"
        )
    receiver = before[-1].func.value  # type: ignore[attr-defined]
    while isinstance(receiver, cst.Call) and isinstance(receiver.func, cst.Attribute):  # scaler.scale(loss)
        receiver = receiver.args[0].value if receiver.args else receiver.func.value
    names = _names(receiver)
    if isinstance(receiver, (cst.Name, cst.Attribute)):
        return receiver
    if names:
        return cst.Name(names[0])
    raise SkillRefused(f"{SKILL}: cannot tell the loss from `{recipe.short(before[-1])}` at {recipe.where(before[-1])}")


def _names(node: cst.CSTNode) -> list[str]:
    found: list[str] = []

    class Finder(cst.CSTVisitor):
        def visit_Name(self, name: cst.Name) -> None:
            found.append(name.value)

    node.visit(Finder())
    return found


def _comes_before(recipe: Recipe, first: cst.Call, second: cst.Call) -> bool:
    calls = recipe.calls()  # in source order
    return calls.index(first) < calls.index(second)


def _grad_norm(recipe: Recipe, edits: Edits, step_statement: cst.SimpleStatementLine, receiver: str) -> str:
    """A name holding the gradient norm: the result of ``clip_grad_norm_`` just before the step
    (captured if it was thrown away), or a new ``get_total_norm`` over the optimizer's gradients."""
    suite = recipe.parent(step_statement)
    body = list(suite.body)  # type: ignore[union-attr]
    for statement in reversed(body[: body.index(step_statement)]):
        clips = recipe.calls_to(".clip_grad_norm_", within=statement)
        if not clips:
            continue
        clip = clips[0]
        target = anchors.assignment_target(recipe, clip)
        if target is not None:
            return recipe.code(target)
        if isinstance(statement, cst.SimpleStatementLine) and len(statement.body) == 1:
            captured = templates.statement(recipe.module, "grad_norm = {clip}", clip=clip)
            edits.replace(
                statement,
                captured.with_changes(
                    leading_lines=statement.leading_lines, trailing_whitespace=statement.trailing_whitespace
                ),
            )
            return "grad_norm"
    norm = templates.statement(
        recipe.module,
        "grad_norm = torch.nn.utils.get_total_norm(\n"
        f'    [p.grad for g in {receiver}.param_groups for p in g["params"] if p.grad is not None]\n'
        ")",
    )
    edits.insert_before(step_statement, [norm])
    edits.add_import("torch")
    return "grad_norm"
