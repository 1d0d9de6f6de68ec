"""The order in which the suite's files start under ``make test`` (pytest-xdist, ``--dist loadfile``).

Files are the unit of the two workers: a worker takes the next file of the collection order when
it has two tests of its own left. A long file that starts last keeps one worker busy while the
other has nothing left to do, so the longest files start first (longest processing time first)
and the short ones fill the end. A file's length is what it took in a measured run of the suite
(``file_durations.json``: seconds by file), or, for a file the table does not know yet, an
estimate from its tests' markers. Reordering never drops a test: a file missing from the table
still runs, and an entry for a file that is gone is ignored.

xdist's own reordering (``--loadscope-reorder``, its default: files by number of tests) would put
the long end-to-end files, which have few tests, last; ``tests/conftest.py`` turns it off.

``TRAINWRIGHT_FILE_DURATIONS=PATH`` makes a run record each file's seconds (its tests' setup, call
and teardown, summed) into the table at PATH, keeping the entries of files it did not run:
``make test PYTEST_ARGS="-p no:cacheprovider" TRAINWRIGHT_FILE_DURATIONS=tests/file_durations.json``
refreshes the committed one.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path
from typing import Callable, Iterable, Sequence

import pytest

DURATIONS_TABLE = Path(__file__).with_name("file_durations.json")
RECORD_ENV = "TRAINWRIGHT_FILE_DURATIONS"

# The estimate of a test the table does not know, by its markers (pyproject.toml's markers say
# what each means): a torchrun launch costs about 10 s on CPU, a slow test over about 20 s.
SLOW_TEST_S = 30.0
MULTIPROCESS_TEST_S = 12.0
OTHER_TEST_S = 0.5


def file_of(nodeid: str) -> str:
    """The file part of a test id (``tests/mcp/test_x.py::test_y[memory]`` -> ``tests/mcp/test_x.py``),
    the unit ``--dist loadfile`` hands to a worker."""
    return nodeid.split("::", 1)[0]


def read_table(path: Path) -> dict[str, float]:
    """Seconds by file from ``path``; no file: an empty table. A table that is not an object of
    non-negative numbers by file is a usage error naming the file and the entry."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return {}
    try:
        table = json.loads(text)
    except json.JSONDecodeError as error:
        raise pytest.UsageError(f"{path}: not JSON ({error})") from None
    if not isinstance(table, dict):
        raise pytest.UsageError(f"{path}: expected an object of seconds by test file, got {type(table).__name__}")
    for name, seconds in table.items():
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not math.isfinite(seconds) or seconds < 0:
            raise pytest.UsageError(f"{path}: {name!r}: expected a number of seconds >= 0, got {seconds!r}")
    return {name: float(seconds) for name, seconds in table.items()}


def estimated_seconds(item: pytest.Item) -> float:
    """What a test the table does not know is taken to cost, from its markers."""
    if item.get_closest_marker("slow") is not None:
        return SLOW_TEST_S
    if item.get_closest_marker("multiprocess") is not None:
        return MULTIPROCESS_TEST_S
    return OTHER_TEST_S


def longest_files_first(items: Sequence[pytest.Item], table: dict[str, float]) -> list[pytest.Item]:
    """``items`` with their files in decreasing order of seconds (the table's, else the estimate
    from the file's tests), each file's tests together and in their own order; files of equal
    seconds keep their collection order. The same items, none dropped or repeated."""
    by_file: dict[str, list[pytest.Item]] = defaultdict(list)
    for item in items:
        by_file[file_of(item.nodeid)].append(item)

    def seconds(name: str) -> float:
        if name in table:
            return table[name]
        return sum(estimated_seconds(item) for item in by_file[name])

    ordered = sorted(by_file, key=lambda name: -seconds(name))  # sorted() is stable
    return [item for name in ordered for item in by_file[name]]


class DurationRecorder:
    """Sums each file's test seconds as reports arrive (in the controller under xdist) and merges
    them into the table at ``path`` when the session ends."""

    def __init__(self, path: Path):
        self.path = path
        self.seconds: dict[str, float] = defaultdict(float)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.seconds[file_of(report.nodeid)] += report.duration

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if not self.seconds:
            return
        root = session.config.rootpath
        text = merged_table(read_table(self.path), self.seconds.items(), lambda name: (root / name).is_file())
        self.path.write_text(text, encoding="utf-8")


def merged_table(table: dict[str, float], measured: Iterable[tuple[str, float]],
                 exists: Callable[[str], bool]) -> str:
    """``table`` with the ``measured`` files' seconds replacing theirs, less the files that no
    longer ``exist``, as the JSON text written (files sorted, seconds to a tenth)."""
    merged = {**table, **dict(measured)}
    kept = {name: round(merged[name], 1) for name in sorted(merged) if exists(name)}
    return json.dumps(kept, indent=0) + "\n"
