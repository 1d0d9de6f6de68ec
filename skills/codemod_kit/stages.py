"""The order of the model-preparation stages, and where a new stage goes.

Wrappers must see the modules they expect: kernel swaps (Liger's fused modules, FlashAttention)
patch the plain Hugging Face model before anything wraps it, tensor parallelism shards the plain
``nn.Linear`` layers, activation checkpointing wraps the (sharded) blocks, ``torch.compile``
compiles the wrapped blocks, and FSDP2 shards last. So a recipe's model statements are kept in this order,
whatever order the skills were applied in::

    build → 4-bit weights → .to(device) → Liger kernels → FlashAttention → LoRA → tensor parallel → sequence parallel → freeze
          → activation checkpointing → torch.compile → FSDP2 / DDP / any wrapper → optimizer
          → training loop

A wrapper is a call named in the tables below (fully_shard, FullyShardedDataParallel,
DistributedDataParallel, PrivacyEngine.make_private) or any call that takes the model and is
assigned back to it (``model = Wrapper(model)``, ``model, opt = accelerator.prepare(model, opt)``).

The statements after the model construction (in the same block) are classified by the calls
they contain; a new stage is inserted before the first statement of a later stage.
"""

from __future__ import annotations

from typing import Iterable

import libcst as cst

from skills.codemod_kit.anchors import ModelAnchor, optimizer_constructors
from skills.codemod_kit.edits import Edits
from skills.codemod_kit.recipe import Recipe, dotted_name

QUANTIZE = 4  # 4-bit base weights (qlora), before the move: the device never holds them in full
PLACE = 5
KERNELS = 6
ATTENTION = 7
LORA = 8
TENSOR_PARALLEL = 10
SEQUENCE_PARALLEL = 11
FREEZE = 12
ACTIVATION_CHECKPOINTING = 20
COMPILE = 30
SHARDING = 100
OPTIMIZER = 200
TRAINING = 300
RETURN = 1000

# Calls (qualified names; a leading dot matches any module) → the stage they belong to. The
# helper names are the functions that the skills write.
STAGE_OF_CALL: dict[str, int] = {
    "apply_liger_kernels": KERNELS,
    "use_flash_attention": ATTENTION,
    "._apply_liger_kernel_to_instance": KERNELS,
    "quantize_4bit": QUANTIZE,
    "apply_lora": LORA,
    "peft.get_peft_model": LORA,
    "peft.inject_adapter_in_model": LORA,
    "apply_tensor_parallel": TENSOR_PARALLEL,
    ".parallelize_module": TENSOR_PARALLEL,
    "engine.sequence_parallel.apply_sequence_parallel": SEQUENCE_PARALLEL,
    "freeze_parameters": FREEZE,
    "checkpoint_blocks": ACTIVATION_CHECKPOINTING,
    ".checkpoint_wrapper": ACTIVATION_CHECKPOINTING,
    ".apply_activation_checkpointing": ACTIVATION_CHECKPOINTING,
    "compile_blocks": COMPILE,
    "torch.compile": COMPILE,
    ".fully_shard": SHARDING,
    "engine.fsdp.apply_fsdp": SHARDING,
    ".FullyShardedDataParallel": SHARDING,
    ".DistributedDataParallel": SHARDING,
}
STAGE_OF_METHOD: dict[str, int] = {
    "to": PLACE,
    "cuda": PLACE,
    "to_empty": PLACE,
    "set_attn_implementation": ATTENTION,
    "requires_grad_": FREEZE,
    "gradient_checkpointing_enable": ACTIVATION_CHECKPOINTING,
    "activation_checkpointing_enable": ACTIVATION_CHECKPOINTING,
    "compile": COMPILE,
    "make_private": SHARDING,
    "make_private_with_epsilon": SHARDING,
    "backward": TRAINING,
}


def stage_of_call(recipe: Recipe, call: cst.Call, optimizers: set[cst.Call]) -> int | None:
    if call in optimizers:
        return OPTIMIZER
    name = recipe.call_name(call)
    if name:
        for key, stage in STAGE_OF_CALL.items():
            if name == key or (key.startswith(".") and name.endswith(key)):
                return stage
    if isinstance(call.func, cst.Attribute):
        method = call.func.attr.value
        if method == "step" and dotted_name(call.func.value).split(".")[-1] not in {"scheduler", "lr_scheduler"}:
            return TRAINING
        return STAGE_OF_METHOD.get(method)
    return None


def stages_after(recipe: Recipe, model: ModelAnchor) -> list[tuple[cst.BaseStatement, int | None]]:
    """The statements after the model construction in its block, with their stages.

    A statement belongs to the *latest* stage among the calls it holds (a training loop that also
    moves batches with ``.to(device)`` is training), so an earlier stage never lands after it.
    """
    optimizers = set(optimizer_constructors(recipe))
    body = list(model.suite.body)
    following = body[body.index(model.statement) + 1 :]
    members = set(following)
    stage: dict[cst.CSTNode, int] = {}

    def mark(node: cst.CSTNode, node_stage: int) -> None:
        """Raise the stage of the statement after the model that holds ``node``."""
        for ancestor in recipe.ancestors(node):
            if ancestor in members:
                stage[ancestor] = max(stage.get(ancestor, node_stage), node_stage)
                return
            if ancestor is model.suite:
                return

    for call in recipe.calls():
        call_stage = stage_of_call(recipe, call, optimizers)
        if call_stage is not None:
            mark(call, call_stage)
    for assign in recipe.assigns():  # model = Wrapper(model), model, opt = accelerator.prepare(model, opt)
        if _wraps_model(recipe, assign, model.target_code) and stage_of_call(recipe, assign.value, optimizers) is None:
            mark(assign, SHARDING)
    result = []
    for statement in following:
        if isinstance(statement, cst.SimpleStatementLine) and any(isinstance(s, cst.Return) for s in statement.body):
            result.append((statement, max(RETURN, stage.get(statement, RETURN))))
        else:
            result.append((statement, stage.get(statement)))
    return result


def _wraps_model(recipe: Recipe, assign: cst.Assign, model: str) -> bool:
    """An assignment that rebinds the model to a call that takes it: a wrapper whose stage the
    tables do not know (accelerate, deepspeed, opacus, a wrapper class of the file). Changes to
    the model go before it, like before fully_shard."""
    value = assign.value
    if not isinstance(value, cst.Call) or not any(dotted_name(a.value) == model for a in value.args):
        return False
    for target in assign.targets:
        names = target.target.elements if isinstance(target.target, (cst.Tuple, cst.List)) else [target.target]
        if any(dotted_name(n.value if isinstance(n, cst.BaseElement) else n) == model for n in names):
            return True
    return False


def find_stage(recipe: Recipe, model: ModelAnchor, stages: Iterable[int]) -> cst.BaseStatement | None:
    """The first statement after the construction that belongs to one of ``stages``."""
    wanted = set(stages)
    for statement, stage in stages_after(recipe, model):
        if stage in wanted:
            return statement
    return None


def insert_stage(
    recipe: Recipe, edits: Edits, model: ModelAnchor, stage: int, new: list[cst.BaseStatement]
) -> None:
    """Insert ``new`` where ``stage`` belongs: before the first statement of a later stage."""
    following = stages_after(recipe, model)
    for statement, other in following:
        if other is not None and other > stage:
            edits.insert_before(statement, new)
            return
    last = following[-1][0] if following else model.statement
    edits.insert_after(last, new)
