"""FSDP2 over the qlora skill's 4-bit layers (engine/fsdp_quantized.py), in this process: the packed
weights become plain frozen parameters that FSDP2 shards, each layer keeps its quantisation state
and hands it to the gathered weight, so the sharded model computes what it computed before; a
float packing that FSDP2 would cast is refused with the model left as it was; and the estimate
of a QLoRA run over two processes counts what each rank holds. The two-process runs (losses,
resume, export) are in tests/skills/test_effect_qlora.py."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from engine.config import ConfigError, ParallelConfig
from engine.distributed import DistInfo
from engine.fsdp import apply_fsdp

pytest.importorskip("bitsandbytes")
pytest.importorskip("peft")


@contextlib.contextmanager
def process_group(backend: str, world_size: int) -> Iterator[DistInfo]:
    """This process as rank 0 of ``world_size`` (``fake``: torch's process group that answers
    every collective without data, to see how rank 0 of a larger world is sharded)."""
    if backend == "fake":
        from torch.testing._internal.distributed.fake_pg import FakeStore

        store: dist.Store = FakeStore()
    else:
        store = dist.HashStore()
    dist.init_process_group(backend, store=store, rank=0, world_size=world_size)
    try:
        mesh = init_device_mesh("cpu", (world_size, 1, 1), mesh_dim_names=("dp", "sp", "tp"))
        yield DistInfo(0, world_size, 0, torch.device("cpu"), mesh, mesh["dp", "sp"]._flatten("dp_sp"))
    finally:
        dist.destroy_process_group()


def tiny_qlora_model(quant_storage: str = "uint8") -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    from skills.lora.helpers import apply_lora
    from skills.qlora.helpers import quantize_4bit

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2))
    quantize_4bit(model, quant_storage=quant_storage)
    apply_lora(model, rank=4)
    for name, parameter in model.named_parameters():  # B starts at zero: make the adapters act
        if "lora_B" in name:
            torch.nn.init.normal_(parameter, std=0.02)
    return model


def loss_and_adapter_grads(model: torch.nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    logits = model(input_ids=ids).logits
    logits.float().square().mean().backward()
    grads = {}
    for name, parameter in model.named_parameters():
        if parameter.grad is not None:
            grad = parameter.grad
            grads[name] = grad.full_tensor() if isinstance(grad, DTensor) else grad
    model.zero_grad()
    return logits.detach().float(), grads


@pytest.mark.parametrize("storage, precision", [("uint8", "float32"), ("uint8", "bfloat16"), ("bfloat16", "bfloat16")])
def test_fsdp2_shards_the_packed_4bit_weights_and_the_model_computes_as_before(storage: str, precision: str):
    model = tiny_qlora_model(storage)
    ids = torch.arange(48).reshape(2, 24) % 64
    before, before_grads = loss_and_adapter_grads(model, ids)
    layer = model.model.layers[0].self_attn.q_proj.base_layer
    packed = layer.weight.detach().clone()

    with process_group("gloo", 1) as info:
        apply_fsdp(model, info, ParallelConfig(fsdp_on_one_process=True, param_dtype=precision))
        # A plain frozen parameter of the packed bytes, sharded; the state is the layer's.
        assert isinstance(layer.weight, DTensor) and type(layer.weight.to_local()) is torch.Tensor
        assert layer.weight.dtype == packed.dtype and not layer.weight.requires_grad
        assert torch.equal(layer.weight.full_tensor().view(torch.uint8), packed.view(torch.uint8))  # bytes: NaN != NaN
        assert layer.quant_state is not None
        after, after_grads = loss_and_adapter_grads(model, ids)
        again, _ = loss_and_adapter_grads(model, ids)  # the second step's gathered weight, the same object

    assert sorted(after_grads) == sorted(before_grads) and all("lora_" in n for n in after_grads)
    assert torch.equal(again, after)
    if precision == "float32":  # one rank in full precision: the same numbers
        assert torch.equal(after, before)
        for name, grad in before_grads.items():
            assert torch.equal(after_grads[name], grad), name
    else:  # computed in bfloat16 by FSDP2's mixed precision: close
        torch.testing.assert_close(after, before, rtol=0.05, atol=0.05)


def test_a_float_packing_that_fsdp2_would_cast_is_refused_and_the_model_is_left_as_it_was():
    model = tiny_qlora_model("float32")
    one_process = DistInfo(0, 1, 0, torch.device("cpu"), None)
    with pytest.raises(ConfigError) as refused:
        apply_fsdp(model, one_process, ParallelConfig(param_dtype="bfloat16"))
    assert str(refused.value) == (
        "model.layers.0.self_attn.q_proj.base_layer: its 4-bit values are packed as torch.float32, which FSDP2 "
        "casts to parallel.param_dtype (torch.bfloat16) before gathering them, scrambling the packed bytes: give "
        "the qlora skill quant_storage='uint8' (never cast) or 'bfloat16'"
    )
    assert all(type(m.base_layer.weight).__name__ == "Params4bit" for n, m in model.named_modules()
               if n.endswith("q_proj"))
    assert all(getattr(m, "quant_state", None) is None for m in model.modules() if type(m).__name__ == "Linear4bit")


def quant_state_bytes(state) -> int:
    tensors = [state.absmax, state.code]
    if state.nested:
        tensors += [state.offset, state.state2.absmax, state.state2.code]
    return sum(t.numel() * t.element_size() for t in tensors)


def test_the_estimate_of_qlora_over_two_processes_counts_what_each_rank_holds(tmp_path: Path, monkeypatch):
    """Rank 0 of a 2-process run built as the engine builds it (FSDP2 over a process group that
    moves no data): its shards of every parameter, the packed 4-bit values included, and the
    scales it keeps whole, against estimate_run's parameter bytes for nproc 2."""
    from engine.config import build_config
    from engine.estimate import GIB, estimate_memory, measure_shape
    from engine.launch import load_recipe_class
    from tests.skills.skill_helpers import template_with

    recipe = template_with(["qlora"], tmp_path / "qlora", {"qlora": {"rank": 4}})
    monkeypatch.chdir(tmp_path)
    recipe_class = load_recipe_class(recipe)
    config = build_config(recipe_class.config_class, recipe / "config.yaml",
                          ["model.hidden_size=1024", "model.intermediate_size=2816", "model.num_layers=2",
                           "data.source=random", "data.random_documents=8", "data.vocab_size=512",
                           "model.vocab_size=512", "data.seq_len=64", "data.batch_size=2"])
    shape = measure_shape(recipe_class, config, 2)  # as estimate_run measures it, on the meta device
    one, two = (estimate_memory(shape, nproc, config.parallel, "cpu")["params"] for nproc in (1, 2))

    with process_group("fake", 2) as info:
        model = recipe_class(config, info).prepare_model()
        shards = sum(p.to_local().nbytes for p in model.parameters())
        scales = sum(quant_state_bytes(m.quant_state) for m in model.modules() if type(m).__name__ == "Linear4bit")
        packed = sum(m.weight.to_local().nbytes for m in model.modules() if type(m).__name__ == "Linear4bit")
    assert packed and scales and all(isinstance(p, DTensor) for p in model.parameters())
    assert two * GIB == pytest.approx(shards + scales, rel=0.02)
    assert one / 2 < two < one  # more than half of one process's: the scales are not sharded
