"""``estimate_run``: will a run fit, and how long will a step take, before it starts.

The recipe's code decides what the model is, so the engine estimates it inside the launch check
(``python -m engine.launch RECIPE --check --estimate DEVICE``, sandboxed like every check; the
method is in engine/estimate.py): the model built on the meta device, its saved activations
counted in one forward of a micro-batch, parameters, gradients and AdamW states under the run's
dtype and FSDP2 sharding. Nothing is written and no run is started.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from engine.config import Overrides, override_args
from mcp_server.models import EstimateFigures, EstimateResult
from mcp_server.operations.launch import bind_hub_models, checked_overrides
from runner import hub
from runner import lifecycle as run_lifecycle
from workspace.workspace import Workspace



def estimate_run(ws: Workspace, recipe: str, overrides: Overrides = None, nproc: int = 1, device: str = "cpu",
                 device_memory_gib: float | None = None) -> EstimateResult:
    """The estimate of a run of ``recipe``, its arguments as :class:`~mcp_server.arguments.EstimateArgs`
    checked them."""
    recipe_dir = ws.recipe(recipe)
    flat = checked_overrides(ws, overrides)
    limits = ws.run_limits()
    # The model is built from its config on the meta device: its weights are never downloaded.
    models = bind_hub_models(ws, hub.recipe_config(recipe_dir, flat), hub.recipe_config(recipe_dir, flat, hub.DATASET_KEY),
                             limits, None, weights=False)
    verdict = run_lifecycle.check_launch(ws.root, recipe_dir, nproc, override_args(flat), limits=limits, models=models,
                                        estimate=(device, device_memory_gib))
    figures = _figures(verdict.estimate)
    shown: dict[str, Any] = figures.model_dump(exclude={"fits", "changes"})
    shown = {"recipe": ws.label(recipe_dir), "nproc": nproc, "device": device, **shown}
    return EstimateResult(fits=figures.fits, estimate=shown, changes=[c.model_dump() for c in figures.changes])


def _figures(value: Any) -> EstimateFigures:
    try:
        return EstimateFigures.model_validate(value)
    except ValidationError as e:  # printed by a process that imported the recipe: never quoted
        raise run_lifecycle.LaunchRefused(f"the launch check gave no valid estimate ({e.error_count()} errors): the recipe's "
                            "code printed a verdict of its own, or the engine it imports is not trainwright's") from None
