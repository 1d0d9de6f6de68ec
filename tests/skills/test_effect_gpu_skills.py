"""liger-kernel and flash-attention on a machine without a GPU: the skills apply, the recipes
train exactly as without them, and each run says once, in its console and in run.json (which
get_run shows), which kernel stayed off and why. The guards themselves are checked in-process
with the GPU and the packages faked, and FlashAttention's document boundaries on packed rows.
(On a GPU: tests/skills/test_gpu_kernels.py.)"""

from __future__ import annotations

import importlib.util
import math
import subprocess
import sys
import types
from pathlib import Path

import pytest

from runner.server_record import NOT_STARTED_BY_SERVER
import torch

from mcp_server.operations.runs import get_run
from workspace.workspace import Workspace
from skills import apply_skill
from tests.skills.skill_helpers import (
    PYTHON,
    REPO,
    SMALL_RUN,
    copy_recipe,
    initial_template_model,
    launch,
    load_recipe_module,
    on_documents,
    run_dir,
    run_metrics,
    template_with,
    traced_not_generated,
    train,
)

STEPS = ("train.max_steps=3",)
LIGER_WARNING = "liger-kernel: no CUDA GPU, so Liger's Triton kernels are off; training continues with the model's own modules"
FLASH_WARNING = "flash-attention: no CUDA GPU; training continues with sdpa attention"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU fallback")
def test_template_with_both_kernels_trains_like_the_plain_template_and_warns_once_each(
    tmp_path: Path, documents: Path, capsys
):
    data = on_documents(documents)
    plain = train(template_with(["sequence-packing"], tmp_path / "plain"), tmp_path / "run-plain", *STEPS, *data)
    recipe = template_with(["liger-kernel", "flash-attention", "sequence-packing"], tmp_path / "kernels")
    (tmp_path / "run-kernels").mkdir()

    result = launch(recipe, tmp_path / "run-kernels", *SMALL_RUN, *STEPS, *data)

    assert result.returncode == 0, result.stderr[-3000:]
    kernels = run_metrics(tmp_path / "run-kernels")
    assert [r["loss"] for r in kernels] == [r["loss"] for r in plain]  # the guards leave the model as it is
    assert result.stdout.count("warning: ") == 2
    assert result.stdout.count(f"warning: {LIGER_WARNING}\n") == 1
    assert result.stdout.count(f"warning: {FLASH_WARNING}\n") == 1
    info = get_run(Workspace.open(tmp_path / "run-kernels"), run_dir(tmp_path / "run-kernels").name)
    # The engine ran by hand: get_run also says the server did not start it.
    assert [w for w in info.warnings if w != NOT_STARTED_BY_SERVER] == [LIGER_WARNING, FLASH_WARNING]
    assert info.status == "completed"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU fallback")
def test_hf_trainer_script_with_both_kernels_trains_and_prints_one_warning_each(tmp_path: Path):
    script = copy_recipe("hf_trainer_style", tmp_path)
    for skill in ("flash-attention", "liger-kernel"):
        assert apply_skill(skill, script).changed

    result = subprocess.run([PYTHON, str(script), "--steps", "4"], cwd=tmp_path, capture_output=True, text=True)

    assert result.returncode == 0, result.stderr[-3000:]
    losses = [float(line.split()[3]) for line in result.stdout.splitlines() if line.startswith("step ")]
    assert len(losses) == 4 and all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]
    assert result.stdout.count(f"warning: {LIGER_WARNING}\n") == 1
    assert result.stdout.count(f"warning: {FLASH_WARNING}\n") == 1


@pytest.mark.slow
def test_every_skill_applies_after_and_before_the_gpu_skills_and_the_template_trains(
    tmp_path: Path, documents: Path, monkeypatch
):
    traced_not_generated(monkeypatch)
    skills = ["liger-kernel", "flash-attention", "muon", "mixed-precision", "gradient-checkpointing", "loss-guard",
              "sequence-packing", "torch-compile", "freeze"]
    recipe = template_with(skills, tmp_path / "recipe")

    records = train(recipe, tmp_path / "run", *STEPS, "optim.lr=1e-2", *on_documents(documents))

    assert len(records) == 3 and all(math.isfinite(r["loss"]) for r in records)
    assert records[0]["padding_frac"] < 0.05


# --- the guards, in-process -------------------------------------------------------------------


@pytest.fixture
def fake_liger(tmp_path: Path, monkeypatch):
    """A stand-in liger_kernel package that records how it was called (removed afterwards)."""
    package = tmp_path / "site" / "liger_kernel"
    (package / "transformers").mkdir(parents=True)
    (package / "__init__.py").write_text(LIGER_STUB)
    (package / "transformers" / "__init__.py").write_text("")
    (package / "transformers" / "monkey_patch.py").write_text(LIGER_APPLY_STUB)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    importlib.invalidate_caches()
    yield
    for name in [m for m in sys.modules if m == "liger_kernel" or m.startswith("liger_kernel.")]:
        del sys.modules[name]
    importlib.invalidate_caches()


def test_liger_guard_names_the_missing_package_when_a_gpu_is_there(tmp_path: Path, monkeypatch):
    module = load_recipe_module(template_with(["liger-kernel"], tmp_path / "liger"))
    model = initial_template_model(template_with([], tmp_path / "plain"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "liger_kernel" else object())
    said = []

    assert module.apply_liger_kernels(model, warn=said.append) is False
    assert said == ["liger-kernel: the liger_kernel package is not installed (pip install liger-kernel); "
                    "training continues with the model's own modules"]


LIGER_STUB = '''
calls = []
'''
# Liger's public apply_liger_kernel_to_llama, with its signature (each model type takes its own).
LIGER_APPLY_STUB = '''
import liger_kernel
def apply_liger_kernel_to_llama(rope=True, cross_entropy=False, fused_linear_cross_entropy=True, rms_norm=True,
                                swiglu=True, model=None):
    liger_kernel.calls.append((model, dict(rope=rope, swiglu=swiglu, rms_norm=rms_norm, cross_entropy=cross_entropy,
                                           fused_linear_cross_entropy=fused_linear_cross_entropy)))
MODEL_TYPE_TO_APPLY_LIGER_FN = {'llama': apply_liger_kernel_to_llama}
'''


def test_liger_guard_patches_the_model_of_a_known_family_with_a_gpu(tmp_path: Path, monkeypatch, fake_liger):
    module = load_recipe_module(template_with(["liger-kernel"], tmp_path / "liger"))
    model = initial_template_model(template_with([], tmp_path / "plain"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    said = []

    assert module.apply_liger_kernels(model, rope=True, swiglu=False, warn=said.append) is True

    import liger_kernel

    assert said == []
    assert liger_kernel.calls == [(model, dict(rope=True, swiglu=False, rms_norm=True, cross_entropy=False,
                                               fused_linear_cross_entropy=True))]


@pytest.mark.skipif(importlib.util.find_spec("liger_kernel") is None, reason="needs the liger-kernel package")
def test_the_template_asks_liger_for_the_summed_loss_it_computes_itself(tmp_path: Path):
    """Real liger-kernel, on CPU: its forward, asked as the template asks (shift_labels,
    num_items_in_batch=1), gives the template's summed loss. In evaluation mode Liger computes it
    from the logits (torch only); in training its fused kernel (GPU: test_gpu_kernels.py)."""
    from liger_kernel.transformers import apply_liger_kernel_to_llama  # the template's model is a Llama

    module = load_recipe_module(template_with(["liger-kernel"], tmp_path / "liger"))
    template = template_with([], tmp_path / "plain")
    plain = initial_template_model(template).eval()
    patched = initial_template_model(template).eval()
    apply_liger_kernel_to_llama(model=patched, rope=False, swiglu=False, rms_norm=False,
                                fused_linear_cross_entropy=True)
    pieces = [torch.arange(33) % 256, torch.arange(9) % 256]
    batch = module.collate(pieces, 32, 257)

    with torch.no_grad():
        expected = module.CausalLM.compute_loss(types.SimpleNamespace(model=plain, fused_linear_cross_entropy=False), batch)
        fused = module.CausalLM.compute_loss(types.SimpleNamespace(model=patched, fused_linear_cross_entropy=True), batch)

    assert torch.allclose(fused, expected, rtol=1e-5)


def test_flash_guard_refuses_float32_compute_with_a_reason(tmp_path: Path, monkeypatch):
    module = load_recipe_module(template_with(["flash-attention"], tmp_path / "flash"))
    model = initial_template_model(template_with([], tmp_path / "plain"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())
    said = []

    assert module.use_flash_attention(model, torch.float32, warn=said.append) is False
    assert said == ["flash-attention: the model computes in torch.float32, and FlashAttention needs bfloat16 or "
                    "float16 (set parallel.param_dtype=bfloat16, or apply the mixed-precision skill first); "
                    "training continues with sdpa attention"]


def test_flash_guard_switches_the_model_and_hooks_packed_rows(tmp_path: Path, monkeypatch):
    module = load_recipe_module(template_with(["sequence-packing", "flash-attention"], tmp_path / "flash"))
    model = initial_template_model(template_with([], tmp_path / "plain"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())
    chosen = []
    monkeypatch.setattr(model, "set_attn_implementation", chosen.append)
    seen = []
    model.model.register_forward_pre_hook(lambda mod, args, kwargs: seen.append(kwargs), with_kwargs=True)

    assert module.use_flash_attention(model, torch.bfloat16, warn=pytest.fail) is True
    pieces = [torch.arange(n) % 256 for n in (41, 10, 24, 30, 6, 18)]  # n tokens fill n - 1 positions
    batch = module.collate_packed(module.pack_pieces(pieces, 64), 64, 257)
    with torch.no_grad():
        model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False)

    assert chosen == ["flash_attention_2"]
    positions = batch["position_ids"].flatten()
    expected_starts = [i for i in range(len(positions)) if positions[i] == 0 or i % 64 == 0]
    assert seen[0]["cu_seq_lens_q"].tolist() == expected_starts + [len(positions)]
    assert seen[0]["cu_seq_lens_q"].dtype == torch.int32
    assert seen[0]["max_length_q"] == seen[0]["max_length_k"] == 64


def test_document_boundaries_leave_masked_forwards_to_transformers(tmp_path: Path):
    module = load_recipe_module(template_with(["flash-attention"], tmp_path / "flash"))
    kwargs = {"position_ids": torch.arange(8).expand(2, 8), "attention_mask": torch.ones(2, 8)}

    assert module.document_boundaries(None, (), kwargs) is None
    assert module.document_boundaries(None, (), {"input_ids": torch.zeros(2, 8)}) is None


@pytest.mark.slow
def test_bench_gpu_runs_end_to_end_on_cpu_in_tiny_mode(tmp_path: Path):
    result = subprocess.run([PYTHON, str(REPO / "bench" / "gpu.py"), "--tiny", "--keep", str(tmp_path)],
                            capture_output=True, text=True, timeout=600)

    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    import json

    summary = json.loads(result.stdout.strip().splitlines()[-1])
    results = summary["results"]
    assert list(results) == ["plain", "liger+flash", "liger+flash+packing"]
    assert all(math.isfinite(r["final_loss"]) and r["tokens_per_s"] > 0 for r in results.values())
    assert results["liger+flash+packing"]["padding_frac"] < 0.05 < results["plain"]["padding_frac"]
    if not torch.cuda.is_available():
        hints = [w for w in results["liger+flash"]["warnings"] if "the sequence-packing skill" in w]
        assert len(hints) == 1  # 40% padding: packing suggested, once
        assert [w for w in results["liger+flash"]["warnings"] if w not in hints] == [LIGER_WARNING, FLASH_WARNING]
        assert "Newton-Schulz kernel: skipped (no CUDA GPU)" in result.stdout
    assert "grpo loss forward + backward on cpu (8 rows, G 4, 8 completion tokens): rows whole " in result.stdout
    assert "grpo.generation_engine=vllm here: " in result.stdout


def test_random_documents_for_the_benchmark_are_fixed_token_ids_below_the_vocabulary(tmp_path: Path):
    module = load_recipe_module(template_with([], tmp_path / "plain"))
    config = module.CausalLMDataConfig(source="random", vocab_size=100, random_documents=50, seq_len=16)

    documents = module.load_documents(config)

    assert len(documents) == 50 and documents[0][0] == "random-0"
    assert all(16 <= len(ids) <= 32 and int(ids.max()) < 98 for _, ids in documents)  # 98, 99: end, padding
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(documents, module.load_documents(config)))
