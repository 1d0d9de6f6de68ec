"""sequence-packing: first-fit-decreasing bin packing of documents into rows, with position
ids that restart per document so attention stays inside each document.

Two recipe shapes are recognised, by structure:

- an engine recipe whose ``prepare_data`` returns a stream class of the file, built from a list
  of pieces, and whose ``__next__`` returns ``collate(pieces, seq_len, pad_id)`` (the template);
- a ``torch.utils.data.DataLoader(dataset, collate_fn=partial(collate, seq_len=..., pad_id=...))``.

In both, the list of sequences is packed (``pack_pieces(...)``) and the collate function is
swapped for ``collate_packed``, which keeps the original's parameter names. Forward calls that
pass ``attention_mask`` get ``position_ids`` instead: transformers builds the block-diagonal
causal mask from restarting position ids only when ``attention_mask`` is None.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import libcst as cst
from pydantic import Field

from skills.codemod_kit import copied, pointing
from skills.codemod_kit import AlreadyApplied, Edits, Recipe, SkillParams, anchors, insert_definitions, templates
from skills.codemod_kit.anchors import keyword, positional
from skills.codemod_kit.layout import with_keyword
from skills.codemod_kit.recipe import dotted_name
from skills.errors import SkillRefused

SKILL = "sequence-packing"
SEQ_LEN_NAMES = ("seq_len", "seq_length", "max_length", "max_len", "block_size", "context_length")
HELPER_NAMES = ("first_fit_decreasing", "pack_pieces", "collate_packed")


class Params(SkillParams):
    seq_len: int | None = Field(
        None,
        ge=2,
        description="Positions per packed row; default: the recipe's own sequence length (the "
        "argument its collate function receives).",
    )
    target: str | None = pointing.target_field()
    loop: str | None = pointing.loop_field()


# The packing functions are a real module beside this file (packing.py), copied into the recipe:
# the pair for the recipe's kind of data, as pack_pieces and collate_packed.
PACKING_MODULE = Path(__file__).with_name("packing.py")


@dataclass
class DataPath:
    """Where the sequences are handed over (wrapped in ``pack_pieces``) and which collate
    function lays out a batch (swapped for ``collate_packed``)."""

    sequences: cst.BaseExpression
    seq_len: cst.BaseExpression
    collate: cst.FunctionDef
    collate_reference: cst.Name  # the Name that refers to the collate function at the call site


def apply(recipe: Recipe, params: Params) -> Edits | AlreadyApplied:
    refuse_a_recipe_that_packs_by_its_config(recipe)
    helpers = recipe.calls_to(*HELPER_NAMES)
    if helpers:
        return AlreadyApplied(f"packing at {recipe.where(helpers[0])}")
    model = pointing.find_model(recipe, SKILL, params.target)
    path = _engine_data_path(recipe) or _dataloader_data_path(recipe)
    if path is None:
        raise SkillRefused(
            f"{SKILL}: looked for an Engine.prepare_data that returns a stream built from a list of "
            "pieces and collated by a function of the file, or a DataLoader(..., "
            f"collate_fn=partial(collate, seq_len=..., pad_id=...)), in {recipe.name}; found neither"
        )
    if "pack" in path.collate.name.value.lower():
        return AlreadyApplied(f"the batches are collated by {path.collate.name.value}()")
    items = path.collate.params.params[0].name.value if path.collate.params.params else ""
    if "pair" in items.lower():
        raise SkillRefused(
            f"{SKILL}: {path.collate.name.value}({items}, ...) ({recipe.where(path.collate)}) lays out each of "
            f"its {items} as rows that are compared with one another (a preference pair's answers); "
            "packing would split and mix them, so this recipe pads"
        )
    if model.kind != "hf":
        raise SkillRefused(
            f"{SKILL}: the model is built by {model.builder}(...) ({recipe.where(model.statement)}), "
            f"{'a module defined in the file' if model.kind == 'custom' else 'not a Hugging Face class the codemod can see'}, whose attention does not take position ids; packed "
            "documents would attend to each other. Packing needs a Hugging Face decoder (or a "
            "model that masks attention per document)"
        )
    forwards = anchors.forward_calls(recipe, model, within=pointing.find_loop(recipe, SKILL, params.loop))
    if not forwards:
        where = f" in the loop {params.loop!r}" if params.loop else ""
        raise SkillRefused(f"{SKILL}: looked for forward calls of the model (`{model.target_code}(...)`){where}; found none")
    model_shifts_labels = any(keyword(call, "labels") is not None for call in forwards)
    images = any(keyword(call, "pixel_values") is not None for call in forwards)
    if images and model_shifts_labels:
        raise SkillRefused(
            f"{SKILL}: the forward call at {recipe.where(forwards[0])} passes pixel_values and labels=; packing "
            "image+text samples needs the recipe to take the loss itself (inputs and next-token labels per "
            "piece, as the vlm template does)"
        )

    edits = Edits(recipe)
    for call in forwards:
        _pass_position_ids(recipe, edits, call)
    parameters = [p.name.value for p in path.collate.params.params]
    if len(parameters) != 3:
        raise SkillRefused(
            f"{SKILL}: the collate function {path.collate.name.value}() ({recipe.where(path.collate)}) "
            "should take (sequences, seq_len, pad_id); it takes "
            f"({', '.join(parameters)})"
        )
    seq_param, pad_param = parameters[1], parameters[2]
    kind = "images" if images else "tokens" if model_shifts_labels else "pairs"
    code = copied.definitions(
        PACKING_MODULE, ["first_fit_decreasing", f"pack_{kind}", f"collate_{kind}"],
        renamed={f"pack_{kind}": "pack_pieces", f"collate_{kind}": "collate_packed", "seq_len": seq_param,
                 "pad_id": pad_param, "IGNORE": "IGNORE_INDEX" if recipe.defines("IGNORE_INDEX") else "-100"},
    )
    insert_definitions(recipe, edits, code, path.collate, after=path.collate)

    seq_len = (
        templates.expression(recipe.module, str(params.seq_len)) if params.seq_len is not None else path.seq_len
    )
    edits.replace(
        path.sequences,
        lambda updated: templates.expression(recipe.module, "pack_pieces({sequences}, {seq_len})", sequences=updated, seq_len=seq_len),
    )
    edits.replace(path.collate_reference, cst.Name("collate_packed"))
    edits.add_import("torch")
    samples = "image+text samples (pictures in the order of their image tokens)" if images else "documents"
    edits.acts_on = (
        f"packs the pieces collated by {path.collate.name.value}() into rows of whole {samples} and passes "
        f"position_ids to {len(forwards)} forward call{'s' if len(forwards) != 1 else ''} of `{model.target_code}`"
    )
    return edits


def _pass_position_ids(recipe: Recipe, edits: Edits, call: cst.Call) -> None:
    """``model(input_ids=b["input_ids"], attention_mask=b["attention_mask"])`` →
    ``model(input_ids=b["input_ids"], position_ids=b["position_ids"], use_cache=False)``.

    transformers builds the per-document mask from position ids only when there is no
    attention mask and no KV cache (a forward without ``use_cache=False`` creates one)."""
    mask = keyword(call, "attention_mask")
    positions_arg = keyword(call, "position_ids")
    cache = keyword(call, "use_cache")
    if positions_arg is None or mask is not None:
        source = keyword(call, "input_ids") or positional(call, 0)
        if source is None or not _is_key_lookup(source.value):
            raise SkillRefused(
                f"{SKILL}: the forward call at {recipe.where(call)} must pass position_ids (and no "
                "attention_mask); the codemod cannot tell where the batch's tensors are"
            )
        positions = source.value.with_changes(  # type: ignore[union-attr]
            slice=[cst.SubscriptElement(cst.Index(cst.SimpleString('"position_ids"')))]
        )
        if mask is not None and positions_arg is None:
            edits.replace(mask, mask.with_changes(keyword=cst.Name("position_ids"), value=positions))
        elif mask is not None:
            edits.replace(call, lambda updated: _without_keyword(updated, "attention_mask"))
        else:
            edits.replace(call, lambda updated: with_keyword(updated, "position_ids", positions))
    if cache is None:
        edits.replace(call, lambda updated: with_keyword(updated, "use_cache", cst.Name("False")))
    elif not (isinstance(cache.value, cst.Name) and cache.value.value == "False"):
        edits.replace(cache, cache.with_changes(value=cst.Name("False")))


def _without_keyword(call: cst.Call, name: str) -> cst.Call:
    args = [a for a in call.args if not (a.keyword is not None and a.keyword.value == name)]
    return call.with_changes(args=args)


def _is_key_lookup(expression: cst.BaseExpression) -> bool:
    return (
        isinstance(expression, cst.Subscript)
        and len(expression.slice) == 1
        and isinstance(expression.slice[0].slice, cst.Index)
        and isinstance(expression.slice[0].slice.value, cst.SimpleString)
    )


def refuse_a_recipe_that_packs_by_its_config(recipe: Recipe) -> None:
    """The vlm_chat template packs by its ``data.packing`` (its families, their images): the skill
    points there rather than pack a second time."""
    own_key = packing_config_key(recipe)
    if own_key is not None:
        key, field = own_key
        raise SkillRefused(
            f"{SKILL}: {recipe.name} packs by its own config key {key} ({recipe.where(field)}), which knows "
            f"the model's family and its images; set {key}=true (launch_run overrides or config.yaml) instead"
        )


def packing_config_key(recipe: Recipe) -> tuple[str, cst.AnnAssign] | None:
    """A recipe that packs at its own config's word (the vlm_chat template's ``data.packing``):
    the key, dotted from the config class that holds the section, and the field."""
    fields = {
        name: statement
        for cls in recipe.top_level_classes().values()
        for line in cls.body.body if isinstance(line, cst.SimpleStatementLine)
        for statement in line.body if isinstance(statement, cst.AnnAssign) and isinstance(statement.target, cst.Name)
        for name in [(cls.name.value, statement.target.value)]
    }
    for (section_class, name), field in fields.items():
        if name != "packing":
            continue
        holders = [key for (_, key), held in fields.items()
                   if isinstance(held.annotation.annotation, cst.Name) and held.annotation.annotation.value == section_class]
        return (f"{holders[0]}.packing" if holders else "packing"), field
    return None


def _engine_data_path(recipe: Recipe) -> DataPath | None:
    engine = anchors.engine_class(recipe)
    if engine is None:
        return None
    prepare = recipe.methods(engine).get("prepare_data")
    if prepare is None:
        return None
    stream = _returned_call(recipe, prepare)
    if stream is not None and dotted_name(stream.func).startswith("self."):  # return self.stream(...)
        method = recipe.methods(engine).get(dotted_name(stream.func)[5:])
        stream = _returned_call(recipe, method) if method is not None else None
    classes = recipe.top_level_classes()
    if stream is None or recipe.call_name(stream) not in classes:
        return None
    stream_class = classes[recipe.call_name(stream)]
    init = recipe.methods(stream_class).get("__init__")
    next_method = recipe.methods(stream_class).get("__next__")
    if init is None or next_method is None:
        return None
    sequences = positional(stream, 0)
    seq_len = _argument_for(stream, init, SEQ_LEN_NAMES)
    collate_call = _returned_call(recipe, next_method)
    functions = recipe.top_level_functions()
    if sequences is None or seq_len is None or collate_call is None:
        return None
    if not isinstance(collate_call.func, cst.Name) or collate_call.func.value not in functions:
        return None
    return DataPath(sequences.value, seq_len, functions[collate_call.func.value], collate_call.func)


def _returned_call(recipe: Recipe, function: cst.FunctionDef) -> cst.Call | None:
    """The call a function returns: ``return X(...)``, or ``s = X(...); ...; return s``."""
    returns = [
        small
        for statement in function.body.body  # type: ignore[attr-defined]
        if isinstance(statement, cst.SimpleStatementLine)
        for small in statement.body
        if isinstance(small, cst.Return) and small.value is not None
    ]
    if len(returns) != 1:
        return None
    value = returns[0].value
    if isinstance(value, cst.Call):
        return value
    if isinstance(value, cst.Name):
        for assign in recipe.assigns():
            if (
                recipe.enclosing_function(assign) is function
                and len(assign.targets) == 1
                and dotted_name(assign.targets[0].target) == value.value
                and isinstance(assign.value, cst.Call)
            ):
                return assign.value
    return None


def _argument_for(call: cst.Call, function: cst.FunctionDef, names: tuple[str, ...]) -> cst.BaseExpression | None:
    """The argument of ``call`` that binds the first parameter of ``function`` named in ``names``."""
    parameters = [p.name.value for p in function.params.params]
    if parameters and parameters[0] == "self":
        parameters = parameters[1:]
    for name in names:
        if name in parameters:
            arg = keyword(call, name) or positional(call, parameters.index(name))
            if arg is not None:
                return arg.value
    return None


def _dataloader_data_path(recipe: Recipe) -> DataPath | None:
    functions = recipe.top_level_functions()
    for loader in recipe.calls_to("torch.utils.data.DataLoader", "torch.utils.data.dataloader.DataLoader"):
        collate_fn = keyword(loader, "collate_fn")
        dataset = positional(loader, 0) or keyword(loader, "dataset")
        if collate_fn is None or dataset is None:
            continue
        value = collate_fn.value
        if not (isinstance(value, cst.Call) and recipe.call_name(value) == "functools.partial"):
            continue
        function = positional(value, 0)
        if function is None or not isinstance(function.value, cst.Name) or function.value.value not in functions:
            continue
        seq_len = next((keyword(value, n) for n in SEQ_LEN_NAMES if keyword(value, n) is not None), None)
        if seq_len is None:
            continue
        return DataPath(dataset.value, seq_len.value, functions[function.value.value], function.value)
    return None
