"""resume_checkpoint takes overrides (the CLI's ``resume --set`` too), and a resume with nothing
left to train is refused with how to continue, instead of a run that does nothing."""

from __future__ import annotations

import pytest

from engine.errors import BadInput
from mcp_server.operations import launch as launching
from workspace.workspace import Workspace
from tests.sandbox.helpers import fake_run, make_workspace, tree_hash


def test_resuming_a_finished_run_with_nothing_left_is_bad_input_that_says_how_to_continue(tmp_path):
    root = make_workspace(tmp_path / "ws")
    run_dir = fake_run(root, "20260101-000000-lm-done", steps=4, checkpoints=(2, 4))
    before = tree_hash(root)
    with pytest.raises(BadInput) as refused:
        launching.resume_checkpoint(Workspace.open(root), run_dir.name, code="head")
    message = str(refused.value)
    assert "checkpoint at step 4 has nothing left to train (train.max_steps is 4)" in message
    assert 'pass overrides {"train.max_steps": 8}' in message
    # An override that still leaves nothing to do is refused the same way.
    with pytest.raises(BadInput, match=r"train.max_steps is 3\)"):
        launching.resume_checkpoint(Workspace.open(root), run_dir.name, overrides={"train.max_steps": 3}, code="head")
    assert tree_hash(root) == before


def test_the_tool_passes_its_overrides_to_the_resume(tmp_path):
    from mcp_server.server import build_server
    from tests.sandbox.helpers import error_text, live_client

    root = make_workspace(tmp_path / "ws")
    run_dir = fake_run(root, "20260101-000000-lm-done", steps=4, checkpoints=(2, 4))
    with live_client(build_server(root)) as client:
        result = client.call("resume_checkpoint", {"run_id": run_dir.name, "step": 4, "code": "head",
                                                   "overrides": {"train.max_steps": 3}})
    assert result.is_error
    assert "bad_input: run 20260101-000000-lm-done's checkpoint at step 4 has nothing left to train " \
           "(train.max_steps is 3)" in error_text(result)


def test_the_cli_resume_takes_the_same_overrides(tmp_path, capsys):
    import json

    from engine.errors import EXIT_BAD_INPUT
    from mcp_server import cli

    root = make_workspace(tmp_path / "ws")
    run_dir = fake_run(root, "20260101-000000-lm-done", steps=4, checkpoints=(2, 4))
    code = cli.main(["resume", run_dir.name, "--code", "head", "--set", "train.max_steps=3", "--workspace",
                     str(root), "--json"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == EXIT_BAD_INPUT and "(train.max_steps is 3)" in out["error"]
