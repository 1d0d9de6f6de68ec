"""What the agent points at: the ``target`` model and the training ``loop`` a skill acts on.

``target`` is a model expression (``model``, ``self._model``, ``netG``, or a submodule on it,
``model.encoder``) or a place, ``file.py:LINE`` (or ``LINE``): the construction on that line.
``loop`` is a place (``file.py:LINE``: the innermost loop or function holding that line) or a
function name (``train``, ``Recipe.train``, ``training_step``). When the codemod finds no model
or several, its refusal lists what it saw (at most five, with ``file:line`` and the expression),
so the next call can name one.
"""

from __future__ import annotations

import re

import libcst as cst

from skills.codemod_kit import anchors
from skills.codemod_kit.anchors import ModelAnchor
from skills.codemod_kit.recipe import Recipe, dotted_name
from skills.errors import SkillRefused

_PLACE = re.compile(r"^(?:(?P<file>[^:\s]+\.py):)?(?P<line>\d+)$")
_GIVEN = re.compile(r"^_*(model|net|network|policy|generator|discriminator|actor|critic|student|lm)$")
LISTED = 5


def place(recipe: Recipe, skill: str, text: str, what: str) -> int | None:
    """The line of ``file.py:LINE`` / ``LINE`` (None when ``text`` is not a place)."""
    match = _PLACE.match(text.strip())
    if match is None:
        return None
    if match["file"] and match["file"].rsplit("/", 1)[-1] != recipe.name:
        raise SkillRefused(
            f"{skill}: {what} {text!r} names {match['file']}, but the skill works on {recipe.name}; "
            f"apply it to {match['file']} or name a line of {recipe.name}"
        )
    return int(match["line"])


def listing(recipe: Recipe, candidates: list[ModelAnchor]) -> str:
    """```self._model` at recipe.py:40 (`self._setup_model(cfg.model)`), ...`` (at most five)."""
    shown = [
        f"`{c.outer or c.target_code}` at {recipe.where(c.statement)} "
        f"(`{recipe.short(c.call, 40) if not c.builder.startswith('the caller') else recipe.short(c.statement, 40)}`)"
        for c in candidates[:LISTED]
    ]
    more = f" and {len(candidates) - LISTED} more" if len(candidates) > LISTED else ""
    return ", ".join(shown) + more


def names(anchor: ModelAnchor) -> tuple[str, ...]:
    return (anchor.target_code, anchor.outer) if anchor.outer else (anchor.target_code,)


def relative(anchor: ModelAnchor, dotted: str) -> str | None:
    """``layers`` for ``self._model.layers`` on the anchor ``self._model``; "" for the model
    itself; None when ``dotted`` does not start with the model."""
    for name in names(anchor):
        if dotted == name:
            return ""
        if dotted.startswith(name + "."):
            return dotted[len(name) + 1 :]
    return None


def find_model(recipe: Recipe, skill: str, target: str | None = None) -> ModelAnchor:
    """The construction of the model to change: the one ``target`` names, else the one trained."""
    candidates = anchors.model_candidates(recipe) or given_models(recipe) or set_up_by_base_class(recipe)
    if target is not None:
        return _named(recipe, skill, target, candidates)
    engine = anchors.engine_class(recipe)
    if engine is not None:
        prepare = recipe.methods(engine).get("prepare_model")
        inside = [c for c in candidates if prepare is not None and recipe.is_inside(c.statement, prepare)]
        if inside:
            candidates = inside
    if len(candidates) > 1:
        trained = [c for c in candidates if anchors.passed_to_optimizer(recipe, c.outer or c.target_code)]
        if trained:
            candidates = trained
    if len(candidates) > 1:  # the model that owns the optimizer it steps (self.policy.optimizer.step())
        receivers = [r for _, r in anchors.optimizer_step_calls(recipe)]
        owners = [c for c in candidates if any(r.startswith((c.outer or c.target_code) + ".") for r in receivers)]
        if owners:
            candidates = owners
    if len(candidates) > 1:
        looping = [c for c in candidates if _in_loop_class(recipe, c)]
        if looping:
            candidates = looping
    if len(candidates) == 1:
        return candidates[0]
    if not candidates:
        wrapped = anchors.wrapped_construction(recipe)
        if wrapped is not None:
            wrapper, inner = wrapped
            raise SkillRefused(
                f"{skill}: the model is built inside a wrapper ({recipe.where(wrapper)}: "
                f"`{recipe.short(wrapper)}`); a change to the model must land before wrappers such as "
                f"DDP, FSDP or PrivacyEngine.make_private; build it on a line of its own "
                f"(`model = {recipe.short(inner, 40)}`), wrap it on the next, then apply again"
            )
        raise SkillRefused(
            f"{skill}: looked for {anchors.MODEL_LOOKED_FOR} in {recipe.name}; found none{_calls_seen(recipe)}"
        )
    raise SkillRefused(
        f"{skill}: found several model constructions ({listing(recipe, candidates)}) and cannot tell "
        f"which one is trained; name the one to change with `target` (e.g. "
        f"target=\"{candidates[0].outer or candidates[0].target_code}\" or target=\"{recipe.where(candidates[0].statement)}\")"
    )


def _in_loop_class(recipe: Recipe, candidate: ModelAnchor) -> bool:
    """``self.model`` set in the class whose methods run backward or step an optimizer."""
    if not (candidate.outer or candidate.target_code).startswith("self."):
        return False
    cls = recipe.enclosing_class(candidate.statement)
    return cls is not None and bool(
        recipe.method_calls("backward", within=cls) or recipe.method_calls("manual_backward", within=cls)
        or anchors.optimizer_step_calls(recipe, within=cls)
    )


def _named(recipe: Recipe, skill: str, target: str, candidates: list[ModelAnchor]) -> ModelAnchor:
    line = place(recipe, skill, target, "target")
    if line is not None:
        for candidate in candidates:
            first, last = recipe.span(candidate.statement)
            if first <= line <= last:
                return candidate
        seen = f"; the model constructions it saw: {listing(recipe, candidates)}" if candidates else (
            f"; it saw no model construction ({anchors.MODEL_LOOKED_FOR}){_calls_seen(recipe)}"
        )
        raise SkillRefused(f"{skill}: target {target!r}: no model is built on line {line} of {recipe.name}{seen}")
    dotted = parse_expression(skill, target)
    named = [c for c in candidates if relative(c, dotted) is not None]
    if named:
        return max(named, key=lambda c: max(len(n) for n in names(c) if relative(c, dotted) is not None))
    seen = f"the model constructions it saw: {listing(recipe, candidates)}" if candidates else (
        f"it saw no model construction ({anchors.MODEL_LOOKED_FOR}){_calls_seen(recipe)}"
    )
    raise SkillRefused(
        f"{skill}: target {target!r} does not start with a model built in {recipe.name}; {seen}; "
        "name one of them (or a submodule on it, `<model>.<submodule>`), or its line as `file.py:LINE`"
    )


def parse_expression(skill: str, target: str) -> str:
    """A model expression (``model.encoder``, ``self.model.layers``) as a dotted name."""
    try:
        expression = cst.parse_expression(target)
    except cst.ParserSyntaxError:
        expression = None
    dotted = dotted_name(expression) if expression is not None else ""
    if not dotted:
        raise SkillRefused(
            f"{skill}: target {target!r} is not a model expression; name the module as an attribute "
            "chain on the model, e.g. `model.encoder` or `self.model.layers`, or its line as `file.py:LINE`"
        )
    return dotted


def given_models(recipe: Recipe) -> list[ModelAnchor]:
    """``self.model = model`` in a method whose parameter ``model`` is then called
    (``self.model(batch)``): a trainer class of the project that is handed its model."""
    found = []
    called = {dotted_name(c.func) for c in recipe.calls()}
    modules = set(recipe.subclasses(*anchors.NN_MODULE, *anchors.HF_PRETRAINED))
    for assign in recipe.assigns():
        if len(assign.targets) != 1 or not isinstance(assign.value, cst.Name):
            continue
        target = dotted_name(assign.targets[0].target)
        if not (target.startswith("self.") and target.count(".") == 1 and _GIVEN.match(target[5:])):
            continue
        function = recipe.enclosing_function(assign)
        if function is None or assign.value.value not in {p.name.value for p in function.params.params}:
            continue
        if recipe.enclosing_class(assign) in modules:  # a submodule of a model class
            continue
        statement = recipe.parent(assign)
        suite = recipe.parent(statement) if statement is not None else None
        if target not in called or not isinstance(statement, cst.SimpleStatementLine):
            continue
        if not isinstance(suite, (cst.Module, cst.IndentedBlock)):
            continue
        found.append(
            ModelAnchor(
                statement=statement,
                target=assign.targets[0].target,
                call=cst.Call(func=assign.value),
                kind="factory",
                builder=f"the caller of {function.name.value}",
                suite=suite,
                target_code=target,
            )
        )
    return found


def set_up_by_base_class(recipe: Recipe) -> list[ModelAnchor]:
    """``super()._setup_model()`` in a method: the base class builds the model attributes the
    class then uses (``self.policy`` in Stable-Baselines3); changes go right after that call."""
    found = []
    for call in recipe.calls():
        func = call.func
        if not (isinstance(func, cst.Attribute) and anchors.factory_name(func.attr.value)):
            continue
        cls = recipe.enclosing_class(call)
        inherited = dotted_name(func.value) == "self" and cls is not None and func.attr.value not in recipe.methods(cls)
        if not (isinstance(func.value, cst.Call) and dotted_name(func.value.func) == "super") and not inherited:
            continue
        statement = recipe.statement_of(call)
        suite = recipe.parent(statement)
        if cls is None or not isinstance(statement, cst.SimpleStatementLine) or not isinstance(suite, cst.IndentedBlock):
            continue
        names = sorted({
            n for n in anchors.model_uses(recipe)
            if n.startswith("self.") and n.count(".") == 1 and anchors.model_like(n)
        })
        for name in names:
            found.append(
                ModelAnchor(
                    statement=statement, target=cst.parse_expression(name), call=call, kind="factory",
                    builder=f"super().{func.attr.value}", suite=suite, target_code=name,
                )
            )
    return found


def _calls_seen(recipe: Recipe) -> str:
    """``; it calls `self.model(...)` (train.py:40)`` — model-like calls whose construction the
    codemod cannot see (built in another file, or handed in)."""
    seen: dict[str, cst.Call] = {}
    for call in recipe.calls():
        name = dotted_name(call.func)
        if name and name not in seen and anchors.model_like(name) and recipe.call_name(call).split(".")[0] not in (
            "torch", "transformers"
        ) and not name[:1].isupper() and name.rsplit(".", 1)[-1] == name.rsplit(".", 1)[-1].lower():
            seen[name] = call
    if not seen:
        return ""
    shown = ", ".join(f"{n}(...) on line {recipe.line(c)}" for n, c in list(seen.items())[:LISTED])
    return (
        f"; it calls a model ({shown}) but cannot see where that model is built (another file, or handed "
        "in): apply the skill to the file that builds it"
    )


# ---------------------------------------------------------------------------------------------
# Loops
# ---------------------------------------------------------------------------------------------

LOOP_NODES = (cst.For, cst.While, cst.FunctionDef)


def find_loop(recipe: Recipe, skill: str, loop: str | None) -> cst.CSTNode | None:
    """The node ``loop`` names: a function (``train``, ``Recipe.train``) or the innermost
    ``for``/``while``/function around ``file.py:LINE``; None without ``loop``."""
    if loop is None:
        return None
    line = place(recipe, skill, loop, "loop")
    if line is not None:
        best = None
        for node in _loop_nodes(recipe):
            first, last = recipe.span(node)
            if first <= line <= last and (best is None or recipe.is_inside(node, best)):
                best = node
        if best is None:
            raise SkillRefused(f"{skill}: loop {loop!r}: line {line} of {recipe.name} is in no loop or function")
        return best
    cls_name, _, function = loop.strip().rpartition(".")
    matches = [
        f for f in recipe._index.functions  # noqa: SLF001 — the index is the recipe's own
        if f.name.value == function
        and (not cls_name or (recipe.enclosing_class(f) is not None and recipe.enclosing_class(f).name.value == cls_name))
    ]
    if len(matches) == 1:
        return matches[0]
    functions = ", ".join(sorted({f.name.value for f in recipe._index.functions})[:12])  # noqa: SLF001
    how = "several functions have that name; write it as `Class.method` or `file.py:LINE`" if matches else (
        f"no function has that name (its functions: {functions})"
    )
    raise SkillRefused(f"{skill}: loop {loop!r}: {how}")


def _loop_nodes(recipe: Recipe):
    for function in recipe._index.functions:  # noqa: SLF001
        yield function
    stack: list[cst.CSTNode] = [recipe.module]
    while stack:
        node = stack.pop()
        for child in node.children:
            if isinstance(child, (cst.For, cst.While)):
                yield child
            if isinstance(child, (cst.BaseCompoundStatement, cst.IndentedBlock, cst.Module, cst.Else)):
                stack.append(child)


# ---------------------------------------------------------------------------------------------
# The parameters, one definition for every skill
# ---------------------------------------------------------------------------------------------

MODEL_TARGET = (
    "The model to change when the file builds several or the codemod cannot tell which: a model "
    "expression ('netG', 'self._model') or the line that builds it ('train.py:42')."
)
LOOP = (
    "The training loop to change: a function ('train', 'Recipe.train', 'training_step') or a line "
    "inside the loop ('train.py:120'). Default: every loop of the file."
)


def target_field(description: str = MODEL_TARGET):
    from pydantic import Field

    return Field(None, description=description)


def loop_field():
    from pydantic import Field

    return Field(None, description=LOOP)
