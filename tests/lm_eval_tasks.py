"""A small lm-evaluation-harness task set of a workspace's own, for the tests of
``evaluate(tasks=[...])``: a multiple-choice and a generate_until task in ``eval_tasks/`` over one
JSONL there, and lm-eval's own numbers for a model (``simple_evaluate`` with ``HFLM``)."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

from engine import benchmarks

MULTIPLE_CHOICE = """\
task: code_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: eval_tasks/code.jsonl
test_split: test
output_type: multiple_choice
doc_to_text: "{{question}}"
doc_to_choice: "{{choices}}"
doc_to_target: "{{answer}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
"""

GENERATE = """\
task: code_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: eval_tasks/code.jsonl
test_split: test
output_type: generate_until
doc_to_text: "{{question}}"
doc_to_target: "{{choices[answer]}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 4
  do_sample: false
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
"""

QUESTIONS = [
    ("def add(a, b):", [" return a + b", " import os", " class A:"], 0),
    ("import os", ["\nprint(os.getcwd())", " pass", " return a"], 0),
    ("class A:", ["\n    pass", " import", " def"], 0),
    ("print(os.", ["getcwd())", "a + b", "A:"], 0),
    ("return a", [" + b", " A", " os"], 0),
    ("def f(x):", [" pass", " return", " os"], 1),
]


def write_tasks(workspace: Path) -> Path:
    """The workspace's task folder: two tasks over one JSONL of its own."""
    folder = workspace / benchmarks.TASKS_DIRNAME
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "code_mc.yaml").write_text(MULTIPLE_CHOICE)
    (folder / "code_gen.yaml").write_text(GENERATE)
    with open(folder / "code.jsonl", "w") as f:
        for question, choices, answer in QUESTIONS * 2:
            f.write(json.dumps({"question": question, "choices": choices, "answer": answer}) + "\n")
    return folder


def lm_eval_reference(workspace: Path, tasks: list[str], **hflm: Any) -> dict[str, Any]:
    """lm-eval's own numbers: ``simple_evaluate`` with ``HFLM`` loading a model folder itself, in
    the workspace (where the task YAMLs name their data)."""
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    lm = HFLM(device="cpu", dtype="float32", batch_size=benchmarks.BATCH_SIZE, **hflm)
    manager = TaskManager(include_path=str(workspace / benchmarks.TASKS_DIRNAME), include_defaults=False)
    with contextlib.chdir(workspace):
        return simple_evaluate(model=lm, tasks=tasks, task_manager=manager, log_samples=False)["results"]


HUB_DATASET = "org/code-questions"
HUB_COMMIT = "d" * 40


def write_hub_task(workspace: Path, cache: Path, task: str = "code_hub") -> Path:
    """Task ``task``: code_mc's questions as the Hub data set :data:`HUB_DATASET`, named by its
    id, in ``cache`` as huggingface_hub lays a data set out (``refs/main``, a snapshot whose
    files are links into ``blobs/``); returns the snapshot folder."""
    write_tasks(workspace)
    repo = cache / f"datasets--{HUB_DATASET.replace('/', '--')}"
    snapshot = repo / "snapshots" / HUB_COMMIT
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(HUB_COMMIT)
    snapshot.mkdir(parents=True, exist_ok=True)
    (repo / "blobs" / "questions").write_bytes((workspace / benchmarks.TASKS_DIRNAME / "code.jsonl").read_bytes())
    if not (snapshot / "test.jsonl").is_symlink():
        (snapshot / "test.jsonl").symlink_to(Path("../../blobs/questions"))
    yaml = MULTIPLE_CHOICE.replace("task: code_mc", f"task: {task}").replace(
        "dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: eval_tasks/code.jsonl\n",
        f"dataset_path: {HUB_DATASET}\n")
    assert HUB_DATASET in yaml
    (workspace / benchmarks.TASKS_DIRNAME / f"{task}.yaml").write_text(yaml)
    return snapshot


BUILTIN_TASK = "piqa"  # lm-eval's own: two-choice, over the Hub data set BUILTIN_DATASET
BUILTIN_DATASET = "baber/piqa"
PIQA_ROWS = [
    {"goal": "To open a jar,", "sol1": "twist the lid.", "sol2": "paint the lid.", "label": 0},
    {"goal": "To dry wet hands,", "sol1": "wave a spoon.", "sol2": "use a towel.", "label": 1},
    {"goal": "To boil water,", "sol1": "heat it on a stove.", "sol2": "put it in a drawer.", "label": 0},
    {"goal": "To read at night,", "sol1": "close the book.", "sol2": "turn on a lamp.", "label": 1},
    {"goal": "To cut paper,", "sol1": "use scissors.", "sol2": "use a sock.", "label": 0},
]


def write_builtin_data(cache: Path) -> Path:
    """lm-eval's :data:`BUILTIN_TASK` data set, a few rows of its schema, in ``cache`` as
    huggingface_hub lays a data set out; returns the snapshot folder."""
    repo = cache / f"datasets--{BUILTIN_DATASET.replace('/', '--')}"
    snapshot = repo / "snapshots" / HUB_COMMIT
    snapshot.mkdir(parents=True, exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(HUB_COMMIT)
    for split, rows in (("train", PIQA_ROWS[:2]), ("validation", PIQA_ROWS)):
        (snapshot / f"{split}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return snapshot
