"""Metric logging: one aggregating :class:`MetricLogger` that fans records out to backends.

Each backend is one small class in its own file: ``console`` (a progress line),
``jsonl`` (``metrics.jsonl`` in the run directory) and ``tensorboard`` (when installed).
"""

from engine.metrics.logger import MetricLogger, MetricBackend

__all__ = ["MetricLogger", "MetricBackend"]
