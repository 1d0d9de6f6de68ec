"""What the tensor-parallel skill writes into a recipe: skills/tensor-parallel/codemod.py copies
``apply_tensor_parallel`` with libcst and sets its ``plan`` to the skill's (the Llama plan here).
A real module, so that ruff lints it and tests import it.
"""

from fnmatch import fnmatch

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from engine.blocks import find_blocks  # written by ensure_find_blocks


def apply_tensor_parallel(model: torch.nn.Module, tp_mesh: DeviceMesh, warn=None) -> int:
    """Tensor parallelism (Megatron-LM style) inside every transformer block that holds the layers
    the plan names, over ``tp_mesh``.

    Column-wise layers split their output features, so each rank computes a slice of the
    attention heads and of the MLP; row-wise layers split their input features and all-reduce
    their output: one all-reduce in attention and one in the MLP per block. Embeddings, norms,
    the output head and blocks with other layers (a vision-language model's vision tower) stay
    replicated. Hugging Face attention reshapes with
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
    plan = {
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(),
    }
    where, blocks = find_blocks(model, "tensor-parallel", warn=warn)
    # Only the blocks that hold every layer the plan names (a vision-language model's vision layers
    # have others): a block sharded in part would mix sharded and whole activations.
    fitting = [b for b in blocks if all(any(fnmatch(n, key) for n, _ in b.named_modules()) for key in plan)]
    for block in fitting:
        parallelize_module(block, tp_mesh, plan)
    if blocks and not fitting:
        message = f"tensor-parallel: no block of {where} has the layers {', '.join(plan)}: name its layers in the plan"
        if warn is None:
            raise ValueError(message)
        warn(message)
    elif fitting:
        count = f"{len(fitting)}" if len(fitting) == len(blocks) else f"{len(fitting)} of the {len(blocks)}"
        print(f"tensor-parallel: sharded {count} blocks of {where} over tp={tp}", flush=True)
    return len(fitting)
