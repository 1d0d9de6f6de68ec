"""The whole suite's hooks: the order its files start in (tests/scheduling.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests import scheduling


def pytest_configure(config: pytest.Config) -> None:
    # xdist's own order (files by number of tests) would undo the one below.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False
    record = os.environ.get(scheduling.RECORD_ENV)
    if record and not hasattr(config, "workerinput"):  # the controller, or a run without xdist
        config.pluginmanager.register(scheduling.DurationRecorder(Path(record)), "file-durations")


@pytest.hookimpl(trylast=True)  # after deselection and pytest's grouping by fixture, which it keeps
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items[:] = scheduling.longest_files_first(items, scheduling.read_table(scheduling.DURATIONS_TABLE))
