"""loss-guard, proven by runs: a NaN step is skipped with the parameters unchanged and training
goes on; bad steps in a row stop the run; spikes are caught."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from engine import run_dir as rd
from engine import run_checkpoints
from tests.skills.skill_helpers import (
    SMALL_RUN,
    launch,
    load_checkpoint,
    load_recipe_module,
    on_documents,
    run_dir,
    run_metrics,
    template_with,
    train,
)


def inject_nan_loss(recipe: Path, condition: str) -> None:
    """Make the recipe's loss NaN on the steps where ``condition`` holds (a test-only override
    appended to the recipe class: the later ``def`` wins)."""
    with open(recipe / "recipe.py", "a") as f:
        f.write(
            "\n    def compute_loss(self, batch, _compute_loss=compute_loss):\n"
            "        loss = _compute_loss(self, batch)\n"
            f"        return loss * float('nan') if {condition} else loss\n"
        )


def test_a_nan_step_is_skipped_with_parameters_unchanged_and_training_goes_on(tmp_path: Path, documents: Path):
    recipe = template_with(["loss-guard"], tmp_path / "recipe")
    inject_nan_loss(recipe, "self.state.step + 1 == 3")

    records = train(
        recipe, tmp_path / "run", "train.max_steps=5", "checkpoint.every=1", "checkpoint.keep_last=10",
        *on_documents(documents),
    )

    losses = [float("nan") if r["loss"] is None else float(r["loss"]) for r in records]  # NaN is not JSON
    assert math.isnan(losses[2]) and all(math.isfinite(x) for x in losses[:2] + losses[3:])
    checkpoints = dict(run_checkpoints.list_checkpoints(run_dir(tmp_path / "run")))
    before, skipped, after = (load_checkpoint(checkpoints[s], tmp_path)["model_optim"] for s in (2, 3, 4))
    for name, weight in before["model"].items():
        assert torch.equal(skipped["model"][name], weight), f"{name} changed on the skipped step"
    assert any(not torch.equal(after["model"][n], w) for n, w in before["model"].items())
    assert rd.read_run(run_dir(tmp_path / "run")).status == rd.COMPLETED


def test_bad_steps_in_a_row_stop_the_run(tmp_path: Path, documents: Path):
    recipe = template_with(["loss-guard"], tmp_path / "recipe", {"loss-guard": {"max_bad_steps": 3}})
    inject_nan_loss(recipe, "self.state.step + 1 >= 2")
    (tmp_path / "run").mkdir()

    result = launch(recipe, tmp_path / "run", *SMALL_RUN, "train.max_steps=8", *on_documents(documents))

    assert result.returncode != 0
    assert "loss-guard: skipped an optimizer step: loss is nan (2 in a row)" in result.stdout
    record = rd.read_run(run_dir(tmp_path / "run"))
    assert record.status == rd.FAILED
    assert "loss-guard: 3 bad steps in a row (last: loss is nan); stopping" in record.error
    assert [r["step"] for r in run_metrics(tmp_path / "run")] == [1, 2, 3]


@pytest.fixture
def loss_guard_class(tmp_path: Path):
    return load_recipe_module(template_with(["loss-guard"], tmp_path / "recipe")).LossGuard


def test_a_loss_spike_after_warmup_is_a_bad_step(loss_guard_class):
    guard = loss_guard_class(max_bad_steps=5, spike_factor=3.0, warmup_steps=3)
    assert [guard.check(torch.tensor(v)) for v in (10.0, 2.0, 2.0)] == [True, True, True]  # warm-up
    assert guard.check(torch.tensor(30.0)) is False  # > 3 × running mean
    assert guard.check(torch.tensor(2.5)) is True
    assert (guard.skipped, guard.bad_in_a_row) == (1, 0)


def test_a_non_finite_gradient_norm_is_a_bad_step(loss_guard_class):
    guard = loss_guard_class()
    assert guard.check(torch.tensor(2.0), torch.tensor(float("inf"))) is False
    assert guard.check(torch.tensor(2.0), torch.tensor(1.0)) is True


def test_the_guard_reads_a_loss_that_requires_grad_without_a_warning():
    import importlib.util
    import warnings

    spec = importlib.util.spec_from_file_location(
        "loss_guard_codemod", Path(__file__).parents[2] / "skills" / "loss-guard" / "codemod.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    namespace: dict = {}
    exec("import math\n" + module.GUARD_CLASS, namespace)
    guard = namespace["LossGuard"]()
    weight = torch.ones(3, requires_grad=True)
    loss = (weight * 2).sum()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the torch warning float() of such a tensor gives
        assert guard.check(loss, torch.linalg.vector_norm(weight * 2)) is True
