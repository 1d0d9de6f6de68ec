"""tensor-parallel: shard each transformer block's linear layers over the ``tp`` mesh dimension.

Anchors: the model construction (a Hugging Face model: the plan names its layers) and the
device mesh (``self.dist.mesh`` in an engine recipe, else ``init_device_mesh(...,
mesh_dim_names=(..., "tp"))``). The call goes first among the wrapping stages, before
activation checkpointing, ``torch.compile`` and FSDP2.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import libcst as cst
from pydantic import Field, field_validator

from skills.codemod_kit import copied, pointing
from skills.codemod_kit import (
    AlreadyApplied,
    Edits,
    Recipe,
    SkillParams,
    anchors,
    ensure_find_blocks,
    gpu_guard,
    insert_definitions,
    reach,
    stages,
    templates,
)
from skills.errors import SkillRefused

SKILL = "tensor-parallel"

LLAMA_PLAN: dict[str, Literal["colwise", "rowwise"]] = {
    "self_attn.q_proj": "colwise",
    "self_attn.k_proj": "colwise",
    "self_attn.v_proj": "colwise",
    "self_attn.o_proj": "rowwise",
    "mlp.gate_proj": "colwise",
    "mlp.up_proj": "colwise",
    "mlp.down_proj": "rowwise",
}


class Params(SkillParams):
    plan: dict[str, Literal["colwise", "rowwise"]] = Field(
        default_factory=lambda: dict(LLAMA_PLAN),
        description="Sub-module of a transformer block → 'colwise' (split output features) or "
        "'rowwise' (split input features, all-reduce the output). The default fits Llama, "
        "Mistral, Qwen2 and other Hugging Face decoders with q/k/v/o and gate/up/down projections.",
    )
    target: str | None = pointing.target_field()

    @field_validator("plan")
    @classmethod
    def _plan_not_empty(cls, plan: dict[str, str]) -> dict[str, str]:
        if not plan:
            raise ValueError("the plan must name at least one sub-module")
        return plan


# apply_tensor_parallel is a real module beside this file (helpers.py), copied into the recipe
# with its plan set to the skill's.
HELPERS_MODULE = Path(__file__).with_name("helpers.py")


class _Plan(cst.CSTTransformer):
    """``plan = {...}`` in apply_tensor_parallel, given the skill's plan."""

    def __init__(self, plan: cst.BaseExpression):
        self.plan = plan
        self.replaced = 0

    def leave_Assign(self, original: cst.Assign, updated: cst.Assign) -> cst.Assign:
        target = updated.targets[0].target if len(updated.targets) == 1 else None
        if isinstance(target, cst.Name) and target.value == "plan":
            self.replaced += 1
            return updated.with_changes(value=self.plan)
        return updated


def _helper(plan: dict[str, str]) -> str:
    styles = {"colwise": "ColwiseParallel()", "rowwise": "RowwiseParallel()"}
    # One entry a line; libcst indents the lines of a parenthesized value by the block's indent.
    entries = "".join(f"    {templates.literal(k)}: {styles[v]},\n" for k, v in plan.items())
    code = cst.parse_module(copied.definitions(HELPERS_MODULE, ["apply_tensor_parallel"]))
    setting = _Plan(cst.parse_expression("{\n" + entries + "}"))
    code = code.visit(setting)
    if setting.replaced != 1:  # helpers.py no longer assigns plan once: the copy would not use it
        raise AssertionError(f"{HELPERS_MODULE.name}: apply_tensor_parallel assigns plan {setting.replaced} times")
    return code.code


LORA_CALLS = ("peft.get_peft_model", "peft.inject_adapter_in_model", "apply_lora")
STOCK_CLIP = ("torch.nn.utils.clip_grad_norm_", "torch.nn.utils.clip_grad.clip_grad_norm_")


def apply(recipe: Recipe, params: Params) -> Edits | AlreadyApplied:
    existing = recipe.calls_to(".parallelize_module", "apply_tensor_parallel")
    if existing:
        return AlreadyApplied(f"tensor parallelism at {recipe.where(existing[0])}")
    lora = recipe.calls_to(*LORA_CALLS)
    if lora:
        raise SkillRefused(
            f"{SKILL}: the recipe applies LoRA ({recipe.where(lora[0])}); peft's LoRA layers add a "
            "full-size output to a tensor-parallel (sharded) one, so the two do not combine; "
            "use FSDP2 for LoRA"
        )
    model = pointing.find_model(recipe, SKILL, params.target)
    if model.kind != "hf":
        raise SkillRefused(
            f"{SKILL}: the model is built by {model.builder}(...) ({recipe.where(model.statement)}), "
            f"{'a module defined in the file' if model.kind == 'custom' else 'not a Hugging Face class the codemod can see'}; the plan shards Hugging Face decoder layers "
            "(self_attn.q_proj ... mlp.down_proj), and hand-written attention must also be taught "
            "to run num_heads / tp heads; see SKILL.md: Doing it by hand"
        )
    mesh = _tp_mesh(recipe, model)
    engine = anchors.engine_class(recipe)
    if engine is None:
        clip = recipe.calls_to(*STOCK_CLIP)
        if clip:
            raise SkillRefused(
                f"{SKILL}: torch.nn.utils.clip_grad_norm_ at {recipe.where(clip[0])} fails once "
                "some gradients are tensor-parallel DTensors and others are not (different device "
                "meshes); clip per mesh as engine/grad_clip.py does, then apply again"
            )
    edits = Edits(recipe)
    ensure_find_blocks(recipe, edits, model.statement)
    insert_definitions(recipe, edits, _helper(params.plan), model.statement)
    edits.add_import("fnmatch", "fnmatch")
    edits.add_import("torch")
    edits.add_import("torch.distributed.device_mesh", "DeviceMesh")
    for name in sorted({"colwise": "ColwiseParallel", "rowwise": "RowwiseParallel"}[v] for v in params.plan.values()):
        edits.add_import("torch.distributed.tensor.parallel", name)
    edits.add_import("torch.distributed.tensor.parallel", "parallelize_module")
    call = templates.statement(
        recipe.module,
        f"apply_tensor_parallel({{model}}, {{mesh}}{gpu_guard.warn_argument(recipe, model)})",
        model=model.target,
        mesh=mesh,
    )
    stages.insert_stage(recipe, edits, model, stages.TENSOR_PARALLEL, [call])
    found = reach.shape(recipe, model)
    edits.acts_on = (
        f"shards {', '.join(params.plan)} in {reach.describe_blocks(found)} over the tp mesh dimension "
        "(when tp > 1)"
    )
    if engine is not None:
        edits.notes.append("launch with torchrun and --set parallel.tp=N")
    return edits


def _tp_mesh(recipe: Recipe, model: anchors.ModelAnchor):
    engine = anchors.engine_class(recipe)
    if engine is not None and recipe.is_inside(model.statement, engine):
        return templates.expression(recipe.module, 'self.dist.mesh["tp"]')
    found = anchors.device_mesh_with(recipe, "tp")
    if found is None:
        raise SkillRefused(
            f"{SKILL}: looked for a device mesh with a 'tp' dimension "
            f"(init_device_mesh(..., mesh_dim_names=(\"dp\", \"tp\"))) in {recipe.name}; found none. "
            "Create one before the model is built, then apply again"
        )
    call, target = found
    statement = recipe.statement_of(call)
    if recipe.parent(statement) is model.suite:
        body = list(model.suite.body)
        if body.index(statement) > body.index(model.statement):
            raise SkillRefused(
                f"{SKILL}: the device mesh ({recipe.where(call)}) is created after the model "
                f"({recipe.where(model.statement)}); create it first, then apply again"
            )
    return templates.expression(recipe.module, "{mesh}[\"tp\"]", mesh=target)
