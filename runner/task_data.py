"""The Hub data sets that the lm-eval tasks of ``evaluate(tasks=[...])`` name, found in the
server's Hugging Face cache.

A task is one of the workspace's ``eval_tasks/`` folder, else one lm-eval ships (its YAMLs in the
installed ``lm_eval`` package, read here as text: the server does not import lm_eval); a group's
tasks and a tag's count as named. A YAML names its data by Hub id (``dataset_path: org/name``, in
the YAML or in the one it ``include``\\ s). The model process is offline, so the server looks the
data set up in its own cache (never on the network) and shows the model process that data set's
repo folder read-only — that one, never the whole cache, and no token;
:func:`engine.benchmarks.hub_datasets_from_snapshots` reads its snapshot for the id. A data set
the cache does not hold is refused before anything starts, naming the task, the data set and how
to download it on the server.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

import yaml

from engine import run_dir as rd
from engine.benchmarks import TASKS_DIRNAME
from engine.errors import BadInput, NotFound
from engine.run_files import read_bounded
from runner import hub

MAX_TASK_FILES = 500
MAX_TASK_FILE_BYTES = 1 << 20
MAX_DATASETS = 8


class _TaskLoader(yaml.SafeLoader):
    """lm-eval's YAML, with its tags (``!function utils.process_docs``) read as nothing."""


_TaskLoader.add_multi_constructor("!", lambda loader, suffix, node: None)


def task_datasets(workspace: Path, tasks: list[str]) -> list[rd.HubModel]:
    """The snapshots in the server's cache of the Hub data sets that ``tasks`` name (at most
    :data:`MAX_DATASETS`): the workspace's YAMLs for the tasks they define, lm-eval's own for the
    rest. A data set the cache lacks is refused (:class:`~engine.errors.BadInput`)."""
    named: dict[str, str] = {}  # data set -> the task that names it
    wanted = set(tasks)
    # The workspace's YAMLs are capped (anyone's files); lm-eval's are the installed package's.
    for folder, most in ((Path(workspace) / TASKS_DIRNAME, MAX_TASK_FILES), (lm_eval_tasks_dir(), None)):
        for _ in range(2):  # the tasks asked for, then a group's tasks
            if not wanted or folder is None:
                break
            defined, members = _scan(folder, _task_files(folder, most), wanted, named)
            wanted = (wanted | members) - defined
            if not members:
                break
    refs = [(dataset, task, ref) for dataset, task in sorted(named.items())
            if (ref := hub.hub_ref(dataset, workspace, "dataset")) is not None]  # not a builder or a workspace folder
    if len(refs) > MAX_DATASETS:
        shown = ", ".join(dataset[:100] for dataset, _, _ in refs[:2 * MAX_DATASETS])
        raise BadInput(f"the lm-eval tasks asked for read {len(refs)} Hub data sets ({shown}"
                       f"{', …' if len(refs) > 2 * MAX_DATASETS else ''}); an evaluation is shown at most "
                       f"{MAX_DATASETS}: evaluate fewer tasks at once")
    found = []
    offline = {**os.environ, "HF_HUB_OFFLINE": "1"}
    for dataset, task, ref in refs:
        try:
            found.append(hub.resolve(ref, environ=offline))
        except (NotFound, BadInput):
            raise BadInput(f"lm-eval task {task!r} reads the Hub data set {dataset!r}, which is not in the server's "
                           "Hugging Face cache (the model process is offline); download it on the server: "
                           f"huggingface-cli download --repo-type dataset {dataset}") from None
    return found


def lm_eval_tasks_dir() -> Path | None:
    """The task folder of the installed ``lm_eval`` package, found without importing it; None
    when it is not installed."""
    spec = importlib.util.find_spec("lm_eval")
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    folder = Path(locations[0]) / "tasks" if locations else None
    return folder if folder is not None and folder.is_dir() else None


def _scan(folder: Path, files: list[Path], wanted: set[str], named: dict[str, str]) -> tuple[set[str], set[str]]:
    """The names of ``wanted`` that the YAML ``files`` of ``folder`` define (a task, a tag or a group) and the
    tasks of the groups among them; each data set they name goes into ``named``. A file is
    parsed only when its text holds a wanted name (lm-eval ships ~14,000 YAMLs)."""
    defined: set[str] = set()
    members: set[str] = set()
    for path in files:
        text = _text(path)
        if text is None or not any(name in text for name in wanted):
            continue
        config = _parse(text)
        if config is None:
            continue
        group = config.get("group")
        if isinstance(group, str) and group in wanted:
            defined.add(group)
            members |= _names(config.get("task"))
            continue
        hit = wanted & (_names(config.get("task")) | _names(config.get("tag")))
        if not hit:
            continue
        defined |= hit
        dataset = config.get("dataset_path")
        if dataset is None and isinstance(config.get("include"), str):
            # Read only inside the tasks folder: ``..``, an absolute path or a link leads out of it.
            try:
                include = (path.parent / config["include"]).resolve()
            except (OSError, RuntimeError, ValueError):  # RuntimeError: a link loop; ValueError: a NUL
                include = None
            included = _read(include) if include is not None and include.is_relative_to(folder.resolve()) else None
            dataset = included.get("dataset_path") if included is not None else None
        if isinstance(dataset, str):
            named.setdefault(dataset, min(hit))
    return defined, members


def _names(value: Any) -> set[str]:
    """A YAML's ``task``/``tag`` value as names (a group's list may hold inline task mappings)."""
    return {n for n in (value if isinstance(value, list) else [value]) if isinstance(n, str)}


def _task_files(folder: Path, most: int | None) -> list[Path]:
    if not folder.is_dir() or folder.is_symlink():
        return []
    return sorted(p for p in folder.rglob("*.yaml") if not p.is_symlink())[:most]


def _text(path: Path) -> str | None:
    """A small regular file's text; None for anything else. What is read is what was checked:
    opened following no link and without waiting on a FIFO, then checked by its descriptor."""
    try:
        return read_bounded(path, MAX_TASK_FILE_BYTES, path.name).decode()
    except (OSError, ValueError):
        return None


def _parse(text: str) -> dict[str, Any] | None:
    try:
        config = yaml.load(text, Loader=_TaskLoader)  # noqa: S506 — a SafeLoader
    except (ValueError, RecursionError, yaml.YAMLError):  # RecursionError: nested past what the parser takes
        return None
    return config if isinstance(config, dict) else None


def _read(path: Path) -> dict[str, Any] | None:
    """A task YAML as a mapping; None for one that is not a small regular file of YAML."""
    text = _text(path)
    return _parse(text) if text is not None else None
