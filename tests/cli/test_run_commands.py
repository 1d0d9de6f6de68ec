"""`trainwright run / resume / status / tail / checkpoints / stop` through the real CLI."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from engine import run_dir as rd
from tests.support import TINY, copy_template, wait_for


def trainwright(workspace, *args, check=True):
    result = subprocess.run(
        [sys.executable, "-m", "mcp_server.cli", *args, "--workspace", str(workspace), "--json"],
        capture_output=True, text=True, timeout=600,
    )
    if check and result.returncode != 0:
        raise AssertionError(f"exit {result.returncode}: {result.stdout}{result.stderr}")
    return result.returncode, json.loads(result.stdout)


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


def test_resume_from_a_step_without_checkpoint_lists_the_steps(workspace):
    _, runs = trainwright(workspace, "runs")
    run_id = next(r["run_id"] for r in runs["runs"] if r["status"] == "completed")
    code, out = trainwright(workspace, "resume", run_id, "--step", "5", check=False)
    assert code == 3
    assert "no complete checkpoint at step 5" in out["error"] and "available steps" in out["error"]


def test_a_detached_run_can_be_stopped_and_leaves_no_process(workspace):
    _, run = trainwright(workspace, "run", "recipes/lm", "--detach", *sets(*TINY, "train.max_steps=100000"))
    run_dir = workspace / run["run_dir"]
    wait_for(lambda: rd.read_metrics_tail(run_dir / rd.METRICS_JSONL, 1)[0], timeout=120)
    record = rd.read_run(run_dir)
    _, stopped = trainwright(workspace, "stop", run["run_id"])
    assert stopped["status"] == "stopped"
    for pid in (record.pid, record.child_pgid):
        assert not rd.pid_alive(pid)
