"""The changes that would make a run fit its device, each estimated again by
:func:`engine.estimate.estimate_memory` on the same measured shape.

The changes: gradient checkpointing (the skill), 16-bit mixed precision, smaller micro-batches
(more accumulation, the same batch), more processes (FSDP2 shards), LoRA and QLoRA (the skills,
at the lora skill's default rank), the 8-bit AdamW (``optim.name=adamw_8bit``) and, on a GPU,
FSDP2's CPU offload (``parallel.cpu_offload=true``) — alone and together.
"""

from __future__ import annotations

import itertools
from typing import Any

from engine.estimate import Shape, estimate_memory

MAX_CHANGES = 8
# Each kind of change the list keeps its best row of, beyond the first MAX_CHANGES.
EACH_KIND = ("apply_skill lora", "apply_skill qlora", "optim.name=adamw_8bit", "parallel.cpu_offload=true")


def changes_that_fit(shape: Shape, config, nproc: int, device: str, limit_gib: float) -> list[dict[str, Any]]:
    """Rows ``{change, peak_gib, fits}``: those that fit with the fewest changes first (at most
    :data:`MAX_CHANGES`), or the lowest peaks when none fits; then the best row of each kind in
    :data:`EACH_KIND` not listed yet, so that LoRA, QLoRA, the 8-bit optimizer and offload are
    always offered with their estimate."""
    parallel, accum = config.parallel, config.train.grad_accum
    micro = config.data.batch_size // (max(1, nproc // (parallel.tp * parallel.sp)) * accum)
    can_checkpoint = bool(not shape.checkpointed_blocks and shape.blocks)
    full = shape.trainable > 2 * shape.lora_values and shape.block_linear > 0  # not adapters already
    adapter_choices = (None, "lora", "qlora") if full else (None, "qlora") if shape.block_linear and not shape.quantized else (None,)
    eight_bit_choices = (False, True) if shape.trainable and shape.optimizer_bytes > 2.5 else (False,)
    offload_choices = (False, True) if device == "cuda" and not parallel.cpu_offload else (False,)
    rows = []
    for checkpointing, bf16, split, more, adapters, eight_bit, offload in itertools.product(
        (False, True) if can_checkpoint else (False,),
        (False, True) if parallel.param_dtype == "float32" else (False,),
        (1, 2, 4, 8), (1, 2, 4, 8), adapter_choices, eight_bit_choices, offload_choices,
    ):
        if micro % (split * more):
            continue
        names = (["apply_skill gradient-checkpointing"] * checkpointing
                 + [f"apply_skill {adapters}"] * bool(adapters)
                 + ["parallel.param_dtype=bfloat16"] * bf16
                 + ["optim.name=adamw_8bit"] * eight_bit
                 + ["parallel.cpu_offload=true"] * offload
                 + [f"train.grad_accum={accum * split}"] * (split > 1)
                 + [f"nproc={nproc * more}"] * (more > 1))
        if not names:
            continue
        memory = estimate_memory(shape, nproc * more, parallel, device,
                                 checkpointing=True if checkpointing else None,
                                 micro_batch_scale=1 / (split * more),
                                 param_dtype="bfloat16" if bf16 else None,
                                 adapters=adapters, eight_bit=eight_bit, cpu_offload=offload or None)
        rows.append({"change": " + ".join(names), "peak_gib": memory["peak_gib"],
                     "fits": memory["peak_gib"] <= limit_gib, "_count": len(names)})
    rows.sort(key=lambda row: (not row["fits"], row["_count"] if row["fits"] else 0, row["peak_gib"]))
    chosen = rows[:MAX_CHANGES]
    for kind in EACH_KIND:
        if not any(kind in row["change"].split(" + ") for row in chosen):
            chosen += [row for row in rows if kind in row["change"].split(" + ")][:1]
    chosen.sort(key=lambda row: (not row["fits"], row["_count"] if row["fits"] else 0, row["peak_gib"]))
    return [{k: v for k, v in row.items() if k != "_count"} for row in chosen]
