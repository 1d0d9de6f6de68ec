"""`trainwright run` on the user's own script (its command line after ``--``), then
`checkpoints` and `resume` with the option named by ``--resume-arg``, through the real CLI."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from engine import run_dir as rd
from engine import run_metrics
from workspace import git as workspace_git
from tests.support import untimed

SCRIPT = Path(__file__).parents[1] / "mcp" / "scripts" / "mlp_train.py"

pytestmark = pytest.mark.slow


def trainwright(workspace, *args, script_args=()):
    """``trainwright ARGS --workspace W --json [-- SCRIPT_ARGS]``: exit code and JSON result."""
    separator = ["--", *script_args] if script_args else []
    result = subprocess.run([sys.executable, "-m", "mcp_server.cli", *args, "--workspace", str(workspace), "--json",
                             *separator], capture_output=True, text=True, timeout=600)
    return result.returncode, json.loads(result.stdout or "{}")


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli-script")
    shutil.copyfile(SCRIPT, root / "train.py")
    workspace_git.commit_paths(workspace_git.ensure_repo(root), [root / "train.py"], "a training script", [])
    return root


def test_run_passes_the_command_line_after_the_separator_and_resume_passes_the_checkpoint(workspace):
    code, out = trainwright(workspace, "run", "train.py", "--resume-arg=--resume",
                            script_args=["--steps", "4", "--save-every", "2"])
    assert code == 0 and out["status"] == "completed", out
    run_dir = workspace / out["run_dir"]
    assert [r["step"] for r in run_metrics.read_all_metrics(run_dir / rd.METRICS_JSONL)] == [1, 2, 3, 4]

    code, listed = trainwright(workspace, "checkpoints", out["run_id"])
    assert code == 0 and [c["step"] for c in listed["checkpoints"]] == [2, 4]
    code, resumed = trainwright(workspace, "resume", out["run_id"], "--step", "2")
    assert code == 0 and resumed["status"] == "completed" and resumed["resumed_from"]["step"] == 2
    continued = [untimed(r) for r in run_metrics.read_all_metrics(workspace / resumed["run_dir"] / rd.METRICS_JSONL)]
    assert continued == [untimed(r) for r in run_metrics.read_all_metrics(run_dir / rd.METRICS_JSONL)[2:]]


def test_a_script_that_fails_is_a_failed_run_with_exit_code_1(workspace):
    code, out = trainwright(workspace, "run", "train.py", script_args=["--steps", "not-a-number"])
    assert code == 1 and out["status"] == "failed"
    console = (workspace / out["run_dir"] / rd.CONSOLE_LOG).read_text()
    assert "argument --steps: invalid int value: 'not-a-number'" in console
