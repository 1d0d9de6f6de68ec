"""A run writes its own run directory; the server and the supervisor (outside the sandbox) read
and update ``run.json`` there. Whatever the run leaves at the names they use — a link to a host
file, a FIFO, a file that is not a run record — must not make them write a host file, hang, or
echo a host file's content back to the agent.

All in this process, on fake run directories (no run is started).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from engine import run_dir as rd
from engine import run_checkpoints
from engine import run_metrics
from mcp_server.operations import model_tools
from workspace.workspace import Workspace
from tests.sandbox.helpers import fake_run, make_workspace, record_folder

SECRET = "host-secret-line-0123456789\n"


@pytest.fixture
def run(tmp_path) -> Path:
    return fake_run(tmp_path / "ws", "r1")


@pytest.fixture
def victim(tmp_path) -> Path:
    path = tmp_path / "outside" / "victim.txt"
    path.parent.mkdir()
    path.write_text(SECRET)
    return path


def test_an_update_never_writes_through_a_temporary_name_the_run_planted(run, victim):
    # The supervisor's pid is in run.json, so the run can predict a pid-named temporary file.
    for pid in {os.getpid(), *range(1, 64)}:
        (run / f".run.json.{pid}.tmp").symlink_to(victim)
    record = rd.update_run(run, status=rd.FAILED)
    assert victim.read_text() == SECRET
    assert not (run / rd.RUN_JSON).is_symlink() and rd.read_run(run).status == record.status == rd.FAILED


def test_the_lock_file_is_never_a_link_or_a_fifo(run, victim):
    missing = victim.parent / "created-by-the-lock"
    (run / ".run.json.lock").unlink()
    (run / ".run.json.lock").symlink_to(missing)
    rd.update_run(run, status=rd.FAILED)
    assert not missing.exists() and victim.read_text() == SECRET
    (run / ".run.json.lock").unlink()
    os.mkfifo(run / ".run.json.lock")  # opening a FIFO to write would wait for a reader forever
    assert rd.update_run(run, status=rd.STOPPED).status == rd.STOPPED


def test_a_linked_run_json_is_not_read_and_its_target_never_echoed(tmp_path, victim):
    workspace = make_workspace(tmp_path / "ws")
    run = fake_run(workspace, "r1")
    (run / rd.RUN_JSON).unlink()
    (run / rd.RUN_JSON).symlink_to(victim)
    with pytest.raises(OSError):
        rd.read_run(run)
    ws = Workspace.open(workspace)
    for call in (lambda: model_tools.sample(ws, "r1", ["x"]), lambda: model_tools.evaluate(ws, "r1"),
                 lambda: model_tools.export_checkpoint(ws, "r1", "exports/x")):
        with pytest.raises(Exception) as caught:
            call()
        assert "host-secret" not in str(caught.value) and "run.json" in str(caught.value)
        assert type(caught.value).__name__ in ("BadInput", "NotFound")
    assert not (workspace / "exports").exists()


def test_a_fifo_run_json_does_not_hang_a_reader(run):
    (run / rd.RUN_JSON).unlink()
    os.mkfifo(run / rd.RUN_JSON)
    with pytest.raises(OSError):
        rd.read_run(run)


def test_a_run_json_that_is_not_a_record_is_refused_without_echoing_it(run):
    (run / rd.RUN_JSON).write_text(SECRET)
    with pytest.raises(ValueError) as caught:
        rd.read_run(run)
    assert "host-secret" not in str(caught.value) and rd.RUN_JSON in str(caught.value)
    (run / rd.RUN_JSON).write_text('{"id": ["' + SECRET.strip() + '"]}')
    with pytest.raises(ValueError) as caught:
        rd.read_run(run)
    assert "host-secret" not in str(caught.value) and "id" in str(caught.value)


def test_the_supervisor_notes_the_outcome_on_the_commit_it_was_started_with(tmp_path):
    from workspace.git import NOTES_REF, open_repo
    from runner.supervise import Supervisor

    workspace, other = make_workspace(tmp_path / "ws"), make_workspace(tmp_path / "other")
    head = open_repo(workspace).head.commit.hexsha
    run = fake_run(workspace, "r1", status=rd.RUNNING, git_commit=head)
    supervisor = Supervisor(record_folder(run, workspace))
    # The run rewrites its run.json: the note should land in another repository.
    rd.update_run(run, workspace=str(other), git_commit=open_repo(other).head.commit.hexsha)
    supervisor.finish(0)
    assert "r1: completed" in open_repo(workspace).git.notes(f"--ref={NOTES_REF}", "show", head)
    assert not open_repo(other).git.for_each_ref("refs/notes")


@pytest.mark.parametrize("plant", ["link", "fifo"])
def test_console_and_metrics_the_run_replaced_by_links_or_fifos_are_not_read(tmp_path, victim, plant):
    from mcp_server.operations import runs as run_ops

    victim.write_text('{"step": 1, "loss": 1.0, "note": "' + SECRET.strip() + '"}\n')
    workspace = make_workspace(tmp_path / "ws")
    run = fake_run(workspace, "r1")
    for name in (rd.CONSOLE_LOG, rd.METRICS_JSONL):
        (run / name).unlink()
        (run / name).symlink_to(victim) if plant == "link" else os.mkfifo(run / name)
    ws = Workspace.open(workspace)
    shown = (run_ops.get_run(ws, "r1").model_dump_json() + run_ops.tail_metrics(ws, "r1").model_dump_json()
             + str(run_ops.tail_text(run / rd.CONSOLE_LOG, 20_000)) + str(run_metrics.read_all_metrics(run / rd.METRICS_JSONL)))
    assert "host-secret" not in shown


def test_a_checkpoints_folder_replaced_by_a_link_holds_no_checkpoint(tmp_path):
    elsewhere = fake_run(tmp_path / "other-workspace", "r9")  # checkpoints of another project
    run = fake_run(tmp_path / "ws", "r1", checkpoints=())
    (run / rd.CHECKPOINTS_DIRNAME).rmdir()
    (run / rd.CHECKPOINTS_DIRNAME).symlink_to(elsewhere / rd.CHECKPOINTS_DIRNAME)
    assert run_checkpoints.list_checkpoints(run) == []
