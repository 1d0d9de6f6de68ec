"""A run's memory and time per process, estimated before it starts.

``python -m engine.launch RECIPE --check --estimate DEVICE [--device-memory-gib G]`` adds an
``estimate`` to the launch check's verdict (the server runs it sandboxed, like every check). The
recipe's own ``prepare_model()`` builds the model on the meta device — its skills applied, no
weights allocated; a Hugging Face model it loads with ``from_pretrained`` is built from its
config, its weights never read (:func:`weights_not_loaded`) — and one forward of a micro-batch of the recipe's shapes runs on it, counting
the bytes autograd saves for backward (:class:`SavedBytes`). So the activation figure is
**measured on the meta device at the run's full sequence length**, not extrapolated, and it sees
what the recipe's code does (gradient checkpointing wrappers, frozen towers, LoRA).

Per process (:func:`estimate_memory`):

- parameters fp32 (4-bit ones, the qlora skill's, at their packed bytes), gradients fp32 for the
  trainable ones, the optimizer's states for the trainable ones (as ``prepare_optimizer`` builds
  it: AdamW's two fp32 states, or two 8-bit ones) — each divided by the FSDP2 shard count
  (dp × sp) when FSDP2 shards (more than one rank, mixed precision,
  ``parallel.fsdp_on_one_process`` or ``parallel.cpu_offload``; engine/fsdp.py), but for the
  4-bit weights' scales, whole on every rank (engine/fsdp_quantized.py), and on a GPU
  none of them with ``parallel.cpu_offload`` (the host holds them);
- activations: the saved bytes of one micro-batch, attention as the run's SDPA call keeps it
  (:func:`on_fake_tensors`: no L × L mask and keys/values not repeated per head where the rows
  are neither packed nor padded, :func:`causal_without_mask`) (scaled by 2/4 with a 16-bit ``param_dtype``,
  by 1/sp with sequence parallelism) plus the largest saved tensor again (its gradient, in
  backward); a checkpointed block keeps only its input, and in backward one block's activations
  come back, once (the largest block's; measured: counting its gradients too overestimated +ckpt
  at 1,024 tokens by 1.18×); on a CPU under glibc's dynamic mmap threshold, adapters' activations
  twice and a checkpointed block's share kept in the heap (:data:`HEAP_KEPT`,
  :data:`HEAP_KEPT_CHECKPOINTED`);
- on a CPU, the process floor: the resident memory of this process after it imported torch and
  the recipe and built the recipe's data pipeline (what a run holds before its model exists), and
  for the LoRA and QLoRA changes what importing peft adds to it (the skills' recipes import it);
  on a GPU the floor is 0 (``max_memory_allocated`` does not count the CUDA context).

Time per step: FLOPs per token (``Engine.flops_per_token`` of the meta model; a checkpointed
block's forward counted twice) × the positions a process computes per step, over the device's FLOP/s: measured by a short matmul probe when the
device is here, else ``metrics.peak_tflops`` × :data:`ASSUMED_MFU`, named in ``time_source``.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator

import torch
from torch import nn
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from engine.blocks import find_blocks
from engine.distributed import DistInfo
from engine.fsdp import DTYPES, transformer_blocks
from engine.memory import heap_keeps_freed_memory, rss_high_water_mb
from engine.optimizers import FP32, is_8bit, optimizer_state_bytes
from engine.vision_language import vision_language_parts

LORA_RANK = 8  # the lora skill's default rank, for the LoRA and QLoRA changes
# bitsandbytes' 4-bit weights: half a byte a value, a float32 scale per block of 64 values, or with
# double quantisation an 8-bit one and a float32 scale per 256 of those.
NF4_PACKED = 0.5
NF4_BYTES = {True: NF4_PACKED + 1 / 64 + 4 / (64 * 256), False: NF4_PACKED + 4 / 64}
ASSUMED_MFU = 0.4
# A CPU run of adapters on a frozen base under glibc's dynamic mmap
# threshold: the resident set keeps about the activations' bytes again, freed but held in the heap
# (bench/estimate_memory.py --models, llama + lora at 1,024 tokens: 1,171 MB measured, 833 with the
# threshold fixed, 301 MB of activations estimated; malloc_trim(0) after each forward gave back 80 MB,
# at each step's start and after backward 40). Counted, lora and qlora measured 0.91-1.03 of the
# estimate (0.70-0.76 before). Full fine-tuning keeps less than its activations (its weight
# gradients reuse the freed blocks: 0.83-0.97 without the term), so it is not counted there.
HEAP_KEPT = 1.0
# A checkpointed block, full fine-tuning, on such a CPU: its forward without grad frees its
# temporaries under the input it keeps for the next block, and the heap does not reuse them, so
# each block holds a share of its activations besides its input (per-block RSS of a checkpointed
# step, forward and backward, llama and qwen2 folders at 256 and 1,024 tokens: 0.39-0.46 of a
# block's activations; +ckpt at 1,024 measured 0.72-0.84 of the estimate without it). Counting
# the whole of each block (as adapters are) hid most of what checkpointing saves
# (tests/mcp/test_estimate_run.py: -41 MB estimated against -100 MB measured).
HEAP_KEPT_CHECKPOINTED = 0.35
GIB = 2**30


@dataclass
class SavedBytes:
    """What autograd keeps for backward during one forward, counted by storage (views of one
    tensor count once; parameters are not activations). ``per_block``: each transformer block's
    own saved bytes and its input's bytes; checkpointed blocks save only their inputs."""

    total: int = 0
    largest: int = 0
    seen: set[int] = field(default_factory=set)
    parameters: set[int] = field(default_factory=set)
    current_block: int | None = None
    per_block: dict[int, list[int]] = field(default_factory=dict)  # block -> [saved, input]

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        key = storage._cdata
        if key not in self.seen and key not in self.parameters:
            self.seen.add(key)
            self.total += storage.nbytes()
            self.largest = max(self.largest, storage.nbytes())
            if self.current_block is not None:
                self.per_block[self.current_block][0] += storage.nbytes()
        return tensor


def _tensor_bytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.untyped_storage().nbytes()
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(v) for v in value)
    if isinstance(value, dict):
        return sum(_tensor_bytes(v) for v in value.values())
    return 0


def is_checkpointed(block: nn.Module) -> bool:
    """Wrapped by ``checkpoint_wrapper``, or a Hugging Face layer whose own switch is on
    (``gradient_checkpointing_enable``: the layer checkpoints itself while training)."""
    return _own_switch_on(block) or type(block).__name__ == "CheckpointWrapper" or any(
        type(m).__name__ == "CheckpointWrapper" for m in block.modules())


def _own_switch_on(block: nn.Module) -> bool:
    return getattr(block, "gradient_checkpointing", False) is True and block.training




def measure_saved_bytes(engine, batch: dict[str, torch.Tensor]) -> tuple[SavedBytes, int, int]:
    """One forward of ``batch`` (meta tensors) through ``engine.compute_loss``; returns the
    saved bytes, the blocks that are checkpointed and all blocks."""
    counter = SavedBytes(parameters={p.untyped_storage()._cdata for p in engine.model.parameters()})
    blocks = transformer_blocks(engine.model)
    checkpointed = [is_checkpointed(b) for b in blocks]
    # A layer that checkpoints itself is measured with its switch off (its activations counted as
    # they are, by block), then its activations are taken out of the total as checkpointing does.
    own = [_own_switch_on(b) for b in blocks]
    handles = []
    for index, block in enumerate(blocks):
        counter.per_block[index] = [0, 0]

        def enter(module, args, kwargs, index=index):
            counter.current_block = index
            counter.per_block[index][1] = _tensor_bytes(args) + _tensor_bytes(kwargs)

        def leave(module, args, kwargs, output, index=index):
            counter.current_block = None
            if checkpointed[index] and not own[index]:
                recomputed.append((index, module, args, kwargs))

        handles.append(block.register_forward_pre_hook(enter, with_kwargs=True))
        handles.append(block.register_forward_hook(leave, with_kwargs=True))
    recomputed: list[tuple[int, nn.Module, Any, Any]] = []
    for block, on in zip(blocks, own):
        if on:
            block.gradient_checkpointing = False
    try:
        with torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda t: t):
            engine.compute_loss(batch)
    finally:
        for handle in handles:
            handle.remove()
        for block, on in zip(blocks, own):
            if on:
                block.gradient_checkpointing = True
    counter.total -= sum(counter.per_block[index][0] for index, on in enumerate(own) if on)
    # A checkpointed block's recomputation in backward: its activations, once. Measured after the
    # model's forward, so that nothing the model records of its blocks' outputs sees it.
    for index, module, args, kwargs in recomputed:
        inner = SavedBytes(parameters=counter.parameters)
        with torch.autograd.graph.saved_tensors_hooks(inner.pack, lambda t: t):
            getattr(module, "_checkpoint_wrapped_module", module)(*args, **kwargs)
        counter.per_block[index][0] = inner.total
    return counter, sum(checkpointed), len(blocks)


@dataclass
class Shape:
    """What one process of the run holds and computes, as measured on the meta device."""

    params: int
    trainable: int
    saved_bytes: int  # one micro-batch's activations, as the recipe's code keeps them
    largest_saved: int
    block_saved: list[int]  # each block's own activations (when not checkpointed)
    block_inputs: list[int]
    checkpointed_blocks: int
    blocks: int
    flops_per_token: float | None
    positions_per_step: int  # per process
    floor_bytes: int
    measured_length: int = 0  # tokens per row of the measured micro-batch (data.seq_len)
    data_length: int = 0  # tokens per row of the data's first micro-batch
    quantized: int = 0  # values held in 4 bits (the qlora skill's layers)
    quantized_bytes: float = 0.0  # their bytes, scales included
    optimizer: str = "AdamW"  # the recipe's optimizer, as its prepare_optimizer builds it
    optimizer_bytes: float = optimizer_state_bytes(False)  # its state bytes per trainable value
    block_linear: int = 0  # values of the plain nn.Linear weights inside the blocks (what QLoRA holds in 4 bits)
    lora_values: int = 0  # adapter values the lora skill at its default rank adds (lora_blocks' linears)
    qlora_values: int | None = None  # those the qlora skill adds (every block's linears); None: lora_values
    # (saved bytes, largest, per block) with only the weights of the layers LoRA adapts trainable
    # (lora_linears), as LoRA trains beside them: tensors kept only for a frozen parameter's
    # gradient are not saved, so a frozen vision tower saves nothing.
    adapter_saved: tuple[int, int, list[int]] | None = None
    # The same with QLoRA's layers trainable (every block's), where they are not LoRA's; None: adapter_saved.
    qlora_saved: tuple[int, int, list[int]] | None = None
    heap_keeps_freed: bool = False  # a CPU run under glibc's dynamic mmap threshold (engine/memory.py)
    peft_import_bytes: int = 0  # what importing peft added to the floor (0: the recipe imports it already)


def estimate_memory(shape: Shape, nproc: int, parallel: Any, device: str, checkpointing: bool | None = None,
                    micro_batch_scale: float = 1.0, param_dtype: str | None = None, adapters: str | None = None,
                    eight_bit: bool = False, cpu_offload: bool | None = None) -> dict[str, Any]:
    """Bytes per process (see the module docstring); ``checkpointing``, ``micro_batch_scale``,
    ``param_dtype``, ``adapters`` (``lora``, ``qlora``: the skill applied, at rank
    :data:`LORA_RANK`), ``eight_bit`` (the 8-bit AdamW) and ``cpu_offload`` re-estimate the same
    model with that change made."""
    tp, sp = parallel.tp, parallel.sp
    fsdp = max(1, nproc // tp)
    dtype = param_dtype or parallel.param_dtype
    offload = parallel.cpu_offload if cpu_offload is None else cpu_offload
    mixed = dtype != "float32" or parallel.reduce_dtype != "float32"
    shards = fsdp if (fsdp > 1 or mixed or parallel.fsdp_on_one_process or offload) else 1
    # 4-bit values: their packed half byte shards, their scales stay whole on every rank (engine/fsdp_quantized.py).
    quantized, scales = shape.quantized, shape.quantized_bytes - shape.quantized * NF4_PACKED
    weights = (shape.params - quantized) * FP32 + quantized * NF4_PACKED
    trainable = shape.trainable
    if adapters == "lora":
        weights, trainable = weights + shape.lora_values * FP32, shape.lora_values
    elif adapters == "qlora":
        trainable = shape.lora_values if shape.qlora_values is None else shape.qlora_values
        weights += trainable * FP32 - shape.block_linear * (FP32 - NF4_PACKED)
        quantized, scales = quantized + shape.block_linear, scales + shape.block_linear * (NF4_BYTES[True] - NF4_PACKED)
    state_bytes = optimizer_state_bytes(True) if eight_bit else shape.optimizer_bytes
    # With offload, each rank's shards of these live in host memory, not on the device.
    on_device = 0 if offload and device == "cuda" else 1
    params = (weights / shards / tp + scales) * on_device
    grads = trainable * FP32 / shards / tp * on_device
    optimizer = trainable * state_bytes / shards / tp * on_device
    # Outside the blocks, what the forward saved; inside, each block's activations, or with
    # checkpointing its input (kept for the recomputation) and, in backward, one block's again.
    measured_checkpointed = shape.checkpointed_blocks > 0
    saved, largest, block_saved = shape.saved_bytes, shape.largest_saved, shape.block_saved
    adapter_saved = shape.qlora_saved if adapters == "qlora" and shape.qlora_saved is not None else shape.adapter_saved
    if adapters and adapter_saved is not None:
        saved, largest, block_saved = adapter_saved
    outside = saved - (0 if measured_checkpointed else sum(block_saved))
    if checkpointing is None:
        checkpointing = measured_checkpointed
    if checkpointing:
        activations = outside + sum(shape.block_inputs) + max(block_saved, default=0)  # recomputed in backward, once
    else:
        activations = outside + sum(block_saved)
    activations += largest
    scale = micro_batch_scale * (DTYPES[dtype].itemsize / FP32) / sp
    activations *= scale
    frozen_base = adapters is not None or not shape.trainable > 2 * shape.lora_values
    if device == "cpu" and shape.heap_keeps_freed and frozen_base:
        activations *= 1 + HEAP_KEPT
    elif device == "cpu" and shape.heap_keeps_freed and checkpointing:
        activations += HEAP_KEPT_CHECKPOINTED * sum(block_saved) * scale
    gathered = 0.0
    if (shards > 1 or on_device == 0) and shape.blocks:  # FSDP2 gathers (or copies in) a block and prefetches the next, in the compute dtype
        gathered = 2 * ((shape.params - quantized) * DTYPES[dtype].itemsize + quantized * NF4_PACKED) / shape.blocks / tp
    floor = shape.floor_bytes + (shape.peft_import_bytes if adapters else 0) if device == "cpu" else 0
    parts = {"floor": floor, "params": params, "grads": grads, "optimizer": optimizer,
             "activations": activations, "gathered": gathered}
    return {key: round(value / GIB, 4) for key, value in parts.items()} | {
        "peak_gib": round(sum(parts.values()) / GIB, 4)}


def step_time(shape: Shape, device: torch.device, dtype: torch.dtype, override_tflops: float | None
              ) -> tuple[float | None, str]:
    """Seconds per optimizer step per process, and where the FLOP/s came from."""
    if not shape.flops_per_token:
        return None, "the recipe gives no FLOPs per token"
    flops = shape.flops_per_token * shape.positions_per_step
    if shape.blocks:  # a checkpointed block runs its forward (2 of the 6 FLOPs per parameter) again
        flops *= 1 + shape.checkpointed_blocks / shape.blocks / 3
    if device.type == "cpu" or torch.cuda.is_available():  # the device is here: measure it
        measured = matmul_flops(device, dtype)
        return flops / measured, f"a {PROBE_SIZE}² matmul probe here: {measured / 1e9:,.1f} GFLOP/s (MFU 1 of that)"
    peak = override_tflops * 1e12 if override_tflops is not None else None
    if peak is None:
        return None, "no such device here, and its peak FLOP/s is not known: metrics.peak_tflops sets it"
    return flops / (peak * ASSUMED_MFU), f"metrics.peak_tflops {peak / 1e12:,.0f} TFLOP/s × MFU {ASSUMED_MFU}"


PROBE_SIZE = 512


def matmul_flops(device: torch.device, dtype: torch.dtype, repeats: int = 5) -> float:
    a = torch.randn(PROBE_SIZE, PROBE_SIZE, device=device, dtype=dtype)
    b = torch.randn(PROBE_SIZE, PROBE_SIZE, device=device, dtype=dtype)
    a @ b  # warm-up
    best = math.inf
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        a @ b
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return 2 * PROBE_SIZE**3 / best


def rss_now_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return int(rss_high_water_mb() * 2**20)


def peft_import_bytes() -> int:
    """The resident bytes importing peft adds to this process: what a recipe with the lora or
    qlora skill holds beside this one's floor; 0 where peft is imported already or missing."""
    if "peft" in sys.modules:
        return 0
    before = rss_now_bytes()
    try:
        import peft  # noqa: F401
    except ImportError:
        return 0
    return max(0, rss_now_bytes() - before)


def measure_shape(recipe_class, config, nproc: int) -> Shape:
    """Build the recipe's engine as one process of an ``nproc`` run would see it, its data
    pipeline for one micro-batch's shapes, and its model on the meta device."""
    parallel = config.parallel
    dp = max(1, nproc // (parallel.tp * parallel.sp))
    meta_config = config.model_copy(deep=True)
    # The model is built unsharded in float32: sharding and precision are applied by the formula.
    meta_config.parallel.param_dtype = meta_config.parallel.reduce_dtype = "float32"
    meta_config.parallel.fsdp_on_one_process = meta_config.parallel.cpu_offload = False
    meta_config.parallel.tp = meta_config.parallel.sp = 1
    engine = recipe_class(meta_config, DistInfo(0, 1, 0, torch.device("cpu"), None))
    micro_batch = config.data.batch_size // (dp * config.train.grad_accum)
    meta_config.data.batch_size = micro_batch * config.train.grad_accum  # one process's share
    torch.manual_seed(config.train.seed)
    batches = engine.prepare_data()
    engine.prepare_eval_data()
    data_batch = next(batches)
    data_length = _row_length(data_batch)
    batch = at_full_length(data_batch, config.data.seq_len)
    floor = rss_now_bytes()
    peft_import = peft_import_bytes()
    engine.device = torch.device("meta")
    with torch.device("meta"), weights_not_loaded():
        engine.model = engine.prepare_model()
    engine.model.train()
    optimizer, optimizer_bytes = _optimizer_of(engine)
    quantized, quantized_bytes = quantized_weights(engine.model)
    block_linear, lora_values, qlora_values = adaptable_linears(engine.model)
    try:
        with on_fake_tensors(engine.model, batch, unmasked=causal_without_mask(data_batch)) as fake_batch:
            counter, checkpointed, blocks, (adapter_saved, qlora_saved) = _forward_saved(
                engine, fake_batch, block_linear, lora_values)
    except (DataDependentOutputException, DynamicOutputShapeException):
        # A forward that reads its inputs' values (Qwen2-VL's image grid and 3-D positions,
        # Idefics3's empty tiles): the model built again on the meta device, the inputs real.
        with torch.device("meta"), weights_not_loaded():
            engine.model = engine.prepare_model()
        engine.model.train()
        with on_meta_beside_real_inputs(batch) as real_batch:
            counter, checkpointed, blocks, (adapter_saved, qlora_saved) = _forward_saved(
                engine, real_batch, block_linear, lora_values)
    unique = {id(p): p for p in engine.model.parameters()}.values()
    positions = sum(v.numel() for k, v in batch.items() if k == "input_ids") * config.train.grad_accum
    per_block = [counter.per_block[i] for i in range(blocks)]
    return Shape(
        params=sum(p.numel() for p in unique), trainable=sum(p.numel() for p in unique if p.requires_grad),
        saved_bytes=counter.total, largest_saved=counter.largest,
        block_saved=[b[0] for b in per_block], block_inputs=[b[1] for b in per_block],
        checkpointed_blocks=checkpointed, blocks=blocks, flops_per_token=engine.flops_per_token(),
        heap_keeps_freed=heap_keeps_freed_memory(),
        positions_per_step=positions, floor_bytes=floor, measured_length=_row_length(batch), data_length=data_length,
        quantized=quantized, quantized_bytes=quantized_bytes, optimizer=optimizer, optimizer_bytes=optimizer_bytes,
        block_linear=block_linear, lora_values=lora_values, qlora_values=qlora_values, adapter_saved=adapter_saved,
        qlora_saved=qlora_saved, peft_import_bytes=peft_import,
    )


def _forward_saved(engine, batch, block_linear: int, lora_values: int):
    """The forward's saved bytes (:func:`measure_saved_bytes`), and those with only the linear
    layers LoRA adapts trainable, then QLoRA's where they differ (a vision-language model's
    vision tower), where that is a change worth measuring."""
    counter, checkpointed, blocks = measure_saved_bytes(engine, batch)
    adapter_saved = qlora_saved = None
    if block_linear and sum(p.numel() for p in engine.model.parameters() if p.requires_grad) > 2 * lora_values:
        lora: set[nn.Module] = set(lora_linears(engine.model).values())
        every: set[nn.Module] = set(block_linears(engine.model))
        adapter_saved = saved_with_only_linears_trainable(engine, batch, lora)
        if every != lora:
            qlora_saved = saved_with_only_linears_trainable(engine, batch, every)
    return counter, checkpointed, blocks, (adapter_saved, qlora_saved)


class _MetaBesideReal(TorchDispatchMode):
    """An op on the inputs alone runs for real, so that a model may read their values (an image
    grid, where the image tokens are); an op that meets a meta tensor (a weight, or what was
    computed from one) runs on the meta device. An input moved to the model's (meta) device
    stays real: its values are still read (an attention mask); a meta tensor indexed by a real
    boolean mask (the hidden states of the tokens a loss covers) takes the mask's positions."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten.index.Tensor and args[0].device.type == "meta":
            args = (args[0], [i for index in args[1] for i in _positions_of_real_mask(index)])
        if func is torch.ops.aten._to_copy.default and kwargs.get("device") == torch.device("meta") \
                and args[0].device.type != "meta":
            kwargs = {key: value for key, value in kwargs.items() if key != "device"}
        if any(isinstance(t, torch.Tensor) and t.device.type == "meta" for t in pytree.tree_leaves((args, kwargs))):
            args, kwargs = pytree.tree_map_only(torch.Tensor, lambda t: t.to("meta"), (args, kwargs))
        return func(*args, **kwargs)


def _positions_of_real_mask(index: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
    """An index of ``aten.index``: a real boolean mask as the positions it selects (one tensor a
    dimension), which index a meta tensor to the mask's count; any other index as it is."""
    if isinstance(index, torch.Tensor) and index.dtype == torch.bool and index.device.type != "meta":
        return index.nonzero(as_tuple=True)
    return (index,)


@contextlib.contextmanager
def on_meta_beside_real_inputs(batch: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """The meta model's forward over the real ``batch`` (:class:`_MetaBesideReal`), for a model
    whose forward reads its inputs' values, which fake tensors cannot give: the activations are
    meta tensors, counted by their sizes as fake ones are; SDPA as the fused kernel keeps it,
    4-bit layers as plain ones. A mask is built, or not, as the model decides from the values."""
    os.environ["TRANSFORMERS_DISABLE_TORCH_CHECK"] = "1"  # its checks of features against tokens read weights' values
    with _MetaBesideReal(), fused_attention(), plain_4bit_layers():
        yield batch


@contextlib.contextmanager
def on_fake_tensors(model: nn.Module, batch: dict[str, Any], unmasked: bool = False) -> Iterator[dict[str, Any]]:
    """``batch`` as fake tensors, and the meta ``model``'s parameters made fake, for a forward
    whose saved bytes are counted: SDPA as the fused kernel keeps it (:func:`fused_attention`),
    4-bit layers as plain ones (:func:`plain_4bit_layers`) and, where the run's rows take no mask
    (``unmasked``: :func:`causal_without_mask`), attention as ``is_causal`` (:func:`no_mask_built`)."""
    # Fake tensors over the meta ones: code that asks a tensor for a value (a mask check in
    # transformers) sees a traced tensor and skips the question, as under torch.compile.
    # transformers' input checks (image tokens vs features) ask for values: skipped, as they can be.
    os.environ["TRANSFORMERS_DISABLE_TORCH_CHECK"] = "1"
    with FakeTensorMode(allow_non_fake_inputs=True) as fake:
        _fake_parameters(model, fake)
        fake_batch = {k: (fake.from_tensor(v.to("meta")) if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}
        with fused_attention(), plain_4bit_layers(), (no_mask_built() if unmasked else contextlib.nullcontext()):
            yield fake_batch


def causal_without_mask(batch: dict[str, Any]) -> bool:
    """Whether a Hugging Face model given this (real) batch attends with SDPA's ``is_causal`` and
    no mask: no padding in its ``attention_mask`` and no packed sequences in its ``position_ids``
    (transformers' own test of them). Then it builds no L × L mask and, with fewer key/value
    heads than query heads, passes ``enable_gqa`` instead of repeating keys and values. On fake
    tensors it cannot read these values and builds both (:func:`no_mask_built` answers for it)."""
    try:
        from transformers.masking_utils import find_packed_sequence_indices
    except ImportError:
        return False
    mask, positions = batch.get("attention_mask"), batch.get("position_ids")
    if isinstance(mask, torch.Tensor) and not bool(mask.all()):
        return False
    if isinstance(positions, torch.Tensor) and positions.dim() == 2:
        return find_packed_sequence_indices(positions) is None
    return True


@contextlib.contextmanager
def no_mask_built() -> Iterator[None]:
    """transformers' mask builder answered as it answers on the real batch that
    :func:`causal_without_mask` found unmasked: no packed sequences, no padding, so no mask
    (the model calls SDPA with ``is_causal``, and ``enable_gqa`` where it can)."""
    try:
        from transformers import masking_utils
    except ImportError:
        yield
        return
    packed, ignore = masking_utils.find_packed_sequence_indices, masking_utils._ignore_causal_mask_sdpa
    masking_utils.find_packed_sequence_indices = lambda position_ids: None
    masking_utils._ignore_causal_mask_sdpa = lambda padding_mask, *args, **kwargs: ignore(None, *args, **kwargs)
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices, masking_utils._ignore_causal_mask_sdpa = packed, ignore


def saved_with_only_linears_trainable(engine, batch, linears: set[nn.Module]) -> tuple[int, int, list[int]]:
    """The saved bytes of the forward again with every parameter frozen but the weights of
    ``linears``: what a LoRA (or QLoRA) run saves, its adapters taking those layers' inputs (a
    frozen vision tower's layers save nothing), and each adapter's rank-:data:`LORA_RANK` product
    ``A x``, which its ``B`` keeps (a quarter of a layer's input at hidden 32, 0.2% at 4,096):
    in its block's activations, and in the forward's unless the block is checkpointed."""
    adapted = {id(m.weight) for m in linears}
    was = {id(p): p.requires_grad for p in engine.model.parameters()}
    blocks = transformer_blocks(engine.model)
    block_of = {id(m): index for index, block in enumerate(blocks) for m in block.modules()}
    products: dict[int, tuple[int | None, int]] = {}  # layer -> (its block, its product's bytes), once

    def product(module, args, output):
        rows = args[0].numel() // module.in_features
        products[id(module)] = (block_of.get(id(module)), rows * LORA_RANK * args[0].element_size())

    handles = [m.register_forward_hook(product) for m in linears]
    for parameter in engine.model.parameters():
        parameter.requires_grad_(id(parameter) in adapted)
    try:
        counter, _, _ = measure_saved_bytes(engine, batch)
    finally:
        for handle in handles:
            handle.remove()
        for parameter in engine.model.parameters():
            parameter.requires_grad_(was[id(parameter)])
    in_forward = sum(size for index, size in products.values() if index is None or not is_checkpointed(blocks[index]))
    per_block = [counter.per_block[i][0] + sum(size for index, size in products.values() if index == i)
                 for i in range(len(blocks))]
    return counter.total + in_forward, counter.largest, per_block


def _optimizer_of(engine) -> tuple[str, float]:
    """The optimizer the recipe's ``prepare_optimizer`` builds over the meta model (no state is
    allocated before a step), and its state bytes per trainable value; AdamW's where it cannot
    be built on the meta device."""
    try:
        optimizer = engine.prepare_optimizer(engine.model)
    except Exception:  # noqa: BLE001 — an optimizer that needs real tensors: counted as AdamW, named so
        return "AdamW (assumed)", optimizer_state_bytes(False)
    return type(optimizer).__name__, optimizer_state_bytes(is_8bit(optimizer))


def quantized_weights(model: nn.Module) -> tuple[int, float]:
    """Values held as bitsandbytes 4-bit weights (the qlora skill's ``Linear4bit`` layers), and
    their bytes: on the meta device they keep their full shape, unquantised."""
    values, held = 0, 0.0
    for parameter in {id(p): p for p in model.parameters()}.values():
        if type(parameter).__name__ == "Params4bit":
            values += parameter.numel()
            held += parameter.numel() * NF4_BYTES[bool(getattr(parameter, "compress_statistics", True))]
    return values, held


def adaptable_linears(model: nn.Module) -> tuple[int, int, int]:
    """The values of the plain ``nn.Linear`` weights inside the model's blocks (what the qlora
    skill adapts and holds in 4 bits), the adapter values the lora skill at rank
    :data:`LORA_RANK` adds by default (those of :func:`lora_blocks`), and those qlora adds."""
    def adapters(linears: Iterable[nn.Linear]) -> int:
        return sum(LORA_RANK * (m.in_features + m.out_features) for m in {id(m): m for m in linears}.values())

    every = block_linears(model)
    return sum(m.weight.numel() for m in every), adapters(lora_linears(model).values()), adapters(every)


def block_linears(model: nn.Module) -> list[nn.Linear]:
    """The plain ``nn.Linear`` layers inside the model's blocks, each once: what the qlora skill
    holds in 4 bits and adapts."""
    found = {id(m): m for block in transformer_blocks(model) for m in block.modules() if type(m) is nn.Linear}
    return list(found.values())  # type: ignore[arg-type]


def lora_linears(model: nn.Module) -> dict[str, nn.Linear]:
    """The linear layers the lora skill adapts without ``target_modules``, by name: the plain
    ``nn.Linear`` layers of :func:`lora_blocks` (of a vision-language model, its language model's
    alone). The one set the LoRA change's trainable values and saved activations count."""
    inside = {id(m) for block in lora_blocks(model) for m in block.modules() if type(m) is nn.Linear}
    return {name: m for name, m in model.named_modules() if id(m) in inside}  # type: ignore[misc]


def lora_blocks(model: nn.Module) -> list[nn.Module]:
    """The blocks whose linear layers the lora skill adapts without ``target_modules``: a
    vision-language model's language model's (the part its written ``vision_language_parts``
    finds, ``within=`` of ``apply_lora``), else the model's own."""
    parts = vision_language_parts(model, "lora", [], every=True)
    within = parts.get("language_model") if "vision_tower" in parts else None
    return transformer_blocks(model) if within is None else find_blocks(within, "lora", warn=lambda message: None)[1]


@contextlib.contextmanager
def plain_4bit_layers() -> Iterator[None]:
    """bitsandbytes' 4-bit layers computed as plain linear layers while the forward is measured:
    on the meta device their weights were never quantised, and what they save for backward is
    what ``nn.Linear`` saves (the input; the weight is dequantised again in backward)."""
    import sys

    if "bitsandbytes" not in sys.modules:
        yield
        return
    from bitsandbytes.nn import Linear4bit

    original = Linear4bit.forward
    Linear4bit.forward = lambda self, x: torch.nn.functional.linear(x, self.weight, self.bias)  # type: ignore[method-assign]
    try:
        yield
    finally:
        Linear4bit.forward = original  # type: ignore[method-assign]


def _row_length(batch: dict[str, Any]) -> int:
    ids = batch.get("input_ids")
    return int(ids.shape[-1]) if isinstance(ids, torch.Tensor) and ids.dim() >= 2 else 0


def at_full_length(batch: dict[str, Any], seq_len: int) -> dict[str, Any]:
    """``batch`` with every row ``seq_len`` tokens long, as the longest batch the run can see: a
    collator that pads to the batch's longest example makes short batches of short data, and an
    estimate "at data.seq_len" must not measure those. Each dimension of a per-row tensor that
    is the rows' length becomes ``seq_len`` (masks of L × L included, and Qwen's 3-D positions,
    (3, rows, L)), its values kept in front (a forward that reads them finds the image tokens
    where they were), the rest zeros, and an ``attention_mask``'s ones (the rows are full); other
    tensors (images) stay as they are."""
    length = _row_length(batch)
    if not length or length >= seq_len:
        return batch
    rows = batch["input_ids"].shape[0]
    grown: dict[str, Any] = {}
    for key, value in batch.items():
        per_row = isinstance(value, torch.Tensor) and value.dim() >= 2 and rows in value.shape[:2]
        after = value.shape.index(rows) + 1 if per_row else 0
        if per_row and length in value.shape[after:]:
            shape = [*value.shape[:after], *(seq_len if n == length else n for n in value.shape[after:])]
            full = torch.full(shape, int(key == "attention_mask"), dtype=value.dtype, device=value.device)
            full[tuple(slice(0, n) for n in value.shape)] = value
            value = full
        grown[key] = value
    return grown


@contextlib.contextmanager
def weights_not_loaded() -> Iterator[None]:
    """A Hugging Face model the recipe loads with ``from_pretrained`` (a folder, a Hub snapshot)
    is built from its config instead: on the meta device no weights are read, and loading them
    there is refused by transformers. What changes the model's shape or kernels is kept
    (``config``, ``dtype``, ``attn_implementation``); the rest of the call is about loading."""
    try:
        from transformers import AutoConfig, PreTrainedModel
    except ImportError:  # a recipe without transformers loads no Hugging Face model
        yield
        return

    def from_config(cls, path, *args, config=None, **kwargs):
        if config is None or isinstance(config, (str, os.PathLike)):
            config = AutoConfig.from_pretrained(config or path, trust_remote_code=kwargs.get("trust_remote_code", False))
        chosen = {k: kwargs[k] for k in ("dtype", "torch_dtype", "attn_implementation") if kwargs.get(k) is not None}
        if chosen.get("dtype") == "auto" or chosen.get("torch_dtype") == "auto":
            chosen.pop("dtype", None), chosen.pop("torch_dtype", None)
        return cls._from_config(config, **chosen)

    original = PreTrainedModel.__dict__["from_pretrained"]
    PreTrainedModel.from_pretrained = classmethod(from_config)  # type: ignore[method-assign, assignment]
    try:
        yield
    finally:
        PreTrainedModel.from_pretrained = original  # type: ignore[method-assign]


class _FusedAttention(torch.autograd.Function):
    """Scaled dot-product attention as a fused kernel keeps it for backward (flash or
    memory-efficient on a GPU, the flash kernel on a CPU): its inputs, its output and one
    log-sum-exp per query row, never the S×S attention weights — only a mask, when one is given
    (a boolean mask as the float one it becomes: measured on the CPU kernel of torch 2.13). On
    the meta device SDPA takes the math path, which saves the weights: at 4k tokens about 3× a
    run's real activations."""

    @staticmethod
    def forward(ctx, query, key, value, mask):  # type: ignore[override]
        # laid out as the kernels lay it out, heads inside positions: the model's transpose back to
        # (batch, position, hidden) is then a view of it, not a copy
        *batch, heads, length, _ = query.shape
        output = query.new_empty((*batch, length, heads, value.shape[-1])).transpose(-3, -2)
        log_sum_exp = query.new_empty(query.shape[:-1], dtype=torch.float32)
        kept = [query, key, value, output, log_sum_exp]
        if mask is not None:
            kept.append(mask.new_empty(mask.shape, dtype=query.dtype) if mask.dtype == torch.bool else mask)
        ctx.save_for_backward(*kept)
        return output

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]  # the estimate runs forward only
        query, key, value = ctx.saved_tensors[:3]
        return torch.zeros_like(query), torch.zeros_like(key), torch.zeros_like(value), None


@contextlib.contextmanager
def fused_attention() -> Iterator[None]:
    """``F.scaled_dot_product_attention`` counted as a fused kernel (:class:`_FusedAttention`)
    while the forward is measured; a model's own eager attention is counted as it is."""
    original = torch.nn.functional.scaled_dot_product_attention

    def sdpa(query, key, value, attn_mask=None, *args, **kwargs):
        return _FusedAttention.apply(query, key, value, attn_mask)

    torch.nn.functional.scaled_dot_product_attention = sdpa
    try:
        yield
    finally:
        torch.nn.functional.scaled_dot_product_attention = original


def _fake_parameters(model: nn.Module, fake: FakeTensorMode) -> None:
    """Replace the meta model's parameters and buffers by fake tensors (a tied weight stays one)."""
    made: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is not None:
                if id(param) not in made:
                    made[id(param)] = nn.Parameter(fake.from_tensor(param), requires_grad=param.requires_grad)
                module._parameters[name] = made[id(param)]  # type: ignore[assignment]
        for name, buffer in list(module._buffers.items()):
            if buffer is not None:
                module._buffers[name] = fake.from_tensor(buffer)


def _activations_source(shape: Shape) -> str:
    said = (f"saved tensors of one micro-batch's forward on the meta device, measured at {shape.measured_length:,} "
            "tokens per row (data.seq_len)")
    if shape.data_length and shape.data_length < shape.measured_length:
        said += (f"; this data's first batch is {shape.data_length:,} tokens long: a batch padded to its longest "
                 "example takes less")
    return said


def estimate(recipe_class, config, nproc: int, device: str, device_memory_gib: float | None) -> dict[str, Any]:
    """The ``estimate`` of the launch check's verdict (mcp_server.models.EstimateResult)."""
    shape = measure_shape(recipe_class, config, nproc)
    parallel = config.parallel
    memory = estimate_memory(shape, nproc, parallel, device)
    seconds, time_source = step_time(shape, torch.device(device), DTYPES[parallel.param_dtype],
                                     config.metrics.peak_tflops)
    result: dict[str, Any] = {
        "params": shape.params, "trainable": shape.trainable, "quantized": shape.quantized,
        "optimizer": shape.optimizer,
        "checkpointed_blocks": f"{shape.checkpointed_blocks} of {shape.blocks}",
        "memory_gib": memory,
        "activations_source": _activations_source(shape),
        "flops_per_token": shape.flops_per_token, "step_time_s": seconds, "time_source": time_source,
        "fits": None, "changes": [],
    }
    if device_memory_gib is not None:
        result["fits"] = memory["peak_gib"] <= device_memory_gib
        if not result["fits"]:
            from engine.estimate_changes import changes_that_fit  # it re-estimates with estimate_memory

            result["changes"] = changes_that_fit(shape, config, nproc, device, device_memory_gib)
    return result
