"""TensorBoard event files, written only when the ``tensorboard`` package is installed."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any


def tensorboard_available() -> bool:
    return importlib.util.find_spec("tensorboard") is not None


class TensorBoardBackend:
    def __init__(self, log_dir: Path):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(log_dir))

    def log(self, record: dict[str, Any]) -> None:
        step = record.get("step", 0)
        for key, value in record.items():
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
