"""Model operations: export a checkpoint as a Hugging Face folder, sample from it, evaluate it.

Each loads the run's recipe, so each runs ``python -m engine.model_io`` in the run sandbox
(:mod:`runner.model_process`), never in this process; what comes back is a bounded result.
An export is written into a staging folder beside its destination and renamed into place when
complete: a failed or interrupted export leaves nothing at ``to``.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import stat
import time
from pathlib import Path
from typing import Iterator

from engine import run_dir as rd
from engine import run_checkpoints
from runner import server_record as sr
from engine.errors import BadInput
from engine.seams import GeneratedSample, TaskScore
from engine.written_trees import DIRECTORY_NO_FOLLOW, remove_tree
from mcp_server import limits
from mcp_server.limits import AGENT_BUDGET_CHARS, json_chars
from mcp_server.models import EvaluateResult, ExportResult, Sample, SampleResult
from runner import hub_push
from runner.hub import Progress
from runner.model_process import ModelProcessFailed, run_model_io
from workspace.paths import RESERVED_DIRS, PathRefused, confine, refuse_reserved
from runner.provenance import check_snapshot_unchanged
from sandbox.redact import redact
from runner.scripts import DOCS_PAGE
from runner.task_data import task_datasets
from workspace.settings import RunLimits
from workspace.workspace import RECIPES_DIRNAME, Workspace

EXPORT_TIMEOUT_S = 1800
SAMPLE_TIMEOUT_S = 600
EVALUATE_TIMEOUT_S = 1800
MAX_LISTED_FILES = 40
MAX_FILE_NAME_CHARS = 120
STAGING_MARK = ".partial-export-"
# A staging folder's name carries when it was made: one older than an export may take was left
# by a server killed midway, and the next export into the same folder removes it.
_STAGING_NAME = re.compile(r"\..*" + re.escape(STAGING_MARK) + r"(\d{10})-[0-9a-f]{8}", re.DOTALL)
MAX_NAME_BYTES = 255  # NAME_MAX of Linux filesystems


def checkpoint_of(ws: Workspace, run_id: str, step: int | None) -> tuple[Path, int]:
    """The run directory and the step of its complete checkpoint ``step`` (default: the latest),
    with its code snapshot checked unchanged."""
    run_dir = ws.run_dir(run_id)
    try:
        rd.read_run(run_dir)  # the model process rebuilds the recipe from the config there
        record = sr.known_run(ws.root, run_dir)  # the snapshot's digest is the server's
    except (OSError, ValueError) as e:  # the run writes its run.json: a link, a FIFO, anything
        why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise BadInput(f"run {run_id}'s {rd.RUN_JSON} cannot be read ({why}), so its model cannot be rebuilt") from None
    if not record.started_by_server:
        raise BadInput(f"run {run_id} was not started by this server, so nothing says its code snapshot is the code "
                       "that trained its checkpoints")
    if record.kind == rd.SCRIPT:
        # Its checkpoint is usable when it is a Hugging Face model folder (TRL's, the Trainer's):
        # transformers loads it in the sandbox, without any of the script's code.
        chosen, path = run_checkpoints.choose_checkpoint(run_dir, rd.SCRIPT, step)
        if path.is_symlink() or not run_checkpoints.is_model_folder(path):
            raise BadInput(f"checkpoint {path.name[:100]} of run {run_id} (a script's) is not a Hugging Face model "
                           "folder (config.json and weights, or a peft adapter_config.json): export_checkpoint, "
                           "sample and evaluate load a script's checkpoint only as such a folder (save_pretrained); "
                           f"{DOCS_PAGE} says how to make the script a recipe")
        return run_dir, chosen
    # Its digests here, where the run's other checkpoints are in view (the good one before a bad
    # one is named), and again in the model process as it reads it.
    chosen, _ = run_checkpoints.choose_checkpoint(run_dir, rd.RECIPE, step, verified=True)
    snapshot = run_dir / rd.SNAPSHOT_DIRNAME
    if not (snapshot / "recipe.py").is_file():
        raise BadInput(f"run {run_id} kept no snapshot of its code, so its model cannot be rebuilt")
    check_snapshot_unchanged(record, snapshot)
    return run_dir, chosen


def export_checkpoint(
    ws: Workspace, run_id: str, to: str, step: int | None = None, lora: str = "merged",
    max_shard_size: str = "2GB", gguf: str | None = None, private: bool = False,
    progress: Progress | None = None,
) -> ExportResult:
    """Write a checkpoint as a Hugging Face folder at ``to`` (new, or an empty folder), or
    (``gguf``: a type, :data:`~engine.seams.GGUF_QUANTIZATIONS`) as one GGUF file in it; or push
    it to the Hub repo ``to`` names (``hub:org/name[@branch]``, ``private`` when it is new)."""
    _check_gguf_is_merged(lora, gguf)
    target = hub_push.push_target(to)
    if target is not None:
        from mcp_server.operations.push import push_checkpoint  # it builds on this module's functions

        return push_checkpoint(ws, run_id, target, step, lora, max_shard_size, gguf, private, progress)
    if private:
        raise BadInput("private applies to a push (to=hub:org/name); a workspace folder has no visibility")
    return _export_to_folder(ws, run_id, to, step, lora, max_shard_size, gguf)


def _export_to_folder(ws: Workspace, run_id: str, to: str, step: int | None, lora: str, max_shard_size: str,
                      gguf: str | None) -> ExportResult:
    """The export into the workspace folder ``to``, staged beside it and renamed into place."""
    destination, relative = _checked_destination(ws, to)
    run_dir, step = checkpoint_of(ws, run_id, step)
    parent, name = destination.parent, destination.name
    missing = [p for p in [parent, *parent.parents] if not p.exists()]
    short = os.fsencode(name)[:80].decode(errors="ignore")  # the staging name fits NAME_MAX too
    staging_name = f".{short}{STAGING_MARK}{int(time.time()):010d}-{secrets.token_hex(4)}"
    parent_fd = None
    # Everything after the checks happens relative to a descriptor of the checked parent folder:
    # a folder on the way swapped for a link meanwhile redirects neither the staging folder, nor
    # the rename, nor the listing of what was written.
    try:
        try:
            parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:  # a file on the way, for instance
            raise BadInput(f"the folder of to {relative.as_posix()!r} cannot be created ({e.strerror}); "
                           "give a path whose folders are folders") from None
        parent_fd = _open_checked_dir(parent, relative.as_posix())
        _remove_abandoned_staging(parent_fd)
        os.mkdir(staging_name, dir_fd=parent_fd)
        staging = parent / staging_name
        result = run_model_io(
            ws.root, run_dir, "export", step,
            ["--to", str(staging), "--lora", lora, "--max-shard-size", max_shard_size, "--final-dir", str(destination),
             *(["--gguf", gguf] if gguf else [])],
            ws.run_limits(), EXPORT_TIMEOUT_S, writable=[staging],
        )
        check_written(parent_fd, staging_name, ws.run_limits().max_export_bytes)
        try:
            with contextlib.suppress(FileNotFoundError):
                os.rmdir(name, dir_fd=parent_fd)  # empty, as checked (a link or a file: ENOTDIR)
            os.rename(staging_name, name, src_dir_fd=parent_fd, dst_dir_fd=parent_fd)
        except OSError as e:  # another export, or anything else, got there first
            raise BadInput(f"to {relative.as_posix()!r} was written meanwhile ({e.strerror}); this export "
                           "was discarded: give a new folder") from None
        files = listed_files(parent_fd, name)
    except BaseException:
        if parent_fd is not None:
            with contextlib.suppress(OSError):
                remove_tree(parent_fd, staging_name)
        for folder in missing:  # parents this export created, innermost first
            try:
                folder.rmdir()
            except OSError:
                break
        raise
    finally:
        if parent_fd is not None:
            os.close(parent_fd)
    return ExportResult(
        run_id=run_id, step=step, path=relative.as_posix(), lora=result.lora, tokenizer=result.tokenizer,
        parameters=result.parameters,
        files={short_text(name, MAX_FILE_NAME_CHARS): size for name, size in files[:MAX_LISTED_FILES]},
    )


def _check_gguf_is_merged(lora: str, gguf: str | None) -> None:
    """The one rule between export's choices (each checked by ExportArgs)."""
    if gguf is not None and lora == "adapter":
        raise BadInput("a GGUF file holds the merged model: leave lora out (merged) with gguf")


def _checked_destination(ws: Workspace, to: str) -> tuple[Path, Path]:
    """The folder an export writes (and its path in the workspace): new or empty, not in the
    workspace's own state, recipes or another export's staging folder, each name short enough."""
    destination = confine(ws.root, to, "to", must_exist=False)
    relative = destination.relative_to(ws.root)
    if not relative.parts:
        raise PathRefused("to is the workspace itself; give a new folder inside it, e.g. exports/my_model")
    if relative.parts[0] in RESERVED_DIRS:
        raise PathRefused(f"to {relative.as_posix()!r} is inside {relative.parts[0]}/, which holds trainwright's "
                          "or git's own state; export elsewhere, e.g. exports/my_model")
    if relative.parts[0] == RECIPES_DIRNAME:
        # A model there would be copied into every run's code snapshot and leave the recipe dirty.
        raise PathRefused(f"to {relative.as_posix()!r} is inside {RECIPES_DIRNAME}/, which holds recipe code; "
                          "export elsewhere, e.g. exports/my_model")
    if any(STAGING_MARK in part for part in relative.parts):  # one on the way would be removed as abandoned
        raise PathRefused(f"to {relative.as_posix()!r} is named like the staging folder of an export; "
                          "give another name")
    for part in relative.parts:
        if len(os.fsencode(part)) > MAX_NAME_BYTES:
            raise PathRefused(f"to has a folder name too long for the filesystem ({len(os.fsencode(part))} bytes, "
                              f"at most {MAX_NAME_BYTES}); give a shorter name")
    if destination.exists() and (not destination.is_dir() or any(destination.iterdir())):
        raise BadInput(f"to {ws.label(destination)!r} exists and is not an empty folder; "
                       "give a new folder (nothing was changed)")
    return destination, relative


def _remove_abandoned_staging(parent_fd: int) -> None:
    """Remove the staging folders in ``parent_fd`` that no export can still be writing (older than
    the export time limit, with a margin): a server killed during an export leaves one."""
    oldest_alive = time.time() - EXPORT_TIMEOUT_S - 600
    for entry in os.listdir(parent_fd):
        match = _STAGING_NAME.fullmatch(entry)
        if match and int(match.group(1)) < oldest_alive:
            with contextlib.suppress(OSError):
                if stat.S_ISDIR(os.stat(entry, dir_fd=parent_fd, follow_symlinks=False).st_mode):
                    remove_tree(parent_fd, entry)


def _open_checked_dir(folder: Path, label: str) -> int:
    """A descriptor of ``folder`` (resolved, inside the workspace), refused when what is at that
    path now is not the folder that was checked (a link swapped in since)."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    if os.readlink(f"/proc/self/fd/{fd}") != str(folder):
        os.close(fd)
        raise BadInput(f"the folder of to {label!r} changed while the export started (a link?); nothing was exported")
    return fd


def short_text(text: str, limit: int) -> str:
    """``text`` cut to ``limit`` characters (a file name the recipe's code chose)."""
    return text if len(text) <= limit else text[: limit - 1] + "…"


EXPORT_FILE_MODE, EXPORT_DIR_MODE = 0o644, 0o755


def check_written(parent_fd: int, name: str, max_bytes: int | None = None) -> None:
    """Refuse an export that holds anything but regular files and folders (recipe code wrote it:
    a link would lead out of the workspace), more than ``max_bytes`` in all (the trusted
    settings' ``runs.max_export_bytes``), more than :data:`~mcp_server.limits.MAX_EXPORT_ENTRIES`
    files and folders or folders nested deeper than :data:`~mcp_server.limits.MAX_EXPORT_DEPTH`;
    set every file's mode to 0644 and every folder's to 0755, whatever the recipe's code set
    (``save_pretrained`` writes 0600 under some umasks)."""
    total = 0
    os.chmod(name, EXPORT_DIR_MODE, dir_fd=parent_fd)  # the staging folder this export made
    for path, dir_fd, info in written_entries(parent_fd, name):
        entry = os.path.basename(path)
        if not (stat.S_ISREG(info.st_mode) or stat.S_ISDIR(info.st_mode)):
            raise ModelProcessFailed(f"the export holds {entry[:100]!r}, which is not a regular file or folder "
                                     "(the recipe's code wrote it); nothing was exported")
        regular = stat.S_ISREG(info.st_mode)
        os.chmod(entry, EXPORT_FILE_MODE if regular else EXPORT_DIR_MODE, dir_fd=dir_fd)
        total += info.st_size if regular else 0
        if max_bytes is not None and total > max_bytes:
            raise BadInput(f"the export is larger than runs.max_export_bytes ({max_bytes:,} bytes) of the "
                           "server's settings; nothing was exported (export lora='adapter', or ask the "
                           "person who runs the server to raise the cap)")



def written_entries(parent_fd: int, name: str) -> Iterator[tuple[str, int, os.stat_result]]:
    """``(path under name, descriptor of its folder, stat)`` of everything under the folder ``name``
    of ``parent_fd``, links not followed, walked a folder at a time without recursion and without
    listing a whole folder first: an export the recipe's code wrote with more than
    :data:`~mcp_server.limits.MAX_EXPORT_ENTRIES` entries, or nested deeper than
    :data:`~mcp_server.limits.MAX_EXPORT_DEPTH`, is refused as soon as the walk gets there."""
    most, deepest, count = limits.MAX_EXPORT_ENTRIES, limits.MAX_EXPORT_DEPTH, 0
    top = os.open(name, DIRECTORY_NO_FOLLOW, dir_fd=parent_fd)
    stack = [(top, "", os.scandir(top))]
    try:
        while stack:
            folder_fd, prefix, listing = stack[-1]
            entry = next(listing, None)
            if entry is None:
                stack.pop()
                listing.close()
                os.close(folder_fd)
                continue
            count += 1
            if count > most:
                raise ModelProcessFailed(f"the export holds more than {most:,} files and folders (the recipe's "
                                         f"code wrote them; an export holds at most {most:,}); nothing was exported")
            info = entry.stat(follow_symlinks=False)
            yield prefix + entry.name, folder_fd, info
            if stat.S_ISDIR(info.st_mode):
                if len(stack) >= deepest:
                    raise ModelProcessFailed(f"the export nests folders too deep (more than {deepest} levels; the "
                                             "recipe's code wrote it); nothing was exported")
                inner = os.open(entry.name, DIRECTORY_NO_FOLLOW, dir_fd=folder_fd)
                stack.append((inner, f"{prefix}{entry.name}/", os.scandir(inner)))
    finally:
        for folder_fd, _, listing in stack:
            listing.close()
            os.close(folder_fd)


def listed_files(parent_fd: int, name: str) -> list[tuple[str, int]]:
    """The files under the folder ``name`` of ``parent_fd`` (links not followed), with their sizes
    (an export :func:`check_written` checked)."""
    return sorted((path, info.st_size) for path, _, info in written_entries(parent_fd, name)
                  if not stat.S_ISDIR(info.st_mode))


def sample(
    ws: Workspace, run_id: str, prompts: list[str], step: int | None = None, max_new_tokens: int = 64,
    temperature: float = 0.0, reasoning: bool | None = None, images: list[str] | None = None,
) -> SampleResult:
    """Continue each prompt with the checkpoint's model (greedy when temperature is 0; a chat
    template's thinking switch on or off with ``reasoning``; ``images``: a workspace image file
    per prompt, for a vision-language run)."""
    if images is not None and len(images) != len(prompts):
        raise BadInput(f"images: give one image per prompt ({len(images)} images for {len(prompts)} prompts)")
    shown = [_image_file(ws.root, image) for image in images or []]
    run_dir, step = checkpoint_of(ws, run_id, step)
    arguments = [f"--prompt={prompt}" for prompt in prompts] + [f"--image={image}" for image in shown]
    arguments += ["--max-new-tokens", str(max_new_tokens), "--temperature", repr(float(temperature))]
    if reasoning is not None:
        arguments += ["--reasoning", "on" if reasoning else "off"]
    result = run_model_io(ws.root, run_dir, "sample", step, arguments, ws.run_limits(), SAMPLE_TIMEOUT_S)
    if len(result.samples) != len(prompts):
        raise ModelProcessFailed(f"the sample result has {len(result.samples)} samples for {len(prompts)} prompts: "
                                 "the recipe's code wrote a result of its own; nothing was changed")
    return SampleResult(run_id=run_id, step=step, chat=result.chat, samples=_bounded_samples(result.samples))


def _image_file(root: Path, image: str) -> Path:
    """An image sample may show the model: a regular file in the workspace, outside its reserved
    folders (a FIFO would hold the model process until a writer came; a folder is no image)."""
    path = refuse_reserved(root, confine(root, image, "images"), "images")
    if not path.is_file():
        raise PathRefused(f"images {path.relative_to(Path(root).resolve()).as_posix()!r} is not a regular file: "
                          "give an image file")
    return path


def _bounded_samples(samples: list[GeneratedSample]) -> list[Sample]:
    """The samples, each text cut to its share of the result budget."""
    share = (AGENT_BUDGET_CHARS - 1200) // max(1, len(samples))
    kept = []
    for item in samples:
        # Redacted before the cut: a secret cut in two would no longer be found by its value.
        prompt, prompt_cut = _fit(redact(item.prompt), min(300, share // 4))
        # What the recipe added (an image's name) and the data's answer: its code wrote them, so cut too.
        shown, shown_cut = _fit(redact(item.input), min(200, share // 8)) if item.input is not None else (None, False)
        expected, expected_cut = (_fit(redact(item.expected), min(300, share // 4))
                                  if item.expected is not None else (None, False))
        calls = json.dumps(item.tool_calls) if item.tool_calls else ""
        calls_fit = len(calls) <= share // 4 and redact(calls) == calls  # a call holding a secret is not shown
        written = [t for t in (item.raw, item.reasoning) if t is not None]
        rest = (share - json_chars(prompt) - json_chars(shown) - json_chars(expected) - (len(calls) if calls_fit else 0)
                - 80 - (60 * len(written) + 60 if written or calls else 0))  # the keys of raw's fields
        # A chat model's text as written and its reasoning share the completion's part (thirds).
        part = rest // (1 + len(written))
        completion, completion_cut = _fit(redact(item.completion), part)
        raw, raw_cut = _fit(redact(item.raw), part) if item.raw is not None else (None, False)
        reasoning, reasoning_cut = _fit(redact(item.reasoning), part) if item.reasoning is not None else (None, False)
        kept.append(Sample(prompt=prompt, completion=completion, new_tokens=item.new_tokens, stopped=item.stopped,
                           cut=prompt_cut or completion_cut or shown_cut or expected_cut or raw_cut or reasoning_cut
                           or (bool(calls) and not calls_fit),
                           input=shown, expected=expected, raw={
                               k: v for k, v in (("text", raw), ("reasoning", reasoning),
                                                 ("tool_calls", item.tool_calls if calls and calls_fit else None))
                               if v is not None}))
    return kept


def _fit(text: str, budget: int) -> tuple[str, bool]:
    """``text`` cut so that it takes at most ``budget`` characters as JSON (escapes count)."""
    if json_chars(text) <= budget:
        return text, False
    low, high = 0, len(text)
    while low < high:  # the longest prefix that fits
        middle = (low + high + 1) // 2
        if json_chars(text[:middle]) + 2 <= budget:
            low = middle
        else:
            high = middle - 1
    return text[:low] + "…", True


def evaluate(ws: Workspace, run_id: str, step: int | None = None, data: list[str] | str | None = None,
             limits: RunLimits | None = None, tasks: list[str] | None = None,
             progress: Progress | None = None) -> EvaluateResult:
    """The eval loss of a checkpoint on the run's held-out data (or on ``data``: workspace files
    or folders, all held out) and the recipe's task metrics; or, with ``tasks``, lm-evaluation-
    harness's scores on them (``engine.benchmarks``); ``limits``: the workspace's run limits
    unless given; ``progress`` is told each task as the model process starts it."""
    paths = [data] if isinstance(data, str) else data
    if paths and tasks:
        raise BadInput("evaluate takes data or tasks, not both: call it once for each")
    if paths is not None:
        resolved = [refuse_reserved(ws.root, confine(ws.root, path, "data"), "data") for path in paths]
    run_dir, step = checkpoint_of(ws, run_id, step)
    arguments = [f"--data={path}" for path in resolved] if paths else [f"--task={task}" for task in tasks or ()]
    datasets = task_datasets(ws.root, tasks) if tasks else []  # the Hub data sets they name, from the server's cache
    result = run_model_io(ws.root, run_dir, "evaluate", step, arguments, limits or ws.run_limits(), EVALUATE_TIMEOUT_S,
                          datasets=datasets, progress=progress if tasks else None)
    if tasks:
        scores, left_out = bounded_task_scores(result.tasks)
        counted = [score["examples"] for score in scores.values() if score["examples"] is not None]  # a group's: None
        warnings = small_sample_warnings(min(counted), "tasks") if counted else []
        if left_out:
            warnings.append(f"{left_out} more task score(s) left out to keep the result small: ask for fewer tasks")
        return EvaluateResult(run_id=run_id, step=step, eval_loss=None, split="tasks", metrics={}, tasks=scores,
                              warnings=warnings)
    split = "data" if paths else "held_out"
    return EvaluateResult(
        run_id=run_id, step=step, eval_loss=result.eval_loss, perplexity=result.perplexity, split=split,
        examples=result.examples, tokens=result.tokens, loss_tokens=result.loss_tokens,
        scored_tokens=result.scored_tokens, metrics=result.metrics,
        warnings=small_sample_warnings(result.examples, split),
    )


def bounded_task_scores(scores: list[TaskScore]) -> tuple[dict[str, dict], int]:
    """lm-eval's scores by task, in its order, as many as fit in the agent's budget (a group such
    as MMLU has dozens of subtasks), and how many were left out."""
    kept: dict[str, dict] = {}
    room = AGENT_BUDGET_CHARS - 1500  # the rest of the result and its warnings
    for index, score in enumerate(scores):
        shown = score.model_dump(exclude={"task"})
        room -= json_chars({score.task: shown})
        if room < 0:
            return kept, len(scores) - index
        kept[score.task] = shown
    return kept, 0


MIN_EXAMPLES = 30


def small_sample_warnings(examples: int | None, split: str) -> list[str]:
    """A warning for numbers over fewer than :data:`MIN_EXAMPLES` examples (a rate over one
    held-out pair is 0 or 1)."""
    where = {"held_out": "the run's held-out split", "data": "the data given", "tasks": "a task given"}[split]
    if examples is None:
        return [f"the recipe did not count the examples of {where}: the numbers' sample size is unknown"]
    if examples < MIN_EXAMPLES:
        more = {"held_out": "raise data.eval_fraction or pass data=[files]", "data": "pass more data",
                "tasks": "give the task more examples"}[split]
        numbers = "scores" if split == "tasks" else "eval_loss and metrics"
        return [f"{numbers} are over {examples} example(s) of {where}, fewer than {MIN_EXAMPLES}: "
                f"a rate moves by {1 / max(1, examples):.2g} per example; {more} for numbers to compare"]
    return []
