"""The Hub data sets that the workspace's lm-eval tasks name, found in the server's Hugging Face
cache, for ``evaluate(tasks=[...])``.

A task YAML of the workspace's ``eval_tasks/`` folder may name its data by Hub id
(``dataset_path: org/name``, in the YAML or in the one of ``eval_tasks/`` it ``include``\\ s). The model process is
offline, so the server looks the data set up in its own cache (never on the network) and shows
the model process that data set's repo folder read-only — that one, never the whole cache, and
no token; :func:`engine.benchmarks.hub_datasets_from_snapshots` reads its snapshot for the id. A
data set the cache does not hold is left out, and the model process says the task's data is not
available offline.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml

from engine import run_dir as rd
from engine.benchmarks import TASKS_DIRNAME
from engine.errors import BadInput, NotFound
from runner import hub

MAX_TASK_FILES = 500
MAX_TASK_FILE_BYTES = 1 << 20
MAX_DATASETS = 8


class _TaskLoader(yaml.SafeLoader):
    """lm-eval's YAML, with its tags (``!function utils.process_docs``) read as nothing."""


_TaskLoader.add_multi_constructor("!", lambda loader, suffix, node: None)


def task_datasets(workspace: Path, tasks: list[str]) -> list[rd.HubModel]:
    """The snapshots in the server's cache of the Hub data sets that the workspace's YAMLs of
    ``tasks`` name (at most :data:`MAX_DATASETS`)."""
    wanted = set(tasks)
    named: set[str] = set()
    folder = Path(workspace) / TASKS_DIRNAME
    for config, path in _task_configs(folder):
        names = config.get("task")
        if not wanted & {n for n in (names if isinstance(names, list) else [names]) if isinstance(n, str)}:
            continue
        dataset = config.get("dataset_path")
        if dataset is None and isinstance(config.get("include"), str):
            # Read only inside the tasks folder: ``..``, an absolute path or a link leads out of it.
            include = (path.parent / config["include"]).resolve()
            included = _read(include) if include.is_relative_to(folder.resolve()) else None
            dataset = included.get("dataset_path") if included is not None else None
        if isinstance(dataset, str):
            named.add(dataset)
    found = []
    offline = {**os.environ, "HF_HUB_OFFLINE": "1"}
    for value in sorted(named)[:MAX_DATASETS]:
        ref = hub.hub_ref(value, workspace, "dataset")
        if ref is None:  # a builder (json, parquet) or a workspace folder
            continue
        try:
            found.append(hub.resolve(ref, environ=offline))
        except (NotFound, BadInput):
            continue
    return found


def _task_configs(folder: Path) -> list[tuple[dict[str, Any], Path]]:
    if not folder.is_dir() or folder.is_symlink():
        return []
    paths = sorted(p for p in folder.rglob("*.yaml") if not p.is_symlink())[:MAX_TASK_FILES]
    return [(config, path) for path in paths if (config := _read(path)) is not None]


def _read(path: Path) -> dict[str, Any] | None:
    """A task YAML as a mapping; None for one that is not a small regular file of YAML."""
    try:
        if path.is_symlink() or not path.is_file() or path.stat().st_size > MAX_TASK_FILE_BYTES:
            return None
        config = yaml.load(path.read_text(), Loader=_TaskLoader)  # noqa: S506 — a SafeLoader
    except (OSError, ValueError, yaml.YAMLError):
        return None
    return config if isinstance(config, dict) else None
