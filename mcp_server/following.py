"""What ``trainwright`` prints of a run as it goes: a Hub download's progress bar, the lines of a
wait, a launched run's console followed until it ends (Ctrl-C stops the run), ``tail --follow``;
and a run's outcome as the command's exit code. :mod:`mcp_server.cli` calls :data:`AFTER` for the
commands that do more than print their result."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path
from typing import Any, Callable

from pydantic import BaseModel

from engine.errors import EXIT_OK, EXIT_RUN_FAILED, EXIT_STOPPED, EXIT_TIMEOUT
from mcp_server import terminal


class DownloadBar:
    """A Hub model's download as a progress bar on stderr (tqdm, which huggingface_hub brings)."""

    def __init__(self) -> None:
        self.bar: Any = None

    def __call__(self, done: float, total: float | None, message: str) -> None:
        from tqdm import tqdm

        if self.bar is None:
            self.bar = tqdm(total=total, unit="B", unit_scale=True, file=sys.stderr, desc=message.split(":")[0],
                            leave=True)
        self.bar.update(max(0.0, done - self.bar.n))

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def said_once() -> Callable[[str], None]:
    """A wait in line, said once on stderr (not a line a second)."""
    said: set[str] = set()

    def say(message: str) -> None:
        if message not in said:
            said.add(message)
            print(message, file=sys.stderr, flush=True)

    return say


class WaitLines:
    """A run's progress while waiting on it: a line on stderr per new step (none with --json)."""

    def __init__(self, quiet: bool):
        self.quiet = quiet

    async def __call__(self, now: Any) -> None:
        if not self.quiet:
            print(now.progress_message(), file=sys.stderr, flush=True)


def emit(args: argparse.Namespace, result: BaseModel, text: Callable[[Any], str]) -> None:
    print(result.model_dump_json() if args.json else text(result))


def after_launch(args: argparse.Namespace, ws: Any, result: Any) -> int:
    """Detached: print the handle. Foreground: stream the console, then print the outcome. A
    SLURM job runs on the cluster: ``status`` follows it."""
    if getattr(args, "target", "local") == "slurm":
        emit(args, result, terminal.job_text)
        return EXIT_OK
    if args.detach:
        emit(args, result, lambda r: terminal.launch_text(r) + f"\n`trainwright status {r.run_id}` shows how it goes")
        return EXIT_OK
    if not args.json:
        print(terminal.launch_text(result), flush=True)
    code = follow_run(ws, result.run_id, echo=not args.json)
    if args.json:
        from mcp_server.operations import runs

        final = result.model_copy(update={"status": runs.get_run(ws, result.run_id).status})
        print(final.model_dump_json())
    return code


def follow_run(ws: Any, run_id: str, echo: bool) -> int:
    """Print the run's console output until it ends; Ctrl-C stops the run (twice: leaves it)."""
    from engine import run_dir as rd
    from mcp_server.operations import runs

    console = ws.run_dir(run_id) / rd.CONSOLE_LOG
    offset = 0
    stopping = False
    while True:
        try:
            _, record = runs.known_run(ws, run_id)
            ended = record.effective_status() in rd.FINAL_STATUSES and not record.supervisor_alive()
            offset = echo_console(console, offset, whole_lines=not ended, echo=echo)
            if ended:
                echo_rest(console, offset, echo)
                break
            time.sleep(0.3)
        except KeyboardInterrupt:
            if stopping:
                raise
            stopping = True
            print("\nstopping the run (Ctrl-C again to leave it running in the background)…", file=sys.stderr)
            runs.stop_run(ws, run_id)
    return outcome(runs.get_run(ws, run_id).status)


ECHO_CHUNK_BYTES = 1 << 20
ECHO_AFTER_END_BYTES = 64 << 20  # what an ended run's console still shows, at most


def echo_rest(console: Path, offset: int, echo: bool) -> None:
    """The console's remaining output once the run has ended, up to ECHO_AFTER_END_BYTES."""
    start = offset
    while offset - start < ECHO_AFTER_END_BYTES:
        moved = echo_console(console, offset, whole_lines=False, echo=echo)
        if moved == offset:
            return
        offset = moved
    with contextlib.suppress(OSError):
        left = console.lstat().st_size - offset  # the name itself: never what a link names
        if left > 0 and echo:
            print(f"\n… console.log has {left:,} more bytes", file=sys.stderr)


def echo_console(console: Path, offset: int, whole_lines: bool, echo: bool) -> int:
    """Print what the console log gained since ``offset``, at most ECHO_CHUNK_BYTES a call (whole
    lines only while the run goes on, so that redaction sees every line whole, unless one line
    fills the chunk); return the new offset."""
    from engine import run_metrics

    chunk = b""
    f = run_metrics.open_run_output(console)  # not through a link the run left
    if f is not None:
        with f:
            f.seek(offset)
            chunk = f.read(ECHO_CHUNK_BYTES)  # a run can make its console.log any size (sparse)
    if whole_lines and len(chunk) < ECHO_CHUNK_BYTES:
        chunk = chunk[: chunk.rfind(b"\n") + 1]
    if chunk and echo:
        sys.stdout.write(chunk.decode("utf-8", errors="replace"))
        sys.stdout.flush()
    return offset + len(chunk)


def outcome(status: str | None) -> int:
    """A run's final status as an exit code."""
    return {"completed": EXIT_OK, "stopped": EXIT_STOPPED}.get(status or "", EXIT_RUN_FAILED)


def after_tail(args: argparse.Namespace, ws: Any, result: Any) -> int:
    """Print the records (one JSON object each with --json --follow), then with --follow the
    new ones until the run ends."""
    from engine import run_dir as rd
    from mcp_server.limits import MAX_TAIL_RECORDS
    from mcp_server.operations import runs

    if args.json and not args.follow:
        print(result.model_dump_json())
        return EXIT_OK
    if not args.json:
        for point in result.resumes:
            print(f"(steps after {point.step}: run {point.run_id})", flush=True)
    last_step = print_records(args, result.records, args.after_step)
    while args.follow:
        time.sleep(1.0)
        more = runs.tail_metrics(ws, args.run_id, n=MAX_TAIL_RECORDS, after_step=last_step)
        last_step = print_records(args, more.records, last_step)
        if more.status in rd.FINAL_STATUSES:
            break
    return EXIT_OK


def print_records(args: argparse.Namespace, records: list[dict[str, Any]], last_step: int | None) -> int | None:
    for record in records:
        print(json.dumps(record) if args.json else terminal.format_record(record), flush=True)
        last_step = record.get("step", last_step)
    return last_step


def after_wait(args: argparse.Namespace, ws: Any, result: Any) -> int:
    emit(args, result, terminal.wait_text)
    if result.reason == "timeout":
        return EXIT_TIMEOUT
    return outcome(result.status) if result.reason == "ended" else EXIT_OK


# What a command does with its result beyond printing it.
AFTER: dict[str, Callable[[argparse.Namespace, Any, Any], int]] = {
    "launch_run": after_launch, "resume_checkpoint": after_launch, "tail_metrics": after_tail,
    "wait_run": after_wait,
}
