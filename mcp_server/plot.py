"""A loss-curve picture of a run (PNG), for agents that read images and for people."""

from __future__ import annotations

import io
import math
from typing import Any, Sequence

# Values beyond this are left out of a picture (and said so): a run may log any finite float,
# and one of ±1e308 overflows the axis range (its span is infinite). The run view
# (run_view.html, MAX_PLOTTED) draws by the same bound.
MAX_PLOTTED = 1e15


def loss_curve_figure(records: list[dict[str, Any]], title: str, resumes: Sequence[tuple[int, str]] = ()):
    """Training loss per step, evaluation loss as points, learning rate on a second axis, and a
    vertical line at each ``(step, run_id)`` where a resumed run took over. Steps are integers."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt
    from matplotlib.ticker import MaxNLocator
    (train, left_train), (evals, left_evals), (lrs, left_lrs) = (
        _series(records, key) for key in ("loss", "eval_loss", "lr"))
    figure, axis = plt.subplots(figsize=(7, 4), dpi=100)
    handles = []
    if train:
        handles += axis.plot(*zip(*train), label="train loss", color="tab:blue", linewidth=1.5)
    if evals:
        handles += axis.plot(*zip(*evals), "o", label="eval loss", color="tab:orange")
    for step, run_id in resumes:
        axis.axvline(step, color="tab:red", linestyle="--", linewidth=1, alpha=0.7)
        axis.annotate(f"resumed: {run_id}", xy=(step, 1), xycoords=("data", "axes fraction"),
                      xytext=(3, -3), textcoords="offset points", rotation=90, va="top", ha="left",
                      fontsize=7, color="tab:red")
    axis.set_xlabel("step")
    axis.set_ylabel("loss")
    axis.xaxis.set_major_locator(MaxNLocator(integer=True))
    axis.grid(alpha=0.3)
    legend_axis = axis
    if lrs:
        lr_axis = legend_axis = axis.twinx()
        handles += lr_axis.plot(*zip(*lrs), color="tab:gray", linewidth=0.8, alpha=0.6, label="learning rate")
        lr_axis.set_ylabel("learning rate", color="tab:gray")
    if not train:
        axis.text(0.5, 0.5, "no metrics yet", ha="center", va="center", transform=axis.transAxes)
    left_out = left_train + left_evals + left_lrs
    if left_out:
        axis.text(0.01, 0.01, f"{left_out} value(s) beyond ±{MAX_PLOTTED:.0e} not drawn", transform=axis.transAxes,
                  fontsize=7, color="tab:red", va="bottom")
    axis.set_title(title, fontsize=10)
    if handles:
        legend_axis.legend(handles=handles, loc="upper right")  # on the top axis: drawn last
    figure.tight_layout()
    return figure


def loss_curve_png(records: list[dict[str, Any]], title: str, resumes: Sequence[tuple[int, str]] = ()) -> bytes:
    figure = loss_curve_figure(records, title, resumes)
    from matplotlib import pyplot as plt

    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    plt.close(figure)
    return buffer.getvalue()


def history_png(ws, run_id: str) -> bytes:
    """The loss curve of a run's whole history across resumes, each resume marked."""
    from mcp_server.operations.history import chain_records

    records, chain = chain_records(ws, run_id)
    resumes = [(s.after_step, s.run_id) for s in chain if s.after_step is not None]
    title = f"run {run_id}" + (f" (resumed {len(resumes)}×, from {chain[0].run_id})" if resumes else "")
    return loss_curve_png(records, title, resumes)


def _series(records: list[dict[str, Any]], key: str) -> tuple[list[tuple[int, float]], int]:
    """``(step, value)`` for the records where ``key`` is a finite number (run output may hold
    anything) within ±:data:`MAX_PLOTTED`, and how many finite values were beyond it."""
    points, beyond = [], 0
    for record in records:
        value, step = record.get(key), record.get("step")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not isinstance(step, int):
            continue
        try:
            value = float(value)
        except OverflowError:
            beyond += 1
            continue
        if not math.isfinite(value) or abs(step) >= 2**53:
            continue
        if abs(value) > MAX_PLOTTED:
            beyond += 1
        else:
            points.append((step, value))
    return points, beyond
