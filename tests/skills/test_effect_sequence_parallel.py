"""sequence-parallel, proven by runs: 2 processes with parallel.sp=2 match 1 process, with
sequence packing (documents restart their position ids inside the rows that get split)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.skills.skill_helpers import on_documents, template_with, train

STEPS = ("train.max_steps=5",)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_sequence_parallel_processes_match_one_process_on_packed_rows(tmp_path: Path, documents: Path, capsys):
    recipe = template_with(["sequence-packing", "sequence-parallel"], tmp_path / "sp")
    data = on_documents(documents)

    one = train(recipe, tmp_path / "one", *STEPS, *data)
    two = train(recipe, tmp_path / "two", *STEPS, *data, "parallel.sp=2", nproc=2)

    differences = [abs(a["loss"] - b["loss"]) for a, b in zip(one, two)]
    norm_differences = [abs(a["grad_norm"] - b["grad_norm"]) for a, b in zip(one, two)]
    with capsys.disabled():
        print(f"\n[sequence-parallel] sp=2 vs 1 process, packed rows, {len(one)} steps: max |loss diff| "
              f"{max(differences):.2e}, max |grad-norm diff| {max(norm_differences):.2e}")
    assert len(one) == len(two) == 5
    assert max(differences) < 1e-4
    assert max(norm_differences) < 1e-3
    # Both runs read the same rows: the same supervised tokens at every step.
    assert [a["tokens_seen"] for a in one] == [b["tokens_seen"] for b in two]
    assert [a["loss_tokens_seen"] for a in one] == [b["loss_tokens_seen"] for b in two]
    assert [a["padding_frac"] for a in one] == [b["padding_frac"] for b in two]
