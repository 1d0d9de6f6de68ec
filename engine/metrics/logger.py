"""The aggregating metric logger."""

from __future__ import annotations

from typing import Any, Protocol


class MetricBackend(Protocol):
    def log(self, record: dict[str, Any]) -> None: ...

    def close(self, failed: bool = False) -> None: ...


def numbers(record: dict[str, Any]) -> dict[str, int | float]:
    """The numeric values of a metrics record, ``step`` left out (backends take it apart). A
    recipe may log anything: text, booleans and integers too large for a float are left out;
    NaN and infinities stay (a diverged loss is worth seeing)."""
    found: dict[str, int | float] = {}
    for key, value in record.items():
        if key == "step" or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        try:
            float(value)
        except OverflowError:
            continue
        found[key] = value
    return found


class MetricLogger:
    """Sends each record to every backend. Only rank 0 owns backends; other ranks log nothing."""

    def __init__(self, backends: list[MetricBackend]):
        self.backends = backends

    def log(self, record: dict[str, Any]) -> None:
        for backend in self.backends:
            backend.log(record)

    def close(self, failed: bool = False) -> None:
        """Close every backend; ``failed`` marks the run failed where a backend records that."""
        for backend in self.backends:
            backend.close(failed)
