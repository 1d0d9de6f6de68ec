"""Benchmark scores of a checkpoint with lm-evaluation-harness: ``evaluate --task NAME``.

The model process (``engine.model_io``, in the run sandbox) hands its loaded model and
tokenizer to lm-eval's ``HFLM`` and runs ``simple_evaluate`` on the tasks named, with lm-eval's
defaults (zero-shot unless the task's YAML says otherwise, its seeds, its stderr). A task is one
of lm-eval's own or one defined in the workspace's :data:`TASKS_DIRNAME` folder (lm-eval's
``include_path``: task YAMLs whose data files are named relative to the workspace). Nothing is
downloaded: the Hub is offline in the sandbox, so a task whose data is not on disk is refused. A
task that names a Hub data set (``dataset_path: org/name``) the server's Hugging Face cache holds
reads the snapshot the server showed this process (:mod:`runner.task_data`; datasets offline
reads only its own prepared copies, not the Hub cache's snapshots).

lm_eval is imported only here, inside the functions: neither the server nor a training run
loads it.
"""

from __future__ import annotations

import contextlib
import difflib
import math
import os
import re
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterator

from engine.data_files import HUB_DATASETS_VARIABLE, bound_hub_path
from engine.errors import MAX_QUOTED_CHARS, BadInput
from engine.seams import MAX_METRIC_NAME_CHARS, MAX_TASK_NAME_CHARS, MAX_TASK_SCORES, MAX_TASKS, TaskScore

TASKS_DIRNAME = "eval_tasks"  # the workspace's folder of lm-eval task YAMLs
BATCH_SIZE = 8  # HFLM's batch of requests
NEAR_NAMES = 5
_TASK_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]*")


def check_tasks(tasks: Any) -> None:
    """The bounds of a ``tasks`` request, each defined once: the server's ``evaluate`` tool
    checks its argument with this (:class:`mcp_server.arguments.EvaluateArgs`), and the model
    process its command line."""
    if not isinstance(tasks, list) or not tasks or not all(isinstance(t, str) for t in tasks):
        raise BadInput("tasks must be a non-empty list of lm-eval task names")
    if len(tasks) > MAX_TASKS:
        raise BadInput(f"at most {MAX_TASKS} tasks at a time, got {len(tasks)}")
    for task in tasks:
        if len(task) > MAX_TASK_NAME_CHARS or not _TASK_NAME.fullmatch(task):
            raise BadInput(f"task {task[:MAX_TASK_NAME_CHARS]!r} is not an lm-eval task name (letters, digits, "
                           f"'_', '-', '.'; at most {MAX_TASK_NAME_CHARS} characters)")
    if len(set(tasks)) != len(tasks):
        raise BadInput("a task is named twice in tasks")


def task_manager(workspace: Path, tasks: list[str]) -> Any:
    """lm-eval's ``TaskManager`` that knows every task of ``tasks``: the workspace's folder alone
    when it defines them all (indexing lm-eval's own ~15,000 takes seconds), else with lm-eval's
    own. An unknown task is refused with the names nearest to it."""
    from lm_eval.tasks import TaskManager

    folder = Path(workspace) / TASKS_DIRNAME
    include = str(folder) if folder.is_dir() else None
    if include is not None:
        local = TaskManager(include_path=include, include_defaults=False)
        if set(tasks) <= set(local.all_tasks):
            return local
    manager = TaskManager(include_path=include)
    known = set(manager.all_tasks)
    for task in tasks:
        if task not in known:
            near = difflib.get_close_matches(task, sorted(known), n=NEAR_NAMES, cutoff=0.6)
            raise BadInput(f"unknown lm-eval task {task!r}" + (f"; near names: {', '.join(near)}" if near else "")
                           + f". A task of your own is a YAML in the workspace's {TASKS_DIRNAME}/ folder "
                           "(lm-eval's task format; data files named relative to the workspace)")
    return manager


def language_model(loaded: Any) -> Any:
    """lm-eval's ``HFLM`` over the loaded checkpoint's model and tokenizer (a recipe engine or a
    script run's :class:`~engine.hf_checkpoint.CheckpointModel`), or a refusal naming why
    ``HFLM`` cannot score it."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from engine.hf_export import set_special_tokens, text_tokenizer

    model, processing = loaded.hf_model(), loaded.hf_processing()
    if processing is None:
        raise BadInput("the run's model has no tokenizer (e.g. data.source=random), so lm-eval's tasks cannot be "
                       "put to it in text")
    family = getattr(getattr(model, "config", None), "model_type", None)
    if family not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise BadInput(f"lm-eval's HFLM scores causal language models; the run's model ({type(model).__name__}, "
                       f"model_type {family!r}) is not one transformers' AutoModelForCausalLM loads")
    from lm_eval.models.huggingface import HFLM

    set_special_tokens(model, processing)
    return HFLM(pretrained=model, tokenizer=text_tokenizer(processing), batch_size=BATCH_SIZE, backend="causal")


def score(load: Callable[[], Any], tasks: list[str], workspace: Path, limit: int | None = None,
          report: Callable[[int, int, str], None] | None = None) -> list[TaskScore]:
    """Each task's metrics (and each subtask's, for a group) with their stderr and example count,
    as ``simple_evaluate`` computes them on the checkpoint ``load()`` returns (called once the
    tasks are known: an unknown one is refused before a model is loaded). The tasks are scored
    one after the other (each task's numbers are its own in lm-eval), ``report`` told each as it
    starts: ``(i, n, "task i of n: NAME")``."""
    check_tasks(tasks)
    # The data sets' prepared copies go to a folder of this process: the sandbox's home is empty,
    # and the host's caches are not there to write into.
    os.environ.setdefault("HF_DATASETS_CACHE", tempfile.mkdtemp(prefix="lm-eval-data-"))
    manager = task_manager(workspace, tasks)
    lm = language_model(load())
    from lm_eval import simple_evaluate

    with hub_datasets_from_snapshots():
        try:  # the data are read as the tasks are built: a refusal here is about the data, not the model
            manager.load(tasks)
        except Exception as e:  # datasets' and lm-eval's errors have no common base: name the cause
            raise BadInput(f"the data of lm-eval task(s) {', '.join(tasks)} is not available offline "
                           f"({type(e).__name__}: {str(e).splitlines()[0][:MAX_QUOTED_CHARS] if str(e) else ''}); "
                           f"put the data in the workspace and name it in a task YAML in {TASKS_DIRNAME}/, or "
                           "the Hub data set in the server's Hugging Face cache") from None
        results: dict[str, Any] = {"results": {}, "n-samples": {}}
        for index, task in enumerate(tasks, start=1):
            if report is not None:
                report(index, len(tasks), f"task {index} of {len(tasks)}: {task}")
            scored = simple_evaluate(model=lm, tasks=[task], task_manager=manager, log_samples=False, limit=limit)
            for part in results:
                results[part].update(scored.get(part, {}))
    return scores(results)


@contextlib.contextmanager
def hub_datasets_from_snapshots() -> Iterator[None]:
    """While it lasts, ``datasets.load_dataset`` of a Hub id the server bound for this process
    (``TRAINWRIGHT_HUB_DATASETS``: the id as a task names it -> its snapshot folder) loads that
    folder: offline, datasets finds only the copies it prepared itself, never a snapshot of the
    Hugging Face cache. Every other path is loaded as given."""
    import datasets

    original = datasets.load_dataset

    def load_dataset(path: str, *args: Any, **kwargs: Any) -> Any:
        snapshot = bound_hub_path(HUB_DATASETS_VARIABLE, path) if isinstance(path, str) else None
        return original(snapshot or path, *args, **kwargs)

    datasets.load_dataset = load_dataset
    try:
        yield
    finally:
        datasets.load_dataset = original


def scores(results: dict[str, Any]) -> list[TaskScore]:
    """lm-eval's ``results`` as :class:`~engine.seams.TaskScore` records: ``acc,none`` is ``acc``
    (a filter other than ``none`` stays in the name), its stderr ``acc_stderr,none``; a value
    that is not a finite number (lm-eval's ``N/A``) is left out."""
    counts = results.get("n-samples", {})
    found = []
    for task, values in list(results["results"].items())[:MAX_TASK_SCORES]:
        metrics: dict[str, float] = {}
        stderr: dict[str, float] = {}
        for key, value in values.items():
            if "," not in key or isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                continue
            metric, _, kept_filter = key.partition(",")
            into = stderr if metric.endswith("_stderr") else metrics
            name = metric.removesuffix("_stderr") if into is stderr else metric
            into[(name if kept_filter == "none" else f"{name},{kept_filter}")[:MAX_METRIC_NAME_CHARS]] = float(value)
        count = counts.get(task, {}).get("effective", values.get("sample_len"))
        found.append(TaskScore(task=task[:MAX_TASK_NAME_CHARS], examples=count if isinstance(count, int) else None,
                               metrics=metrics, stderr={k: v for k, v in stderr.items() if k in metrics}))
    return found
