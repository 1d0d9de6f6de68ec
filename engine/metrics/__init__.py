"""Metric logging: one aggregating :class:`MetricLogger` that fans records out to backends.

Each backend is one small class in its own file: ``console`` (a progress line),
``jsonl`` (``metrics.jsonl`` in the run directory), ``tensorboard`` (when installed), and those
chosen in ``metrics.backends`` (``optional`` checks and opens them): ``wandb``, ``mlflow``,
``trackio``. A backend's ``destination`` says where its metrics went (run.json keeps it).
"""

from engine.metrics.logger import MetricLogger, MetricBackend

__all__ = ["MetricLogger", "MetricBackend"]
