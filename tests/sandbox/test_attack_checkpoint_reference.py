"""A run that starts from another run's checkpoint (``run:RUN_ID@STEP``, resume_checkpoint) sees
that checkpoint read-only in its sandbox. The other run may still be running and rewriting its
own run folder: a link it puts in the checkpoint's place after the server chose the checkpoint
must show the new run nothing of the host."""

from __future__ import annotations

import sys

import pytest

from engine import run_dir as rd
from runner import processes
from runner import server_record as sr
from sandbox.bwrap import find_bwrap, probe
from tests.sandbox.helpers import make_workspace, supervise
from workspace.workspace import record_dir

RUN_ID = "20260101-000000-from-0000"
SOURCE = "20260101-000000-source-0000"
READ = ("import pathlib, sys; p = pathlib.Path(sys.argv[1]); "
        "print('SEEN', sorted(x.name for x in p.iterdir()) if p.is_dir() else p.read_text(), flush=True)")


def _start_from(tmp_path, swap: bool) -> tuple[str, sr.ServerRecord]:
    if probe(find_bwrap()) is not None:
        pytest.skip(f"bubblewrap cannot run here: {probe(find_bwrap())}")
    workspace = make_workspace(tmp_path / "ws")
    checkpoint = workspace / rd.RUNS_DIRNAME / SOURCE / rd.CHECKPOINTS_DIRNAME / "step-5"
    checkpoint.mkdir(parents=True)
    (checkpoint / "model.pt").write_text("weights")
    if swap:  # as the source run can, once the server has chosen step-5
        (tmp_path / "host").mkdir()
        (tmp_path / "host" / "secret.txt").write_text("host secret")
        (checkpoint / "model.pt").unlink()
        checkpoint.rmdir()
        checkpoint.symlink_to(tmp_path / "host")
    run_dir = workspace / rd.RUNS_DIRNAME / RUN_ID
    supervise(run_dir, [sys.executable, "-c", READ, str(checkpoint)], run_id=RUN_ID, kind=rd.SCRIPT,
              resumed_from=rd.ResumedFrom(run_id=SOURCE, step=5, path=str(checkpoint)), sandbox={
                  "bwrap": find_bwrap(), "read_only": [str(workspace), str(checkpoint)], "writable": [str(run_dir)],
                  "hidden": [str(p) for p in processes.hidden_state(workspace)]}).wait(60)
    return (run_dir / rd.CONSOLE_LOG).read_text(), sr.read_record(record_dir(workspace, RUN_ID))


def test_the_checkpoint_a_run_starts_from_is_shown_in_its_sandbox(tmp_path):
    console, record = _start_from(tmp_path, swap=False)
    assert "SEEN ['model.pt']" in console and record.status == rd.COMPLETED and record.isolation == "full", console


def test_a_link_put_in_the_checkpoints_place_fails_the_run_unstarted_and_shows_nothing_of_the_host(tmp_path):
    console, record = _start_from(tmp_path, swap=True)
    assert "secret" not in console and "SEEN" not in console, console
    assert record.status == rd.FAILED
    assert record.error == (f"the run was not started: the checkpoint it starts from ({SOURCE} step 5) is gone or "
                            "a link now")
