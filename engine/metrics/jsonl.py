"""``metrics.jsonl``: one JSON object per logged step, flushed at once so watchers see it."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from engine.run_dir import MetricsDestination


def _finite_or_none(value: Any) -> Any:
    # JSON has no NaN/Infinity; write them as strings so every line stays valid JSON.
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


class JsonlBackend:
    def __init__(self, path: Path):
        self.file = open(path, "a", buffering=1)
        self.destination = MetricsDestination(kind="jsonl", location=str(path))

    def log(self, record: dict[str, Any]) -> None:
        clean = {k: _finite_or_none(v) for k, v in record.items()}
        self.file.write(json.dumps(clean, separators=(",", ":")) + "\n")
        self.file.flush()

    def close(self, failed: bool = False) -> None:
        self.file.close()
