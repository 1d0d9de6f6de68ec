"""The estimator's activation rules against what a real forward saves: a Hugging Face model whose
rows take no mask is counted as SDPA with ``is_causal`` and ``enable_gqa`` (no L × L mask, keys
and values not repeated), a packed or padded batch with its mask; checkpointing's recomputation
is counted once."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from engine.estimate import (HEAP_KEPT_CHECKPOINTED, Shape, causal_without_mask, estimate_memory, measure_saved_bytes,
                             on_fake_tensors)

ROWS, LENGTH = 2, 128
CONFIG = dict(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, attn_implementation="sdpa")


def engine_of(model: torch.nn.Module) -> SimpleNamespace:
    return SimpleNamespace(model=model, compute_loss=lambda batch: model(**batch, use_cache=False).logits.sum())


def batch(positions: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"input_ids": torch.zeros(ROWS, LENGTH, dtype=torch.int64), "position_ids": positions}


def real_saved(positions: torch.Tensor) -> int:
    torch.manual_seed(0)
    engine = engine_of(LlamaForCausalLM(LlamaConfig(**CONFIG)).train())
    counter, _, _ = measure_saved_bytes(engine, batch(positions))
    return counter.total


def estimated_saved(positions: torch.Tensor, unmasked: bool | None = None) -> int:
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**CONFIG)).train()
    engine = engine_of(model)
    rows = batch(positions)
    unmasked = causal_without_mask(rows) if unmasked is None else unmasked
    with on_fake_tensors(model, rows, unmasked=unmasked) as fake_rows:
        counter, _, _ = measure_saved_bytes(engine, fake_rows)
    return counter.total


UNPACKED = torch.arange(LENGTH).expand(ROWS, LENGTH).clone()
PACKED = torch.cat([torch.arange(LENGTH // 2), torch.arange(LENGTH // 2)]).expand(ROWS, LENGTH).clone()


def test_unpacked_rows_are_counted_as_sdpa_keeps_them_with_is_causal_and_gqa():
    assert causal_without_mask(batch(UNPACKED))
    real = real_saved(UNPACKED)
    estimated = estimated_saved(UNPACKED)
    assert estimated == pytest.approx(real, rel=0.02)
    # Fake tensors alone make transformers build the mask (a float L × L per layer, as SDPA keeps
    # it) and repeat keys and values to the 4 query heads (2 more heads each, per layer).
    layers, head_dim = 2, 16
    mask = ROWS * LENGTH * LENGTH * 4
    repeats = 2 * 2 * ROWS * LENGTH * head_dim * 4
    assert estimated_saved(UNPACKED, unmasked=False) == estimated + layers * (mask + repeats)


def test_packed_rows_keep_their_mask_in_the_estimate_as_in_the_run():
    assert not causal_without_mask(batch(PACKED))
    assert not causal_without_mask({**batch(UNPACKED), "attention_mask": torch.ones(ROWS, LENGTH).tril()})
    assert causal_without_mask({**batch(UNPACKED), "attention_mask": torch.ones(ROWS, LENGTH)})
    assert estimated_saved(PACKED) == pytest.approx(real_saved(PACKED), rel=0.02)


def test_checkpointing_counts_one_blocks_recomputation_once():
    mib = 2**20
    shape = Shape(params=0, trainable=0, saved_bytes=(1000 + 3 * 300) * mib, largest_saved=50 * mib,
                  block_saved=[200 * mib, 300 * mib, 250 * mib], block_inputs=[10 * mib] * 3, checkpointed_blocks=0,
                  blocks=3, flops_per_token=None, positions_per_step=0, floor_bytes=0)
    parallel = SimpleNamespace(tp=1, sp=1, param_dtype="float32", reduce_dtype="float32", cpu_offload=False,
                               fsdp_on_one_process=False)
    plain = estimate_memory(shape, 1, parallel, "cpu")["activations"] * 1024
    checkpointed = estimate_memory(shape, 1, parallel, "cpu", checkpointing=True)["activations"] * 1024
    outside = 1000 + 900 - 750
    assert plain == pytest.approx(outside + 750 + 50, abs=0.1)
    # the blocks' inputs, the largest block recomputed in backward (once), the largest gradient
    assert checkpointed == pytest.approx(outside + 30 + 300 + 50, abs=0.1)


def test_a_cpu_run_of_adapters_or_checkpointed_blocks_under_glibcs_dynamic_threshold_counts_freed_activations_again():
    from engine.memory import heap_keeps_freed_memory

    mib = 2**20
    adapters = dict(params=1000, trainable=10, saved_bytes=300 * mib, largest_saved=0, block_saved=[100 * mib] * 3,
                    block_inputs=[mib] * 3, checkpointed_blocks=0, blocks=3, flops_per_token=None,
                    positions_per_step=0, floor_bytes=0, lora_values=10)
    parallel = SimpleNamespace(tp=1, sp=1, param_dtype="float32", reduce_dtype="float32", cpu_offload=False,
                               fsdp_on_one_process=False)

    def activations_mib(device="cpu", **shape):
        return estimate_memory(Shape(**{**adapters, **shape}), 1, parallel, device)["activations"] * 1024

    assert activations_mib(heap_keeps_freed=True) == pytest.approx(600, abs=0.1)
    assert activations_mib(heap_keeps_freed=False) == pytest.approx(300, abs=0.1)  # the threshold fixed
    assert activations_mib("cuda", heap_keeps_freed=True) == pytest.approx(300, abs=0.1)
    assert activations_mib(heap_keeps_freed=True, trainable=1000) == pytest.approx(300, abs=0.1)  # full fine-tuning
    # Checkpointed full fine-tuning (the forward saved the blocks' inputs only): inputs and one
    # block's again, not doubled, and each block's share of its activations that the heap keeps.
    checkpointed = dict(heap_keeps_freed=True, trainable=1000, checkpointed_blocks=3, saved_bytes=3 * mib)
    assert activations_mib(**checkpointed) == pytest.approx(3 + 3 + 100 + HEAP_KEPT_CHECKPOINTED * 300, abs=0.1)
    assert activations_mib(**{**checkpointed, "heap_keeps_freed": False}) == pytest.approx(3 + 3 + 100, abs=0.1)
    assert activations_mib("cuda", **checkpointed) == pytest.approx(3 + 3 + 100, abs=0.1)
    assert heap_keeps_freed_memory({}) is True
    assert heap_keeps_freed_memory({"TRAINWRIGHT_MMAP_THRESHOLD": "262144"}) is False
    assert heap_keeps_freed_memory({"MALLOC_MMAP_THRESHOLD_": "65536"}) is False


def test_the_lora_and_qlora_changes_on_a_cpu_hold_what_importing_peft_adds_beside_the_floor():
    """The skills' recipes import peft, the recipe as it is may not: a CPU run with the skill holds
    what that import added (54 MB measured beside vlm_chat's floor: bench/estimate_memory.py --vlm)."""
    import subprocess
    import sys

    from tests.support import REPO

    mib = 2**20
    shape = Shape(params=1000, trainable=1000, saved_bytes=0, largest_saved=0, block_saved=[0], block_inputs=[0],
                  checkpointed_blocks=0, blocks=1, flops_per_token=None, positions_per_step=0, floor_bytes=400 * mib,
                  lora_values=10, block_linear=500, peft_import_bytes=50 * mib)
    parallel = SimpleNamespace(tp=1, sp=1, param_dtype="float32", reduce_dtype="float32", cpu_offload=False,
                               fsdp_on_one_process=False)
    floors = {(device, adapters): round(estimate_memory(shape, 1, parallel, device, adapters=adapters)["floor"] * 1024)
              for device in ("cpu", "cuda") for adapters in (None, "lora", "qlora")}  # GiB to 4 places: MB to ±0.1
    assert floors == {("cpu", None): 400, ("cpu", "lora"): 450, ("cpu", "qlora"): 450,
                      ("cuda", None): 0, ("cuda", "lora"): 0, ("cuda", "qlora"): 0}
    # Measured in a process that has not imported peft; nothing where it is imported already.
    probe = ("from engine.estimate import peft_import_bytes; import sys; assert 'peft' not in sys.modules; "
             "print(peft_import_bytes(), peft_import_bytes())")
    done = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"})
    first, again = map(int, done.stdout.split())
    assert first > 5 * mib and again == 0, (first, again)
