"""A loss-curve picture of a run (PNG), for agents that read images and for people."""

from __future__ import annotations

import io
from typing import Any


def loss_curve_png(records: list[dict[str, Any]], title: str) -> bytes:
    """Training loss per step, evaluation loss as points, learning rate on a second axis."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    train = [(r["step"], r["loss"]) for r in records if isinstance(r.get("loss"), (int, float))]
    evals = [(r["step"], r["eval_loss"]) for r in records if isinstance(r.get("eval_loss"), (int, float))]
    lrs = [(r["step"], r["lr"]) for r in records if isinstance(r.get("lr"), (int, float))]

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
    axis.legend(loc="upper right")
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    plt.close(figure)
    return buffer.getvalue()
