"""The Hub data sets an lm-eval task of the workspace names, found in the server's Hugging Face
cache (``runner.task_data``): the model process of ``evaluate(tasks=[...])`` is shown the repo
folder of each data set the tasks asked for name, and nothing else of the cache."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.benchmarks import TASKS_DIRNAME
from runner.hub import ModelBinding
from runner.task_data import task_datasets
from engine.errors import BadInput
from tests.lm_eval_tasks import (BUILTIN_DATASET, BUILTIN_TASK, HUB_COMMIT, HUB_DATASET, write_builtin_data,
                                   write_hub_task, write_tasks)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    cache = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)  # looked up offline whatever the server's setting
    return cache


def test_only_the_data_set_a_task_asked_for_names_is_bound_read_only(tmp_path, cache):
    workspace = tmp_path / "ws"
    snapshot = write_hub_task(workspace, cache)
    other = cache / "datasets--org--other" / "snapshots" / HUB_COMMIT
    other.mkdir(parents=True)
    (cache / "datasets--org--other" / "refs").mkdir()
    (cache / "datasets--org--other" / "refs" / "main").write_text(HUB_COMMIT)
    tasks = workspace / TASKS_DIRNAME
    (tasks / "other.yaml").write_text("task: other_task\ndataset_path: org/other\n")
    (found,) = task_datasets(workspace, ["code_hub", "code_mc"])
    assert (found.repo_id, found.repo_type, found.commit, found.path) == (HUB_DATASET, "dataset", HUB_COMMIT,
                                                                          str(snapshot))
    binding = ModelBinding((found,))
    assert binding.read_only() == [cache / "datasets--org--code-questions"]  # the repo's folder, not the cache
    assert "TRAINWRIGHT_HUB_DATASETS" in binding.env() and binding.env()["HF_HUB_OFFLINE"] == "1"
    assert task_datasets(workspace, ["code_mc"]) == []  # its data is a workspace file


def test_an_included_yaml_names_the_data_set_and_one_the_cache_lacks_is_refused(tmp_path, cache):
    workspace = tmp_path / "ws"
    write_hub_task(workspace, cache)
    tasks = workspace / TASKS_DIRNAME
    (tasks / "_base.yaml").write_text(f"dataset_path: {HUB_DATASET}\noutput_type: multiple_choice\n")
    (tasks / "derived.yaml").write_text("include: _base.yaml\ntask: derived\nprocess_docs: !function utils.docs\n")
    (tasks / "absent.yaml").write_text("task: absent\ndataset_path: org/not-cached\n")
    assert [m.repo_id for m in task_datasets(workspace, ["derived"])] == [HUB_DATASET]
    assert task_datasets(Path(tmp_path / "nowhere"), ["derived"]) == []
    with pytest.raises(BadInput, match="lm-eval task 'absent' reads the Hub data set 'org/not-cached', which is "
                                       "not in the server's Hugging Face cache"):
        task_datasets(workspace, ["absent"])


def test_lm_evals_own_task_finds_its_data_set_in_the_cache_or_is_refused_naming_how_to_get_it(tmp_path, cache):
    workspace = tmp_path / "ws"
    write_tasks(workspace)  # the workspace defines other tasks: piqa is lm-eval's own
    with pytest.raises(BadInput) as refused:
        task_datasets(workspace, ["code_mc", BUILTIN_TASK])
    assert str(refused.value) == (
        f"lm-eval task '{BUILTIN_TASK}' reads the Hub data set '{BUILTIN_DATASET}', which is not in the server's "
        "Hugging Face cache (the model process is offline); download it on the server: "
        f"huggingface-cli download --repo-type dataset {BUILTIN_DATASET}")
    snapshot = write_builtin_data(cache)
    (found,) = task_datasets(workspace, ["code_mc", BUILTIN_TASK])
    assert (found.repo_id, found.path) == (BUILTIN_DATASET, str(snapshot))
    assert ModelBinding((found,)).read_only() == [cache / "datasets--baber--piqa"]
    assert task_datasets(workspace, ["no_such_task_anywhere"]) == []  # the model process names it unknown


def test_an_include_that_leads_out_of_the_tasks_folder_is_not_read(tmp_path, cache):
    """``include`` is lm-eval's, relative to the YAML: ``../..`` or a folder link led the server to
    read (and act on) a YAML outside the workspace's eval_tasks/, as a FIFO's or a secret's path."""
    workspace = tmp_path / "ws"
    write_hub_task(workspace, cache)
    tasks = workspace / TASKS_DIRNAME
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "_base.yaml").write_text(f"dataset_path: {HUB_DATASET}\n")
    (tasks / "linked").symlink_to(outside)
    (tasks / "up.yaml").write_text("include: ../../outside/_base.yaml\ntask: up\n")
    (tasks / "absolute.yaml").write_text(f"include: {outside / '_base.yaml'}\ntask: absolute\n")
    (tasks / "via_link.yaml").write_text("include: linked/_base.yaml\ntask: via_link\n")
    for task in ("up", "absolute", "via_link"):
        assert task_datasets(workspace, [task]) == [], task
    (tasks / "sub").mkdir()
    (tasks / "_inside.yaml").write_text(f"dataset_path: {HUB_DATASET}\n")
    (tasks / "sub" / "near.yaml").write_text("include: ../_inside.yaml\ntask: near\n")
    assert [m.repo_id for m in task_datasets(workspace, ["near"])] == [HUB_DATASET]  # inside the folder: read
