"""A recipe may log any JSON number: an integer too large for a float (``10**400``) must not turn
wait_run into an internal error, nor stop the supervisor before it writes the run's git note."""

from __future__ import annotations

import json

from engine import run_dir as rd
from mcp_server.server import build_server
from sandbox.supervise import run_note
from tests.sandbox.helpers import error_text, fake_run, live_client, make_workspace

HUGE = 10**400


def test_wait_run_survives_a_loss_too_large_for_a_float(tmp_path):
    root = make_workspace(tmp_path / "ws")
    run_dir = fake_run(root, "20260101-000000-lm-huge", exit_code=0)
    with open(run_dir / rd.METRICS_JSONL, "a") as f:
        f.write(json.dumps({"step": 5, "loss": HUGE, "tokens_per_s": HUGE}) + "\n")
    with live_client(build_server(root)) as client:
        result = client.call("wait_run", {"run_id": "20260101-000000-lm-huge", "timeout_s": 5})
    assert not result.is_error, error_text(result)
    assert result.structured_content["reason"] == "ended" and result.structured_content["step"] == 5


def test_the_git_note_survives_a_loss_too_large_for_a_float():
    record = rd.RunRecord(id="20260101-000000-lm-huge", recipe="recipes/lm", status=rd.COMPLETED)
    note = run_note(record, {"step": 5, "loss": HUGE, "tokens_per_s": HUGE})
    assert note.startswith("run 20260101-000000-lm-huge: completed; step 5/")
