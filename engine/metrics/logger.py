"""The aggregating metric logger."""

from __future__ import annotations

import os
import time
from typing import Any, Protocol

_LOADED = time.monotonic()


def process_age_s() -> float:
    """Seconds since this process started (Linux: its start time in /proc), or since this module
    was imported where that cannot be read."""
    try:
        with open("/proc/self/stat", "rb") as stat, open("/proc/uptime", "rb") as uptime:
            started_ticks = int(stat.read().rsplit(b")", 1)[1].split()[19])  # field 22, starttime
            return max(0.0, float(uptime.read().split()[0]) - started_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return time.monotonic() - _LOADED


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
        """Send ``record``, stamped with ``elapsed_s`` (the process's age: what a whole run's
        time and its warm-up are compared by) unless it has one."""
        if self.backends and "elapsed_s" not in record:
            record = {**record, "elapsed_s": round(process_age_s(), 3)}
        for backend in self.backends:
            backend.log(record)

    def close(self, failed: bool = False) -> None:
        """Close every backend; ``failed`` marks the run failed where a backend records that."""
        for backend in self.backends:
            backend.close(failed)
