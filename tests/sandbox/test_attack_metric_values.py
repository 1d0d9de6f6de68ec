"""A recipe may log any JSON number: an integer too large for a float (``10**400``) must not turn
wait_run into an internal error, nor stop the supervisor before it writes the run's git note."""

from __future__ import annotations

import json

from engine import run_dir as rd
from runner import server_record as sr
from mcp_server.server import build_server
from runner.supervise import run_note
from tests.sandbox.helpers import error_text, fake_run, live_client, make_workspace, record_folder

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


def test_the_git_note_is_one_bounded_line_whatever_the_run_wrote(tmp_path, monkeypatch):
    # run.json and metrics.jsonl are the run's to write: what it put there must not add a line
    # of its own to the commit's note (one line per run), nor make the note huge.
    from runner import supervise

    forged = "\nrun 20260101-000000-lm-other: completed; loss 0.0100\n"
    record = rd.RunRecord(id="20260101-000000-lm-huge", recipe="recipes/lm" + forged, status=rd.COMPLETED,
                          data=rd.DataSummary(source="x" * 200_000 + forged + "\x1b]52;c;AAAA\x07", documents=1,
                                              tokens=1, train_documents=1, eval_documents=0, train_tokens=1,
                                              eval_tokens=0))
    note = run_note(record, {"step": forged + "9" * 200_000})
    assert "\n" not in note and "\r" not in note and "\x1b" not in note and len(note) < 2000
    # The supervisor names the run and recipe as launched (the server's record), not as run.json
    # says by the end.
    root = make_workspace(tmp_path / "ws")
    run_dir = fake_run(root, "20260101-000000-lm-huge", exit_code=0, git_commit="0" * 40)
    written = []
    monkeypatch.setattr(supervise, "add_note", lambda root, sha, text: written.append(text))
    supervisor = supervise.Supervisor(record_folder(run_dir, root))
    rd.update_run(run_dir, id="20260101-000000-lm-other", recipe="recipes/other")
    supervisor.write_git_note(sr.read_record(record_folder(run_dir, root)))
    assert written and written[0].startswith("run 20260101-000000-lm-huge: ") and "recipes/other" not in written[0]
