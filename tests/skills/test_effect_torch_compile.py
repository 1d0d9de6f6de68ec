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


@pytest.mark.slow
def test_packed_compiled_blocks_compile_once_on_documents_of_every_length(tmp_path: Path, monkeypatch):
    """Documents longer than a row (full rows of one piece each: transformers drops their SDPA
    mask) beside short ones (packed rows: a mask), and evaluations (no gradients) mid-run: the
    compiled blocks compiled again at the first batch of the other kind and at the first
    evaluation. Now they compile once."""
    import json

    from tests.skills.skill_helpers import launch, traced_not_generated

    traced_not_generated(monkeypatch)
    monkeypatch.setenv("TORCH_LOGS", "recompiles")
    with open(tmp_path / "docs.jsonl", "w") as f:
        for i in range(60):
            text = "def f(x):\n    return x + 1\n" * (30 if i % 2 else 1)  # 870 bytes or 29
            f.write(json.dumps({"text": text}) + "\n")
    recipe = template_with(["sequence-packing", "torch-compile"], tmp_path / "recipe")
    (tmp_path / "run").mkdir()
    result = launch(recipe, tmp_path / "run", "model.num_layers=2", "data.seq_len=64", "data.batch_size=4",
                    "data.source=files", f"data.paths=[{tmp_path / 'docs.jsonl'}]", "train.max_steps=12",
                    "train.log_every=1", "train.eval_every=4", "checkpoint.every=0", "checkpoint.at_end=false",
                    "metrics.tensorboard=false")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "torch-compile: compiled 2 blocks" in result.stdout
    assert result.stderr.count("Recompiling function") == 0, [
        line for line in result.stderr.splitlines() if "guard failure" in line or "- 0/" in line]
