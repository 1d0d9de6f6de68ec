"""lora: low-rank adapters with peft; only the adapters train.

Anchors: the model construction (``apply_lora(model, ...)`` goes first among the
wrapping stages: tensor parallelism cannot follow, and FSDP2 shards the adapted model) and every
``torch.optim`` constructor (handed only trainable parameters).
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field

from skills.codemod_kit import copied, pointing, vlm
from skills.codemod_kit.anchors import ModelAnchor
from skills.codemod_kit import (
    AlreadyApplied,
    Edits,
    Recipe,
    SkillParams,
    ensure_find_blocks,
    insert_definitions,
    only_trainable_parameters,
    reach,
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
    target: str | None = pointing.target_field()


# What it writes is a real module beside this file (helpers.py), copied into the recipe.
HELPERS_MODULE = Path(__file__).with_name("helpers.py")

TENSOR_PARALLEL_CALLS = (".parallelize_module", "apply_tensor_parallel")


# What says LoRA is there already (written by this skill or by hand).
LORA_CALLS = ("peft.get_peft_model", "peft.inject_adapter_in_model", "apply_lora", "peft.LoraConfig")


def apply(recipe: Recipe, params: Params) -> Edits | AlreadyApplied:
    existing = recipe.calls_to(*LORA_CALLS)
    if existing:
        return AlreadyApplied(f"LoRA at {recipe.where(existing[0])}")
    refuse_tensor_parallel(recipe, SKILL)
    model = pointing.find_model(recipe, SKILL, params.target)
    edits = Edits(recipe)
    edits.acts_on = add_lora(recipe, edits, model, params)
    edits.notes.append("needs the peft package (pip install peft)")
    return edits


def refuse_tensor_parallel(recipe: Recipe, skill: str) -> None:
    tp = recipe.calls_to(*TENSOR_PARALLEL_CALLS)
    if tp:
        raise SkillRefused(
            f"{skill}: the recipe applies tensor parallelism ({recipe.where(tp[0])}); peft's LoRA "
            "layers add a full-size output to a sharded one, so the two do not combine; use "
            "LoRA with FSDP2 (parallel.tp=1)"
        )


def add_lora(recipe: Recipe, edits: Edits, model: ModelAnchor, params: Params) -> str:
    """Write ``apply_lora`` and its call into ``edits`` (the qlora skill writes it too, after
    its 4-bit weights); returns what the adapters act on."""
    found = reach.shape(recipe, model)
    acts_on = _targets(recipe, found, params)
    only_trainable_parameters(recipe, edits, SKILL)
    if params.target_modules is None:
        ensure_find_blocks(recipe, edits, model.statement)
    insert_definitions(recipe, edits, copied.definitions(HELPERS_MODULE), model.statement)
    for name in copied.imports(HELPERS_MODULE):
        edits.add_import(*name)
    alpha = int(params.alpha) if float(params.alpha).is_integer() else params.alpha
    statements = []
    within = ""
    if language_model_only(found, params):
        vlm.ensure_helper(recipe, edits, model.statement)
        statements.append(templates.statement(
            recipe.module,
            f'language_model = vision_language_parts({{model}}, "{SKILL}", [], every=True).get("language_model")',
            model=model.target,
        ))
        within = ", within=language_model"
    statements.append(templates.statement(
        recipe.module,
        f"apply_lora({{model}}, rank={params.rank}, alpha={alpha}, "
        f"dropout={params.dropout}, target_modules={templates.literal(params.target_modules)}{within})",
        model=model.target,
    ))
    stages.insert_stage(recipe, edits, model, stages.LORA, statements)
    return acts_on


def language_model_only(found: reach.ModelShape, params: Params) -> bool:
    """A vision-language model without named targets: its language model's layers are adapted,
    never the vision tower's or the projector's (a Hugging Face class, or a class of the file with
    a language-model attribute; at run time ``vision_language_parts`` finds it by name, and a
    model without one has the layers of all its blocks adapted)."""
    if params.target_modules is not None or not vlm.is_vision_language(found):
        return False
    return found.hf or any(name in vlm.NAMES["language_model"] for name in found.attributes)


def _targets(recipe: Recipe, found: reach.ModelShape, params: Params) -> str:
    """What the adapters will be put on, or a refusal naming the linear layers the codemod saw."""
    leaves = sorted({path.rsplit(".", 1)[-1] for path in found.linears})
    seen = ", ".join(leaves) if leaves else "none"
    if params.target_modules is not None:
        if found.hf or found.cls is None:
            return f"adapts {', '.join(params.target_modules)} (matched at run time)"
        matched = [t for t in params.target_modules if any(p == t or p.endswith("." + t) for p in found.linears)]
        missing = [t for t in params.target_modules if t not in matched]
        if missing:
            raise SkillRefused(
                f"{SKILL}: target_modules {missing} name no nn.Linear layer of {found.name} "
                f"({recipe.where(found.model.statement)}); its linear layers are: {seen}"
            )
        count = sum(1 for p in found.linears if any(p == t or p.endswith("." + t) for t in matched))
        return f"adapts {', '.join(matched)} ({count} linear layer{'s' if count != 1 else ''} in the code)"
    if language_model_only(found, params):
        return (
            f"adapts every nn.Linear in the layers of the language model of {found.name} (named at run time), "
            "not the vision tower's or the projector's"
        )
    if found.hf:
        return f"adapts every nn.Linear in the decoder layers of {found.name} (named at run time)"
    reach.require_blocks(
        recipe, SKILL, found,
        f"name the linear layers to adapt with target_modules (its linear layers: {seen})",
    )
    names = reach.block_linears(found)
    if not names and (found.cls is None or found.opaque or not all(c.elements_known for c in found.containers)):
        return f"adapts every nn.Linear in {reach.describe_blocks(found)} (named at run time)"
    if not names:
        raise SkillRefused(
            f"{SKILL}: looked for nn.Linear layers in the blocks of {found.name} "
            f"({recipe.where(found.model.statement)}: {reach.describe_blocks(found)}); found none; name the linear layers to adapt with target_modules (its linear layers: {seen})"
        )
    inside = tuple(c.path + "." for c in found.containers)
    outside = [p for p in found.linears if p.rsplit(".", 1)[-1] in names and not p.startswith(inside)]
    more = f", and {len(outside)} linear layer(s) of those names outside them ({', '.join(outside)})" if outside else ""
    return f"adapts {', '.join(names)} in {reach.describe_blocks(found)}{more}"
