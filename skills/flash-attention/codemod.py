"""flash-attention: FlashAttention 2 for a Hugging Face model (``attn_implementation=
"flash_attention_2"``), switched on at run time where it can run, with packed rows (position ids
that restart per document) sent to its variable-length kernel.

Anchor: the model construction; ``use_flash_attention(model, compute_dtype=...)`` goes right
after it, before any wrapper. The compute dtype it checks is the file's autocast dtype when the
forwards run under autocast, else the engine's ``self.compute_dtype`` (FSDP2's param dtype) in an
engine recipe, else the model's own dtype.
"""

from __future__ import annotations

import libcst as cst
from pydantic import Field

from skills.codemod_kit import pointing
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


HELPER = '''
def use_flash_attention(
    model: torch.nn.Module,
    compute_dtype: torch.dtype,
    packed_sequences: bool = True,
    warn: Callable[[str], None] | None = None,
) -> bool:
    """FlashAttention 2 for a Hugging Face model (``attn_implementation="flash_attention_2"``)
    where it can run: a CUDA GPU of the Ampere generation or newer, the flash_attn package, and
    bfloat16 or float16 compute (``compute_dtype``). Otherwise the model keeps its attention (sdpa)
    and ``warn`` says why, once. With ``packed_sequences``, forwards that pass position ids and no
    attention mask get FlashAttention's variable-length arguments (``document_boundaries``), so
    packed documents do not attend to each other. Returns whether FlashAttention 2 is on.
    (Written by the flash-attention skill.)
    """
    warn = warn or (lambda message: print(f"warning: {message}", flush=True))
    reason = None
    if not torch.cuda.is_available():
        reason = "no CUDA GPU"
    elif importlib.util.find_spec("flash_attn") is None:
        reason = "the flash_attn package is not installed (pip install flash-attn --no-build-isolation)"
    elif torch.cuda.get_device_capability()[0] < 8:
        reason = f"{torch.cuda.get_device_name()} is older than Ampere"
    elif compute_dtype not in (torch.bfloat16, torch.float16):
        reason = (
            f"the model computes in {compute_dtype}, and FlashAttention needs bfloat16 or float16 "
            "(set parallel.param_dtype=bfloat16, or apply the mixed-precision skill first)"
        )
    if reason is not None:
        current = getattr(getattr(model, "config", None), "_attn_implementation", None) or "its own"
        warn(f"flash-attention: {reason}; training continues with {current} attention")
        return False
    model.set_attn_implementation("flash_attention_2")
    if packed_sequences:
        model.register_forward_pre_hook(document_boundaries, with_kwargs=True)
    return True


def document_boundaries(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """Forward pre-hook: rows whose position ids restart at 0 at each document (packed rows, no
    attention mask) get FlashAttention 2's variable-length arguments over the flattened batch:
    ``cu_seq_lens_q/k``, where each document (and each row) starts, and ``max_length_q/k``, the
    row length (an upper bound that stays the same from batch to batch). transformers then calls
    ``flash_attn_varlen_func``: each token attends only to its own document. (From position ids
    alone it does so only for a batch of one row.) (Written by the flash-attention skill.)
    """
    position_ids = kwargs.get("position_ids")
    if position_ids is None or kwargs.get("attention_mask") is not None or "cu_seq_lens_q" in kwargs:
        return None
    starts = position_ids == 0
    starts[..., 0] = True
    starts = starts.flatten().nonzero().flatten()
    end = torch.tensor([position_ids.numel()], device=starts.device)
    boundaries = torch.cat([starts, end]).to(torch.int32)
    row = position_ids.size(-1)
    return args, {
        **kwargs,
        "cu_seq_lens_q": boundaries,
        "cu_seq_lens_k": boundaries,
        "max_length_q": row,
        "max_length_k": row,
    }
'''

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
    insert_definitions(recipe, edits, HELPER, model.statement)
    edits.add_import("importlib.util")
    edits.add_import("torch")
    edits.add_import("typing", "Callable")
    edits.notes.append("FlashAttention 2 runs on CUDA GPUs with flash-attn installed; elsewhere the run warns and continues")
    edits.acts_on = f"switches the attention of `{model.target_code}` (a Hugging Face model) to flash_attention_2 on CUDA"
    return edits
