"""Secrets by value: what a run prints of the server's environment never comes back in clear —
not in tool results, resources, errors, the audit log or the CLI's output."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from engine import run_dir as rd
from mcp_server.server import build_server
from sandbox import redact as redaction
from sandbox.redact import Redactor
from tests.sandbox.helpers import AUDIT, error_text, fake_run, live_client, make_workspace

SECRETS = {
    "MYSQL_PWD": "hunter2-mysql-pw",
    "REDIS_URL": "redis://:r3dis-pass-word@cache.internal:6379/0",
    "STRIPE_SK": "stripe-secret-value-42",
    "HF_TOKEN": "hf_abcdefghijklmnopqrstuvwxyz0123",
    "SOME_SETTING": "Zq8vN2xLw0Rk7TfY4bHc9sJm1PdG6uEa",  # a key by shape: long and random
}
RUN_ID = "20260101-000000-lm-5ec7"


def test_values_are_caught_by_name_by_url_and_by_shape():
    redactor = Redactor({**SECRETS, "PATH": "/usr/bin:/bin", "PWD": "/work/somewhere", "LANG": "C.UTF-8"})
    text = " | ".join(SECRETS.values()) + " /usr/bin:/bin /work/somewhere C.UTF-8"
    shown = redactor.text(text)
    for value in SECRETS.values():
        assert value not in shown
    assert "r3dis-pass-word" not in shown
    assert "/usr/bin:/bin /work/somewhere C.UTF-8" in shown  # ordinary values stay readable


def test_credentials_in_urls_and_token_formats_are_caught_without_the_environment():
    shown = Redactor({}).text(
        "postgres://app:s3cr3tpass@db:5432/x ghp_0123456789abcdefghijABCDEFGHIJ sk_live_0123456789abcdef"
    )
    assert "s3cr3tpass" not in shown and "ghp_" not in shown and "sk_live_" not in shown
    assert "postgres://app:***@db:5432/x" in shown


def test_short_values_are_not_collected():
    assert Redactor({"API_TOKEN": "abc"}).text("abc abcdef") == "abc abcdef"


def test_a_result_is_redacted_at_every_depth():
    redactor = Redactor(SECRETS)
    value = {"a": [{"b": ("x " + SECRETS["MYSQL_PWD"],)}], SECRETS["STRIPE_SK"]: 1}
    assert SECRETS["MYSQL_PWD"] not in json.dumps(redactor.value(value))
    assert SECRETS["STRIPE_SK"] not in json.dumps(redactor.value(value))


@pytest.fixture
def leaky_workspace(tmp_path, monkeypatch):
    for name, value in SECRETS.items():
        monkeypatch.setenv(name, value)
    root = make_workspace(tmp_path / "ws")
    leaked = "\n".join(f"{k}={v}" for k, v in SECRETS.items())
    run_dir = fake_run(root, RUN_ID, status=rd.FAILED, error=f"crashed: {SECRETS['MYSQL_PWD']}")
    (run_dir / rd.CONSOLE_LOG).write_text(f"reading /proc/1/environ\n{leaked}\n")
    with open(run_dir / rd.METRICS_JSONL, "a") as f:
        f.write(json.dumps({"step": 5, "loss": 1.0, "note": SECRETS["REDIS_URL"]}) + "\n")
    yield root
    redaction.reload()


def _assert_clean(text: str) -> None:
    for value in SECRETS.values():
        assert value not in text
    assert "r3dis-pass-word" not in text


def test_tool_results_resources_errors_and_the_audit_are_redacted(leaky_workspace):
    with live_client(build_server(leaky_workspace)) as client:
        results = [
            client.call("get_run", {"run_id": RUN_ID}),
            client.call("tail_metrics", {"run_id": RUN_ID}),
            client.call("list_runs", {}),
            client.call("get_run", {"run_id": SECRETS["MYSQL_PWD"]}),  # an error that echoes its input
        ]
        texts = [error_text(r) + json.dumps(r.structured_content or {}) for r in results]
        assert "***" in texts[0]
        for uri in (f"run://{RUN_ID}/log", f"run://{RUN_ID}/metrics"):
            texts.append("".join(c.text for c in client.read_resource(uri).contents))
    for text in texts:
        _assert_clean(text)
    _assert_clean((leaky_workspace / AUDIT).read_text())


def test_the_cli_output_is_redacted(leaky_workspace):
    env = {"PATH": "/usr/bin:/bin", **SECRETS}
    for command in (["status", RUN_ID], ["tail", RUN_ID], ["status", RUN_ID, "--json"], ["status", SECRETS["MYSQL_PWD"]]):
        result = subprocess.run(
            [sys.executable, "-m", "mcp_server.cli", *command, "--workspace", str(leaky_workspace)],
            capture_output=True, text=True, env=env, timeout=60,
        )
        assert result.stdout or result.stderr
        _assert_clean(result.stdout + result.stderr)
