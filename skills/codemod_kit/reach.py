"""What a change to the model will act on, decided from the code the codemod can see.

A block-wise skill (activation checkpointing, per-block compilation, tensor parallelism, freezing
the first blocks) acts only on a model with repeated blocks; LoRA only on ``nn.Linear`` layers.
This module reads the model's class (and the classes of the file it builds as attributes) and
finds:

- block containers: ``nn.ModuleList(...)`` of anything, or ``nn.Sequential(...)`` of modules of
  one class (``nn.Sequential(*[Block() for _ in range(4)])``, ``nn.Sequential(Down(), Down())``);
  a Hugging Face model class has its decoder layers;
- the ``nn.Linear`` layers of the model and of its blocks, by attribute name.

The written helpers find the same things at run time (``find_blocks``), so what ``apply_skill``
reports is what the run does. A ``target`` (a model expression such as ``model.encoder``) names
the module to act on when the search would find nothing or the wrong thing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import libcst as cst

from skills.codemod_kit import anchors, pointing
from skills.codemod_kit.anchors import ModelAnchor
from skills.codemod_kit.recipe import Recipe, dotted_name
from skills.errors import SkillRefused

MODULE_LIST = ("torch.nn.ModuleList",)
SEQUENTIAL = ("torch.nn.Sequential",)
MODULE_DICT = ("torch.nn.ModuleDict",)
LINEAR = ("torch.nn.Linear",)
TRANSFORMER_STACKS = ("torch.nn.TransformerEncoder", "torch.nn.TransformerDecoder")
_DEPTH = 4


@dataclass
class Container:
    path: str  # attribute path from the model, e.g. "transformer.h"
    kind: str  # "ModuleList" / "Sequential" / "module" (a target that is one module)
    count: int | None  # number of blocks when the code says it
    count_text: str  # "4", "`config.n_layer`", "3 (`depth`'s default)", "?"
    block_class: cst.ClassDef | None  # the local class of the blocks, when one
    elements_known: bool = True  # False when the blocks are added elsewhere (append, *layers)
    builtin: bool = False  # torch.nn's own layers (nn.TransformerEncoder's): dynamo skips compiling them alone


@dataclass
class ModelShape:
    """What the codemod can see of the model: its class, block containers and linear layers."""

    model: ModelAnchor
    cls: cst.ClassDef | None  # the model's class when defined in the file
    hf: bool  # a Hugging Face model class: decoder layers, names known only at run time
    containers: list[Container] = field(default_factory=list)
    linears: list[str] = field(default_factory=list)  # attribute paths of nn.Linear layers
    attributes: list[str] = field(default_factory=list)  # the model class's own submodules

    hf_class: str = ""  # the Hugging Face class the model is built from
    opaque: list[str] = field(default_factory=list)  # submodules built by classes the codemod cannot see
    owner: Recipe | None = None  # the file that defines ``cls`` (a sibling module: model.py)

    @property
    def name(self) -> str:
        if self.cls is not None:
            return self.cls.name.value
        return self.hf_class or self.model.builder


def model_class(recipe: Recipe, model: ModelAnchor) -> cst.ClassDef | None:
    """The file's class that builds the model (through a builder function of the file too)."""
    classes = recipe.top_level_classes()
    name = recipe.call_name(model.call)
    if name in classes:
        return classes[name]
    function = recipe.top_level_functions().get(name)
    if function is not None:
        for ret in recipe.returns_of(function):
            if ret.value is not None:
                inner = anchors.unwrap_chain(ret.value)
                if isinstance(inner, cst.Call) and recipe.call_name(inner) in classes:
                    return classes[recipe.call_name(inner)]
    return None


def shape(recipe: Recipe, model: ModelAnchor) -> ModelShape:
    owner, cls = recipe, model_class(recipe, model)
    hf = model.kind == "hf"
    if cls is None and model.kind == "factory":
        sibling = sibling_class(recipe, model.call)
        if sibling is not None:
            owner, cls = sibling
            hf = cls in owner.subclasses(*anchors.HF_PRETRAINED)
    found = ModelShape(model=model, cls=cls, hf=hf, owner=owner)
    if found.hf:
        found.hf_class = cls.name.value if cls is not None else _hf_class(recipe, model.call)
    if cls is not None and not found.hf:
        found.attributes = [n for n, v in _attributes(owner, cls).items() if _builds_module(v)]
        _walk_class(owner, cls, "", found, 0)
    return found


def _builds_module(value: cst.BaseExpression) -> bool:
    """``nn.Linear(...)``, ``Block(...)``, ``build_encoder(...)``: not ``config.n_layer``, not ``None``."""
    value = anchors.unwrap_chain(value)
    if not isinstance(value, cst.Call):
        return False
    name = dotted_name(value.func).rsplit(".", 1)[-1]
    return bool(name) and (name[:1].isupper() or "build" in name or "make" in name or "create" in name)


def sibling_class(recipe: Recipe, call: cst.Call) -> tuple[Recipe, cst.ClassDef] | None:
    """``GPT`` of ``from model import GPT`` when ``model.py`` sits next to the file: a recipe
    folder whose model lives in one file and loop in another."""
    module, _, name = recipe.call_name(call).rpartition(".")
    if not module:
        return None
    folder = recipe.path.parent
    for candidate in (folder / (module.replace(".", "/") + ".py"), folder / (module.rsplit(".", 1)[-1] + ".py")):
        if candidate.is_file() and candidate.resolve() != recipe.path.resolve():
            try:
                other = Recipe(candidate, candidate.read_text(encoding="utf-8"))
            except (OSError, UnicodeDecodeError, SkillRefused):
                return None
            cls = other.top_level_classes().get(name)
            if cls is not None and cls in other.subclasses(*anchors.MODULE_BASES, *anchors.HF_PRETRAINED):
                return other, cls
            return None
    return None


def _hf_class(recipe: Recipe, call: cst.Call) -> str:
    """``LlamaForCausalLM`` for ``LlamaForCausalLM(config)``, ``X.from_pretrained(...)`` or a
    builder function of the file that returns one."""
    name = recipe.call_name(call)
    if name.startswith("transformers."):
        parts = name.split(".")
        return parts[-2] if parts[-1] in {"from_pretrained", "from_config", "_from_config"} else parts[-1]
    function = recipe.top_level_functions().get(name)
    classes: list[str] = []
    if function is not None:
        for ret in recipe.returns_of(function):
            inner = anchors.unwrap_chain(ret.value) if ret.value is not None else None
            if isinstance(inner, (cst.Name, cst.Attribute)):  # model = X(...); ...; return model
                built = [c.call for c in anchors.constructions_of(recipe, function, dotted_name(inner))]
                inner = built[0] if len(built) == 1 else inner
            if isinstance(inner, cst.Call) and recipe.call_name(inner).startswith("transformers."):
                found = _hf_class(recipe, inner)
                if found not in classes:
                    classes.append(found)
    return " or ".join(classes) or name.rsplit(".", 1)[-1]


def _attributes(recipe: Recipe, cls: cst.ClassDef) -> dict[str, cst.BaseExpression]:
    """``self.<name> = <value>`` in the class's methods, in source order (the first one wins)."""
    out: dict[str, cst.BaseExpression] = {}
    for assign in recipe.assigns():
        if recipe.enclosing_class(assign) is not cls or len(assign.targets) != 1:
            continue
        target = dotted_name(assign.targets[0].target)
        if target.startswith("self.") and target.count(".") == 1:
            out.setdefault(target[5:], assign.value)
    return out


def _local_module_class(recipe: Recipe, call: cst.BaseExpression) -> cst.ClassDef | None:
    if not isinstance(call, cst.Call):
        return None
    cls = recipe.top_level_classes().get(recipe.call_name(call))
    if cls is not None and cls in recipe.subclasses(*anchors.MODULE_BASES):
        return cls
    return None


def _walk_class(recipe: Recipe, cls: cst.ClassDef, prefix: str, found: ModelShape, depth: int) -> None:
    if depth > _DEPTH:
        return
    for name, value in _attributes(recipe, cls).items():
        _walk_value(recipe, value, prefix + name, found, depth)


def _walk_value(recipe: Recipe, value: cst.BaseExpression, path: str, found: ModelShape, depth: int) -> None:
    value = anchors.unwrap_chain(value)
    if not isinstance(value, cst.Call):
        return
    name = recipe.call_name(value)
    if name in LINEAR:
        found.linears.append(path)
        return
    if name == "torch.nn.Transformer":  # its encoder's and decoder's layers
        for part, default in (("encoder", 6), ("decoder", 6)):
            arg = anchors.keyword(value, f"num_{part}_layers")
            count = int(arg.value.value) if arg is not None and isinstance(arg.value, cst.Integer) else None
            text = str(count) if count is not None else (f"`{recipe.code(arg.value)}`" if arg else f"{default} (default)")
            found.containers.append(Container(f"{path}.{part}.layers", "ModuleList", count, text, None, builtin=True))
        return
    if name in TRANSFORMER_STACKS:  # nn.TransformerEncoder(layer, num_layers): its .layers
        count_arg = value.args[1].value if len(value.args) > 1 else None
        count = int(count_arg.value) if isinstance(count_arg, cst.Integer) else None
        text = str(count) if count is not None else (f"`{recipe.code(count_arg)}`" if count_arg is not None else "?")
        found.containers.append(Container(f"{path}.layers", "ModuleList", count, text, None, builtin=True))
        return
    if name in MODULE_DICT:
        for key, item in _dict_items(value):
            _walk_value(recipe, item, f"{path}.{key}", found, depth)
        return
    if name in MODULE_LIST or name in SEQUENTIAL:
        elements, count, count_text = _elements(recipe, value)
        comprehension = _from_comprehension(value)
        classes = {recipe.call_name(e) if isinstance(e, cst.Call) else "" for e in elements}
        one_class = len(classes) == 1 and "" not in classes
        if name in MODULE_LIST:
            repeated = True
        else:  # a Sequential is blocks when its modules are of one class (and more than one)
            repeated = one_class and (comprehension or len(elements) >= 2)
        if repeated:
            block = _local_module_class(recipe, elements[0]) if one_class else None
            found.containers.append(
                Container(path, name.rsplit(".", 1)[-1], count, count_text, block, elements_known=bool(elements))
            )
        for index, element in enumerate(elements):
            _walk_value(recipe, element, f"{path}.<i>" if comprehension else f"{path}.{index}", found, depth + 1)
        return
    cls = _local_module_class(recipe, value)
    if cls is not None:
        _walk_class(recipe, cls, path + ".", found, depth + 1)
    elif not name.startswith("torch.") and name.rsplit(".", 1)[-1][:1].isupper():
        found.opaque.append(path)


def _dict_items(call: cst.Call) -> list[tuple[str, cst.BaseExpression]]:
    if not call.args:
        return []
    inner = call.args[0].value
    if isinstance(inner, cst.Call) and dotted_name(inner.func) == "dict":
        return [(a.keyword.value, a.value) for a in inner.args if a.keyword is not None]
    if isinstance(inner, cst.Dict):
        return [
            (e.key.evaluated_value, e.value)
            for e in inner.elements
            if isinstance(e, cst.DictElement) and isinstance(e.key, cst.SimpleString)
        ]
    return []


def _from_comprehension(call: cst.Call) -> bool:
    return len(call.args) == 1 and isinstance(call.args[0].value, (cst.ListComp, cst.GeneratorExp))


def _elements(recipe: Recipe, call: cst.Call) -> tuple[list[cst.BaseExpression], int | None, str]:
    """The module expressions a ModuleList/Sequential is built from, and how many there are."""
    args = [a for a in call.args if a.keyword is None]
    if len(args) == 1 and (args[0].star == "*" or recipe.call_name(call) in MODULE_LIST):
        inner = args[0].value
        if isinstance(inner, (cst.List, cst.Tuple)):
            elements = [e.value for e in inner.elements if not isinstance(e, cst.StarredElement)]
            return elements, len(elements), str(len(elements))
        if isinstance(inner, (cst.ListComp, cst.GeneratorExp)):
            count, text = _range_count(recipe, inner.for_in)
            return [inner.elt], count, text
        return [], None, "?"
    elements = [a.value for a in args if not a.star]
    if not elements or any(a.star for a in args):  # ModuleList() filled by append, Sequential(*layers)
        return elements, None, "?"
    return elements, len(elements), str(len(elements))


def _range_count(recipe: Recipe, comp_for: cst.CompFor) -> tuple[int | None, str]:
    it = comp_for.iter
    if isinstance(it, cst.Call) and dotted_name(it.func) == "range" and len(it.args) == 1:
        value = it.args[0].value
        if isinstance(value, cst.Integer):
            return int(value.value), value.value
        default = _parameter_default(recipe, comp_for, value)
        if default is not None:
            return None, f"{default} (`{recipe.code(value)}`'s default)"
        return None, f"`{recipe.code(value)}`"
    return None, "?"


def _parameter_default(recipe: Recipe, node: cst.CSTNode, value: cst.BaseExpression) -> str | None:
    """``depth`` → ``3`` when ``depth`` is a parameter of the enclosing function with default 3."""
    function = recipe.enclosing_function(node)
    if function is None or not isinstance(value, cst.Name):
        return None
    for param in function.params.params:
        if param.name.value == value.value and isinstance(param.default, cst.Integer):
            return param.default.value
    return None


# ---------------------------------------------------------------------------------------------
# Targets named by the agent
# ---------------------------------------------------------------------------------------------


def find_target_model(recipe: Recipe, skill: str, target: str | None) -> ModelAnchor:
    """The model to change: the one the target names (a model expression, or a line), when
    given (so a file that trains two models, a GAN, can be told which)."""
    return pointing.find_model(recipe, skill, target)


def resolve_target(recipe: Recipe, skill: str, found: ModelShape, target: str | None) -> Container | None:
    """The module a target names, checked against the model's class when the file defines it;
    None when there is no target or it names the model itself (its blocks are searched)."""
    if target is None or pointing.place(recipe, skill, target, "target") is not None:
        return None
    dotted = pointing.parse_expression(skill, target)
    path = pointing.relative(found.model, dotted)
    if not path:
        return None
    if found.cls is None or found.hf:
        return Container(path, "module", None, "?", None)
    for container in found.containers:
        if container.path == path:
            return container
    if path in found.attributes:
        return Container(path, "module", 1, "1", None)
    head = path.split(".")[0]
    if head in found.attributes:  # deeper than the codemod follows; checked at run time
        return Container(path, "module", None, "?", None)
    raise SkillRefused(
        f"{skill}: target {target!r} names no submodule of {found.name}; its submodules are "
        f"{_listing(found.attributes)}"
    )


def target_code(found: ModelShape, container: Container) -> str:
    """The target as code at the model's construction (``model.layers`` where the skill writes
    its call, also when the agent named it through ``self._model.layers``)."""
    return _join(found.model.target_code, container.path)


# ---------------------------------------------------------------------------------------------
# Refusals and reports
# ---------------------------------------------------------------------------------------------


def _listing(names: list[str]) -> str:
    return ", ".join(f"`{n}`" for n in names) if names else "none"


def submodules(found: ModelShape) -> str:
    """```model.embed`, `model.lstm`, `model.head``` for refusals that suggest a target."""
    return _listing([f"{found.model.target_code}.{name}" for name in found.attributes]) if found.attributes else (
        f"`{found.model.target_code}.<submodule>`"
    )


def require_blocks(recipe: Recipe, skill: str, found: ModelShape, instead: str) -> list[Container]:
    """The block containers of the model, or a refusal that says what was found and what works.
    A model whose class (or a submodule's class) the codemod cannot see has its blocks found at
    run time (the written helper raises when there are none)."""
    if found.hf or found.containers or found.cls is None or found.opaque:
        return found.containers
    where = recipe.where(found.model.statement)
    seen = (
        f"{found.name} ({where}) has no repeated blocks (an nn.ModuleList, or an nn.Sequential of "
        f"modules of one class); its submodules are {_listing(found.attributes)}"
    )
    raise SkillRefused(f"{skill}: {seen}, so the change would do nothing; {instead}")


def describe_blocks(found: ModelShape, target: Container | None = None) -> str:
    """``4 blocks of model.layers`` / ``the decoder layers of LlamaForCausalLM (counted at run time)``."""
    model = found.model.target_code
    if target is not None and target.path:
        if target.kind == "module":
            return f"`{_join(model, target.path)}` as one block"
        return f"{_count(target)} of `{_join(model, target.path)}`"
    if found.hf:
        from skills.codemod_kit import vlm  # (vlm imports this module)

        # The layers its _no_split_modules names (find_blocks): a vision-language model's both towers'.
        layers = "the layers of the vision tower and of the language model" if vlm.is_vision_language(found) \
            else "the decoder layers"
        return f"{layers} of {found.name} (counted at run time)"
    if not found.containers:
        inside = f" (inside {', '.join(f'`{_join(model, p)}`' for p in found.opaque)})" if found.opaque else ""
        return (
            f"the repeated blocks of `{model}`{inside}, found at run time: it is built by "
            f"{found.model.builder}(...), whose class the codemod cannot see"
            if found.cls is None
            else f"the repeated blocks of `{model}`{inside}, found at run time"
        )
    if len(found.containers) == 1:
        only = found.containers[0]
        return f"{_count(only)} of `{_join(model, only.path)}`"
    places = ", ".join(f"`{_join(model, c.path)}` ({_count(c)})" for c in found.containers)
    return f"the blocks of the largest (by parameters, at run time) of {places}"


def _count(container: Container) -> str:
    if container.count is not None:
        return f"{container.count} block{'s' if container.count != 1 else ''}"
    if container.count_text != "?":
        return f"{container.count_text} blocks"  # e.g. "`config.n_layer` blocks"
    return "the blocks (counted at run time)"


def _join(model: str, path: str) -> str:
    return model if path in ("", model) or path.startswith(model + ".") else f"{model}.{path}"


def block_linears(found: ModelShape) -> list[str]:
    """The leaf names of the nn.Linear layers inside the blocks (``q_proj``, ``c_fc``)."""
    names: set[str] = set()
    for container in found.containers:
        prefix = container.path + "."
        for linear in found.linears:
            if linear.startswith(prefix):
                names.add(linear.rsplit(".", 1)[-1])
    return sorted(names)
