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

import libcst as cst
from pydantic import Field

from skills.codemod_kit import pointing
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


FIRST_FIT_DECREASING = '''
def first_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Bin packing: the indices of ``lengths`` grouped into bins that hold at most ``capacity``.
    Longest first, each item goes into the first bin with room for it (first-fit decreasing
    needs at most 11/9 of the optimal number of bins, plus one). A max-tree over the bins'
    free room finds that bin in O(log n). (Written by the sequence-packing skill.)
    """
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    size = 1
    while size < max(1, len(lengths)):
        size *= 2
    room = [capacity] * (2 * size)  # leaves: free room of bin i (unopened bins are empty)
    bins: list[list[int]] = []
    for item in order:
        need = lengths[item]
        if need > capacity:
            raise ValueError(f"a sequence of {need} positions does not fit in rows of {capacity}")
        node = 1
        while node < size:  # down to the leftmost bin with enough room
            node = 2 * node if room[2 * node] >= need else 2 * node + 1
        if node - size == len(bins):
            bins.append([])
        bins[node - size].append(item)
        room[node] -= need
        node //= 2
        while node:
            room[node] = max(room[2 * node], room[2 * node + 1])
            node //= 2
    return bins
'''

# The recipe computes the next-token loss itself: a piece of n tokens gives n - 1 (input, label)
# pairs. (The template's convention.)
PACK_PAIRS = '''
def pack_pieces(pieces: list[torch.Tensor], SEQ_LEN: int) -> list[tuple[torch.Tensor, ...]]:
    """Sequence packing: group pieces into rows of at most ``SEQ_LEN`` positions with
    first-fit decreasing, so that rows carry more documents and less padding. A piece of n
    tokens fills n - 1 positions (inputs with their next-token labels). Each row is a tuple of
    pieces, laid out by ``collate_packed``. A piece may also be a 2 × n tensor: its tokens,
    and the targets the loss looks at (IGNORE elsewhere, e.g. an SFT prompt).
    (Written by the sequence-packing skill.)
    """
    bins = first_fit_decreasing([torch.as_tensor(piece).shape[-1] - 1 for piece in pieces], SEQ_LEN)
    return [tuple(pieces[i] for i in sorted(members)) for members in bins]


def collate_packed(rows: list, SEQ_LEN: int, PAD_ID: int) -> dict[str, torch.Tensor]:
    """Lay out packed rows (tuples of pieces; a lone piece is a row of its own): inputs and
    next-token labels piece after piece, padding at the end, and position ids that restart at 0
    for each piece. With ``attention_mask=None``, transformers turns restarting position ids
    into a block-diagonal causal mask, so a token attends only to its own piece and each
    piece's loss is what it would be alone. (Written by the sequence-packing skill.)
    """
    input_ids = torch.full((len(rows), SEQ_LEN), PAD_ID, dtype=torch.int64)
    labels = torch.full((len(rows), SEQ_LEN), IGNORE, dtype=torch.int64)
    position_ids = torch.zeros((len(rows), SEQ_LEN), dtype=torch.int64)
    for row, pieces in enumerate(rows):
        start = 0
        for piece in pieces if isinstance(pieces, tuple) else (pieces,):
            piece = torch.as_tensor(piece)
            tokens, targets = (piece[0], piece[1]) if piece.dim() == 2 else (piece, piece)
            n = len(tokens) - 1
            input_ids[row, start : start + n] = tokens[:-1]
            labels[row, start : start + n] = targets[1:]
            position_ids[row, start : start + n] = torch.arange(n)
            start += n
        position_ids[row, start:] = torch.arange(SEQ_LEN - start)  # the padding: a sequence of its own
    return {"input_ids": input_ids, "labels": labels, "position_ids": position_ids}
'''

# Image+text samples: a piece is ``(tokens_and_targets, pixel_values)``, laid out as in PACK_PAIRS;
# the pictures of a batch go in the order of their image tokens (row after row, piece after piece),
# which is the order a LLaVA-style model puts their features in. A row is a list (a lone piece is
# a tuple).
PACK_IMAGES = '''
def pack_pieces(pieces: list[tuple[torch.Tensor, torch.Tensor]], SEQ_LEN: int) -> list[list[tuple]]:
    """Sequence packing of image+text samples: group ``(tokens_and_targets, pixel_values)`` pieces
    into rows of at most ``SEQ_LEN`` positions with first-fit decreasing, so that rows carry more
    samples and less padding. A piece of n tokens (its image tokens included) fills n - 1
    positions. Each row is a list of pieces, laid out by ``collate_packed``. (Written by the
    sequence-packing skill.)
    """
    bins = first_fit_decreasing([piece[0].shape[-1] - 1 for piece in pieces], SEQ_LEN)
    return [[pieces[i] for i in sorted(members)] for members in bins]


def collate_packed(rows: list, SEQ_LEN: int, PAD_ID: int) -> dict[str, torch.Tensor]:
    """Lay out packed rows (lists of ``(tokens_and_targets, pixel_values)`` pieces; a lone piece
    is a row of its own): inputs and next-token labels piece after piece, padding at the end,
    position ids that restart at 0 for each piece, and the pictures in the order of their image
    tokens (row after row, piece after piece), the order in which the model fills its image
    tokens. With ``attention_mask=None``, transformers turns restarting position ids into a
    block-diagonal causal mask, so each sample's loss is what it would be alone. (Written by the
    sequence-packing skill.)
    """
    input_ids = torch.full((len(rows), SEQ_LEN), PAD_ID, dtype=torch.int64)
    labels = torch.full((len(rows), SEQ_LEN), IGNORE, dtype=torch.int64)
    position_ids = torch.zeros((len(rows), SEQ_LEN), dtype=torch.int64)
    pictures = []
    for row, pieces in enumerate(rows):
        start = 0
        for tokens, picture in pieces if isinstance(pieces, list) else (pieces,):
            n = tokens.shape[-1] - 1
            input_ids[row, start : start + n] = tokens[0, :-1]
            labels[row, start : start + n] = tokens[1, 1:]
            position_ids[row, start : start + n] = torch.arange(n)
            pictures.append(picture)
            start += n
        position_ids[row, start:] = torch.arange(SEQ_LEN - start)  # the padding: a sequence of its own
    return {
        "input_ids": input_ids,
        "labels": labels,
        "position_ids": position_ids,
        "pixel_values": torch.stack(pictures),
    }
'''

# The model shifts the labels itself (Hugging Face ``labels=``): a document of n tokens fills n
# positions and its labels are its tokens.
PACK_TOKENS = '''
def pack_pieces(documents: list, SEQ_LEN: int) -> list[tuple]:
    """Sequence packing: group documents into rows of at most ``SEQ_LEN`` tokens with
    first-fit decreasing, so that rows carry more documents and less padding (a longer document
    is cut to ``SEQ_LEN``, as unpacked batches cut it). Each row is a tuple of documents, laid
    out by ``collate_packed``. (Written by the sequence-packing skill.)
    """
    bins = first_fit_decreasing([min(len(document), SEQ_LEN) for document in documents], SEQ_LEN)
    return [tuple(documents[i] for i in sorted(members)) for members in bins]


def collate_packed(rows: list, SEQ_LEN: int, PAD_ID: int) -> dict[str, torch.Tensor]:
    """Lay out packed rows (tuples of documents; a lone document is a row of its own): documents
    one after the other, padding at the end, and position ids that restart at 0 for each
    document. With ``attention_mask=None``, transformers turns restarting position ids into a
    block-diagonal causal mask, so a token attends only to its own document. The model shifts
    the labels, so each document's first label is ignored: nothing in its document comes
    before it. Each document's loss is what it would be alone. (Written by the sequence-packing
    skill.)
    """
    input_ids = torch.full((len(rows), SEQ_LEN), PAD_ID, dtype=torch.int64)
    labels = torch.full((len(rows), SEQ_LEN), IGNORE, dtype=torch.int64)
    position_ids = torch.zeros((len(rows), SEQ_LEN), dtype=torch.int64)
    for row, documents in enumerate(rows):
        start = 0
        for document in documents if isinstance(documents, tuple) else (documents,):
            tokens = torch.as_tensor(document[:SEQ_LEN], dtype=torch.int64)
            n = len(tokens)
            input_ids[row, start : start + n] = tokens
            labels[row, start + 1 : start + n] = tokens[1:]
            position_ids[row, start : start + n] = torch.arange(n)
            start += n
        position_ids[row, start:] = torch.arange(SEQ_LEN - start)  # the padding: a sequence of its own
    return {"input_ids": input_ids, "labels": labels, "position_ids": position_ids}
'''


@dataclass
class DataPath:
    """Where the sequences are handed over (wrapped in ``pack_pieces``) and which collate
    function lays out a batch (swapped for ``collate_packed``)."""

    sequences: cst.BaseExpression
    seq_len: cst.BaseExpression
    collate: cst.FunctionDef
    collate_reference: cst.Name  # the Name that refers to the collate function at the call site


def apply(recipe: Recipe, params: Params) -> Edits | AlreadyApplied:
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
    code = FIRST_FIT_DECREASING + (PACK_IMAGES if images else PACK_TOKENS if model_shifts_labels else PACK_PAIRS)
    ignore = "IGNORE_INDEX" if recipe.defines("IGNORE_INDEX") else "-100"
    code = code.replace("SEQ_LEN", seq_param).replace("PAD_ID", pad_param).replace("IGNORE", ignore)
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
