"""``export_checkpoint(to="hub:org/name[@branch]")``: a checkpoint exported in the run sandbox,
evaluated, given a model card and uploaded by the server (:mod:`runner.hub_push`).

The export is written into a staging folder outside the workspace, which is removed whatever
happens: a push leaves nothing on disk. The token is checked with the Hub before the checkpoint
is loaded, so a missing or read-only token costs no export; the sandboxed processes never get
it (the variables holding it are taken out of ``runs.pass_env`` for them).
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from pathlib import Path

from engine.errors import BadInput
from engine.written_trees import remove_path
from mcp_server.models import ExportResult
from mcp_server.operations.compare import skills_of_run
from mcp_server.operations.model_card import model_card
from mcp_server.operations.model_tools import (
    EXPORT_TIMEOUT_S,
    MAX_FILE_NAME_CHARS,
    MAX_LISTED_FILES,
    check_written,
    checkpoint_of,
    evaluate,
    listed_files,
    short_text,
)
from runner import hub_push
from runner import server_record as sr
from runner.hub import Progress
from runner.model_process import ModelProcessFailed, run_model_io
from workspace.workspace import Workspace

FOLDER_NAME = "model"
PUSH_STAGES = 3  # exported, evaluated, uploaded


def _report(progress: Progress | None, done: int, message: str) -> None:
    if progress is not None:
        progress(float(done), float(PUSH_STAGES), message)


def push_checkpoint(ws: Workspace, run_id: str, target: hub_push.PushTarget, step: int | None, lora: str,
                    max_shard_size: str, gguf: str | None, private: bool,
                    progress: Progress | None = None) -> ExportResult:
    """Export checkpoint ``step`` of the run, evaluate it, write its card and push it to
    ``target`` as one commit; the result's ``path`` is ``hub:org/name@<commit>``."""
    token = hub_push.server_token()
    hub_push.check_access(target, token)
    run_dir, step = checkpoint_of(ws, run_id, step)
    record = sr.known_run(ws.root, run_dir)
    hidden = hub_push.token_variables(token)
    limits = ws.run_limits()
    limits = dataclasses.replace(limits, pass_env=tuple(n for n in limits.pass_env if n not in hidden))
    staging = Path(tempfile.mkdtemp(prefix="trainwright-push-"))
    try:
        folder = staging / FOLDER_NAME
        folder.mkdir()
        result = run_model_io(
            ws.root, run_dir, "export", step,
            ["--to", str(folder), "--lora", lora, "--max-shard-size", max_shard_size, "--final-dir", str(folder),
             *(["--gguf", gguf] if gguf else [])],
            limits, EXPORT_TIMEOUT_S, writable=[folder],
        )
        staging_fd = os.open(staging, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            check_written(staging_fd, FOLDER_NAME, limits.max_export_bytes)
            files = listed_files(staging_fd, FOLDER_NAME)
        finally:
            os.close(staging_fd)
        _refuse_local_base(folder, target)
        size = sum(files_size for _, files_size in files)
        _report(progress, 1, f"exported step {step} of {run_id} ({size / 2**20:,.1f} MiB); evaluating it")
        try:
            evaluation, not_evaluated = evaluate(ws, run_id, step, limits=limits), None
        except (BadInput, ModelProcessFailed) as e:  # the card says why; the model is pushed all the same
            evaluation, not_evaluated = None, str(e)
        library = "gguf" if gguf else "peft" if result.lora == "adapter" else "transformers"
        card = model_card(record, step, skills_of_run(ws, record), library, result.parameters, evaluation,
                          not_evaluated)
        (folder / "README.md").write_text(hub_push.scrub(card, token))
        sizes = {**dict(files), "README.md": (folder / "README.md").stat().st_size}
        message = hub_push.COMMIT_MESSAGE.format(what="GGUF" if gguf else "model", run_id=run_id, step=step)
        _report(progress, 2, f"uploading to {target.shown}: {len(sizes)} files, {sum(sizes.values()) / 2**20:,.1f} MiB")
        commit = hub_push.upload(folder, target, token, private, message)
        _report(progress, PUSH_STAGES, f"uploaded to {target.shown}: commit {commit[:12]}")
    finally:
        remove_path(staging, ignore_errors=True)  # the recipe's code wrote it: nested as it liked
    return ExportResult(
        run_id=run_id, step=step, path=f"{hub_push.HUB_PREFIX}{target.repo_id}@{commit}", lora=result.lora,
        tokenizer=result.tokenizer, parameters=result.parameters,
        files={short_text(name, MAX_FILE_NAME_CHARS): size for name, size in sorted(sizes.items())[:MAX_LISTED_FILES]},
    )


def _refuse_local_base(folder: Path, target: hub_push.PushTarget) -> None:
    """An adapter whose base is a folder of this machine (named relative to the export) would
    name nothing on the Hub: refused (its ``base/``, for a model trained from scratch, goes with it)."""
    config = folder / "adapter_config.json"
    if not config.is_file():
        return
    try:
        base = json.loads(config.read_text()).get("base_model_name_or_path")
    except (OSError, ValueError, AttributeError):
        base = None
    if isinstance(base, str) and base.startswith(".."):
        raise BadInput(f"the adapter's base model is a workspace folder ({base[:100]!r}), which {target.shown} "
                       "cannot name: push the merged model (lora='merged'), or start the run from a Hub model")
