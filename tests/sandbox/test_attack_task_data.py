"""Attack: the workspace's lm-eval task YAMLs (``eval_tasks/``) are anyone's files, read by the
server itself when ``evaluate(tasks=[...])`` asks which Hub data sets to show the model process.
A YAML swapped for a FIFO while the server reads must not hang it, and tasks naming more data
sets than are shown must be refused, not left to fail offline in the model process."""

from __future__ import annotations

import multiprocessing
import os
import threading

import pytest

from engine.benchmarks import TASKS_DIRNAME
from engine.errors import BadInput
from runner import task_data
from tests.lm_eval_tasks import HUB_COMMIT


@pytest.fixture
def cache(tmp_path, monkeypatch):
    cache = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(task_data, "lm_eval_tasks_dir", lambda: None)  # the workspace's tasks alone
    return cache


def cached(cache, name: str) -> None:
    repo = cache / f"datasets--org--{name}"
    (repo / "snapshots" / HUB_COMMIT).mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(HUB_COMMIT)


def flip(path, stop) -> None:
    """Another process: the YAML swapped, atomically and over and over, between a file and a FIFO."""
    spare = path.with_name("spare")
    while not stop.is_set():
        spare.write_text("task: flipped\ndataset_path: org/flipped\n")
        os.replace(spare, path)
        os.mkfifo(spare)
        os.replace(spare, path)


def test_a_task_yaml_swapped_for_a_fifo_while_it_is_read_does_not_hang_the_server(tmp_path, cache):
    """_text checked that the YAML was a regular file, then read it by name: a FIFO swapped in
    between left the server waiting for a writer for ever."""
    workspace = tmp_path / "ws"
    (workspace / TASKS_DIRNAME).mkdir(parents=True)
    cached(cache, "flipped")
    context = multiprocessing.get_context("fork")
    stop = context.Event()
    flipper = context.Process(target=flip, args=(workspace / TASKS_DIRNAME / "flipped.yaml", stop))
    flipper.start()
    answered: list[int] = []

    def ask() -> None:
        for _ in range(1000):
            task_data.task_datasets(workspace, ["flipped"])
            answered.append(1)

    asking = threading.Thread(target=ask, daemon=True)
    try:
        asking.start()
        asking.join(60)
    finally:
        stop.set()
        flipper.join(10)
    assert not asking.is_alive(), f"the server waited on a FIFO after {len(answered)} answers"
    assert len(answered) == 1000


def test_tasks_that_name_more_data_sets_than_are_shown_are_refused_naming_them(tmp_path, cache):
    """The data sets past the 8th were dropped without a word: the model process, offline, then
    failed to load them deep in lm-eval."""
    workspace = tmp_path / "ws"
    (workspace / TASKS_DIRNAME).mkdir(parents=True)
    names = [f"set{i}" for i in range(task_data.MAX_DATASETS + 1)]
    for name in names:
        cached(cache, name)
        (workspace / TASKS_DIRNAME / f"{name}.yaml").write_text(f"task: task_{name}\ndataset_path: org/{name}\n")
    with pytest.raises(BadInput) as refused:
        task_data.task_datasets(workspace, [f"task_{name}" for name in names])
    assert str(refused.value) == ("the lm-eval tasks asked for read 9 Hub data sets (org/set0, org/set1, org/set2, "
                                  "org/set3, org/set4, org/set5, org/set6, org/set7, org/set8); an evaluation is shown "
                                  "at most 8: evaluate fewer tasks at once")
    assert len(task_data.task_datasets(workspace, [f"task_{name}" for name in names[:8]])) == 8


def test_a_task_yaml_nested_past_what_yaml_parses_is_no_task(tmp_path, cache):
    """yaml.load raised RecursionError on a workspace YAML nested 100,000 deep (under the 1 MiB
    bound) that holds the task's name: evaluate failed as a trainwright bug."""
    workspace = tmp_path / "ws"
    (workspace / TASKS_DIRNAME).mkdir(parents=True)
    (workspace / TASKS_DIRNAME / "deep.yaml").write_text("# task: deep\n" + "[" * 100_000)
    assert task_data.task_datasets(workspace, ["deep"]) == []


def test_a_task_yaml_that_includes_a_link_loop_is_read_without_its_include(tmp_path, cache):
    """Path.resolve raised RuntimeError ("Symlink loop") on an include the workspace linked to
    itself: evaluate failed as a trainwright bug."""
    workspace = tmp_path / "ws"
    (workspace / TASKS_DIRNAME).mkdir(parents=True)
    (workspace / TASKS_DIRNAME / "loop").symlink_to("loop")
    (workspace / TASKS_DIRNAME / "looped.yaml").write_text("task: looped\ninclude: loop\n")
    assert task_data.task_datasets(workspace, ["looped"]) == []
