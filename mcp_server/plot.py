"""A loss-curve picture of a run (PNG), for agents that read images and for people."""

from __future__ import annotations

import io
import math
from typing import Any


def loss_curve_png(records: list[dict[str, Any]], title: str) -> bytes:
    """Training loss per step, evaluation loss as points, learning rate on a second axis."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    train, evals, lrs = _series(records, "loss"), _series(records, "eval_loss"), _series(records, "lr")

    figure, axis = plt.subplots(figsize=(7, 4), dpi=100)
    if train:
        axis.plot(*zip(*train), label="train loss", color="tab:blue", linewidth=1.5)
    if evals:
        axis.plot(*zip(*evals), "o", label="eval loss", color="tab:orange")
    axis.set_xlabel("step")
    axis.set_ylabel("loss")
    axis.grid(alpha=0.3)
    if lrs:
        lr_axis = axis.twinx()
        lr_axis.plot(*zip(*lrs), color="tab:gray", linewidth=0.8, alpha=0.6, label="lr")
        lr_axis.set_ylabel("learning rate", color="tab:gray")
    if not train:
        axis.text(0.5, 0.5, "no metrics yet", ha="center", va="center", transform=axis.transAxes)
    axis.set_title(title, fontsize=10)
    if train or evals:
        axis.legend(loc="upper right")
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    plt.close(figure)
    return buffer.getvalue()


def _series(records: list[dict[str, Any]], key: str) -> list[tuple[int, float]]:
    """``(step, value)`` for the records where ``key`` is a finite number (run output may hold anything)."""
    points = []
    for record in records:
        value, step = record.get(key), record.get("step")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not isinstance(step, int):
            continue
        try:
            value = float(value)
        except OverflowError:
            continue
        if math.isfinite(value) and abs(step) < 2**53:
            points.append((step, value))
    return points
