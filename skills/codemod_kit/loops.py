"""Training-loop anchors: the backward calls, the loss they are called on, and the forward calls
that compute it.

A loop drives its backward pass as ``loss.backward()`` (plain PyTorch, also
``scaler.scale(loss).backward()``), ``accelerator.backward(loss)`` (accelerate),
``fabric.backward(loss)`` (Lightning Fabric), ``self.manual_backward(loss)`` (Lightning's manual
optimization) or ``model_engine.backward(loss)`` (DeepSpeed). A Lightning ``training_step``
returns its loss and lets the Trainer run backward and the optimizer.
"""

from __future__ import annotations

import libcst as cst

from skills.codemod_kit import anchors
from skills.codemod_kit.recipe import Recipe, dotted_name

LOOKED_FOR = (
    "`loss.backward()`, `accelerator.backward(loss)`, `fabric.backward(loss)` or a Lightning "
    "`training_step` that returns the loss"
)


def backward_calls(recipe: Recipe, within: cst.CSTNode | None = None) -> list[cst.Call]:
    return recipe.method_calls("backward", within=within) + recipe.method_calls("manual_backward", within=within)


def loss_of(backward: cst.Call) -> cst.BaseExpression | None:
    """The loss a backward call is called on: the argument of ``accelerator.backward(loss)`` and
    ``self.manual_backward(loss)``, the receiver of ``loss.backward()`` (through
    ``scaler.scale(loss)`` and ``(loss / accumulation)``)."""
    method = backward.func.attr.value  # type: ignore[attr-defined]
    first = next((a for a in backward.args if a.keyword is None and not a.star), None)
    if method == "manual_backward" or (first is not None and _is_engine(backward.func.value)):  # type: ignore[attr-defined]
        return first.value if first is not None else None
    receiver = backward.func.value  # type: ignore[attr-defined]
    while isinstance(receiver, cst.Call) and isinstance(receiver.func, cst.Attribute):  # scaler.scale(loss)
        receiver = receiver.args[0].value if receiver.args else receiver.func.value
    return receiver


def _is_engine(receiver: cst.BaseExpression) -> bool:
    """``accelerator``, ``self.fabric``, ``model_engine``: an object whose ``backward`` takes the loss."""
    name = dotted_name(receiver).rsplit(".", 1)[-1].lower()
    return bool(name) and any(word in name for word in ("accelerator", "fabric", "engine", "trainer", "strategy"))


def loss_name(loss: cst.BaseExpression) -> cst.BaseExpression | None:
    """``loss`` for ``loss``, ``self.loss``, ``(loss / n)``, ``loss.mean()``: the name to check."""
    if isinstance(loss, (cst.Name, cst.Attribute)):
        return loss
    found: list[cst.BaseExpression] = []

    class Finder(cst.CSTVisitor):
        def visit_Name(self, name: cst.Name) -> None:
            found.append(name)

    loss.visit(Finder())
    return found[0] if found else None


def lightning_steps(recipe: Recipe) -> list[cst.FunctionDef]:
    """``training_step`` methods of LightningModule subclasses (automatic optimization)."""
    found = []
    for cls in recipe.subclasses(*anchors.LIGHTNING_MODULE):
        step = recipe.methods(cls).get("training_step")
        if step is not None and not recipe.method_calls("manual_backward", within=cls):
            found.append(step)
    return found


def forward_calls(recipe: Recipe, within: cst.CSTNode | None = None) -> list[cst.Call]:
    """Calls of a model-like object (``model(x)``, ``self.model(**batch)``, ``self(x)`` in a
    LightningModule) in the functions that run backward: the loop's forward passes when the
    codemod cannot see where the model is built."""
    scopes: list[cst.CSTNode] = []
    for backward in backward_calls(recipe, within):
        scope = recipe.enclosing_function(backward) or recipe.module
        if scope not in scopes:
            scopes.append(scope)
    for step in lightning_steps(recipe):
        if within is None or recipe.is_inside(step, within):
            scopes.append(step)
    if within is not None and not scopes:
        scopes = [within]
    local = set(recipe.top_level_functions()) | set(recipe.top_level_classes())
    found = []
    for call in recipe.calls():
        name = dotted_name(call.func)
        if not name or name in local or not any(recipe.is_inside(call, s) for s in scopes):
            continue
        in_step = any(recipe.is_inside(call, s) for s in lightning_steps(recipe))
        owner, _, method = name.rpartition(".")
        if anchors.model_like(name) or (name == "self" and in_step):
            found.append(call)
        elif owner and anchors.model_like(owner) and method not in NOT_FORWARD and not method.startswith("_"):
            found.append(call)  # self.policy.evaluate_actions(obs, actions)
    return found


# Methods of a model that do not run its forward pass.
NOT_FORWARD = {
    "parameters", "named_parameters", "train", "eval", "to", "cuda", "cpu", "state_dict", "load_state_dict",
    "zero_grad", "modules", "named_modules", "children", "apply", "requires_grad_", "set_training_mode",
    "register_forward_hook", "register_buffer", "half", "float", "bfloat16", "save_pretrained", "generate",
    "get_input_embeddings", "resize_token_embeddings", "compile", "backward", "step",
}


def helper_backward(recipe: Recipe, scope: cst.CSTNode, before: cst.Call) -> tuple[cst.Call, cst.BaseExpression | None]:
    """A call, before ``before`` in ``scope``, of a function or method of the file that runs the
    backward pass (``loss = self.forward_backward_step(...)``, ``backward(total_loss, scaler)``),
    and the loss it leaves in ``scope``: the argument the function runs backward on, or the
    name its result is assigned to (None when neither: the loss stays inside the function)."""
    calls = recipe.calls()
    position = calls.index(before)
    functions = recipe.top_level_functions()
    cls = recipe.enclosing_class(scope)
    methods = recipe.methods(cls) if cls is not None else {}
    found = None
    for call in calls[:position]:
        if not recipe.is_inside(call, scope):
            continue
        name = dotted_name(call.func)
        function = functions.get(name) or (methods.get(name[5:]) if name.startswith("self.") else None)
        if function is None or function is scope or not backward_calls(recipe, within=function):
            continue
        found = (call, function)
    if found is None:
        return None  # type: ignore[return-value]
    call, function = found
    params = [p.name.value for p in function.params.params if p.name.value != "self"]
    for backward in backward_calls(recipe, within=function):
        loss = loss_of(backward)
        name = loss_name(loss) if loss is not None else None
        if isinstance(name, cst.Name) and name.value in params:
            index = params.index(name.value)
            positional = [a for a in call.args if a.keyword is None and not a.star]
            if index < len(positional):
                return call, positional[index].value
            by_name = next((a for a in call.args if a.keyword is not None and a.keyword.value == name.value), None)
            if by_name is not None:
                return call, by_name.value
    parent = recipe.parent(call)
    if isinstance(parent, cst.Assign) and len(parent.targets) == 1 and isinstance(parent.targets[0].target, cst.Name):
        return call, parent.targets[0].target
    return call, None
