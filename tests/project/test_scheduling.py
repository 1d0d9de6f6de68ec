"""The suite's files start longest first (tests/scheduling.py), and no test is lost on the way."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

from tests import scheduling


@dataclass
class FakeItem:
    """What the ordering reads of a collected test: its id and its markers."""

    nodeid: str
    markers: tuple[str, ...] = field(default=())

    def get_closest_marker(self, name: str):
        return name if name in self.markers else None


def ids(items) -> list[str]:
    return [item.nodeid for item in items]


def test_files_start_longest_first_by_the_table_each_keeping_its_tests_in_order():
    items = [FakeItem("tests/a.py::one"), FakeItem("tests/b.py::one"), FakeItem("tests/a.py::two"),
             FakeItem("tests/c.py::one"), FakeItem("tests/b.py::two[stdio]")]
    table = {"tests/a.py": 5.0, "tests/b.py": 90.0, "tests/c.py": 30.0}
    assert ids(scheduling.longest_files_first(items, table)) == [
        "tests/b.py::one", "tests/b.py::two[stdio]", "tests/c.py::one", "tests/a.py::one", "tests/a.py::two"]


def test_a_file_the_table_does_not_know_still_runs_placed_by_its_markers():
    items = [FakeItem("tests/known.py::one"), FakeItem("tests/new_fast.py::one"),
             FakeItem("tests/new_slow.py::one", ("slow",)), FakeItem("tests/new_slow.py::two"),
             FakeItem("tests/new_torchrun.py::one", ("multiprocess",))]
    table = {"tests/known.py": 20.0, "tests/gone.py": 500.0}  # a stale entry changes nothing
    assert ids(scheduling.longest_files_first(items, table)) == [
        "tests/new_slow.py::one", "tests/new_slow.py::two",  # 30 + 0.5 s
        "tests/known.py::one",  # 20 s measured
        "tests/new_torchrun.py::one",  # 12 s
        "tests/new_fast.py::one"]  # 0.5 s


def test_files_of_equal_seconds_keep_their_collection_order():
    items = [FakeItem(f"tests/t{n}.py::x") for n in (3, 1, 2)]
    assert ids(scheduling.longest_files_first(items, {})) == ids(items)


def test_the_table_is_read_or_refused_naming_the_file_and_entry(tmp_path):
    path = tmp_path / "durations.json"
    assert scheduling.read_table(path) == {}
    path.write_text('{"tests/a.py": 12, "tests/b.py": 0.5}')
    assert scheduling.read_table(path) == {"tests/a.py": 12.0, "tests/b.py": 0.5}
    for text, expected in [("{", "not JSON"), ("[1]", "expected an object"),
                           ('{"tests/a.py": -1}', "'tests/a.py': expected a number of seconds >= 0, got -1"),
                           ('{"tests/a.py": "9"}', "'tests/a.py'"), ('{"tests/a.py": true}', "'tests/a.py'")]:
        path.write_text(text)
        with pytest.raises(pytest.UsageError, match=str(path)) as refused:
            scheduling.read_table(path)
        assert expected in str(refused.value)


def test_a_recorded_run_replaces_its_files_keeps_the_others_and_drops_the_gone():
    table = {"tests/a.py": 10.0, "tests/b.py": 20.0, "tests/gone.py": 5.0}
    text = scheduling.merged_table(table, [("tests/b.py", 3.14159), ("tests/c.py", 7.0)],
                                   exists=lambda name: name != "tests/gone.py")
    assert json.loads(text) == {"tests/a.py": 10.0, "tests/b.py": 3.1, "tests/c.py": 7.0}
    assert text.splitlines()[1] == '"tests/a.py": 10.0,'  # one file a line: merges stay local


def test_the_recorder_sums_setup_call_and_teardown_by_file(tmp_path):
    path = tmp_path / "durations.json"
    path.write_text('{"tests/old.py": 1.0}')
    recorder = scheduling.DurationRecorder(path)
    for nodeid, seconds in [("tests/old.py::t", 2.0), ("tests/old.py::t", 0.5), ("tests/new.py::t[x]", 4.0)]:
        recorder.pytest_runtest_logreport(SimpleNamespace(nodeid=nodeid, duration=seconds))
    (tmp_path / "tests").mkdir()
    for name in ("old.py", "new.py"):
        (tmp_path / "tests" / name).touch()

    recorder.pytest_sessionfinish(SimpleNamespace(config=SimpleNamespace(rootpath=tmp_path)))
    assert scheduling.read_table(path) == {"tests/old.py": 2.5, "tests/new.py": 4.0}


def test_xdist_keeps_the_order_given(pytestconfig):
    # Its default reorder (files by number of tests) would start the long end-to-end files last.
    assert pytestconfig.option.loadscopereorder is False


def test_the_committed_table_reads_as_seconds_by_test_file():
    table = scheduling.read_table(scheduling.DURATIONS_TABLE)
    assert table, "tests/file_durations.json is empty"
    assert [name for name in table if not (name.startswith("tests/") and name.endswith(".py"))] == []
