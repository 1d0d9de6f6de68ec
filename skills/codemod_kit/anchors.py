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

ENGINE_BASES = ("engine.engine.Engine", "engine.Engine")
NN_MODULE = ("torch.nn.Module", "torch.nn.modules.module.Module")
LIGHTNING_MODULE = (
    "lightning.LightningModule",
    "lightning.pytorch.LightningModule",
    "pytorch_lightning.LightningModule",
    "lightning.pytorch.core.LightningModule",
    "pytorch_lightning.core.LightningModule",
)
MODULE_BASES = NN_MODULE + LIGHTNING_MODULE
HF_PRETRAINED = ("transformers.PreTrainedModel", "transformers.modeling_utils.PreTrainedModel")
_HF_MODEL_CLASS = re.compile(r"(Model|For[A-Za-z]+)$")
_CHAIN_METHODS = {"to", "cuda", "cpu", "float", "bfloat16", "half", "train", "to_empty"}
_HF_LOADERS = {"from_pretrained", "from_config", "_from_config"}
# Functions that build a model and whose class the codemod cannot see: build_model, setup_model,
# self._setup_model, timm.create_model, get_model, load_model; config.instantiate(cfg.model) when
# assigned to a model-like name.
_FACTORY = re.compile(
    r"^_*(setup|build|create|get|load|make|init|initialize|instantiate|prepare|construct)(_[a-z0-9]+)*"
    r"_(model|net|network|transformer|gpt|llm|lm|policy)$",
    re.I,
)
_MODEL_NAME = re.compile(
    r"^_*([a-z0-9]+_)*(model|net|network|policy|generator|discriminator|critic|actor|gpt|llm|lm|transformer|student"
    r"|teacher)([A-Z][a-z]*|\d*)$",
    re.I,
)
_LIBRARY_ROOTS = {"torch", "transformers", "peft", "trl", "accelerate", "lightning", "pytorch_lightning", "deepspeed"}

ModelKind = Literal["hf", "custom", "factory"]


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
    statement: cst.BaseStatement  # the construction (an if/else that builds it in each branch)
    target: cst.BaseExpression  # Name("model") or Attribute(self.model)
    call: cst.Call
    kind: ModelKind
    builder: str  # the name the construction calls, for messages
    suite: Suite
    target_code: str
    outer: str = ""  # ``self._model`` for ``self._model = self._setup_model()`` that returns this one


def engine_class(recipe: Recipe) -> cst.ClassDef | None:
    classes = recipe.subclasses(*ENGINE_BASES)
    return classes[0] if len(classes) == 1 else None


_VERBS = {"save", "load", "eval", "evaluate", "train", "get", "set", "unwrap", "wrap", "create", "build", "setup",
          "make", "init", "prepare", "update", "compute", "run", "log", "print", "push", "export", "freeze"}


def model_like(name: str) -> bool:
    """``model``, ``self._model``, ``netG``, ``policy``: a name that holds a model (not
    ``save_model``, ``self._setup_model``: functions)."""
    last = name.rsplit(".", 1)[-1]
    return bool(_MODEL_NAME.match(last)) and last.lstrip("_").split("_")[0].lower() not in _VERBS


def _model_kind(recipe: Recipe, call: cst.Call, depth: int = 0, target: str = "") -> ModelKind | None:
    name = recipe.call_name(call)
    if not name:
        return None
    parts = name.split(".")
    if parts[-1] in _HF_LOADERS and len(parts) > 1:
        return "hf" if _HF_MODEL_CLASS.search(parts[-2]) else None
    if parts[0] == "transformers":
        return "hf" if _HF_MODEL_CLASS.search(parts[-1]) else None
    local_classes = recipe.top_level_classes()
    if name in local_classes:
        cls = local_classes[name]
        if cls in recipe.subclasses(*HF_PRETRAINED):
            return "hf"
        if cls in recipe.subclasses(*MODULE_BASES):
            return "custom"
        return None
    function = recipe.top_level_functions().get(name)
    if function is None and parts[0] == "self" and len(parts) == 2:
        cls = recipe.enclosing_class(call)
        function = recipe.methods(cls).get(parts[1]) if cls is not None else None
    if function is not None and depth == 0:
        kinds = set()
        for ret in recipe.returns_of(function):
            if ret.value is not None:
                inner = unwrap_chain(ret.value)
                if isinstance(inner, cst.Call):
                    kind = _model_kind(recipe, inner, depth + 1)
                    if kind:
                        kinds.add(kind)
                elif isinstance(inner, (cst.Name, cst.Attribute)):
                    kinds.update(c.kind for c in constructions_of(recipe, function, dotted_name(inner)))
        if kinds:
            return "hf" if kinds == {"hf"} else "custom" if "custom" in kinds else "factory"
    if parts[0] in _LIBRARY_ROOTS and parts[-1] != "create_model":
        return None
    if _FACTORY.match(parts[-1]):
        return "factory"
    if target and model_like(target):
        if parts[-1] == "instantiate":
            return "factory"
        local = dotted_name(call.func)
        imported = recipe.imports.get(local.split(".")[0], "")
        if local.count(".") <= 1 and imported and imported.split(".")[0] not in _LIBRARY_ROOTS and parts[-1][:1].isupper():
            return "factory"  # model = GPT(config) with GPT imported from the project's model.py
    return None


def constructions_of(recipe: Recipe, function: cst.FunctionDef, name: str) -> list[ModelAnchor]:
    """The model constructions inside ``function`` that assign ``name`` (``model = X(...)``)."""
    return [c for c in _all_constructions(recipe) if c.target_code == name and recipe.is_inside(c.statement, function)]


def _all_constructions(recipe: Recipe) -> list[ModelAnchor]:
    cached = getattr(recipe, "_model_constructions", None)
    if cached is None:
        cached = []
        recipe._model_constructions = cached  # type: ignore[attr-defined]  # guards the recursion too
        cached.extend(_scan_constructions(recipe))
    return cached


def _scan_constructions(recipe: Recipe) -> list[ModelAnchor]:
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
        target_code = recipe.code(target)
        if any(dotted_name(a.value) == target_code for a in value.args):
            continue  # model = get_peft_model(model, ...): a stage of the model, not its construction
        kind = _model_kind(recipe, value, target=target_code)
        if kind is None or (kind == "factory" and not _used_as_model(recipe, target_code)):
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
                target_code=target_code,
            )
        )
    return _merge_branches(recipe, found)


_MODEL_METHODS = {"parameters", "named_parameters", "train", "eval", "to", "cuda", "compile", "state_dict", "load_state_dict", "modules",
                  "named_modules", "zero_grad", "requires_grad_", "gradient_checkpointing_enable"}


def factory_name(name: str) -> bool:
    """``build_model``, ``_setup_model``, ``create_model``: a function that builds a model."""
    return bool(_FACTORY.match(name))


def _used_as_model(recipe: Recipe, name: str) -> bool:
    return name in model_uses(recipe)


def model_uses(recipe: Recipe) -> set[str]:
    """Names used as a model: called (``model(x)``), asked for their parameters or modules, or
    handed to a wrapper (``fabric.setup(model)``, ``accelerator.prepare(model, ...)``)."""
    uses = getattr(recipe, "_model_uses", None)
    if uses is None:
        uses = set()
        for call in recipe.calls():
            func = call.func
            uses.add(dotted_name(func))
            if isinstance(func, cst.Attribute) and func.attr.value in _MODEL_METHODS:
                uses.add(dotted_name(func.value))
            if isinstance(func, cst.Attribute) and func.attr.value in {"setup", "prepare", "setup_module", "fit"} or (
                dotted_name(func).rsplit(".", 1)[-1] in {"DistributedDataParallel", "DDP", "fully_shard", "FSDP"}
            ):
                uses.update(dotted_name(a.value) for a in call.args)
        recipe._model_uses = uses  # type: ignore[attr-defined]
    return uses


def _merge_branches(recipe: Recipe, found: list[ModelAnchor]) -> list[ModelAnchor]:
    """``if pretrained: model = X.from_pretrained(...) else: model = X.from_config(...)``: one
    construction, the ``if`` statement, so that later stages go after both branches."""
    merged: list[ModelAnchor] = []
    for anchor in found:
        same = next((m for m in merged if m.target_code == anchor.target_code), None)
        if same is not None:
            common = _common_if(recipe, same.statement, anchor.statement)
            if common is not None:
                suite = recipe.parent(common)
                if isinstance(suite, (cst.Module, cst.IndentedBlock)):
                    same.statement, same.suite = common, suite
                    if same.kind != anchor.kind:
                        same.kind = "hf" if {same.kind, anchor.kind} == {"hf"} else "factory"
                    continue
        merged.append(anchor)
    return merged


def _common_if(recipe: Recipe, first: cst.CSTNode, second: cst.CSTNode) -> cst.If | None:
    """The outermost ``if`` of the chain that holds both statements in different branches."""
    outer_of_first = [a for a in recipe.ancestors(first) if isinstance(a, cst.If)]
    for candidate in outer_of_first:
        if recipe.is_inside(second, candidate):
            top = candidate
            while isinstance(recipe.parent(top), cst.Else) or isinstance(recipe.parent(top), cst.If):
                top = recipe.parent(top)  # type: ignore[assignment]
                while not isinstance(top, cst.If):
                    top = recipe.parent(top)  # type: ignore[assignment]
            return top
    return None


def model_candidates(recipe: Recipe) -> list[ModelAnchor]:
    """Assignments that build a model, leaving out sub-modules built inside model classes. A
    construction returned by a function of the file (``self._model = self._setup_model()``,
    whose ``model = config.instantiate(...)`` is returned) stands for the outer assignment: the
    change lands where the model is built, before the wrappers the function applies. A top-level
    builder function that only builds (``def build_model(cfg): model = Llava(config);
    model.load_weights(...); return model``, no wrapper after the construction) stands for its
    construction instead: the changes land at its call, where the recipe prepares the model."""
    found = list(_all_constructions(recipe))
    replaced: set[int] = set()
    builders: set[int] = set()
    for outer in found:
        name = recipe.call_name(outer.call)
        parts = name.split(".")
        function = recipe.top_level_functions().get(name)
        if function is None and parts[0] == "self" and len(parts) == 2:
            cls = recipe.enclosing_class(outer.call)
            function = recipe.methods(cls).get(parts[1]) if cls is not None else None
        if function is None:
            continue
        for ret in recipe.returns_of(function):
            inner_value = unwrap_chain(ret.value) if ret.value is not None else None
            if isinstance(inner_value, (cst.Name, cst.Attribute)):
                inners = constructions_of(recipe, function, dotted_name(inner_value))
                if name in recipe.top_level_functions() and inners and all(_only_builds(recipe, i) for i in inners):
                    builders.update(id(i) for i in inners)
                    continue
                for inner in inners:
                    inner.outer = outer.target_code
                    replaced.add(id(outer))
    return [c for c in found if id(c) not in replaced and id(c) not in builders]


def _only_builds(recipe: Recipe, construction: ModelAnchor) -> bool:
    """No model stage (a wrapper, a kernel swap, checkpointing...) after the construction in its
    function: loading weights or setting attributes only."""
    from skills.codemod_kit import stages

    return all(stage in (None, stages.RETURN) for _, stage in stages.stages_after(recipe, construction))


MODEL_LOOKED_FOR = (
    "the model construction (an assignment such as `model = LlamaForCausalLM(...)`, "
    "`model = build_model(...)` or `model = GPT(...)` with GPT an nn.Module subclass)"
)


def wrapped_construction(recipe: Recipe) -> tuple[cst.Call, cst.Call] | None:
    """``model = DDP(Net().to(device))``: a model construction passed straight to a wrapper."""
    for assign in recipe.assigns():
        value = unwrap_chain(assign.value)
        if not isinstance(value, cst.Call):
            continue
        for arg in value.args:
            inner = unwrap_chain(arg.value)
            if isinstance(inner, cst.Call) and _model_kind(recipe, inner) in ("hf", "custom"):
                if recipe.enclosing_class(assign) not in set(recipe.subclasses(*NN_MODULE, *HF_PRETRAINED)):
                    return value, inner
    return None


def passed_to_optimizer(recipe: Recipe, target_code: str) -> bool:
    """Are the model's parameters given to an optimizer (a torch.optim class, or any call that
    names an optimizer: ``config.instantiate(cfg.optimizer, self._model.parameters())``)?"""
    names = {target_code}
    constructors = set(optimizer_constructors(recipe))
    for call in recipe.calls():
        if call not in constructors and not _names_an_optimizer(recipe, call):
            continue
        for arg in call.args:
            text = recipe.code(arg.value)
            for name in names:
                if text == name or f"{name}.parameters(" in text or f"{name}.named_parameters(" in text:
                    return True
    return False


def _names_an_optimizer(recipe: Recipe, call: cst.Call) -> bool:
    target = assignment_target(recipe, call)
    if target is not None and "opt" in recipe.code(target).lower():
        return True
    return "optim" in recipe.code(call).lower()


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


_OPTIMIZER_NAME = re.compile(r"^_*(opt|optim|optimi[sz]er)(s|_\w+|[A-Z]\w*)?$")


def optimizer_like(name: str) -> bool:
    """``optimizer``, ``self._optimizer``, ``self.optimizers``, ``optD``, ``opt_g``."""
    last = name.rsplit(".", 1)[-1]
    return bool(_OPTIMIZER_NAME.match(last)) and "sched" not in last.lower()


def optimizer_step_calls(recipe: Recipe, within: cst.CSTNode | None = None) -> list[tuple[cst.Call, str]]:
    """Optimizer steps and the optimizer each steps: ``<optimizer>.step()`` on a name assigned
    from an optimizer constructor or named like one (``self._optimizer``, ``self.optimizers``,
    ``optD``), and ``scaler.step(optimizer)`` of a GradScaler."""
    names = set()
    for call in optimizer_constructors(recipe):
        target = assignment_target(recipe, call)
        if target is not None:
            names.add(dotted_name(target))
    found = []
    for call in recipe.method_calls("step", within=within):
        receiver = dotted_name(call.func.value)  # type: ignore[attr-defined]
        if not receiver:
            continue
        if receiver in names or (optimizer_like(receiver) and not call.args):
            found.append((call, receiver))
        elif "scaler" in receiver.rsplit(".", 1)[-1].lower() and len(call.args) == 1:
            optimizer = dotted_name(call.args[0].value)
            if optimizer:
                found.append((call, optimizer))
    return found


# ---------------------------------------------------------------------------------------------
# Forward calls and the mesh
# ---------------------------------------------------------------------------------------------


def forward_calls(recipe: Recipe, model: ModelAnchor, within: cst.CSTNode | None = None) -> list[cst.Call]:
    """Calls of the model object (``model(...)``, ``self.model(...)``), inside ``within`` when given."""
    receivers = {model.target_code} | ({model.outer} if model.outer else set())
    if engine_class(recipe) is not None:
        receivers.add("self.model")
    return [
        c for c in recipe.calls()
        if dotted_name(c.func) in receivers and (within is None or recipe.is_inside(c, within))
    ]


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
