"""Checkpoints with ``torch.distributed.checkpoint`` (DCP), published atomically.

A save writes every rank's shards into ``checkpoints/.partial-step-<N>/``; when all ranks are
done (DCP writes its ``.metadata`` last), rank 0 renames the folder to ``step-<N>``. A rename is
atomic, so a checkpoint is either complete under its final name or not there at all: a run
killed mid-save leaves only a ``.partial-`` folder, which is never loaded. Old checkpoints are
renamed to ``.trash-`` before they are deleted, for the same reason.

What is saved is a dict of ``Stateful`` objects, so this module does not need to know what
they are: model and optimizer (:class:`ModelOptimizerState`), scheduler, train state, data
position and the RNG state of every rank (:class:`RNGState`). DCP reshards on load, so a
checkpoint written by N processes loads into M.

A save that fails (no space left, no permission) raises :class:`CheckpointSaveError` with one
line that names the cause; the partial folder is removed and the previous checkpoint is left
as it was, so the run fails with a clear reason and can be resumed from that one.
"""

from __future__ import annotations

import os
import random
import shutil
import warnings
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful

from engine import checkpoint_manifest as manifest
from engine import run_dir as rd
from engine import run_checkpoints
from engine.errors import MAX_QUOTED_CHARS, BadInput


# Wrappers' names that the state dict's keys leave out (activation checkpointing, torch.compile).
WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.")


def quantized_weight_names(model: torch.nn.Module) -> set[str]:
    """The names of the model's quantised weights, without wrappers' prefixes: bitsandbytes'
    4-bit parameters, which carry their ``quant_state`` as the ``qlora`` skill writes them, and
    the packed weight of a 4-bit layer prepared for FSDP2, whose layer holds the state
    (``engine.fsdp_quantized``)."""
    names = set()
    for module_name, module in model.named_modules():
        for name, parameter in module.named_parameters(recurse=False):
            prepared = name == "weight" and getattr(module, "quant_state", None) is not None
            if prepared or getattr(parameter, "quant_state", None) is not None:
                full = f"{module_name}.{name}" if module_name else name
                for prefix in WRAPPER_PREFIXES:
                    full = full.replace(prefix, "")
                names.add(full)
    return names


def holds_quantized_weights(model: torch.nn.Module) -> bool:
    """Whether some of the model's parameters are quantised (:func:`quantized_weight_names`)."""
    return bool(quantized_weight_names(model))


def model_state_options(model: torch.nn.Module) -> StateDictOptions:
    """How a model's checkpoint state is read and written. A model with quantised weights keeps
    only its trainable parameters (the adapters): its frozen base is rebuilt by the recipe from
    the same weights and seed before a load, and the quantised layers' packed bytes and scales
    are no state a load could put back."""
    if holds_quantized_weights(model):
        return StateDictOptions(ignore_frozen_params=True, strict=False)
    return StateDictOptions()


def without_quantization_state(model: torch.nn.Module, state: dict[str, Any]) -> dict[str, Any]:
    """``state`` less what bitsandbytes adds under each quantised weight's name
    (``<weight>.absmax``, ``<weight>.quant_map``, ``<weight>.quant_state.*``)."""
    quantized = quantized_weight_names(model)
    return {
        key: value for key, value in state.items()
        if not any(".".join(key.split(".")[:i]) in quantized for i in range(1, key.count(".") + 1))
    }


class ModelOptimizerState(Stateful):
    """Model and optimizer state as DCP wants it: sharded tensors with fully qualified names
    (the trainable ones only, for a model with quantised weights: :func:`model_state_options`)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer):
        self.model = model
        self.optimizer = optimizer
        self.options = model_state_options(model)

    def state_dict(self) -> dict[str, Any]:
        model_state, optim_state = get_state_dict(self.model, self.optimizer, options=self.options)
        if self.options.ignore_frozen_params:
            model_state = without_quantization_state(self.model, model_state)
        return {"model": model_state, "optim": optim_state}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state_dict["model"],
            optim_state_dict=state_dict["optim"],
            options=self.options,
        )


class SchedulerState(Stateful):
    """An LR scheduler's state without its lambdas (they are code, rebuilt by the recipe)."""

    def __init__(self, scheduler: torch.optim.lr_scheduler.LRScheduler):
        self.scheduler = scheduler

    def state_dict(self) -> dict[str, Any]:
        state = self.scheduler.state_dict()
        state.pop("lr_lambdas", None)
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state = dict(self.scheduler.state_dict())
        state.update(state_dict)
        self.scheduler.load_state_dict(state)


class RNGState(Stateful):
    """The RNG state of every rank (torch CPU and CUDA, Python's ``random``).

    Each rank's state is gathered so that the saved object is the same on every rank. On load
    with the same world size each rank gets its own state back; with another world size (a
    resharded resume) the ranks are reseeded from the seed and the step, with a warning.
    """

    def __init__(self, seed: int, step_fn):
        self.seed = seed
        self.step_fn = step_fn

    @staticmethod
    def _local() -> dict[str, Any]:
        state = {"torch": torch.get_rng_state(), "python": random.getstate()}
        if torch.cuda.is_available():
            state["cuda"] = torch.cuda.get_rng_state()
        return state

    def state_dict(self) -> dict[str, Any]:
        local = self._local()
        if dist.is_initialized() and dist.get_world_size() > 1:
            gathered: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, local)
        else:
            gathered = [local]
        return {"per_rank": gathered}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        per_rank = state_dict["per_rank"]
        rank = dist.get_rank() if dist.is_initialized() else 0
        world = dist.get_world_size() if dist.is_initialized() else 1
        if len(per_rank) == world:
            state = per_rank[rank]
            torch.set_rng_state(state["torch"])
            random.setstate(state["python"])
            if "cuda" in state and torch.cuda.is_available():
                torch.cuda.set_rng_state(state["cuda"])
        else:
            seed = self.seed + 1_000_003 * self.step_fn() + rank
            torch.manual_seed(seed)
            random.seed(seed)
            if rank == 0:
                warnings.warn(
                    f"checkpoint has RNG states for {len(per_rank)} ranks, this run has {world}: "
                    "ranks were reseeded from (seed, step, rank)",
                    stacklevel=2,
                )


class CheckpointSaveError(RuntimeError):
    """A checkpoint could not be written; the previous complete checkpoint is untouched."""


def root_cause(error: BaseException) -> BaseException:
    """The error behind DCP's wrapper (it gathers each rank's exception and traceback)."""
    seen = set()
    while id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, CheckpointException) and error.failures:
            error = next(iter(error.failures.values()))[0]
        elif isinstance(error, OSError) or error.__cause__ is None:
            return error
        else:
            error = error.__cause__
    return error


def _describe_save_failure(step: int, error: BaseException, previous: int | None, free: int | None) -> str:
    """One line for run.json: what failed, in words a user acts on, and what is left."""
    cause = root_cause(error)
    if isinstance(cause, OSError) and cause.errno is not None:
        what = f"{cause.strerror or os.strerror(cause.errno)} (errno {cause.errno})"
    else:
        what = f"{type(cause).__name__}: {cause}".splitlines()[0]
        if free is not None and free < rd.LOW_SPACE_BYTES:
            # torch's zip writer reports a full disk as a position mismatch, not as ENOSPC.
            what = f"No space left on device ({free:,} bytes free where checkpoints are written; {what})"
    kept = (
        f"the previous checkpoint, step {previous}, is untouched and can be resumed"
        if previous is not None else "there is no earlier checkpoint"
    )
    return f"could not write the checkpoint of step {step}: {what[:MAX_QUOTED_CHARS]}; {kept}"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Checkpointer:
    def __init__(self, checkpoints_dir: Path, keep_last: int, is_main: bool):
        self.root = Path(checkpoints_dir)
        self.keep_last = keep_last
        self.is_main = is_main

    def save(self, step: int, states: dict[str, Any]) -> Path:
        final = self.root / run_checkpoints.checkpoint_dir_name(step)
        partial = self.root / (run_checkpoints.PARTIAL_PREFIX + final.name)
        if self.is_main:
            self.root.mkdir(parents=True, exist_ok=True)
            if partial.exists():  # left by an earlier attempt that was interrupted
                shutil.rmtree(partial)
        _barrier()
        try:
            dcp.save(states, checkpoint_id=str(partial))
            _barrier()
            if self.is_main:
                manifest.write_manifest(partial)  # last: what verifies the files above
                if final.exists():  # a re-save of the same step: replace it safely
                    self._trash(final)
                os.rename(partial, final)
                _fsync_dir(self.root)
                self._prune()
        except BaseException as e:
            free = rd.free_bytes(self.root)  # before the partial folder is removed
            if self.is_main:
                shutil.rmtree(partial, ignore_errors=True)
            if isinstance(e, (KeyboardInterrupt, SystemExit)):
                raise
            previous = run_checkpoints.latest_checkpoint(self.root.parent)
            raise CheckpointSaveError(
                _describe_save_failure(step, e, previous[0] if previous else None, free)
            ) from e
        _barrier()
        return final

    def _trash(self, path: Path) -> None:
        trash = path.with_name(run_checkpoints.TRASH_PREFIX + path.name)
        shutil.rmtree(trash, ignore_errors=True)
        os.rename(path, trash)
        shutil.rmtree(trash, ignore_errors=True)

    def _prune(self) -> None:
        run_dir = self.root.parent
        complete = run_checkpoints.list_checkpoints(run_dir)
        for _, path in complete[: max(0, len(complete) - self.keep_last)]:
            self._trash(path)


class CheckpointCorrupt(BadInput):
    """A checkpoint's files are not as they were saved (or cannot be loaded): which file, and
    which earlier checkpoint is good."""


def verify_checkpoint(path: Path) -> None:
    """Every file of the checkpoint at ``path`` as its manifest says, digests included; else
    :class:`CheckpointCorrupt`."""
    path = Path(path)
    step = run_checkpoints.checkpoint_step(path)
    if step is None or not (path / run_checkpoints.DCP_METADATA).is_file():
        raise CheckpointCorrupt(f"{path.name} is not a complete checkpoint (step-<N> with {run_checkpoints.DCP_METADATA})")
    why = manifest.problem(path, full=True)
    if why is not None:
        raise CheckpointCorrupt(run_checkpoints.corrupt_checkpoint_message(path.parent.parent, step, why, full=True))


def saved_keys(path: Path) -> set[str] | None:
    """The flattened keys a checkpoint holds (``train.step``, ...), from its DCP metadata; None
    when it cannot be read (the load that follows then says why)."""
    try:
        return set(dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata)
    except Exception:  # noqa: BLE001 — a damaged .metadata is the load's to report, naming the file
        return None


def load_checkpoint(path: Path, states: dict[str, Any],
                    before_load: Callable[[set[str] | None], None] | None = None) -> None:
    """Load a complete, verified checkpoint into ``states`` (DCP reshards to this run's world
    size); one that does not verify or load is :class:`CheckpointCorrupt`, in one line.
    ``before_load`` is told the keys the verified checkpoint holds (:func:`saved_keys`) before
    ``states`` are read: a state can leave out a key an older checkpoint lacks."""
    path = Path(path)
    verify_checkpoint(path)
    if before_load is not None:
        before_load(saved_keys(path))
    try:
        dcp.load(states, checkpoint_id=str(path))
    except BaseException as e:  # DCP's CheckpointException (a BaseException) wraps the cause
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        cause = root_cause(e)
        what = f"{type(cause).__name__}: {cause}".splitlines()[0][:MAX_QUOTED_CHARS]
        raise CheckpointCorrupt(run_checkpoints.corrupt_checkpoint_message(
            path.parent.parent, run_checkpoints.checkpoint_step(path) or 0, f"it cannot be loaded ({what})", full=True)) from e


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
