"""loss-guard: skip optimizer steps with a non-finite loss or gradient norm, or a loss spike;
stop after K bad steps in a row.

Anchors: in an engine recipe, the ``Engine.before_optimizer_step`` hook (overridden in the
recipe class); elsewhere, each ``<optimizer>.step()`` call (guarded by an ``if``), the
``.backward()`` before it (the loss), ``clip_grad_norm_`` (the gradient norm) and the optimizer's
construction (the guard is created next to it).
"""

from __future__ import annotations

from pathlib import Path

import libcst as cst
from pydantic import Field

from skills.codemod_kit import copied, pointing
from skills.codemod_kit import AlreadyApplied, Edits, Recipe, SkillParams, anchors, insert_definitions, templates
from skills.codemod_kit import frameworks, loops
from skills.codemod_kit.recipe import dotted_name
from skills.errors import SkillRefused

SKILL = "loss-guard"


class Params(SkillParams):
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
    target: str | None = pointing.target_field()
    loop: str | None = pointing.loop_field()


# LossGuard and unscale_once are a real module beside this file (helpers.py), copied into the recipe.
HELPERS_MODULE = Path(__file__).with_name("helpers.py")
GUARD_CLASS = copied.definitions(HELPERS_MODULE, ["LossGuard"])

HOOK = '''
class _:
    def before_optimizer_step(self, ctx: StepContext) -> bool:
        """Skip this step when its loss or gradient norm is bad (the loss-guard skill)."""
        return self.loss_guard.check(ctx.loss, ctx.grad_norm)

    @cached_property
    def loss_guard(self) -> LossGuard:
        return LossGuard()
'''

GUARD_NAMES = ("LossGuard", "loss_guard", "isfinite", "isnan", "isinf")


def _arguments(params: Params) -> str:
    return (
        f"max_bad_steps={params.max_bad_steps}, spike_factor={params.spike_factor}, "
        f"warmup_steps={params.warmup_steps}"
    )


class _GuardArguments(cst.CSTTransformer):
    """``LossGuard()`` calls given the skill's arguments."""

    def __init__(self, params: Params):
        call = cst.parse_expression(f"LossGuard({_arguments(params)})")
        assert isinstance(call, cst.Call)
        self.args = call.args

    def leave_Call(self, original: cst.Call, updated: cst.Call) -> cst.Call:
        if isinstance(updated.func, cst.Name) and updated.func.value == "LossGuard":
            return updated.with_changes(args=self.args)
        return updated


def _with_arguments(members: cst.BaseStatement, params: Params) -> cst.BaseStatement:
    return members.visit(_GuardArguments(params))  # type: ignore[return-value]


def apply(recipe: Recipe, params: Params) -> Edits | AlreadyApplied:
    engine = anchors.engine_class(recipe)
    if engine is not None and params.loop is None and params.target is None:
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
    methods = _with_arguments(templates.statements(recipe.module, HOOK)[0], params)
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
    loop = pointing.find_loop(recipe, SKILL, params.loop)
    steps = anchors.optimizer_step_calls(recipe, within=loop)
    if params.target is not None:
        steps = _named_steps(recipe, params.target, steps)
    if not steps:
        lightning = [s for s in loops.lightning_steps(recipe) if loop is None or recipe.is_inside(s, loop)]
        if lightning:
            return _apply_to_lightning(recipe, params, lightning)
        trainer = frameworks.hf_trainers(recipe)
        owner = (
            f"; the loop belongs to the Hugging Face Trainer ({recipe.where(trainer[0])}), which has no hook "
            "that skips an optimizer step" if trainer else ""
        )
        where = f" inside the loop at {recipe.where(loop)}" if loop is not None else ""
        raise SkillRefused(
            f"{SKILL}: looked for an Engine subclass (its before_optimizer_step hook), an optimizer step "
            f"(`optimizer.step()`, `self._optimizer.step()`, `scaler.step(optimizer)`) or a Lightning "
            f"training_step{where} in {recipe.name}; found none{owner}"
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
            _create_guard(recipe, edits, params, receiver, guard, call)
            guard_created.add(guard)
        loss = _loss_name(recipe, call)
        scaler = _scaler(call)
        if scaler:  # the scaler skips steps with non-finite gradients itself; the guard judges the loss
            if not recipe.defines("unscale_once"):
                insert_definitions(recipe, edits, UNSCALE_ONCE, recipe.statement_of(call))
            guarded_step = templates.statement(
                recipe.module,
                f"if {guard}.check({{loss}}):\n    pass\nelse:\n    unscale_once({scaler}, {receiver})",
                loss=loss,
            )
        else:
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
    places = ", ".join(f"`{recipe.short(call.func.value)}.step()` at line {recipe.line(call)}" for call, _ in steps)
    edits.acts_on = f"guards {places} with the loss that `.backward()` was called on"
    return edits


UNSCALE_ONCE = copied.definitions(HELPERS_MODULE, ["unscale_once"])

CACHED_GUARD = '''
class _:
    @cached_property
    def loss_guard(self) -> LossGuard:
        return LossGuard()
'''


def _add_cached_guard(recipe: Recipe, edits: Edits, params: Params, cls: cst.ClassDef) -> None:
    """A ``loss_guard`` cached_property on the class: created on first use, kept across calls."""
    if "loss_guard" in recipe.methods(cls):
        return
    members = _with_arguments(templates.statements(recipe.module, CACHED_GUARD)[0], params)
    new_members = [m.with_changes(leading_lines=[cst.EmptyLine(indent=False)]) for m in members.body.body]  # type: ignore[attr-defined]
    edits.replace(cls.body, lambda updated, new=new_members: updated.with_changes(body=[*updated.body, *new]))
    edits.add_import("functools", "cached_property")


def _scaler(step: cst.Call) -> str:
    """``scaler`` for ``scaler.step(optimizer)``; "" for ``optimizer.step()``."""
    receiver = dotted_name(step.func.value)  # type: ignore[attr-defined]
    return receiver if step.args and "scaler" in receiver.rsplit(".", 1)[-1].lower() else ""


def _named_steps(recipe: Recipe, target: str, steps: list[tuple[cst.Call, str]]) -> list[tuple[cst.Call, str]]:
    """The steps of the optimizer ``target`` names (``self._optimizer``, ``optD``) or on its line."""
    line = pointing.place(recipe, SKILL, target, "target")
    if line is not None:
        named = [(c, r) for c, r in steps if recipe.span(recipe.statement_of(c))[0] == line]
    else:
        named = [(c, r) for c, r in steps if r == pointing.parse_expression(SKILL, target)]
    if named:
        return named
    seen = ", ".join(f"`{r}` at {recipe.where(c)}" for c, r in steps[: pointing.LISTED]) or "none"
    raise SkillRefused(
        f"{SKILL}: target {target!r} names no optimizer step; the optimizer steps it saw: {seen}; "
        "name the optimizer (e.g. `optimizer`) or the step's line (`file.py:LINE`)"
    )


def _apply_to_lightning(recipe: Recipe, params: Params, steps: list[cst.FunctionDef]) -> Edits | AlreadyApplied:
    """A LightningModule's training_step: returning None skips the batch (no backward, no
    optimizer step), Lightning's own way to skip a step in automatic optimization."""
    edits = Edits(recipe)
    for step in steps:
        if any(recipe.references(name, step) for name in GUARD_NAMES):
            return AlreadyApplied(f"training_step at {recipe.where(step)} checks its loss")
        returns = [r for r in recipe.returns_of(step) if r.value is not None]
        if not returns:
            raise SkillRefused(f"{SKILL}: the training_step at {recipe.where(step)} returns no loss")
        for ret in returns:
            statement = recipe.statement_of(ret)
            loss = ret.value
            value = templates.expression(recipe.module, "{loss}", loss=loss)
            if not isinstance(loss, (cst.Name, cst.Attribute)):
                first = loss.elements[0].value if isinstance(loss, cst.Dict) and loss.elements else None
                if isinstance(loss, cst.Dict) and first is not None:
                    value = first  # {"loss": loss, ...}
                else:
                    raise SkillRefused(
                        f"{SKILL}: training_step returns `{recipe.short(loss)}` at {recipe.where(ret)}; "
                        "return a loss variable (`return loss`) first"
                    )
            check = templates.statement(recipe.module, "if not self.loss_guard.check({loss}):\n    return None", loss=value)
            edits.insert_before(statement, [check])
        cls = recipe.enclosing_class(step)
        _add_cached_guard(recipe, edits, params, cls)
        if not recipe.defines("LossGuard"):
            insert_definitions(recipe, edits, GUARD_CLASS, cls)
    edits.add_import("math")
    edits.add_import("functools", "cached_property")
    edits.acts_on = (
        f"checks the loss of {len(steps)} Lightning training_step{'s' if len(steps) != 1 else ''} "
        f"({', '.join(recipe.where(s) for s in steps)}): a bad loss returns None, so Lightning skips that "
        "batch's backward and optimizer step"
    )
    edits.notes.append("in automatic optimization the gradient norm is not checked: the step is skipped before backward")
    return edits


def _is_guarded(recipe: Recipe, call: cst.Call) -> bool:
    for node in recipe.ancestors(call):
        if isinstance(node, cst.If) and any(recipe.references(n, node.test) for n in GUARD_NAMES):
            return True
    return False


def _create_guard(
    recipe: Recipe, edits: Edits, params: Params, receiver: str, guard: str, step: cst.Call
) -> None:
    """``loss_guard = LossGuard(...)`` next to the optimizer's construction; when the codemod
    cannot see it (``config.instantiate``, ``accelerator.prepare``), at the end of the class's
    ``__init__`` for ``self.`` optimizers, else before the outermost loop around the step."""
    created = templates.statement(recipe.module, f"{guard} = LossGuard({_arguments(params)})")
    for optimizer in anchors.optimizer_constructors(recipe):
        target = anchors.assignment_target(recipe, optimizer)
        if target is not None and dotted_name(target) == receiver:
            statement = recipe.statement_of(optimizer)
            if not recipe.defines("LossGuard"):
                insert_definitions(recipe, edits, GUARD_CLASS, statement)
            edits.insert_after(statement, [created])
            return
    cls = recipe.enclosing_class(step)
    if guard.startswith("self.") and cls is not None:
        _add_cached_guard(recipe, edits, params, cls)
    else:
        function = recipe.enclosing_function(step)
        loops_around = [a for a in recipe.ancestors(step) if isinstance(a, (cst.For, cst.While))
                        and (function is None or recipe.is_inside(a, function))]
        if not loops_around:
            raise SkillRefused(
                f"{SKILL}: could not find where `{receiver}` is created, nor a loop around its step at "
                f"{recipe.where(step)} to create the guard before; name the loop with `loop`"
            )
        edits.insert_before(loops_around[-1], [created])
    if not recipe.defines("LossGuard"):
        insert_definitions(recipe, edits, GUARD_CLASS, step)


def _loss_name(recipe: Recipe, step: cst.Call) -> cst.BaseExpression:
    """The tensor that the backward pass was last run on before the step, in the same function
    (``loss.backward()``, ``accelerator.backward(loss)``, ``scaler.scale(loss).backward()``)."""
    scope = recipe.enclosing_function(step) or recipe.module
    before = [c for c in loops.backward_calls(recipe, within=scope) if _comes_before(recipe, c, step)]
    if not before:
        helper = loops.helper_backward(recipe, scope, step)
        if helper is not None:
            call, loss = helper
            if loss is not None:
                return loops.loss_name(loss) or loss
            raise SkillRefused(
                f"{SKILL}: the backward pass runs inside `{recipe.short(call.func)}(...)` ({recipe.where(call)}), "
                f"which keeps its loss; the optimizer step is at {recipe.where(step)}: return the loss from it "
                "(`loss = ...`) or guard the step by hand"
            )
        raise SkillRefused(
            f"{SKILL}: looked for the backward pass ({loops.LOOKED_FOR}) before the optimizer step at "
            f"{recipe.where(step)}; found none"
        )
    last = max(before, key=lambda c: recipe.calls().index(c))
    loss = loops.loss_of(last)
    name = loops.loss_name(loss) if loss is not None else None
    if name is None:
        raise SkillRefused(f"{SKILL}: cannot tell the loss from `{recipe.short(last)}` at {recipe.where(last)}")
    return name


def _comes_before(recipe: Recipe, first: cst.Call, second: cst.Call) -> bool:
    calls = recipe.calls()  # in source order
    return calls.index(first) < calls.index(second)


def _grad_norm(recipe: Recipe, edits: Edits, step_statement: cst.SimpleStatementLine, receiver: str) -> str:
    """A name holding the gradient norm: the result of ``clip_grad_norm_`` just before the step
    (captured if it was thrown away), or a new ``get_total_norm`` over the optimizer's gradients."""
    suite = recipe.parent(step_statement)
    body = list(suite.body)  # type: ignore[union-attr]
    for statement in reversed(body[: body.index(step_statement)]):
        clips = recipe.calls_to(".clip_grad_norm_", ".clip_gradients", within=statement)
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
