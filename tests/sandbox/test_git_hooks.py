"""Git without the workspace's hooks: a ``post-commit`` hook, a ``pre-commit`` hook and a
``core.fsmonitor`` command planted in the workspace's repository never run when trainwright
commits, and git never sees the server's secrets."""

from __future__ import annotations

import os
import stat

import pytest

from mcp_server.operations import recipes as recipe_ops
from mcp_server.operations import skills as skill_ops
from workspace import git as workspace_git
from sandbox import redact as redaction
from workspace.workspace import Workspace
from tests.sandbox.helpers import make_workspace


def _plant(root, marker):
    script = f"#!/bin/sh\necho \"$0 $MYSQL_PWD\" >> {marker}\n"
    for hook in ("post-commit", "pre-commit", "fsmonitor"):
        path = root / ".git" / "hooks" / hook
        path.write_text(script)
        path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    with open(root / ".git" / "config", "a") as f:
        f.write(f"[core]\n\tfsmonitor = {root / '.git' / 'hooks' / 'fsmonitor'}\n")


@pytest.fixture
def workspace(tmp_path, monkeypatch):
    monkeypatch.setenv("MYSQL_PWD", "hunter2-mysql-pw")
    root = make_workspace(tmp_path / "ws")
    marker = tmp_path / "hook-ran"
    _plant(root, marker)
    yield Workspace.open(root), marker
    redaction.reload()


def test_apply_skill_and_scaffold_run_no_hook(workspace):
    ws, marker = workspace
    result = skill_ops.apply_skill(ws, "gradient-checkpointing", "recipes/lm")
    assert result.commit
    scaffolded = recipe_ops.scaffold_recipe(ws, "causal_lm", "fresh", {"train.max_steps": 5}, ["loss-guard"])
    assert scaffolded.commit and scaffolded.skills[0].commit
    assert not marker.exists(), marker.read_text()


def test_git_gets_the_server_secrets_blanked():
    os.environ["STRIPE_SK"] = "stripe-secret-value-42"
    try:
        scrubbed = workspace_git.scrubbed_environment()
    finally:
        del os.environ["STRIPE_SK"]
    assert scrubbed["STRIPE_SK"] == ""
    assert "PATH" not in scrubbed
