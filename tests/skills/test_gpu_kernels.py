"""The GPU skills on a CUDA GPU: numerics of what they write against the plain model, on a tiny
Llama in bfloat16. Each test skips with its reason where the GPU or the package is missing.

    pytest -m gpu tests/skills/test_gpu_kernels.py -s      # prints the measured timings
"""

from __future__ import annotations

import copy
import importlib.util
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.skills.skill_helpers import load_recipe_module, template_with

pytestmark = pytest.mark.gpu


def needs(package: str):
    """Skip without a CUDA GPU, or without ``package`` (pip install 'trainwright[gpu]')."""
    if not torch.cuda.is_available():
        return pytest.mark.skip(reason="needs a CUDA GPU")
    return pytest.mark.skipif(importlib.util.find_spec(package) is None, reason=f"needs the {package} package")


needs_flash_attn = needs("flash_attn")
needs_liger = needs("liger_kernel")
needs_triton = needs("triton")


def tiny_llama(vocab_size: int = 258):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa")
    return LlamaForCausalLM(config).cuda().to(torch.bfloat16)


def engine_like(model, **flags):
    return types.SimpleNamespace(model=model, device=torch.device("cuda"), **flags)


@needs_flash_attn
def test_flash_attention_matches_sdpa_on_padded_rows(tmp_path: Path):
    module = load_recipe_module(template_with(["flash-attention"], tmp_path / "flash"))
    reference = tiny_llama()
    model = copy.deepcopy(reference)
    batch = {k: v.cuda() for k, v in module.collate([torch.arange(100) % 256, torch.arange(30) % 256], 64, 257).items()}

    assert module.use_flash_attention(model, torch.bfloat16, warn=pytest.fail) is True
    with torch.no_grad():
        expected = module.CausalLM.compute_loss(engine_like(reference), batch)
        flash = module.CausalLM.compute_loss(engine_like(model), batch)

    assert model.config._attn_implementation == "flash_attention_2"
    assert torch.allclose(flash, expected, rtol=2e-2), (flash.item(), expected.item())


@needs_flash_attn
def test_flash_attention_keeps_packed_documents_apart(tmp_path: Path):
    module = load_recipe_module(template_with(["sequence-packing", "flash-attention"], tmp_path / "flash"))
    reference = tiny_llama()
    model = copy.deepcopy(reference)
    assert module.use_flash_attention(model, torch.bfloat16, warn=pytest.fail) is True
    generator = torch.Generator().manual_seed(0)
    pieces = [torch.randint(0, 256, (n,), generator=generator) for n in (40, 9, 23, 30, 5, 17, 33, 12)]

    def per_document_losses(net, batch):
        batch = {k: v.cuda() for k, v in batch.items()}
        logits = net(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
        losses = F.cross_entropy(logits.flatten(0, 1).float(), batch["labels"].flatten(), reduction="none")
        return losses.view(batch["labels"].shape), batch["labels"]

    with torch.no_grad():
        alone, alone_labels = per_document_losses(reference, module.collate_packed(pieces, 64, 257))
        packed, packed_labels = per_document_losses(model, module.collate_packed(module.pack_pieces(pieces, 64), 64, 257))

    alone_total = alone[alone_labels != -100].sum()
    packed_total = packed[packed_labels != -100].sum()
    assert torch.allclose(packed_total, alone_total, rtol=2e-2), (packed_total.item(), alone_total.item())


@needs_liger
def test_liger_loss_and_gradients_match_the_plain_template(tmp_path: Path, capsys):
    module = load_recipe_module(template_with(["liger-kernel"], tmp_path / "liger"))
    reference = tiny_llama().float()
    model = copy.deepcopy(reference)
    assert module.apply_liger_kernels(model, warn=pytest.fail) is True
    batch = {k: v.cuda() for k, v in module.collate([torch.arange(65) % 256, torch.arange(30) % 256], 64, 257).items()}

    plain = module.CausalLM.compute_loss(engine_like(reference, fused_linear_cross_entropy=False), batch)
    fused = module.CausalLM.compute_loss(engine_like(model.train(), fused_linear_cross_entropy=True), batch)
    plain.backward()
    fused.backward()

    gradient_gap = max((a.grad - b.grad).abs().max().item() for a, b in zip(model.parameters(), reference.parameters()))
    with capsys.disabled():
        print(f"\n[liger-kernel] summed loss {fused.item():.4f} vs {plain.item():.4f}; max gradient gap {gradient_gap:.1e}")
    assert torch.allclose(fused, plain, rtol=1e-4)
    assert gradient_gap < 1e-3


@needs_triton
def test_triton_newton_schulz_matches_torch_and_reports_its_speed(tmp_path: Path, capsys):
    module = load_recipe_module(template_with(["muon"], tmp_path / "muon", params={"muon": {"triton": True}}))
    lines = []
    for rows, cols in ((256, 256), (512, 2048), (2048, 2048), (5632, 2048)):
        matrix = torch.randn(rows, cols, device="cuda")
        torch_result = module.newton_schulz_torch(matrix, 5).float()
        triton_result = module.newton_schulz_triton(matrix, 5).float()
        gap = (torch_result - triton_result).abs().max().item()
        times = []
        for function in (module.newton_schulz_torch, module.newton_schulz_triton):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(10):
                function(matrix, 5)
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 10)
        chosen = module.newton_schulz(matrix, 5)  # measures once, then keeps the faster
        assert chosen.shape == matrix.shape
        lines.append(f"{rows}x{cols}: torch {times[0]:.3f} ms, triton {times[1]:.3f} ms, max gap {gap:.1e}")
        assert gap < 5e-2 * torch_result.abs().max().item() + 1e-2
    with capsys.disabled():
        print("\n[muon] Newton-Schulz " + "; ".join(lines))


@needs_triton
def test_muon_step_on_the_gpu_trains_a_tiny_llama(tmp_path: Path):
    module = load_recipe_module(template_with(["muon"], tmp_path / "muon", params={"muon": {"triton": True}}))
    model = tiny_llama().float()
    optimizer = module.MuonWithAdamW(model, lr=2e-2)
    batch = torch.randint(0, 256, (4, 65), device="cuda")
    losses = []
    for _ in range(10):
        loss = model(input_ids=batch[:, :-1], labels=batch[:, 1:], use_cache=False).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5
