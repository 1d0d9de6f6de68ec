"""Benchmark scores with lm-evaluation-harness (``engine.benchmarks``), in this process: a
multiple-choice and a generate_until task defined in a workspace's ``eval_tasks/`` folder over a
JSONL there, scored on a tiny model exactly as lm-eval's own ``simple_evaluate`` with ``HFLM``
scores the same model folder; and the refusals (an unknown task with the names near it, data
that is not on disk, a model HFLM cannot score, a bad task name). The tool's path, through the
sandbox, is tests/mcp/test_script_checkpoints.py's and tests/mcp/test_model_tools.py's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from engine import benchmarks
from engine.errors import BadInput
from engine.hf_checkpoint import load_checkpoint_model
from tests.fake_hub import tiny_llama_folder
from tests.lm_eval_tasks import QUESTIONS, lm_eval_reference, write_tasks


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    workspace = tmp_path_factory.mktemp("benchmarks")
    write_tasks(workspace)
    tiny_llama_folder(workspace / "model")
    return workspace


@pytest.fixture
def in_workspace(workspace, monkeypatch):
    """The model process runs in the workspace: task YAMLs name their data relative to it."""
    monkeypatch.chdir(workspace)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(workspace / ".datasets-cache"))
    return workspace


def test_scores_equal_lm_evals_own_on_the_same_model(in_workspace):
    scored = benchmarks.score(lambda: load_checkpoint_model(in_workspace / "model", "run-1"), ["code_mc", "code_gen"],
                              in_workspace)
    expected = lm_eval_reference(in_workspace, ["code_mc", "code_gen"], pretrained=str(in_workspace / "model"))
    by_task = {s.task: s for s in scored}
    assert set(by_task) == {"code_mc", "code_gen"}
    assert by_task["code_mc"].examples == by_task["code_gen"].examples == 2 * len(QUESTIONS)
    assert by_task["code_mc"].metrics == {"acc": expected["code_mc"]["acc,none"],
                                          "acc_norm": expected["code_mc"]["acc_norm,none"]}
    assert by_task["code_mc"].stderr == {"acc": expected["code_mc"]["acc_stderr,none"],
                                         "acc_norm": expected["code_mc"]["acc_norm_stderr,none"]}
    assert by_task["code_gen"].metrics == {"exact_match": expected["code_gen"]["exact_match,none"]}
    assert 0 <= by_task["code_mc"].metrics["acc"] <= 1


def test_results_keep_a_filters_name_and_leave_out_what_is_not_a_number():
    results = {"results": {"gsm": {"alias": "gsm", "exact_match,strict-match": 0.5,
                                   "exact_match_stderr,strict-match": 0.1, "exact_match,flexible": 0.25,
                                   "exact_match_stderr,flexible": "N/A", "sample_len": 4},
                           "group": {"acc,none": 0.3, "acc_stderr,none": "N/A", "alias": "group"}},
               "n-samples": {"gsm": {"original": 4, "effective": 4}}}
    gsm, group = benchmarks.scores(results)
    assert (gsm.task, gsm.examples) == ("gsm", 4)
    assert gsm.metrics == {"exact_match,strict-match": 0.5, "exact_match,flexible": 0.25}
    assert gsm.stderr == {"exact_match,strict-match": 0.1}
    assert (group.task, group.examples, group.metrics, group.stderr) == ("group", None, {"acc": 0.3}, {})


@pytest.mark.slow  # lm-eval indexes its own ~15,000 task YAMLs to look for the name: 15-30 s on 2 cores
def test_an_unknown_task_is_refused_with_the_names_near_it_before_a_model_is_loaded(in_workspace):
    def load():
        raise AssertionError("the model was loaded for a task that does not exist")

    with pytest.raises(BadInput) as refused:
        benchmarks.score(load, ["code_mcq"], in_workspace)
    message = str(refused.value)
    assert message.startswith("unknown lm-eval task 'code_mcq'; near names: code_mc")
    assert "a YAML in the workspace's eval_tasks/ folder" in message


def test_a_task_whose_data_is_not_on_disk_is_refused(in_workspace, tmp_path, monkeypatch):
    write_tasks(tmp_path)
    (tmp_path / "eval_tasks" / "code.jsonl").unlink()
    monkeypatch.chdir(tmp_path)
    with pytest.raises(BadInput) as refused:
        benchmarks.score(lambda: load_checkpoint_model(in_workspace / "model", "run-1"), ["code_mc"], tmp_path)
    assert str(refused.value).startswith("the data of lm-eval task(s) code_mc is not available offline (")
    assert "put the data in the workspace and name it in a task YAML in eval_tasks/" in str(refused.value)


def test_a_task_naming_a_hub_data_set_reads_the_snapshot_bound_for_it(in_workspace, tmp_path, monkeypatch):
    import json

    from engine.data_files import HUB_DATASETS_VARIABLE
    from tests.lm_eval_tasks import HUB_DATASET, write_hub_task

    snapshot = write_hub_task(in_workspace, tmp_path / "hub")
    model = load_checkpoint_model(in_workspace / "model", "run-1")
    monkeypatch.setenv(HUB_DATASETS_VARIABLE, json.dumps({HUB_DATASET: str(snapshot)}))
    started: list = []
    by_task = {s.task: s for s in benchmarks.score(lambda: model, ["code_mc", "code_hub"], in_workspace,
                                                   report=lambda *told: started.append(told))}
    assert started == [(1, 2, "task 1 of 2: code_mc"), (2, 2, "task 2 of 2: code_hub")]  # each as it starts
    # The same questions, from the snapshot of the cache instead of the workspace's file.
    assert (by_task["code_hub"].examples, by_task["code_hub"].metrics) == (by_task["code_mc"].examples,
                                                                          by_task["code_mc"].metrics)
    monkeypatch.delenv(HUB_DATASETS_VARIABLE)  # not bound: offline, datasets cannot find it
    with pytest.raises(BadInput, match=r"the data of lm-eval task\(s\) code_hub is not available offline"):
        benchmarks.score(lambda: model, ["code_hub"], in_workspace)


def test_a_builtin_task_reads_its_hub_data_set_bound_from_the_cache_as_lm_eval_scores_it(in_workspace, tmp_path,
                                                                                        monkeypatch):
    """lm-eval's own piqa (its YAML in the lm_eval package names baber/piqa), over a few rows of
    that data set's schema in a cache snapshot, with a small limit: the numbers of lm-eval's
    simple_evaluate with HFLM loading the same model folder and its piqa YAML."""
    import json

    import datasets
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    from engine.data_files import HUB_DATASETS_VARIABLE
    from runner.task_data import lm_eval_tasks_dir
    from tests.lm_eval_tasks import BUILTIN_DATASET, BUILTIN_TASK, write_builtin_data

    snapshot = write_builtin_data(tmp_path / "hub")
    monkeypatch.setenv(HUB_DATASETS_VARIABLE, json.dumps({BUILTIN_DATASET: str(snapshot)}))
    (scored,) = benchmarks.score(lambda: load_checkpoint_model(in_workspace / "model", "run-1"), [BUILTIN_TASK],
                                 in_workspace, limit=4)
    original = datasets.load_dataset
    monkeypatch.setattr(datasets, "load_dataset", lambda path, *a, **k: original(
        str(snapshot) if path == BUILTIN_DATASET else path, *a, **k))
    manager = TaskManager(include_path=str(lm_eval_tasks_dir() / BUILTIN_TASK), include_defaults=False)
    lm = HFLM(pretrained=str(in_workspace / "model"), device="cpu", dtype="float32", batch_size=benchmarks.BATCH_SIZE)
    expected = simple_evaluate(model=lm, tasks=[BUILTIN_TASK], task_manager=manager, log_samples=False,
                               limit=4)["results"][BUILTIN_TASK]
    assert (scored.task, scored.examples) == (BUILTIN_TASK, 4)  # the limit, of the 5 rows
    assert scored.metrics == {"acc": expected["acc,none"], "acc_norm": expected["acc_norm,none"]}
    assert scored.stderr == {"acc": expected["acc_stderr,none"], "acc_norm": expected["acc_norm_stderr,none"]}


@dataclass
class Loaded:
    model: Any
    processing: Any

    def hf_model(self) -> Any:
        return self.model

    def hf_processing(self) -> Any:
        return self.processing


def test_a_model_hflm_cannot_score_is_refused(workspace):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from tests.vlm_families import tiny_vlm_folder

    folder = tiny_vlm_folder(workspace / "vlm", "llava")
    vlm = Loaded(AutoModelForImageTextToText.from_pretrained(folder), AutoProcessor.from_pretrained(folder))
    with pytest.raises(BadInput, match=r"lm-eval's HFLM scores causal language models; the run's model "
                                       r"\(LlavaForConditionalGeneration, model_type 'llava'\) is not one"):
        benchmarks.language_model(vlm)
    text_only = load_checkpoint_model(workspace / "model", "run-1")
    with pytest.raises(BadInput, match=r"the run's model has no tokenizer"):
        benchmarks.language_model(Loaded(text_only.model, None))


@pytest.mark.parametrize("tasks, message", [
    ([], "tasks must be a non-empty list of lm-eval task names"),
    ("arc_easy", "tasks must be a non-empty list of lm-eval task names"),
    (["t"] * 9, "at most 8 tasks at a time, got 9"),
    (["../x"], "task '../x' is not an lm-eval task name"),
    (["--limit=1"], "task '--limit=1' is not an lm-eval task name"),
    (["arc_easy", "arc_easy"], "a task is named twice in tasks"),
])
def test_task_names_are_checked(tasks, message):
    with pytest.raises(BadInput, match=message.replace("(", r"\(").replace(".", r"\.")):
        benchmarks.check_tasks(tasks)
