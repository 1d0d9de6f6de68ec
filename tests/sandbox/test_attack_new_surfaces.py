"""Hostile run output against the newer readers: a script run's TensorBoard event files and
checkpoints, compare_runs' metrics, and the live poller (``mcp_server.live``).

A run can write anything in its own run directory: links to host files, FIFOs, huge files. The
server and the supervisor read those names as untrusted input: never through a link, never
waiting on a FIFO (SECURITY.md, "What it does not guarantee" and "Readers that survive any run
output"). No real run is started: the files are planted in a fake run's directory.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

from engine import run_dir as rd
from engine import run_checkpoints
from mcp_server.live import LiveRuns
from mcp_server.operations.compare import compare_runs
from runner.tensorboard_events import EventFiles
from workspace.workspace import Workspace
from tests.sandbox.helpers import fake_run, make_workspace, scalar_event


def _bounded(call, seconds: float = 5.0):
    """``call()``'s result, failing the test when it blocks (a FIFO read) for ``seconds``."""
    result: dict[str, object] = {}

    def target():
        try:
            result["value"] = call()
        except BaseException as e:  # noqa: BLE001 - re-raised below
            result["error"] = e

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"{call} blocked for {seconds} s (a FIFO planted by the run)"
    if "error" in result:
        raise result["error"]  # type: ignore[misc]
    return result.get("value")


def _script_run(workspace: Path, run_id: str) -> Path:
    return fake_run(workspace, run_id, kind=rd.SCRIPT, script="train.py", checkpoints=())


def test_a_link_in_a_run_directory_does_not_let_the_live_poll_watch_a_host_file(tmp_path):
    """The poll that tells subscribers a run changed looks at the run's ``metrics.jsonl``,
    ``console.log`` and ``checkpoints/``. A run that puts a link there to a host file (here a
    stand-in for the server's token file) must not have the poll report that file's changes:
    a link in their place is read as empty, and the checkpoint lister does not follow one
    because it "could make the listing say whether a host path exists"."""
    workspace = make_workspace(tmp_path / "ws")
    run_dir = _script_run(workspace, "20261202-000000-script-aaaa")
    secret = tmp_path / "outside" / "http-token"
    secret.parent.mkdir()
    secret.write_text("token-v1\n")
    for name in (rd.METRICS_JSONL, rd.CONSOLE_LOG):
        (run_dir / name).unlink()
        (run_dir / name).symlink_to(secret)
    (run_dir / rd.CHECKPOINTS_DIRNAME).rmdir()  # made empty with the run directory
    (run_dir / rd.CHECKPOINTS_DIRNAME).symlink_to(secret.parent, target_is_directory=True)

    live = LiveRuns(Workspace.open(workspace), bus=None)  # the bus is only for delivering updates
    before = live._observe(run_dir.name, None)
    assert before is not None
    os.utime(secret, ns=(1, 1))
    secret.write_text("token-v2 is longer\n")  # the host file changes; the run's files do not
    (secret.parent / "new-file").write_text("x")
    after = live._observe(run_dir.name, before)
    assert after is not None
    assert before.files == after.files, (
        "the live poll follows the run's links out of its run directory: "
        f"{ {k: (before.files[k], after.files[k]) for k in before.files if before.files[k] != after.files[k]} }")


def test_fifos_and_links_planted_in_a_script_run_neither_block_nor_leak(tmp_path):
    """A FIFO and links to a host file planted as ``metrics.jsonl``, as a TensorBoard events
    file and among ``checkpoints/``: compare_runs, the checkpoint lister and the supervisor's
    event reader return at once, read nothing from the host file and list no link or FIFO."""
    workspace = make_workspace(tmp_path / "ws")
    run_a = _script_run(workspace, "20261202-000001-script-aaaa")
    run_b = _script_run(workspace, "20261202-000002-script-bbbb")
    outside = tmp_path / "outside"
    outside.mkdir()
    host_events = outside / "events.out.tfevents.1.host.1.0"
    host_events.write_bytes(scalar_event(7, "leaked", 1234.5))
    host_metrics = outside / "metrics.jsonl"
    host_metrics.write_text("".join(f'{{"step": {s}, "tokens_per_s": 999, "step_time_s": 1, "peak_mem_mb": 4242}}\n'
                                    for s in range(1, 9)))

    (run_a / rd.METRICS_JSONL).unlink()
    os.mkfifo(run_a / rd.METRICS_JSONL)
    (run_b / rd.METRICS_JSONL).unlink()
    (run_b / rd.METRICS_JSONL).symlink_to(host_metrics)
    for run in (run_a, run_b):
        logs = run / "logs"
        logs.mkdir()
        os.mkfifo(logs / "events.out.tfevents.2.fifo.1.0")
        (logs / "events.out.tfevents.3.link.1.0").symlink_to(host_events)
        (run / "tb_link").symlink_to(outside, target_is_directory=True)  # a link to a folder of events
        checkpoints = run / rd.CHECKPOINTS_DIRNAME
        checkpoints.mkdir(exist_ok=True)
        (checkpoints / "ckpt_100.pt").write_bytes(b"real")
        (checkpoints / "ckpt_200.pt").symlink_to(host_events)
        (checkpoints / "step-300").symlink_to(outside, target_is_directory=True)
        os.mkfifo(checkpoints / "ckpt_400.pt")

    ws = Workspace.open(workspace)
    result = _bounded(lambda: compare_runs(ws, run_a.name, run_b.name))
    shown = result.model_dump_json()
    assert "4242" not in shown and "999" not in shown, "compare_runs read metrics through a link out of the run"

    for run in (run_a, run_b):
        listed = _bounded(lambda: run_checkpoints.run_checkpoints(run, rd.SCRIPT))
        assert listed == [(100, run / rd.CHECKPOINTS_DIRNAME / "ckpt_100.pt")]
        events = _bounded(lambda: EventFiles(run).new_scalars())
        assert events == [], f"the event reader read through a link or FIFO: {events}"

    # The reader does read a real events file in the run directory (the check above is not vacuous).
    (run_a / "logs" / "events.out.tfevents.4.real.1.0").write_bytes(scalar_event(5, "loss/train", 2.5))
    assert _bounded(lambda: EventFiles(run_a).new_scalars()) == [(5, {"loss_train": 2.5})]


def test_an_events_folder_swapped_for_a_link_after_the_search_is_not_read_through(tmp_path, monkeypatch):
    """The supervisor searches the run directory for event files, then opens each by its path
    with ``O_NOFOLLOW``, which guards the last name only. A running script that swaps the folder
    holding its events file for a link (between the search and the read: it can retry at will,
    the supervisor looks again and again) must not make the supervisor read a host file of that
    name through the link: its scalars would land in the run's own metrics.jsonl, which the run
    reads back."""
    workspace = make_workspace(tmp_path / "ws")
    run = _script_run(workspace, "20261202-000003-script-cccc")
    name = "events.out.tfevents.9.host.1.0"
    outside = tmp_path / "outside"  # e.g. another run's log folder
    outside.mkdir()
    (outside / name).write_bytes(scalar_event(3, "other_runs_secret", 42.0))
    logs = run / "logs"
    logs.mkdir()
    (logs / name).write_bytes(b"")  # a real, empty events file: what the search finds

    files = EventFiles(run)
    search = EventFiles._find

    def search_then_swap(self):
        found = search(self)
        (logs / name).unlink()
        logs.rmdir()
        logs.symlink_to(outside, target_is_directory=True)  # what the script does meanwhile
        return found

    monkeypatch.setattr(EventFiles, "_find", search_then_swap)
    assert files.new_scalars() == [], "the event reader followed a folder swapped for a link out of the run"
