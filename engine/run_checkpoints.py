"""A run's checkpoints: how they are named, which are complete, and the one chooser every
resume, export, sample and evaluate goes through.

``checkpoints/step-<NNNNNNNN>/`` is published under that exact name only once it is complete
(saves in progress are ``.partial-step-<NNNNNNNN>/``, removals ``.trash-...``); an engine
checkpoint is complete when its manifest (:mod:`engine.checkpoint_manifest`) verifies. A script
run's checkpoints are what its script saved, found by the step number in their names. Torch-free.
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

from engine import checkpoint_manifest as manifest
from engine.errors import BadInput, NotFound
from engine.run_dir import CHECKPOINTS_DIRNAME, SCRIPT, RunKind
from engine.run_files import NO_FOLLOW

# A checkpoint directory is published under this exact name only once it is complete.
_CHECKPOINT_NAME = re.compile(r"^step-(\d{8})$")
PARTIAL_PREFIX = ".partial-"
TRASH_PREFIX = ".trash-"
# DCP writes its metadata file last, after every rank's data is on disk.
DCP_METADATA = ".metadata"


def checkpoint_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def checkpoint_step(path: Path) -> int | None:
    """The step of a published checkpoint directory, or None when the name is not one."""
    match = _CHECKPOINT_NAME.fullmatch(path.name)
    return int(match.group(1)) if match else None


def list_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints of a run, oldest first: published (:func:`published_checkpoints`),
    and every file of each there at the size its manifest says (:mod:`engine.checkpoint_manifest`)."""
    return [(step, path) for step, path in published_checkpoints(run_dir) if manifest.problem(path, full=False) is None]


def unusable_checkpoints(run_dir: Path) -> list[tuple[int, str]]:
    """The published checkpoints that are not complete, with what is wrong with each."""
    found = ((step, manifest.problem(path, full=False)) for step, path in published_checkpoints(run_dir))
    return [(step, why) for step, why in found if why is not None]


def published_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """Checkpoints published under their final name with DCP's metadata in them, oldest first.

    A save that was interrupted lives under a ``.partial-`` name and is never listed.
    Nothing is followed through a link: run code writes this folder, and a link (the folder,
    a ``step-`` entry, or its ``.metadata``) could lead a resume (whose sandbox binds the
    checkpoint by path) to another run's files, or make the listing say whether a host path
    exists.
    """
    root = Path(run_dir) / CHECKPOINTS_DIRNAME
    try:
        root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | NO_FOLLOW)
    except OSError:  # missing, a link, not a folder
        return []
    found = []
    try:
        for name in os.listdir(root_fd):
            step = checkpoint_step(Path(name))
            if step is None:
                continue
            try:
                entry_fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | NO_FOLLOW, dir_fd=root_fd)
            except OSError:
                continue
            try:
                metadata = os.stat(DCP_METADATA, dir_fd=entry_fd, follow_symlinks=False)
            except OSError:
                continue
            finally:
                os.close(entry_fd)
            if stat.S_ISREG(metadata.st_mode):
                found.append((step, root / name))
    finally:
        os.close(root_fd)
    return sorted(found)


_SCRIPT_CHECKPOINT_STEP = re.compile(r"(\d{1,12})(?!.*\d)")


def list_script_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """The checkpoints a script run wrote in its own format, oldest first: each file or folder
    directly under ``checkpoints/`` whose name holds a number, the last number being its step
    (``step-200/``, ``ckpt_100.pt``, ``epoch3.pt``). Hidden names (a save in progress, by the
    usual ``.tmp`` habit) and links are not checkpoints, and nothing is followed through a link
    (the same reasons as :func:`list_checkpoints`); at one step the last name in order wins."""
    root = Path(run_dir) / CHECKPOINTS_DIRNAME
    try:
        root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | NO_FOLLOW)
    except OSError:
        return []
    found: dict[int, Path] = {}
    try:
        for name in sorted(os.listdir(root_fd)):
            match = _SCRIPT_CHECKPOINT_STEP.search(name)
            if name.startswith(".") or match is None:
                continue
            try:
                info = os.stat(name, dir_fd=root_fd, follow_symlinks=False)
            except OSError:
                continue
            if stat.S_ISREG(info.st_mode) or stat.S_ISDIR(info.st_mode):
                found[int(match.group(1))] = root / name
    finally:
        os.close(root_fd)
    return sorted(found.items())


HF_MODEL_CONFIG, HF_ADAPTER_CONFIG = "config.json", "adapter_config.json"


def is_model_folder(folder: Path) -> bool:
    """Whether a script's checkpoint is a Hugging Face model folder (``save_pretrained``'s, as
    TRL and the Trainer write ``checkpoint-N/``) or a peft adapter folder, which export, sample
    and evaluate load with transformers."""
    folder = Path(folder)
    return folder.is_dir() and ((folder / HF_MODEL_CONFIG).is_file() or (folder / HF_ADAPTER_CONFIG).is_file())


def run_checkpoints(run_dir: Path, kind: RunKind) -> list[tuple[int, Path]]:
    """A run's checkpoints as its kind defines them: the engine's complete ``step-<N>`` folders,
    or a script's own files (:func:`list_script_checkpoints`)."""
    return list_script_checkpoints(run_dir) if kind == SCRIPT else list_checkpoints(run_dir)


def latest_checkpoint(run_dir: Path) -> tuple[int, Path] | None:
    checkpoints = list_checkpoints(run_dir)
    return checkpoints[-1] if checkpoints else None


def corrupt_checkpoint_message(run_dir: Path, step: int, why: str, full: bool = False) -> str:
    """Why the checkpoint at ``step`` cannot be used, and the latest earlier one that can (its
    files checked by size; with ``full``, by digest too)."""
    earlier = [(s, path) for s, path in list_checkpoints(run_dir) if s < step]
    good = next((s for s, path in reversed(earlier) if not full or manifest.problem(path, full=True) is None), None)
    run_id = Path(run_dir).name
    then = (f"the latest good checkpoint before it is step {good} (resume_checkpoint(run_id={run_id!r}, step={good}))"
            if good is not None else "there is no good checkpoint before it")
    return f"checkpoint {checkpoint_dir_name(step)} of run {run_id} is corrupt: {why}; {then}"


def choose_checkpoint(run_dir: Path, kind: RunKind, step: object, verified: bool = False) -> tuple[int, Path]:
    """The checkpoint of the run at ``step`` (None: the latest complete one), as its kind defines
    them; a step whose checkpoint is not complete is refused with what is wrong and which
    earlier one is good. ``verified``: an engine checkpoint's digests are checked too (every
    byte read), before a run or a model is built on it."""
    chosen = _choose_checkpoint(run_dir, kind, step)
    if verified and kind != SCRIPT:
        why = manifest.problem(chosen[1], full=True)
        if why is not None:
            raise BadInput(corrupt_checkpoint_message(run_dir, chosen[0], why, full=True))
    return chosen


def _choose_checkpoint(run_dir: Path, kind: RunKind, step: object) -> tuple[int, Path]:
    run_id = Path(run_dir).name
    checkpoints = run_checkpoints(run_dir, kind)
    if step is not None and (isinstance(step, bool) or not isinstance(step, int)):
        raise BadInput(f"step must be an integer, got {step!r}")
    by_step = dict(checkpoints)
    if step is None and checkpoints:
        return checkpoints[-1]
    if step in by_step:
        return step, by_step[step]
    unusable = dict(unusable_checkpoints(run_dir)) if kind != SCRIPT else {}
    if step in unusable:
        raise BadInput(corrupt_checkpoint_message(run_dir, step, unusable[step]))
    if not checkpoints:
        broken = (f" ({len(unusable)} not complete: {corrupt_checkpoint_message(run_dir, max(unusable), unusable[max(unusable)])})"
                  if unusable else "")
        raise NotFound(f"run {run_id} has no complete checkpoint{broken}; list_checkpoints shows them as they come")
    raise NotFound(f"run {run_id} has no complete checkpoint at step {step}; "
                   f"available steps: {', '.join(str(s) for s, _ in checkpoints[-20:])}")
