"""tensor-parallel, proven by runs: 2 processes with parallel.tp=2 match 1 process."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.skills.skill_helpers import on_documents, template_with, train

STEPS = ("train.max_steps=5",)


@pytest.mark.multiprocess
def test_two_tensor_parallel_processes_match_one_process(tmp_path: Path, documents: Path, capsys):
    recipe = template_with(["tensor-parallel"], tmp_path / "tp")
    data = on_documents(documents)

    one = train(recipe, tmp_path / "one", *STEPS, *data)
    two = train(recipe, tmp_path / "two", *STEPS, *data, "parallel.tp=2", nproc=2)

    differences = [abs(a["loss"] - b["loss"]) for a, b in zip(one, two)]
    norm_differences = [abs(a["grad_norm"] - b["grad_norm"]) for a, b in zip(one, two)]
    with capsys.disabled():
        print(f"\n[tensor-parallel] tp=2 vs 1 process, {len(one)} steps: max |loss diff| {max(differences):.2e}, "
              f"max |grad-norm diff| {max(norm_differences):.2e}")
    assert len(one) == len(two) == 5
    assert max(differences) < 1e-4
    assert max(norm_differences) < 1e-3

