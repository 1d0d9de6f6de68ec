"""torch-compile, proven by a run: the compiled recipe trains, with the losses of eager mode."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.skills.skill_helpers import on_documents, template_with, train

STEPS = ("train.max_steps=4",)


@pytest.mark.slow
def test_compiled_blocks_train_like_eager_mode(tmp_path: Path, documents: Path, capsys):
    data = on_documents(documents)
    eager = train(template_with([], tmp_path / "eager"), tmp_path / "run-eager", *STEPS, *data)
    compiled = train(template_with(["torch-compile"], tmp_path / "compiled"), tmp_path / "run-compiled", *STEPS, *data)

    gap = max(abs(a["loss"] - b["loss"]) for a, b in zip(eager, compiled))
    with capsys.disabled():
        print(f"\n[torch-compile] first step {compiled[0]['step_time_s']:.1f} s (compilation), "
              f"max |compiled - eager| loss {gap:.1e}")
    assert compiled[-1]["loss"] < compiled[0]["loss"]
    assert gap < 1e-3
