"""What a training script imports from trainwright: ``trainwright.track(step, **values)``.

A script run by trainwright (``launch_run`` on a ``.py`` file) reports its metrics by printing
JSON lines with a ``step``; :func:`track` prints one. The run's supervisor, outside the
sandbox, reads them (``runner/scripts.py``), so there is one reader of a script's metrics,
whichever way it prints them. Outside a trainwright run it does nothing, so the script runs
unchanged wherever trainwright is installed. Stdlib only: it is imported by the script.
"""

from __future__ import annotations

import json
import math
import os
import sys

__all__ = ["track"]

# Every run process has it (runner.processes.RUN_ID_VARIABLE): the mark of the run.
_RUN_ID_VARIABLE = "TRAINWRIGHT_RUN_ID"


def track(step: int, **values: float) -> None:
    """Record ``values`` (numbers: ``loss=2.31, lr=3e-4``) at ``step`` as one metrics record
    of the run. Non-numbers and non-finite numbers are left out; in a run over several
    processes only rank 0's records are kept. A no-op outside a trainwright run."""
    if not os.environ.get(_RUN_ID_VARIABLE) or os.environ.get("RANK", "0") != "0":
        return
    if isinstance(step, bool) or not isinstance(step, int):
        raise TypeError(f"step must be an integer, got {type(step).__name__}")
    record: dict[str, float | int] = {"step": step}
    for key, value in values.items():
        number = _number(value)
        if number is not None:
            record[key] = number
    print(json.dumps(record), file=sys.stdout, flush=True)


def _number(value: object) -> float | int | None:
    """A plain number from ``value`` (a Python number, or a one-element tensor or array), or None."""
    if hasattr(value, "item") and callable(value.item):
        try:
            value = value.item()
        except (TypeError, ValueError, RuntimeError):
            return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value
