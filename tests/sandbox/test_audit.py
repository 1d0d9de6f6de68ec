"""Every tool call is appended to ``.trainwright/audit.jsonl`` — also those the SDK refuses before
a tool runs — with secrets redacted; ``trainwright audit`` prints the latest entries."""

from __future__ import annotations

import json

import pytest

from mcp_server.cli import main as cli_main
from mcp_server.server import build_server
from workspace.audit import AuditLog
from tests.sandbox.helpers import AUDIT, error_text, fake_run, live_client, make_workspace

SECRET = "s3cr3t-value-that-must-never-be-logged"
GITHUB_TOKEN = "ghp_" + "A1b2C3d4E5" * 4
RUN_ID = "20260101-000000-lm-abcd"


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = make_workspace(tmp_path_factory.mktemp("audit") / "ws")
    fake_run(root, RUN_ID)
    return root


@pytest.fixture
def calls(workspace, monkeypatch):
    monkeypatch.setenv("TRAINWRIGHT_TEST_API_KEY", SECRET)
    (workspace / AUDIT).unlink(missing_ok=True)
    with live_client(build_server(workspace)) as client:
        results = {
            "ok": client.call("get_run", {"run_id": RUN_ID}),
            "refused": client.call("get_run", {"run_id": f"../{SECRET}"}),
            "schema": client.call("tail_metrics", {"run_id": RUN_ID, "n": "many"}),
            "unknown": client.call("delete_everything", {"api_key": SECRET}),
            "params": client.call("apply_skill", {"skill": "gradient-checkpointing", "recipe": "recipes/lm",
                                                  "params": {"api_key": SECRET, "note": GITHUB_TOKEN}, "dry_run": True}),
            "huge": client.call("get_skill", {"skill": "x" * 200_000}),
        }
    return results, AuditLog(workspace / ".trainwright").tail(100)


def test_every_call_is_one_entry_with_its_outcome(calls):
    results, entries = calls
    assert [(e["tool"], e["outcome"]) for e in entries] == [
        ("get_run", "ok"), ("get_run", "error"), ("tail_metrics", "error"), ("delete_everything", "error"),
        ("apply_skill", "error"), ("get_skill", "error"),
    ]
    assert not results["ok"].is_error and all(r.is_error for k, r in results.items() if k != "ok")
    assert "not a plain name" in entries[1]["error"]
    assert "valid integer" in entries[2]["error"]
    assert "unknown tool" in entries[3]["error"]
    assert entries[5]["arguments"] == {"size": 200_012} and "too large" in entries[5]["error"]
    for entry in entries:
        assert entry["time"].endswith("+00:00")


def test_secrets_are_redacted_in_the_log_and_in_what_the_agent_sees(calls, workspace):
    results, entries = calls
    text = (workspace / AUDIT).read_text()
    assert SECRET not in text and GITHUB_TOKEN not in text
    assert entries[3]["arguments"] == {"api_key": "***"}  # named like a secret
    assert entries[1]["arguments"] == {"run_id": "../***"}  # the value of a secret variable
    assert entries[4]["arguments"]["params"] == {"api_key": "***", "note": "***"}  # a credential's shape
    assert SECRET not in error_text(results["refused"])


def test_long_values_are_cut_in_the_log(workspace):
    log = AuditLog(workspace / ".trainwright")
    log.record("get_skill", {"skill": "y" * 10_000, "items": list(range(500))}, "error", error="z" * 10_000)
    entry = log.tail(1)[0]
    assert len(entry["arguments"]["skill"]) <= 501 and len(entry["arguments"]["items"]) == 50
    assert len(entry["error"]) <= 501


def test_the_audit_command_prints_the_latest_entries(calls, workspace, capsys):
    assert cli_main(["audit", "--workspace", str(workspace), "-n", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[1:3] == ["apply_skill", "error"]
    assert "get_skill" in lines[2] and "too large" in lines[3]

    assert cli_main(["audit", "--workspace", str(workspace), "--json", "-n", "3"]) == 0
    entries = json.loads(capsys.readouterr().out)["entries"]
    assert [e["tool"] for e in entries] == ["delete_everything", "apply_skill", "get_skill"]

    assert cli_main(["audit", "--workspace", str(workspace), "-n", "0", "--json"]) == 2
    assert "at least 1" in json.loads(capsys.readouterr().out)["error"]


def test_the_tail_of_a_long_log_reads_only_its_end(tmp_path):
    log = AuditLog(tmp_path)
    for i in range(5000):
        log.record("list_runs", {"limit": i}, "ok")
    with open(log.path, "ab") as f:
        f.write(b'{"half a line')  # a write in progress
    assert [e["arguments"]["limit"] for e in log.tail(3)] == [4997, 4998, 4999]
    assert len(log.tail(10_000)) == 5000


def test_an_empty_workspace_has_no_entries(tmp_path, capsys):
    assert cli_main(["audit", "--workspace", str(tmp_path)]) == 0
    assert "no tool calls recorded yet" in capsys.readouterr().out
