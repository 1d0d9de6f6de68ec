"""tensor-parallel: shard each transformer block's linear layers over the ``tp`` mesh dimension.

Anchors: the model construction (a Hugging Face model: the plan names its layers) and the
device mesh (``self.dist.mesh`` in an engine recipe, else ``init_device_mesh(...,
mesh_dim_names=(..., "tp"))``). The call goes first among the wrapping stages, before
activation checkpointing, ``torch.compile`` and FSDP2.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from skills.codemod_kit import pointing
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


HELPER = '''
def apply_tensor_parallel(model: torch.nn.Module, tp_mesh: DeviceMesh, warn=None) -> int:
    """Tensor parallelism (Megatron-LM style) inside every transformer block, over ``tp_mesh``.

    Column-wise layers split their output features, so each rank computes a slice of the
    attention heads and of the MLP; row-wise layers split their input features and all-reduce
    their output: one all-reduce in attention and one in the MLP per block. Embeddings, norms
    and the output head stay replicated. Hugging Face attention reshapes with
    ``view(..., -1, head_dim)``, so each rank runs num_heads / tp heads without a config change;
    the head counts must divide by the tp size. Call it before activation checkpointing,
    torch.compile and fully_shard. Returns the number of sharded blocks. (Written by the
    tensor-parallel skill.)
    """
    tp = tp_mesh.size()
    if tp == 1:
        return 0
    config = model.config
    for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        value = getattr(config, name, None)
        if value is not None and value % tp:
            raise ValueError(f"tensor parallel: {name}={value} does not divide by tp={tp}")
    where, blocks = find_blocks(model, "tensor-parallel", warn=warn)
    for block in blocks:
        parallelize_module(block, tp_mesh, PLAN)
    if blocks:
        print(f"tensor-parallel: sharded {len(blocks)} blocks of {where} over tp={tp}", flush=True)
    return len(blocks)
'''


def _helper(plan: dict[str, str]) -> str:
    styles = {"colwise": "ColwiseParallel()", "rowwise": "RowwiseParallel()"}
    entries = "".join(f"        {templates.literal(k)}: {styles[v]},\n" for k, v in plan.items())
    return HELPER.replace(
        "    for block in blocks:\n        parallelize_module(block, tp_mesh, PLAN)\n",
        "    for block in blocks:\n        parallelize_module(block, tp_mesh, plan)\n",
    ).replace(
        "    where, blocks = find_blocks(",
        "    plan = {\n" + entries + "    }\n    where, blocks = find_blocks(",
    )


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
