"""`trainwright run / resume / status / wait / tail / plot / recipes / describe / checkpoints /
stop` through the real CLI: ``cli.main`` in this process for the JSON answers and exit codes (a
fresh interpreter is ~10 s on 2 cores; test_exit_codes does the same), a process of its own for
the text that ``tail`` and ``describe`` print."""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys

import pytest

from engine import run_dir as rd
from mcp_server import cli
from tests.support import TINY, copy_template


def trainwright(workspace, *args, check=True):
    """``trainwright ARGS --workspace W --json`` in this process: exit code and JSON answer."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main([*args, "--workspace", str(workspace), "--json"])
    if check and code != 0:
        raise AssertionError(f"exit {code}: {out.getvalue()}{err.getvalue()}")
    return code, json.loads(out.getvalue())


def sets(*items):
    return [arg for item in items for arg in ("--set", item)]


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    copy_template(root / "recipes")
    return root


@pytest.mark.parametrize(
    "override, expected",
    [
        ("train.max_stpes=3", "unknown config key 'train.max_stpes'"),
        ("train.max_steps=abc", "bad value for config key 'train.max_steps'"),
        ("model.num_layerz=2", "valid keys in 'model':"),
    ],
)
def test_a_bad_set_fails_naming_the_key_and_leaves_no_run_directory(workspace, override, expected):
    code, out = trainwright(workspace, "run", "recipes/lm", "--set", override, check=False)
    assert code == 2
    assert expected in out["error"]
    assert not (workspace / rd.RUNS_DIRNAME).exists()


def test_an_unknown_recipe_is_not_found(workspace):
    code, out = trainwright(workspace, "run", "recipes/nope", check=False)
    assert code == 3 and "no recipe 'recipes/nope' in the workspace" in out["error"]


def test_run_then_resume_from_a_checkpoint_records_resumed_from(workspace):
    code, run = trainwright(
        workspace, "run", "recipes/lm", *sets(*TINY, "train.max_steps=6", "checkpoint.every=3")
    )
    assert code == 0 and run["status"] == "completed"
    assert (workspace / run["run_dir"] / rd.CONSOLE_LOG).read_text().count("step ") >= 6

    _, checkpoints = trainwright(workspace, "checkpoints", run["run_id"])
    assert [c["step"] for c in checkpoints["checkpoints"]] == [3, 6]

    _, resumed = trainwright(workspace, "resume", run["run_id"], "--step", "3")
    assert resumed["resumed_from"]["run_id"] == run["run_id"]
    assert resumed["resumed_from"]["step"] == 3
    record = rd.read_run(workspace / resumed["run_dir"])
    assert record.resumed_from.run_id == run["run_id"]
    assert record.status == rd.COMPLETED

    _, tail = trainwright(workspace, "tail", resumed["run_id"], "-n", "10")
    assert [r["step"] for r in tail["records"]] == [4, 5, 6]
    _, original = trainwright(workspace, "tail", run["run_id"], "-n", "3")
    assert [r["loss"] for r in tail["records"]] == [r["loss"] for r in original["records"]]


def resumed_run(workspace) -> rd.RunRecord:
    """run.json of the run that test_run_then_resume... resumed from step 3."""
    records = [rd.read_run(p) for p in sorted((workspace / rd.RUNS_DIRNAME).iterdir())]
    return next(r for r in records if r.resumed_from)


def test_wait_tail_and_plot_follow_a_resumed_run(workspace, tmp_path):
    child = resumed_run(workspace)

    code, waited = trainwright(workspace, "wait", child.id)
    assert code == 0 and waited["reason"] == "ended" and waited["status"] == "completed" and waited["step"] == 6

    _, history = trainwright(workspace, "tail", child.id, "--follow-resumes")
    assert [r["step"] for r in history["records"]] == [1, 2, 3, 4, 5, 6]
    assert history["resumes"] == [{"run_id": child.id, "step": 3}]

    text = subprocess.run(
        [sys.executable, "-m", "mcp_server.cli", "tail", child.id, "--follow-resumes",
         "--workspace", str(workspace)],
        capture_output=True, text=True, timeout=120,
    ).stdout.splitlines()
    assert text[0] == f"(steps after 3: run {child.id})" and text[1].startswith("step 1 | loss ")

    code, plotted = trainwright(workspace, "plot", child.id, "-o", str(tmp_path / "loss.png"))
    assert code == 0 and (tmp_path / "loss.png").read_bytes().startswith(b"\x89PNG\r\n\x1a\n")


def test_recipes_lists_the_recipe_folders_with_their_runs(workspace):
    runs_of_lm = [p for p in (workspace / rd.RUNS_DIRNAME).iterdir() if rd.read_run(p).recipe == "recipes/lm"]

    _, listed = trainwright(workspace, "recipes")

    assert listed == {"recipes": [{"path": "recipes/lm", "template": None, "last_commit": None, "last_change": None,
                                   "skills": 0, "runs": len(runs_of_lm)}], "truncated": False}
    assert len(runs_of_lm) >= 2


def test_describe_prints_every_config_key_with_default_and_value(workspace):
    _, described = trainwright(workspace, "describe", "recipes/lm")
    fields = {f["key"]: f for f in described["fields"]}
    assert fields["checkpoint.every"]["default"] == 100 and fields["checkpoint.every"]["value"] == 50
    assert described["template"] is None and described["skills"] == []

    text = subprocess.run(
        [sys.executable, "-m", "mcp_server.cli", "describe", "lm", "--workspace", str(workspace)],
        capture_output=True, text=True, timeout=300,
    ).stdout
    line = next(line for line in text.splitlines() if line.startswith("checkpoint.every "))
    assert line.split()[:5] == ["checkpoint.every", "int", "50", "*", "100"]


def test_wait_rejects_a_timeout_above_the_bound(workspace):
    child = resumed_run(workspace)
    code, out = trainwright(workspace, "wait", child.id, "--timeout", "601", check=False)
    assert code == 2 and "timeout_s must be a number of seconds above 0 and at most 600" in out["error"]


def test_resume_from_a_step_without_checkpoint_lists_the_steps(workspace):
    _, runs = trainwright(workspace, "runs")
    run_id = next(r["run_id"] for r in runs["runs"] if r["status"] == "completed")
    code, out = trainwright(workspace, "resume", run_id, "--step", "5", check=False)
    assert code == 3
    assert "no complete checkpoint at step 5" in out["error"] and "available steps" in out["error"]


def test_a_detached_run_can_be_stopped_and_leaves_no_process(workspace):
    _, run = trainwright(workspace, "run", "recipes/lm", "--detach", *sets(*TINY, "train.max_steps=100000"))
    run_dir = workspace / run["run_dir"]
    code, reached = trainwright(workspace, "wait", run["run_id"], "--until-step", "2", "--timeout", "300")
    assert code == 0 and reached["reason"] == "reached_step" and reached["step"] >= 2
    code, timed_out = trainwright(workspace, "wait", run["run_id"], "--until-step", "1000000000", "--timeout", "1",
                                  check=False)
    assert code == 124 and timed_out["reason"] == "timeout" and timed_out["status"] == "running"
    record = rd.read_run(run_dir)
    _, stopped = trainwright(workspace, "stop", run["run_id"])
    assert stopped["status"] == "stopped"
    for pid in (record.pid, record.child_pgid):
        assert not rd.pid_alive(pid)
    code, ended = trainwright(workspace, "wait", run["run_id"], check=False)
    assert code == 130 and ended["reason"] == "ended" and ended["status"] == "stopped"
