"""TensorBoard event files, written only when the ``tensorboard`` package is installed."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from engine.metrics.logger import numbers
from engine.run_dir import MetricsDestination


def tensorboard_available() -> bool:
    return importlib.util.find_spec("tensorboard") is not None


class TensorBoardBackend:
    def __init__(self, log_dir: Path):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(log_dir))
        self.destination = MetricsDestination(kind="tensorboard", location=str(log_dir))

    def log(self, record: dict[str, Any]) -> None:
        step = record.get("step", 0)
        for key, value in numbers(record).items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def close(self, failed: bool = False) -> None:
        self.writer.close()
