"""The aggregating metric logger."""

from __future__ import annotations

from typing import Any, Protocol


class MetricBackend(Protocol):
    def log(self, record: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


class MetricLogger:
    """Sends each record to every backend. Only rank 0 owns backends; other ranks log nothing."""

    def __init__(self, backends: list[MetricBackend]):
        self.backends = backends

    def log(self, record: dict[str, Any]) -> None:
        for backend in self.backends:
            backend.log(record)

    def close(self) -> None:
        for backend in self.backends:
            backend.close()
