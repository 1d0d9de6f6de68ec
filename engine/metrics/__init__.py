"""Metric logging: one aggregating :class:`MetricLogger` that fans records out to backends.

- ``logger``       the aggregating metric logger
- ``console``      a progress line per logged step
- ``jsonl``        ``metrics.jsonl``, the record every watcher reads
- ``tensorboard``  TensorBoard event files, when the package is installed
- ``optional``     the optional backends chosen by name: Weights & Biases, MLflow, trackio
- ``wandb``        Weights & Biases, offline by default
- ``mlflow``       MLflow, a local SQLite store by default
- ``trackio``      trackio, a local store by default

A backend's ``destination`` says where its metrics went (run.json keeps it).
"""

from engine.metrics.logger import MetricLogger, MetricBackend

__all__ = ["MetricLogger", "MetricBackend"]
