"""A run writes its own run.json, so it can write a data summary whose ``streaming`` flag and
counts disagree: ``streaming: false`` with the counts null (as only a streamed summary has them),
or ``streaming: true`` with ``bytes`` null. What the server shows of it (get_run, `trainwright
status`, the model card, the supervisor's commit note) neither crashes nor prints "None"."""

from __future__ import annotations

import json
import os

import pytest

from engine import run_dir as rd
from engine import run_files
from mcp_server import terminal
from mcp_server.operations import model_card, runs
from runner.supervise import run_note
from tests.sandbox.helpers import fake_run, make_workspace
from workspace.workspace import Workspace

RUN_ID = "20260101-000000-lm-forged-stream"
COUNTS = ("documents", "tokens", "train_documents", "eval_documents", "train_tokens", "eval_tokens")


@pytest.mark.parametrize("forged", [{"streaming": False, **dict.fromkeys(COUNTS)},
                                    {"streaming": True, "bytes": None, "files": None, **dict.fromkeys(COUNTS)}])
def test_a_forged_streaming_flag_or_null_counts_show_without_crashing(tmp_path, forged):
    root = make_workspace(tmp_path / "ws")
    summary = rd.DataSummary(source="files", paths=["data"], files=1, documents=2, tokens=9, train_documents=2,
                             eval_documents=0, train_tokens=9, eval_tokens=0)
    run_dir = fake_run(root, RUN_ID, status=rd.RUNNING, steps=0, checkpoints=(), pid=os.getpid(), data=summary)
    record = json.loads((run_dir / rd.RUN_JSON).read_text())
    record["data"].update(forged)  # as the run's code can write it
    run_files.write_json_atomic(run_dir / rd.RUN_JSON, record)

    info = runs.get_run(Workspace.open(root), RUN_ID)
    data = rd.read_run(run_dir).data
    shown = [terminal.status_text(info), data.describe(), run_note(rd.read_run(run_dir), None),
             *model_card._data_lines(data, None)]
    assert all("None" not in line for line in shown), shown
