"""The sandboxed process that exports, samples or evaluates a run's checkpoint.

``python -m engine.model_io`` imports the run's recipe (arbitrary code), so it runs as a run
does: in the bubblewrap sandbox (:mod:`sandbox.bwrap`), with the run limits of the workspace,
the allow-listed environment, never on the host's network, in a session of its
own, and every process it started is ended when it ends. It sees the workspace read-only
(without ``.git/``, ``.trainwright/`` and ``runs/``), the run's ``run.json``, code snapshot and
one checkpoint read-only, and may write only into the folders the caller names (an export's
staging folder) and a fresh result folder, from which the host reads one bounded JSON file
without following links, validated as :mod:`engine.seams`' model of the action's result.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import secrets
import stat
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any, Callable, Iterator, Literal, Sequence, TypeVar, overload

from engine import run_dir as rd
from engine import run_checkpoints
from runner import server_record as sr
from engine.data_files import WORKSPACE_VARIABLE
from engine.errors import MAX_ERROR_CHARS, BadInput, NotFound
from engine.written_trees import remove_path
from engine.seams import (
    EvaluateOutcome,
    ExportOutcome,
    ModelOutcome,
    ModelProcessFailed,
    MAX_PROGRESS_BYTES,
    ModelRefusal,
    SampleOutcome,
    read_model_progress,
    read_model_result,
)
from workspace.settings import RunLimits
from sandbox.environment import THREADS_VARIABLE, run_environment, threads_per_process
from runner.hub import ModelBinding, Progress, recorded_binding
from runner.processes import RUN_ID_VARIABLE, run_contained
from sandbox.redact import redact

RESULT_NAME = "result.json"
PROGRESS_NAME = "progress.json"
PROGRESS_EVERY_S = 0.5
T = TypeVar("T")
MAX_RESULT_BYTES = 1 << 20
MAX_STDERR_CHARS = 1500
__all__ = ["ModelProcessFailed", "run_model_io"]  # ModelProcessFailed is engine.seams'; callers import it from here

# Each model process loads a whole model: at most runs.max_concurrent_runs of them at once in
# this server (an agent calling sample in a loop without waiting gets a refusal, not a process).
_running = 0
_running_lock = threading.Lock()


@contextlib.contextmanager
def _slot(limits: RunLimits) -> Iterator[None]:
    global _running
    cap = limits.max_concurrent_runs or 2 * (os.cpu_count() or 1)
    with _running_lock:
        if _running >= cap:
            raise BadInput(f"{_running} export, sample or evaluate processes are running, at most {cap} at once "
                           "(runs.max_concurrent_runs); call again when one has answered")
        _running += 1
    try:
        yield
    finally:
        with _running_lock:
            _running -= 1


@overload
def run_model_io(workspace: Path, run_dir: Path, action: Literal["export"], step: int, arguments: list[str],
                 limits: RunLimits, timeout_s: float, writable: list[Path] | None = None,
                 datasets: Sequence[rd.HubModel] = (), progress: Progress | None = None) -> ExportOutcome: ...
@overload
def run_model_io(workspace: Path, run_dir: Path, action: Literal["sample"], step: int, arguments: list[str],
                 limits: RunLimits, timeout_s: float, writable: list[Path] | None = None,
                 datasets: Sequence[rd.HubModel] = (), progress: Progress | None = None) -> SampleOutcome: ...
@overload
def run_model_io(workspace: Path, run_dir: Path, action: Literal["evaluate"], step: int, arguments: list[str],
                 limits: RunLimits, timeout_s: float, writable: list[Path] | None = None,
                 datasets: Sequence[rd.HubModel] = (), progress: Progress | None = None) -> EvaluateOutcome: ...
def run_model_io(
    workspace: Path,
    run_dir: Path,
    action: str,
    step: int,
    arguments: list[str],
    limits: RunLimits,
    timeout_s: float,
    writable: list[Path] | None = None,
    datasets: Sequence[rd.HubModel] = (),
    progress: Progress | None = None,
) -> ModelOutcome:
    """Run ``python -m engine.model_io ACTION RUN_DIR --step STEP ARGUMENTS`` in the sandbox and
    return its result, validated (:func:`engine.seams.read_model_result`); its refusals are
    raised as :class:`BadInput` or :class:`NotFound`, a failure of the recipe's code or a result
    that is not the engine's as :class:`ModelProcessFailed`. ``datasets``: Hub data sets of the
    server's cache it reads too (an lm-eval task's: :func:`runner.task_data.task_datasets`), each
    repo folder shown read-only. ``progress``: told what the process writes of how far it got
    (:class:`~engine.seams.ModelProgress`, ``evaluate --task``'s task as it starts), redacted."""
    with _slot(limits):
        return _run_model_io(workspace, run_dir, action, step, arguments, limits, timeout_s, writable, datasets,
                             progress)


def _run_model_io(workspace: Path, run_dir: Path, action: str, step: int, arguments: list[str],
                  limits: RunLimits, timeout_s: float, writable: list[Path] | None,
                  datasets: Sequence[rd.HubModel] = (), progress: Progress | None = None) -> ModelOutcome:
    workspace, run_dir = Path(workspace), Path(run_dir)
    # Never the host's network, whatever runs.network says: the process reads only files (the
    # Hub is offline), and an lm-eval task's data URL is still fetched by datasets in offline mode.
    limits = dataclasses.replace(limits, network="isolated")
    models = recorded_binding(_recorded_models(workspace, run_dir))
    models = ModelBinding((*models.models, *datasets))
    name = _checkpoint_name(workspace, run_dir, step)
    checkpoint = run_dir / rd.CHECKPOINTS_DIRNAME / name
    out_dir = Path(tempfile.mkdtemp(prefix="trainwright-model-"))
    try:
        result_file = out_dir / RESULT_NAME
        progress_file = out_dir / PROGRESS_NAME
        command = [sys.executable, "-m", "engine.model_io", action, str(run_dir), "--step", str(step),
                   "--result", str(result_file), *(["--progress", str(progress_file)] if progress else []), *arguments]
        mark = f"model-{secrets.token_hex(8)}"
        env = run_environment(
            extra={
                THREADS_VARIABLE: str(threads_per_process(1, limits.threads_per_process)),
                RUN_ID_VARIABLE: mark, WORKSPACE_VARIABLE: str(workspace), "PYTHONDONTWRITEBYTECODE": "1",
                "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1", "TRANSFORMERS_VERBOSITY": "error",
                **models.env(),
            },
            pass_env=limits.pass_env,
        )
        visible = [workspace, run_dir / rd.SNAPSHOT_DIRNAME, *models.read_only(), *_start_folder(workspace, run_dir)]
        bound = _open_run_files(run_dir, step, name)
        try:
            _, stderr = _following(progress_file, progress, lambda: run_contained(
                command, workspace, visible, [out_dir, *(writable or [])], env, limits, timeout_s, mark,
                bound_fds={run_dir / rd.RUN_JSON: bound[0], checkpoint: bound[1]}))
        except OSError as e:
            raise ModelProcessFailed(f"the engine could not be started for {action}: {e}") from None
        except subprocess.TimeoutExpired:
            raise ModelProcessFailed(f"{action} took over {timeout_s:.0f} s and was stopped") from None
        finally:
            for fd in bound:
                os.close(fd)
        written = _read_result(result_file)
    finally:
        remove_path(out_dir, ignore_errors=True)  # the recipe's code could write into it
    if written is None:
        result = None
    elif len(written) > MAX_RESULT_BYTES:
        raise ModelProcessFailed(f"the recipe's code failed during {action}: its result is over {MAX_RESULT_BYTES} bytes")
    else:
        result = read_model_result(action, written)
    if result is None:
        # Redacted before the cut: a server secret cut in two would no longer be found by its value.
        last = redact("\n".join(stderr.strip().splitlines()[-8:]))[-MAX_STDERR_CHARS:]
        raise ModelProcessFailed(f"{action} ended without a result; its last output:\n{last or '(none)'}")
    if isinstance(result, ModelRefusal):
        error = redact(result.error)[:MAX_ERROR_CHARS]
        if result.kind == "not_found":
            raise NotFound(error)
        if result.kind == "bad_input":
            raise BadInput(error)
        raise ModelProcessFailed(f"the recipe's code failed during {action}: {error}")
    return result


def _following(path: Path, progress: Progress | None, run: Callable[[], T]) -> T:
    """``run()``, and meanwhile (and once more at its end) the lines the model process appended to
    its progress file at ``path`` (read each :data:`PROGRESS_EVERY_S`, without following a link,
    its first :data:`~engine.seams.MAX_PROGRESS_BYTES`), each new one told to ``progress`` from
    this thread (the caller's: an MCP binding sends notifications from its worker thread)."""
    if progress is None:
        return run()
    outcome: list[Any] = []

    def contained() -> None:
        try:
            outcome.append((True, run()))
        except BaseException as e:  # re-raised in the caller's thread
            outcome.append((False, e))

    thread = threading.Thread(target=contained, name="model-process", daemon=True)
    thread.start()
    told = 0
    while True:
        thread.join(PROGRESS_EVERY_S)
        lines = (_read_file(path, MAX_PROGRESS_BYTES) or b"")[:MAX_PROGRESS_BYTES].split(b"\n")[:-1]
        for line in lines[told:]:
            now = read_model_progress(line)
            if now is not None:
                progress(now.done, now.total, redact(now.message))
        told = max(told, len(lines))
        if not thread.is_alive():
            break
    ok, value = outcome[0]
    if not ok:
        raise value
    return value


def _recorded_models(workspace: Path, run_dir: Path) -> list[rd.HubModel]:
    """The Hub models of the server's record of the run (never the run's own run.json)."""
    try:
        return sr.known_run(workspace, run_dir).hub_models
    except (OSError, ValueError, BadInput):  # the model process says what is wrong with run.json
        return []


def _start_folder(workspace: Path, run_dir: Path) -> list[Path]:
    """The folder the run's model started from (its config's ``model.pretrained_path``: an
    earlier run's checkpoint, exported by the server), from the server's record."""
    try:
        started = sr.known_run(workspace, run_dir).started_from
    except (OSError, ValueError, BadInput):
        return []
    return [Path(started.path)] if started is not None else []


def _checkpoint_name(workspace: Path, run_dir: Path, step: int) -> str:
    """The name of the checkpoint folder of ``step``: the engine's ``step-<N>``, or what a
    script run's script saved (kind from the server's record)."""
    try:
        kind = sr.known_run(workspace, run_dir).kind
    except (OSError, ValueError, BadInput):
        kind = rd.RECIPE
    if kind == rd.SCRIPT:
        found = dict(run_checkpoints.list_script_checkpoints(run_dir))
        if step in found:
            return found[step].name
    return run_checkpoints.checkpoint_dir_name(step)


def _open_run_files(run_dir: Path, step: int, name: str) -> tuple[int, int]:
    """Descriptors of the run's ``run.json`` and of its checkpoint ``step``, opened without
    following a link at any level below the run directory. A run that is still running writes
    these folders: the sandbox shows what these descriptors hold, so a link it swaps in after
    the server's checks never shows a host folder to the recipe's code."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
    opened: list[int] = []
    try:
        opened.append(os.open(run_dir, flags | os.O_DIRECTORY))
        opened.append(os.open(rd.RUN_JSON, flags | os.O_PATH, dir_fd=opened[0]))
        opened.append(os.open(rd.CHECKPOINTS_DIRNAME, flags | os.O_DIRECTORY, dir_fd=opened[0]))
        opened.append(os.open(name, flags | os.O_DIRECTORY, dir_fd=opened[2]))
        if not stat.S_ISREG(os.fstat(opened[1]).st_mode):
            raise NotADirectoryError(f"{rd.RUN_JSON} is not a file")
    except OSError as e:
        for fd in opened:
            os.close(fd)
        raise NotFound(f"run {run_dir.name} has no complete checkpoint at step {step} "
                       f"(its run directory changed: {e.strerror or e})") from None
    for fd in (opened[0], opened[2]):
        os.close(fd)
    return opened[1], opened[3]


def _read_result(path: Path) -> bytes | None:
    """The result file as written, opened without following a link: its first
    ``MAX_RESULT_BYTES + 1`` bytes (more: it is too large), or None when there is none."""
    return _read_file(path, MAX_RESULT_BYTES)


def _read_file(path: Path, max_bytes: int) -> bytes | None:
    """A file the model process wrote, opened without following a link: its first ``max_bytes
    + 1`` bytes, or None when there is no regular file."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            return None
        return f.read(max_bytes + 1)
