"""flash-attention: FlashAttention 2 for a Hugging Face model (``attn_implementation=
"flash_attention_2"``), switched on at run time where it can run, with packed rows (position ids
that restart per document) sent to its variable-length kernel.

Anchor: the model construction; ``use_flash_attention(model, compute_dtype=...)`` goes right
after it, before any wrapper. The compute dtype it checks is the file's autocast dtype when the
forwards run under autocast, else the engine's ``self.compute_dtype`` (FSDP2's param dtype) in an
engine recipe, else the model's own dtype.
"""

from __future__ import annotations

from pathlib import Path

import libcst as cst
from pydantic import Field

from skills.codemod_kit import copied, pointing
from skills.codemod_kit import AlreadyApplied, Edits, Recipe, SkillParams, insert_definitions, stages
from skills.codemod_kit.anchors import keyword
from skills.codemod_kit.gpu_guard import autocast_dtype, in_engine, insert_kernel_stage, require_hf_model, warn_argument

SKILL = "flash-attention"
FLASH = "flash_attention_2"


class Params(SkillParams):
    packed_sequences: bool = Field(
        True,
        description="Send rows whose position ids restart (packed documents, no attention mask) to "
        "FlashAttention's variable-length kernel, so tokens attend only within their document. Off: "
        "transformers does that only for a batch of one row.",
    )
    target: str | None = pointing.target_field()


# What it writes is a real module beside this file (helpers.py), copied into the recipe.
HELPERS_MODULE = Path(__file__).with_name("helpers.py")

HELPER_NAMES = ("use_flash_attention", "document_boundaries")


def _existing(recipe: Recipe) -> cst.CSTNode | None:
    calls = recipe.calls_to(*HELPER_NAMES)
    if calls:
        return calls[0]
    for call in recipe.calls():
        chosen = keyword(call, "attn_implementation")
        if chosen is None and isinstance(call.func, cst.Attribute) and call.func.attr.value == "set_attn_implementation":
            chosen = call.args[0] if call.args else None
        if chosen is not None and isinstance(chosen.value, cst.SimpleString) and chosen.value.evaluated_value == FLASH:
            return call
    return None


def apply(recipe: Recipe, params: Params) -> Edits | AlreadyApplied:
    existing = _existing(recipe)
    if existing is not None:
        return AlreadyApplied(f"FlashAttention 2 at {recipe.where(existing)}")
    model = pointing.find_model(recipe, SKILL, params.target)
    require_hf_model(
        recipe, SKILL, model,
        "attn_implementation is a Hugging Face switch. (Its F.scaled_dot_product_attention already runs "
        "a FlashAttention kernel on CUDA GPUs in bfloat16/float16.)",
    )
    edits = Edits(recipe)
    dtype = autocast_dtype(recipe)
    if dtype is None:
        dtype = "self.compute_dtype" if in_engine(recipe, model) else "{model}.dtype"
    insert_kernel_stage(
        recipe, edits, model,
        f"use_flash_attention({{model}}, compute_dtype={dtype}, packed_sequences={params.packed_sequences}"
        f"{warn_argument(recipe, model)})",
        stage=stages.ATTENTION,
    )
    insert_definitions(recipe, edits, copied.definitions(HELPERS_MODULE), model.statement)
    for name in copied.imports(HELPERS_MODULE):
        edits.add_import(*name)
    edits.notes.append("FlashAttention 2 runs on CUDA GPUs with flash-attn installed; elsewhere the run warns and continues")
    edits.acts_on = f"switches the attention of `{model.target_code}` (a Hugging Face model) to flash_attention_2 on CUDA"
    return edits
