"""qlora: the base model's linear layers in 4 bits (bitsandbytes), LoRA adapters on them.

Anchors: the model construction (``quantize_4bit(model, ...)`` goes right after it, before
the model is moved to its device and before ``apply_lora``: peft wraps the quantised layers) and every ``torch.optim`` constructor (handed
only trainable parameters). The adapters are the lora skill's, written by its own code; a
recipe that has LoRA already gets only the 4-bit weights.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field

from skills.codemod_kit import copied, pointing, reach, stages, templates, vlm
from skills.codemod_kit import AlreadyApplied, Edits, Recipe, ensure_find_blocks, insert_definitions
from skills.lora import codemod as lora

SKILL = "qlora"

HELPERS_MODULE = Path(__file__).with_name("helpers.py")

# What says the base weights are quantised already (by this skill, or by transformers' own
# bitsandbytes loading).
QUANTIZED_CALLS = ("quantize_4bit", "transformers.BitsAndBytesConfig", "bitsandbytes.nn.Linear4bit")


class Params(lora.Params):
    quant_type: Literal["nf4", "fp4"] = Field(
        "nf4", description="4-bit data type: nf4 (NormalFloat, QLoRA's) or fp4."
    )
    double_quant: bool = Field(True, description="Quantise the per-block scales too (about 0.4 bits a weight less).")
    compute_dtype: Literal["bfloat16", "float16", "float32"] | None = Field(
        None, description="The dtype the 4-bit layers compute in; default: the weights' own dtype (the run's)."
    )
    quant_storage: Literal["uint8", "bfloat16", "float16", "float32"] = Field(
        "uint8",
        description="The dtype the packed 4-bit bytes are stored as (transformers' bnb_4bit_quant_storage).",
    )


def apply(recipe: Recipe, params: Params) -> Edits | AlreadyApplied:
    existing = recipe.calls_to(*QUANTIZED_CALLS)
    if existing:
        return AlreadyApplied(f"4-bit weights at {recipe.where(existing[0])}")
    lora.refuse_tensor_parallel(recipe, SKILL)
    model = pointing.find_model(recipe, SKILL, params.target)
    found = reach.shape(recipe, model)
    reach.require_blocks(recipe, SKILL, found, "use the lora skill with target_modules, in full precision")
    edits = Edits(recipe)
    ensure_find_blocks(recipe, edits, model.statement)
    insert_definitions(recipe, edits, copied.definitions(HELPERS_MODULE), model.statement)
    for name in copied.imports(HELPERS_MODULE):
        edits.add_import(*name)
    call = templates.statement(
        recipe.module,
        f"quantize_4bit({{model}}, quant_type={templates.literal(params.quant_type)}, "
        f"double_quant={params.double_quant}, compute_dtype={templates.literal(params.compute_dtype)}, "
        f"quant_storage={templates.literal(params.quant_storage)})",
        model=model.target,
    )
    stages.insert_stage(recipe, edits, model, stages.QUANTIZE, [call])
    where = f"the decoder layers of {found.name}" if found.hf and not vlm.is_vision_language(found) \
        else reach.describe_blocks(found)
    quantised = (f"quantises every nn.Linear in {where} to 4-bit {params.quant_type}"
                 f"{' (double quantisation)' if params.double_quant else ''}")
    lora_there = recipe.calls_to(*lora.LORA_CALLS)
    if lora_there:
        edits.acts_on = f"{quantised}; the LoRA at {recipe.where(lora_there[0])} adapts them"
    else:
        edits.acts_on = f"{quantised}; {lora.add_lora(recipe, edits, model, params)}"
    edits.notes.append("needs the bitsandbytes and peft packages (pip install 'trainwright[qlora]')")
    return edits


