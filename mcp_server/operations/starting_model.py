"""A recipe launch that starts from an earlier run's checkpoint: ``model.pretrained_path:
run:RUN_ID@STEP`` (or ``run:RUN_ID``, its latest complete checkpoint), in an override or in the
recipe's ``config.yaml``.

The reference is :data:`runner.scripts.CHECKPOINT_REFERENCE`, the one a script's ``args`` take,
resolved the same way: the run from the server's records, its checkpoint among those listed
complete (an engine checkpoint's digests verified), never a path a run wrote. A template loads
``model.pretrained_path`` as a Hugging Face folder, so the checkpoint is exported once as one —
what ``export_checkpoint`` writes (the run's recipe in the sandbox, LoRA merged; a script run's
Hugging Face folder or peft adapter loaded as ``sample`` loads it) — into
``.trainwright/start-models/<run>-step-<N>/``, which no run can write, and later launches from the
same checkpoint reuse it. The launch gets that folder as its ``model.pretrained_path``; its
launch check and its sandbox show it read-only (the run's ``started_from``, bound as a script's
``run:`` checkpoint is: :meth:`runner.supervise.Supervisor.bound_checkpoint`). The run trains from
step 1 with a new optimizer: its steps are its own, not a continuation of the earlier run's
(``resume_checkpoint`` continues a run).

An export is kept while a run still in ``runs/`` started from it (that run's own checkpoints are
rebuilt from it by ``sample``, ``evaluate``, ``export_checkpoint`` and ``resume_checkpoint``). One
that no run names — its launch was refused after the export, or its runs were deleted — is
removed by the next launch that exports one and by ``trainwright data-cache``, once it is older
than :data:`START_MODEL_GRACE_S` (until then a launch may be about to name it; a launch that
reuses one makes it new again, under the folder's lock that pruning and removal take);
``trainwright data-cache`` lists them all with their sizes and the runs that use them
(:func:`start_models`), and removes one by name when no run uses it (:func:`remove_start_models`).

A checkpoint of another kind of model than the recipe loads is refused before anything is
exported (:func:`check_family`): a template's family is its engine class in ``recipe.py``
(:data:`FAMILIES`), a script checkpoint's the architecture its ``config.json`` names.
"""

from __future__ import annotations

import ast
import contextlib
import fcntl
import json
import os
import secrets
import stat
import time
from pathlib import Path
from typing import Any

from engine import run_checkpoints
from engine import run_dir as rd
from engine.config import MAX_PRETRAINED_CONFIG_BYTES
from engine.errors import BadInput, NotFound
from engine.run_files import open_beneath, read_open_bounded
from engine.written_trees import remove_tree
from mcp_server import limits
from mcp_server.operations.model_tools import EXPORT_TIMEOUT_S, check_written, checkpoint_of
from runner import hub, scripts
from runner import server_record as sr
from runner.model_process import run_model_io
from workspace.workspace import STATE_DIRNAME, Workspace, open_real_dir

START_MODELS_DIRNAME = "start-models"
_TEXT = "a causal language model (AutoModelForCausalLM)"
_VISION = "a vision-language model (AutoModelForImageTextToText)"
FAMILIES = {  # a template's engine class -> (the template, the model it loads as model.pretrained_path)
    "CausalLM": ("causal_lm", _TEXT), "SFT": ("sft", _TEXT), "DPO": ("dpo", _TEXT), "GRPO": ("grpo", _TEXT),
    "VLM": ("vlm", "the vlm template's own vision-language model (an exported vlm run)"),
    "VLMChat": ("vlm_chat", _VISION),
}
_STAGING_PREFIX = ".partial-"
START_MODEL_GRACE_S = 3600  # an export no run names yet is kept this long: a launch may be about to name it


def start_models_dir(workspace: Path | str) -> Path:
    """``<workspace>/.trainwright/start-models``: the checkpoints launches start from, exported."""
    return Path(workspace) / STATE_DIRNAME / START_MODELS_DIRNAME


def starting_model(ws: Workspace, code_dir: Path, overrides: dict[str, Any], progress: hub.Progress | None = None,
                   local: bool = True) -> tuple[dict[str, Any], rd.ResumedFrom | None]:
    """The launch's ``overrides`` with the earlier run's checkpoint that ``model.pretrained_path``
    names (in them, or in ``code_dir``'s ``config.yaml``) replaced by its exported folder, and that
    checkpoint as the run's ``started_from``; ``overrides`` as given and None when it names none.
    ``local=False`` (a SLURM job, whose nodes' sandboxes are not this machine's): refused."""
    value = hub.recipe_config(code_dir, overrides)
    reference = scripts.checkpoint_reference([value]) if isinstance(value, str) else None
    if reference is None:
        return overrides, None
    if reference.option:
        raise BadInput(f"{hub.MODEL_KEY} {value[:120]!r}: name an earlier run's checkpoint as run:RUN_ID or "
                       "run:RUN_ID@STEP, alone")
    if not local:
        raise BadInput(f"{hub.MODEL_KEY} {value[:120]!r}: a SLURM job's nodes are not shown an earlier run's "
                       "checkpoint; export_checkpoint it to a workspace folder and name that folder")
    run_dir, step = checkpoint_of(ws, reference.run_id, reference.step)
    check_family(ws, code_dir, run_dir, step)
    folder = exported_checkpoint(ws, run_dir, step, progress)
    started = rd.ResumedFrom(run_id=run_dir.name, step=step, path=str(folder))
    return {**overrides, hub.MODEL_KEY: str(folder)}, started


def check_family(ws: Workspace, code_dir: Path, run_dir: Path, step: int) -> None:
    """Refuse a checkpoint whose model is not the kind the recipe in ``code_dir`` loads, naming
    the run, its template (or a script's architecture) and what the recipe expects. Either side
    unknown (a renamed engine class, a peft adapter): left to the launch check."""
    expected = FAMILIES.get(_engine_class(code_dir / "recipe.py") or "")
    if expected is None:
        return
    record = rd.read_run(run_dir)
    if record.kind == rd.SCRIPT:
        _, path = run_checkpoints.choose_checkpoint(run_dir, rd.SCRIPT, step)
        architecture, family = _script_family(run_dir, path)
        source = f"a script run whose checkpoint {path.name[:100]} is a {architecture}"
    else:
        template, family = FAMILIES.get(_engine_class(run_dir / rd.SNAPSHOT_DIRNAME / "recipe.py") or "", (None, None))
        source = f"a run of the {template} template"
    if family is None or family == expected[1]:
        return
    try:
        recipe = ws.label(code_dir)
    except ValueError:  # the code of a commit, checked out outside the workspace
        recipe = code_dir.name
    raise BadInput(f"{hub.MODEL_KEY} run:{run_dir.name}: run {run_dir.name} is {source} ({family}); the recipe "
                   f"{recipe} ({expected[0]} template) loads {expected[1]}: start from a run of that kind; "
                   "nothing was started")


def _engine_class(recipe: Path) -> str | None:
    """The name of ``recipe``'s class that derives from ``Engine`` (or from a template's engine)."""
    try:
        tree = ast.parse(recipe.read_bytes()) if recipe.is_file() and not recipe.is_symlink() else None
    except (OSError, SyntaxError, ValueError):
        return None
    for node in tree.body if tree is not None else ():
        bases = {base.id for base in getattr(node, "bases", ()) if isinstance(base, ast.Name)}
        if isinstance(node, ast.ClassDef) and bases & ({"Engine"} | set(FAMILIES)):
            return node.name if node.name in FAMILIES else next(iter(bases & set(FAMILIES)), None)
    return None


def _script_family(run_dir: Path, folder: Path) -> tuple[str | None, str | None]:
    """The architecture a script checkpoint's ``config.json`` names and its family (None: a peft
    adapter, or an architecture neither family holds)."""
    from transformers.models.auto.modeling_auto import (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
                                                        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)
    # The run wrote it: opened a name at a time from the run's folder following no link, without
    # waiting on a FIFO, and read bounded.
    try:
        fd = open_beneath(run_dir, (folder / run_checkpoints.HF_MODEL_CONFIG).relative_to(run_dir))
        if fd is None:
            return None, None
        config = json.loads(read_open_bounded(fd, MAX_PRETRAINED_CONFIG_BYTES, run_checkpoints.HF_MODEL_CONFIG))
        architecture = config["architectures"][0]
    except (OSError, ValueError, KeyError, IndexError, TypeError, RecursionError):  # "[" * 100_000: RecursionError
        return None, None
    if not isinstance(architecture, str):
        return None, None
    if architecture in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES.values():
        return architecture, _VISION
    return architecture, _TEXT if architecture in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values() else None


def exported_checkpoint(ws: Workspace, run_dir: Path, step: int, progress: hub.Progress | None = None) -> Path:
    """The folder of run ``run_dir``'s checkpoint ``step`` exported as a Hugging Face model (LoRA
    merged), made now unless an earlier launch made it: staged beside it, renamed into place
    when complete, so a folder under its final name is whole."""
    root = start_models_dir(ws.root)
    name = f"{run_dir.name}-step-{step}"
    os.close(open_real_dir(root.parent, create=True))
    prune_start_models(ws, keep=name)
    root_fd = open_real_dir(root, create=True)
    try:
        with _holding(root_fd):  # found and made new at once: a prune meanwhile sees it used now
            if _is_folder(root_fd, name):
                os.utime(name, dir_fd=root_fd, follow_symlinks=False)
                return root / name
        staging = f"{_STAGING_PREFIX}{name}-{secrets.token_hex(4)}"
        os.mkdir(staging, dir_fd=root_fd)
        try:
            if progress is not None:
                progress(0, 1, f"exporting run {run_dir.name}'s checkpoint at step {step} to start from")
            run_model_io(ws.root, run_dir, "export", step,
                         ["--to", str(root / staging), "--lora", "merged", "--final-dir", str(root / name)],
                         ws.run_limits(), EXPORT_TIMEOUT_S, writable=[root / staging])
            check_written(root_fd, staging, ws.run_limits().max_export_bytes)
            with contextlib.suppress(OSError):  # another launch exported it meanwhile: theirs is kept
                os.rename(staging, name, src_dir_fd=root_fd, dst_dir_fd=root_fd)
            if not _is_folder(root_fd, name):
                raise BadInput(f"the export of run {run_dir.name}'s checkpoint at step {step} could not be kept in "
                               f"{STATE_DIRNAME}/{START_MODELS_DIRNAME}/; nothing was started")
            if progress is not None:
                progress(1, 1, f"exported run {run_dir.name}'s checkpoint at step {step}")
        finally:
            with contextlib.suppress(OSError):
                remove_tree(root_fd, staging)
        return root / name
    finally:
        os.close(root_fd)


def start_models(ws: Workspace) -> list[tuple[str, int, list[str]]]:
    """``(name, bytes, runs started from it)`` of every export in :func:`start_models_dir` (a
    staging folder a crashed export left included, no run using it)."""
    root = start_models_dir(ws.root)
    if not root.is_dir() or root.is_symlink():
        return []
    real = root.resolve()
    users: dict[str, list[str]] = {}
    for run_id in ws.run_ids():
        try:
            started = sr.read_record(ws.record_dir(run_id)).started_from
        except (OSError, ValueError):
            continue
        if started is not None and Path(started.path).resolve().parent == real:
            users.setdefault(Path(started.path).name, []).append(run_id)
    return [(folder.name, _folder_bytes(folder), users.get(folder.name, []))
            for folder in sorted(root.iterdir()) if folder.is_dir() and not folder.is_symlink()]


def prune_start_models(ws: Workspace, keep: str | None = None) -> list[tuple[str, int]]:
    """Remove the exports no run uses that are older than :data:`START_MODEL_GRACE_S` (all but
    ``keep``); returns what was removed."""
    root = start_models_dir(ws.root)
    with _locked(root) as root_fd:
        stale = [(name, size) for name, size, users in start_models(ws) if not users and name != keep
                 and time.time() - os.stat(name, dir_fd=root_fd, follow_symlinks=False).st_mtime > START_MODEL_GRACE_S]
        for name, _ in stale:
            with contextlib.suppress(OSError):
                remove_tree(root_fd, name)
    return stale


def chosen_start_models(ws: Workspace, names: list[str]) -> list[tuple[str, int]]:
    """``(name, bytes)`` of the exports ``names`` (``all``: every one no run uses), checked: one
    that is not there, or that a run still in the workspace started from, is refused."""
    there = {name: (size, users) for name, size, users in start_models(ws)}
    chosen = [name for name, (_, users) in there.items() if not users] if names == ["all"] else names
    for name in chosen:
        if name not in there:
            raise NotFound(f"no export {name[:120]!r} in {STATE_DIRNAME}/{START_MODELS_DIRNAME}/; there: "
                           f"{', '.join(there)[:300] or 'none'}")
        if there[name][1]:
            raise BadInput(f"{STATE_DIRNAME}/{START_MODELS_DIRNAME}/{name} is what run(s) "
                           f"{', '.join(there[name][1][:5])} started from (their checkpoints are rebuilt from it): "
                           "it is kept while they are in runs/; nothing was removed")
    return [(name, there[name][0]) for name in chosen]


def remove_start_models(ws: Workspace, names: list[str]) -> list[tuple[str, int]]:
    """Remove the exports ``names`` (as :func:`chosen_start_models` checks them: all or none)."""
    with _locked(start_models_dir(ws.root)) as root_fd:
        chosen = chosen_start_models(ws, names)
        for name, _ in chosen:
            remove_tree(root_fd, name)
    return chosen


@contextlib.contextmanager
def _holding(root_fd: int):
    """The exports' folder locked (a flock on it): a launch's reuse of an export, a prune and a
    removal are one at a time, so none removes an export another launch has just chosen."""
    fcntl.flock(root_fd, fcntl.LOCK_EX)
    try:
        yield
    finally:
        fcntl.flock(root_fd, fcntl.LOCK_UN)


@contextlib.contextmanager
def _locked(root: Path):
    """:func:`_holding` the folder ``root`` (a descriptor of it, or -1 when there is none: nothing to remove)."""
    try:
        root_fd = open_real_dir(root)
    except (OSError, BadInput):
        yield -1
        return
    try:
        with _holding(root_fd):
            yield root_fd
    finally:
        os.close(root_fd)


def _folder_bytes(folder: Path) -> int:
    """The bytes of the regular files under ``folder`` (links not followed), walked without
    recursion: recipe code wrote an export, nested as deep as it liked. A folder an export left
    half-written (a server killed midway) may hold any number of files: the first
    :data:`~mcp_server.limits.MAX_EXPORT_ENTRIES` are counted, no more."""
    total, folders, left = 0, [str(folder)], limits.MAX_EXPORT_ENTRIES
    while folders and left > 0:
        with contextlib.suppress(OSError), os.scandir(folders.pop()) as entries:  # OSError: a path past PATH_MAX
            for entry in entries:
                left -= 1
                if left < 0:
                    break
                with contextlib.suppress(OSError):
                    if entry.is_dir(follow_symlinks=False):
                        folders.append(entry.path)
                    elif entry.is_file(follow_symlinks=False):
                        total += entry.stat(follow_symlinks=False).st_size
    return total


def _is_folder(dir_fd: int, name: str) -> bool:
    """Whether ``name`` in the folder ``dir_fd`` is a folder (not a link to one)."""
    try:
        return stat.S_ISDIR(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except FileNotFoundError:
        return False
