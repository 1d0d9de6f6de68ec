"""gradient-checkpointing, proven by runs: the same losses, a lower peak memory."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.skills.skill_helpers import on_documents, template_with, train

# Activations dominate: 16 × 256 positions through 8 layers; the model itself is ~6 M parameters.
ACTIVATION_HEAVY = ("model.num_layers=8", "data.seq_len=256", "data.batch_size=16", "train.max_steps=2")


@pytest.mark.slow
def test_checkpointing_keeps_the_losses_and_lowers_peak_memory(tmp_path: Path, documents: Path, capsys):
    plain = template_with([], tmp_path / "plain")
    checkpointed = template_with(["gradient-checkpointing"], tmp_path / "checkpointed")
    data = on_documents(documents)

    without = train(plain, tmp_path / "run-plain", *ACTIVATION_HEAVY, *data)
    with_checkpointing = train(checkpointed, tmp_path / "run-ckpt", *ACTIVATION_HEAVY, *data)
    # The same process with (almost) no activations: what the model, optimizer and data cost.
    floor = train(plain, tmp_path / "run-floor", *ACTIVATION_HEAVY, *data, "data.seq_len=8")

    assert [r["loss"] for r in with_checkpointing] == [r["loss"] for r in without]
    peak_without = max(r["peak_mem_mb"] for r in without)
    peak_with = max(r["peak_mem_mb"] for r in with_checkpointing)
    base = max(r["peak_mem_mb"] for r in floor)
    ratio = peak_with / peak_without
    activation_ratio = (peak_with - base) / (peak_without - base)
    with capsys.disabled():
        print(
            f"\n[gradient-checkpointing] peak RSS {peak_without:.0f} -> {peak_with:.0f} MB "
            f"(ratio {ratio:.2f}); above the {base:.0f} MB floor: ratio {activation_ratio:.2f}"
        )
    assert ratio < 0.8
    assert activation_ratio < 0.6
