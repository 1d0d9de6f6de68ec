"""examples/ci/agent_smoke.sh, the script the example CI workflow runs, on the tiny model."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.mcp.conftest import git, tiny_config, trainwright_command
from tests.support import REPO

SCRIPT = REPO / "examples" / "ci" / "agent_smoke.sh"
WORKFLOW = REPO / "examples" / "ci" / "agent-smoke.yml"

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    """A workspace with recipes/lm scaffolded (tiny model) through the CLI."""
    root = tmp_path_factory.mktemp("ci")
    config = [f"--config={key}={value}" for key, value in tiny_config().items()]
    subprocess.run([*trainwright_command(), "scaffold", "causal_lm", "lm", *config, "--workspace", str(root),
                    "--json"], check=True, capture_output=True, timeout=300)
    return root


def smoke(workspace: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    environment = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "PYTHON": sys.executable,
        "WORKSPACE": str(workspace),
        "SMOKE_STEPS": "4",
    }
    environment.pop("GITHUB_STEP_SUMMARY", None)
    environment.update(env)
    return subprocess.run(["bash", str(SCRIPT), *args], env=environment, capture_output=True, text=True,
                          timeout=600)


@pytest.fixture(scope="module")
def first_smoke(workspace, tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    """The script's first run on the workspace: it applies gradient-checkpointing."""
    summary = tmp_path_factory.mktemp("summary") / "summary.md"
    return smoke(workspace, "recipes/lm", "gradient-checkpointing", GITHUB_STEP_SUMMARY=str(summary)), summary


def test_the_smoke_script_applies_the_skill_runs_and_passes_on_a_finite_loss(workspace, first_smoke):
    result, summary = first_smoke
    assert result.returncode == 0, result.stdout + result.stderr
    assert git(workspace, "log", "-1", "--format=%s") == "skill(gradient-checkpointing): apply to recipes/lm"
    assert "== smoke run: recipes/lm, 4 steps on 1 process(es)" in result.stdout
    assert "completed at step 4, loss " in result.stdout
    assert "ok: final loss " in result.stdout and "is finite" in result.stdout
    assert "with `gradient-checkpointing`: step 4, loss " in summary.read_text()


def test_review_lists_the_skill_commit_with_the_smoke_run_it_produced(workspace, first_smoke):
    run_id = re.search(r"^run (\S+): completed", first_smoke[0].stdout, re.MULTILINE).group(1)
    result = subprocess.run([*trainwright_command(), "review", "--workspace", str(workspace), "--json"],
                            capture_output=True, text=True, timeout=120, check=True)
    skill_commit, scaffold_commit = json.loads(result.stdout)["commits"][:2]
    assert skill_commit["subject"] == "skill(gradient-checkpointing): apply to recipes/lm"
    assert skill_commit["tool"] == "apply_skill" and skill_commit["skill"].startswith("gradient-checkpointing@")
    (run,) = [r for r in skill_commit["runs"] if r["run_id"] == run_id]
    assert run["status"] == "completed" and run["step"] == 4 and math.isfinite(run["loss"])
    assert f"run {run_id}: completed; step 4/4; loss " in skill_commit["note"]
    assert scaffold_commit["subject"] == "recipe(lm): scaffold from template causal_lm"


def test_the_smoke_script_fails_the_job_when_the_loss_is_not_finite(workspace, first_smoke):
    result = smoke(workspace, "recipes/lm", "gradient-checkpointing", SMOKE_SET="optim.lr=1e30 optim.warmup_steps=0")
    assert result.returncode == 1
    assert "is already applied" in result.stdout and "(nothing to commit)" in result.stdout  # not an error
    assert "ended with a loss that is not finite: nan" in result.stderr.lower()


def test_the_smoke_script_fails_the_job_on_an_unknown_skill(workspace):
    before = git(workspace, "rev-parse", "HEAD")
    result = smoke(workspace, "recipes/lm", "gradient-checkpoint")
    assert result.returncode == 1
    assert "::error::apply_skill gradient-checkpoint: no skill named 'gradient-checkpoint'" in result.stderr
    assert git(workspace, "rev-parse", "HEAD") == before


def test_the_smoke_script_fails_the_job_on_a_bad_override(workspace):
    result = smoke(workspace, "recipes/lm", SMOKE_SET="train.max_stpes=3")
    assert result.returncode == 1
    assert "the smoke run did not start (exit 2): unknown config key 'train.max_stpes'" in result.stderr


def test_the_workflow_runs_the_script_after_installing_trainwright():
    workflow = yaml.safe_load(WORKFLOW.read_text())
    steps = workflow["jobs"]["smoke"]["steps"]
    commands = [step.get("run", "") for step in steps]
    install = next(i for i, c in enumerate(commands) if "pip install" in c and "trainwright" in c.lower())
    smoke_step = next(i for i, c in enumerate(commands) if "agent_smoke.sh" in c)
    assert install < smoke_step
    assert workflow["jobs"]["smoke"]["timeout-minutes"] <= 60
