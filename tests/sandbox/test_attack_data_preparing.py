"""A run writes its data's tokenizing progress into its own run.json (``data.preparing``), so it
can write anything there. What get_run and wait_run show of it stays bounded and sane: no
negative counts, no 300-digit numbers, no NaN, infinite or negative time left."""

from __future__ import annotations

import json
import os

import anyio
import pytest

from engine import run_dir as rd
from engine import run_files
from engine.data_summary import MAX_DATA_COUNT, MAX_PREPARING_ETA_S
from mcp_server.operations import runs
from mcp_server.operations.waiting import wait_run
from tests.sandbox.helpers import fake_run, make_workspace
from workspace.workspace import Workspace

RUN_ID = "20260101-000000-lm-forged-prep"


def _shown(tmp_path, forged: dict) -> tuple[dict, str]:
    root = make_workspace(tmp_path / "ws")
    pending = rd.DataSummary(source="files", paths=["data"], files=1, documents=0, tokens=0, train_documents=0,
                             eval_documents=0, train_tokens=0, eval_tokens=0, bytes=4,
                             preparing=rd.DataPreparation(bytes_total=4))
    run_dir = fake_run(root, RUN_ID, status=rd.RUNNING, steps=0, checkpoints=(), pid=os.getpid(), data=pending)
    record = json.loads((run_dir / rd.RUN_JSON).read_text())
    record["data"]["preparing"] = forged  # as the run's code can write it
    run_files.write_json_atomic(run_dir / rd.RUN_JSON, record)
    shown = runs.get_run(Workspace.open(root), RUN_ID).data["preparing"]
    heard: list[str] = []

    async def on_progress(now):
        heard.append(now.progress_message())

    anyio.run(lambda: wait_run(Workspace.open(root), RUN_ID, timeout_s=0.05, on_progress=on_progress))
    return shown, heard[0]


def test_huge_forged_counts_are_cut_to_a_petabyte_and_the_progress_line_stays_short(tmp_path):
    shown, heard = _shown(tmp_path, {"documents": 10**300, "bytes_done": 10**300, "bytes_total": 10**300,
                                     "eta_s": 1e308})
    assert shown == {"documents": MAX_DATA_COUNT, "bytes_done": MAX_DATA_COUNT,
                     "bytes_total": MAX_DATA_COUNT, "eta_s": float(MAX_PREPARING_ETA_S)}
    assert len(heard) < 200 and "about 10000000 s left" in heard


@pytest.mark.parametrize("eta", [-50, "NaN", "Infinity", "-Infinity"])
def test_a_negative_or_not_finite_time_left_is_not_shown(tmp_path, eta):
    shown, heard = _shown(tmp_path, {"documents": -3, "bytes_done": -1, "bytes_total": 8_000_000, "eta_s": eta})
    assert shown == {"documents": 0, "bytes_done": 0, "bytes_total": 8_000_000, "eta_s": None}
    assert heard == "tokenizing the data as the run's first phase: 0 documents, 0.0 of 8.0 MB"


def test_the_data_summarys_own_counts_a_run_forges_are_bounded_too(tmp_path):
    """The summary's counts live in the same run-written file: each is cut to 0..MAX_DATA_COUNT."""
    root = make_workspace(tmp_path / "ws")
    summary = rd.DataSummary(source="files", paths=["data"], files=1, documents=2, tokens=9, train_documents=2,
                             eval_documents=0, train_tokens=9, eval_tokens=0)
    run_dir = fake_run(root, RUN_ID, status=rd.RUNNING, steps=0, checkpoints=(), pid=os.getpid(), data=summary)
    record = json.loads((run_dir / rd.RUN_JSON).read_text())
    record["data"].update(documents=10**300, tokens=-5, dropped=10**20, files=None)
    run_files.write_json_atomic(run_dir / rd.RUN_JSON, record)
    shown = runs.get_run(Workspace.open(root), RUN_ID).data
    assert (shown["documents"], shown["tokens"], shown["dropped"], shown["files"]) == (MAX_DATA_COUNT, 0, MAX_DATA_COUNT, None)
