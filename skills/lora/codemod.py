"""lora: low-rank adapters with peft; only the adapters train.

Anchors: the model construction (``apply_lora(model, ...)`` goes first among the
wrapping stages: tensor parallelism cannot follow, and FSDP2 shards the adapted model) and every
``torch.optim`` constructor (handed only trainable parameters).
"""

from __future__ import annotations

from pydantic import Field

from skills.codemod_kit import (
    AlreadyApplied,
    Edits,
    Recipe,
    SkillParams,
    anchors,
    ensure_transformer_blocks,
    insert_definitions,
    only_trainable_parameters,
    stages,
    templates,
)
from skills.errors import SkillRefused

SKILL = "lora"


class Params(SkillParams):
    rank: int = Field(8, ge=1, description="Rank r of the adapters (LoraConfig.r).")
    alpha: float = Field(16, gt=0, description="Scale numerator: updates are scaled by alpha / r.")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the adapters' input.")
    target_modules: list[str] | None = Field(
        None,
        description="Names of the nn.Linear layers to adapt (e.g. ['q_proj', 'v_proj']); default: "
        "every nn.Linear inside the transformer blocks (the output head is left alone).",
    )


HELPER = '''
def apply_lora(
    model: torch.nn.Module,
    rank: int = 8,
    alpha: float = 16,
    dropout: float = 0.0,
    target_modules: list[str] | None = None,
) -> None:
    """LoRA (Hu et al., 2021) with peft: freeze the model and learn a low-rank update
    ``(alpha / rank) * B @ A`` next to each targeted linear layer. ``B`` starts at zero, so
    training starts from the model as it is; only the adapters are trainable, which cuts
    gradient and optimizer memory to a small fraction. The adapters are injected in place: the
    model keeps its class and attributes. Without ``target_modules``, every ``nn.Linear`` inside
    the transformer blocks is adapted. (Written by the lora skill.)
    """
    if target_modules is None:
        target_modules = sorted(
            {
                name.rsplit(".", 1)[-1]
                for block in transformer_blocks(model)
                for name, module in block.named_modules()
                if isinstance(module, torch.nn.Linear)
            }
        )
    config = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=target_modules)
    inject_adapter_in_model(config, model)
'''

TENSOR_PARALLEL_CALLS = (".parallelize_module", "apply_tensor_parallel")


def apply(recipe: Recipe, params: Params) -> Edits | AlreadyApplied:
    existing = recipe.calls_to("peft.get_peft_model", "peft.inject_adapter_in_model", "apply_lora", "peft.LoraConfig")
    if existing:
        return AlreadyApplied(f"LoRA at {recipe.where(existing[0])}")
    tp = recipe.calls_to(*TENSOR_PARALLEL_CALLS)
    if tp:
        raise SkillRefused(
            f"{SKILL}: the recipe applies tensor parallelism ({recipe.where(tp[0])}); peft's LoRA "
            "layers add a full-size output to a sharded one, so the two do not combine; use "
            "LoRA with FSDP2 (parallel.tp=1)"
        )
    model = anchors.find_model(recipe, SKILL)
    edits = Edits(recipe)
    only_trainable_parameters(recipe, edits, SKILL)
    ensure_transformer_blocks(recipe, edits, model.statement)
    insert_definitions(recipe, edits, HELPER, model.statement)
    edits.add_import("torch")
    edits.add_import("peft", "LoraConfig")
    edits.add_import("peft", "inject_adapter_in_model")
    alpha = int(params.alpha) if float(params.alpha).is_integer() else params.alpha
    call = templates.statement(
        recipe.module,
        f"apply_lora({{model}}, rank={params.rank}, alpha={alpha}, "
        f"dropout={params.dropout}, target_modules={templates.literal(params.target_modules)})",
        model=model.target,
    )
    stages.insert_stage(recipe, edits, model, stages.LORA, [call])
    edits.notes.append("needs the peft package (pip install peft)")
    return edits
