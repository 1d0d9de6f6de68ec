"""Anchors that codemods look for, found by structure and qualified names.

- the model: the assignment that builds it (a ``transformers`` model class, a function of the
  file that returns one, or an ``nn.Module`` subclass defined in the file);
- the recipe class: a subclass of ``engine.Engine`` (its ``prepare_*`` methods are anchors too);
- optimizers: ``torch.optim.*`` constructors (and the optimizer classes skills write) and their
  ``.step()`` calls;
- forward calls: calls of the model object;
- the device mesh: ``init_device_mesh(..., mesh_dim_names=(...))``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

import libcst as cst

from skills.codemod_kit.recipe import Recipe, Suite, dotted_name
from skills.errors import SkillRefused

ENGINE_BASES = ("engine.engine.Engine", "engine.Engine")
NN_MODULE = ("torch.nn.Module", "torch.nn.modules.module.Module")
HF_PRETRAINED = ("transformers.PreTrainedModel", "transformers.modeling_utils.PreTrainedModel")
_HF_MODEL_CLASS = re.compile(r"(Model|For[A-Za-z]+)$")
_CHAIN_METHODS = {"to", "cuda", "cpu", "float", "bfloat16", "half", "train", "to_empty"}

ModelKind = Literal["hf", "custom"]


def unwrap_chain(expression: cst.BaseExpression) -> cst.BaseExpression:
    """``Build(...).to(device).train()`` → ``Build(...)``."""
    while (
        isinstance(expression, cst.Call)
        and isinstance(expression.func, cst.Attribute)
        and expression.func.attr.value in _CHAIN_METHODS
        and isinstance(expression.func.value, cst.Call)
    ):
        expression = expression.func.value
    return expression


@dataclass
class ModelAnchor:
    statement: cst.SimpleStatementLine
    target: cst.BaseExpression  # Name("model") or Attribute(self.model)
    call: cst.Call
    kind: ModelKind
    builder: str  # the name the construction calls, for messages
    suite: Suite
    target_code: str


def engine_class(recipe: Recipe) -> cst.ClassDef | None:
    classes = recipe.subclasses(*ENGINE_BASES)
    return classes[0] if len(classes) == 1 else None


def _model_kind(recipe: Recipe, call: cst.Call, depth: int = 0) -> ModelKind | None:
    name = recipe.call_name(call)
    if not name:
        return None
    parts = name.split(".")
    if parts[0] == "transformers":
        cls = parts[-2] if parts[-1] in {"from_pretrained", "from_config", "_from_config"} else parts[-1]
        return "hf" if _HF_MODEL_CLASS.search(cls) else None
    local_classes = recipe.top_level_classes()
    if name in local_classes:
        cls = local_classes[name]
        if cls in recipe.subclasses(*HF_PRETRAINED):
            return "hf"
        if cls in recipe.subclasses(*NN_MODULE):
            return "custom"
        return None
    functions = recipe.top_level_functions()
    if name in functions and depth == 0:
        kinds = set()
        for ret in recipe.returns_of(functions[name]):
            if ret.value is not None:
                inner = unwrap_chain(ret.value)
                if isinstance(inner, cst.Call):
                    kind = _model_kind(recipe, inner, depth + 1)
                    if kind:
                        kinds.add(kind)
        if kinds:
            return "hf" if kinds == {"hf"} else "custom"
    return None


def model_candidates(recipe: Recipe) -> list[ModelAnchor]:
    """Assignments that build a model, leaving out sub-modules built inside model classes."""
    found = []
    module_classes = set(recipe.subclasses(*NN_MODULE, *HF_PRETRAINED))
    for assign in recipe.assigns():
        if recipe.enclosing_class(assign) in module_classes:
            continue
        if len(assign.targets) != 1:
            continue
        target = assign.targets[0].target
        if not isinstance(target, (cst.Name, cst.Attribute)):
            continue
        value = unwrap_chain(assign.value)
        if not isinstance(value, cst.Call):
            continue
        kind = _model_kind(recipe, value)
        if kind is None:
            continue
        statement = recipe.parent(assign)
        if not isinstance(statement, cst.SimpleStatementLine) or len(statement.body) != 1:
            continue
        suite = recipe.parent(statement)
        if not isinstance(suite, (cst.Module, cst.IndentedBlock)):
            continue
        found.append(
            ModelAnchor(
                statement=statement,
                target=target,
                call=value,
                kind=kind,
                builder=recipe.call_name(value).split(".")[-1],
                suite=suite,
                target_code=recipe.code(target),
            )
        )
    return found


MODEL_LOOKED_FOR = (
    "the model construction (an assignment such as `model = LlamaForCausalLM(...)`, "
    "`model = build_model(...)` or `model = GPT(...)` with GPT an nn.Module subclass)"
)


def find_model(recipe: Recipe, skill: str, several: str = "") -> ModelAnchor:
    """The one assignment that builds the trained model; refuses when there is none or several
    (``several``: what the refusal suggests then, e.g. a parameter that names the model)."""
    candidates = model_candidates(recipe)
    engine = engine_class(recipe)
    if engine is not None:
        prepare = recipe.methods(engine).get("prepare_model")
        inside = [c for c in candidates if prepare is not None and recipe.is_inside(c.statement, prepare)]
        if inside:
            candidates = inside
    if len(candidates) > 1:
        trained = [c for c in candidates if _passed_to_optimizer(recipe, c.target_code)]
        if trained:
            candidates = trained
    if not candidates:
        wrapped = _wrapped_construction(recipe)
        if wrapped is not None:
            wrapper, inner = wrapped
            raise SkillRefused(
                f"{skill}: the model is built inside a wrapper ({recipe.where(wrapper)}: "
                f"`{recipe.short(wrapper)}`); a change to the model must land before wrappers such as "
                f"DDP, FSDP or PrivacyEngine.make_private; build it on a line of its own "
                f"(`model = {recipe.short(inner, 40)}`), wrap it on the next, then apply again"
            )
        raise SkillRefused(f"{skill}: looked for {MODEL_LOOKED_FOR} in {recipe.name}; found none")
    if len(candidates) > 1:
        places = ", ".join(f"`{c.target_code}` at {recipe.where(c.statement)}" for c in candidates)
        raise SkillRefused(
            f"{skill}: found several model constructions ({places}) and cannot tell which one is "
            f"trained; {several.format(model=candidates[0].target_code) or 'apply the pattern by hand (SKILL.md: Doing it by hand)'}"
        )
    return candidates[0]


def _wrapped_construction(recipe: Recipe) -> tuple[cst.Call, cst.Call] | None:
    """``model = DDP(Net().to(device))``: a model construction passed straight to a wrapper."""
    for assign in recipe.assigns():
        value = unwrap_chain(assign.value)
        if not isinstance(value, cst.Call):
            continue
        for arg in value.args:
            inner = unwrap_chain(arg.value)
            if isinstance(inner, cst.Call) and _model_kind(recipe, inner) is not None:
                if recipe.enclosing_class(assign) not in set(recipe.subclasses(*NN_MODULE, *HF_PRETRAINED)):
                    return value, inner
    return None


def _passed_to_optimizer(recipe: Recipe, target_code: str) -> bool:
    for call in optimizer_constructors(recipe):
        if not call.args:
            continue
        first = recipe.code(call.args[0].value)
        if f"{target_code}.parameters" in first or first == target_code:
            return True
    return False


# ---------------------------------------------------------------------------------------------
# Optimizers
# ---------------------------------------------------------------------------------------------


# Optimizer classes that skills write into a recipe. They take the model (not its parameters)
# and keep only the trainable parameters themselves.
SKILL_OPTIMIZERS = ("MuonWithAdamW",)


def optimizer_constructors(recipe: Recipe) -> list[cst.Call]:
    """``torch.optim.*`` constructors, and constructors of the optimizer classes skills write."""
    found = []
    for call in recipe.calls():
        name = recipe.call_name(call)
        if name.startswith("torch.optim.") and not name.startswith("torch.optim.lr_scheduler"):
            last = name.rsplit(".", 1)[-1]
            if last[:1].isupper():
                found.append(call)
        elif name in SKILL_OPTIMIZERS:
            found.append(call)
    return found


def assignment_target(recipe: Recipe, value: cst.CSTNode) -> cst.BaseExpression | None:
    parent = recipe.parent(value)
    if isinstance(parent, cst.Assign) and parent.value is value and len(parent.targets) == 1:
        return parent.targets[0].target
    return None


def optimizer_step_calls(recipe: Recipe) -> list[tuple[cst.Call, str]]:
    """``<optimizer>.step()`` calls whose receiver was assigned from an optimizer constructor."""
    names = set()
    for call in optimizer_constructors(recipe):
        target = assignment_target(recipe, call)
        if target is not None:
            names.add(dotted_name(target))
    found = []
    for call in recipe.method_calls("step"):
        receiver = dotted_name(call.func.value)  # type: ignore[attr-defined]
        if receiver and receiver in names:
            found.append((call, receiver))
    return found


# ---------------------------------------------------------------------------------------------
# Forward calls and the mesh
# ---------------------------------------------------------------------------------------------


def forward_calls(recipe: Recipe, model: ModelAnchor) -> list[cst.Call]:
    """Calls of the model object (``model(...)``, ``self.model(...)``)."""
    receivers = {model.target_code}
    if engine_class(recipe) is not None:
        receivers.add("self.model")
    return [c for c in recipe.calls() if dotted_name(c.func) in receivers]


def keyword(call: cst.Call, name: str) -> cst.Arg | None:
    return next((a for a in call.args if a.keyword is not None and a.keyword.value == name), None)


def positional(call: cst.Call, index: int) -> cst.Arg | None:
    args = [a for a in call.args if a.keyword is None and not a.star]
    return args[index] if index < len(args) else None


def string_values(expression: cst.BaseExpression) -> list[str]:
    """The string literals of a tuple/list expression (``("dp", "tp")`` → ``["dp", "tp"]``)."""
    if isinstance(expression, (cst.Tuple, cst.List)):
        return [
            e.value.evaluated_value
            for e in expression.elements
            if isinstance(e.value, cst.SimpleString) and isinstance(e.value.evaluated_value, str)
        ]
    return []


def device_mesh_with(recipe: Recipe, dim: str) -> tuple[cst.Call, cst.BaseExpression] | None:
    """The ``init_device_mesh`` call that names a ``dim`` dimension, and what it is assigned to."""
    for call in recipe.calls_to(".init_device_mesh"):
        names = keyword(call, "mesh_dim_names")
        if names is not None and dim in string_values(names.value):
            target = assignment_target(recipe, call)
            if target is not None:
                return call, target
    return None
