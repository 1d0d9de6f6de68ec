"""What a run writes cannot make the server work without bound or answer with an internal
error: manifests nested, naming a file twice or with a NUL, a file that grows while it is
hashed, a console that grows while it is read, a console with no end of line, a lone surrogate
in a metrics record, a run directory full of files, and describe_recipe calls that wait for a
check while the rest of the server works (an attacker's pass over the new surfaces)."""

from __future__ import annotations

import hashlib
import io
import json
import os
import threading
import time
from pathlib import Path

import pytest

from engine import checkpoint_manifest as manifest
from engine import run_dir as rd
from engine import run_checkpoints
from engine import run_metrics
from mcp_server.operations import runs as run_ops
from tests.sandbox.helpers import fake_run, live_client, make_workspace


def checkpoint_with(run_dir: Path, step: int, text: str) -> Path:
    folder = run_dir / rd.CHECKPOINTS_DIRNAME / run_checkpoints.checkpoint_dir_name(step)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / run_checkpoints.DCP_METADATA).write_bytes(b"meta")
    (folder / manifest.MANIFEST).write_text(text)
    return folder


def entry(path: str, data: bytes) -> dict:
    return {"path": path, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


@pytest.mark.parametrize("text, why", [
    ("[" * 100_000, "damaged (RecursionError)"),
    (json.dumps({"format": 1, "files": [entry("a\x00b", b"")]}), "damaged (String should match pattern"),
    (json.dumps({"format": 1, "files": [entry(run_checkpoints.DCP_METADATA, b"meta")] * 4_000}), "named more than once"),
])
def test_a_hostile_manifest_makes_its_checkpoint_unusable_not_the_tools_fail(tmp_path, text, why):
    root = make_workspace(tmp_path / "ws")
    run_dir = fake_run(root, "r1", checkpoints=())
    checkpoint_with(run_dir, 4, text)
    from workspace.workspace import Workspace

    listed = run_ops.list_checkpoints(Workspace.open(root), "r1")
    assert listed.checkpoints == [] and len(listed.unusable) == 1
    assert listed.unusable[0].startswith("step-00000004: manifest.json is ") and why in listed.unusable[0]
    assert run_ops.get_run(Workspace.open(root), "r1").status == rd.COMPLETED


def test_a_file_that_grows_while_it_is_hashed_is_read_no_further_than_its_saved_size(tmp_path, monkeypatch):
    run_dir = tmp_path / "runs" / "r1"
    data = b"x" * 1000
    folder = checkpoint_with(run_dir, 2, json.dumps({"format": 1, "files": [entry("shard", data)]}))
    (folder / "shard").write_bytes(data + b"\0" * (8 << 20))  # grown (sparse) after its size was checked
    real_fstat, read = os.fstat, []

    def fstat_at_saved_size(fd):  # the check saw 1,000 bytes; the run grows the file right after
        info = real_fstat(fd)
        return os.stat_result((info.st_mode, info.st_ino, info.st_dev, info.st_nlink, info.st_uid, info.st_gid,
                               1000 if info.st_size > 1000 else info.st_size, 0, 0, 0))

    def counted_read(fd, n):
        chunk = os.read(fd, n)
        read.append(len(chunk))
        return chunk

    shim = type("os_shim", (), {"__getattr__": lambda self, name: getattr(os, name)})()
    shim.fstat, shim.read = fstat_at_saved_size, counted_read
    monkeypatch.setattr(manifest, "os", shim)
    why = manifest.problem(folder, full=True)
    assert why is not None and "does not match the digest" in why
    manifest_bytes = (folder / manifest.MANIFEST).stat().st_size  # read once, whole
    assert sum(read) - manifest_bytes <= 1001  # the shard: its saved size and one byte, not 8 MB more


def test_the_console_tail_is_never_more_than_asked_even_when_the_run_grows_it_meanwhile(monkeypatch, tmp_path):
    class Growing(io.BytesIO):
        def seek(self, offset, whence=0):  # the size seen: 100 bytes; then 10 MB more arrive
            result = super().seek(offset, whence)
            return 100 if whence == os.SEEK_END else result

    monkeypatch.setattr(run_metrics, "open_run_output", lambda path: Growing(b"a\n" * (5 << 20)))
    text = run_ops.tail_text(tmp_path / "console.log", 20)
    assert text is not None and len(text) <= 21


def test_the_cli_reads_a_console_without_an_end_of_line_in_bounded_chunks_and_moves_on(tmp_path, capsys):
    from mcp_server import following

    console = tmp_path / rd.CONSOLE_LOG
    with open(console, "wb") as f:
        f.truncate(3 * following.ECHO_CHUNK_BYTES + 5)  # sparse, no newline anywhere
    offset = following.echo_console(console, 0, whole_lines=True, echo=False)
    assert offset == following.ECHO_CHUNK_BYTES  # one chunk, printed though it holds no whole line
    following.echo_rest(console, offset, echo=True)
    captured = capsys.readouterr()
    assert len(captured.out) == 2 * following.ECHO_CHUNK_BYTES + 5 and captured.err == ""


def test_a_lone_surrogate_in_a_metrics_record_is_shown_escaped_not_an_error(tmp_path):
    from mcp_server.server import build_server

    root = make_workspace(tmp_path / "ws")
    run_dir = fake_run(root, "r1")
    with open(run_dir / rd.METRICS_JSONL, "a") as f:
        f.write('{"step": 5, "loss": 1.0, "note": "\\ud800", "\\udfff": 2.0}\n')  # JSON escapes, on disk ASCII
    with live_client(build_server(root)) as client:
        for tool in ("tail_metrics", "get_run"):
            result = client.call(tool, {"run_id": "r1"})
            assert not result.is_error, result.content[0].text
        records = client.call("tail_metrics", {"run_id": "r1"}).structured_content["records"]
        assert records[-1]["note"] == "\\ud800" and records[-1]["\\udfff"] == 2.0


def test_the_event_file_search_looks_at_a_bounded_number_of_names(tmp_path, monkeypatch):
    from runner import tensorboard_events as events

    run_dir = tmp_path / "run"
    (run_dir / "noise").mkdir(parents=True)
    for i in range(events.MAX_SCANNED_ENTRIES + 2_000):
        (run_dir / "noise" / f"f{i}").touch()
    real_scandir, looked = os.scandir, []

    class Counted:
        def __init__(self, path):
            self.listing = real_scandir(path)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.listing.close()

        def __iter__(self):
            for item in self.listing:
                looked.append(item.name)
                yield item

    monkeypatch.setattr(events.os, "scandir", Counted)
    assert events.EventFiles(run_dir)._find() == []
    assert len(looked) <= events.MAX_SCANNED_ENTRIES + 1


def test_describe_calls_waiting_for_a_check_leave_the_servers_threads_to_the_other_tools(tmp_path, monkeypatch):
    """50 describe_recipe calls wait for one slow check (a recipe can sleep at import for up to
    the check's timeout): list_runs still answers at once."""
    import anyio

    from mcp_server.operations import recipe_info
    from mcp_server.server import build_server

    release = threading.Event()

    def slow_check(*args, **kwargs):
        release.wait(60)
        raise RuntimeError("released")

    monkeypatch.setattr(recipe_info, "check_launch", slow_check)
    monkeypatch.setattr(recipe_info, "_checked", type(recipe_info._checked)())
    root = make_workspace(tmp_path / "ws")
    fake_run(root, "r1")
    with live_client(build_server(root)) as client:
        async def describe_many():
            async with anyio.create_task_group() as group:
                for _ in range(50):
                    group.start_soon(client.client.call_tool, "describe_recipe", {"recipe": "recipes/lm"})

        waiting = client.portal.start_task_soon(describe_many)
        time.sleep(1.0)
        started = time.perf_counter()
        assert not client.call("list_runs").is_error
        took = time.perf_counter() - started
        release.set()
        waiting.result(60)
    assert took < 5.0
