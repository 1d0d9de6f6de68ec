"""OpenMP threads of every training process sleep while they wait (engine/openmp.py says why:
spinning threads ran steps at a fifth of their speed on a shared machine until a first
checkpoint throttled them as a side effect)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from engine.openmp import apply_wait_policy
from sandbox.environment import run_environment

REPO = Path(__file__).resolve().parents[2]


def test_a_run_environment_makes_openmp_threads_sleep_while_they_wait():
    env = run_environment({"PATH": "/usr/bin"})
    assert env["OMP_WAIT_POLICY"] == "PASSIVE"
    assert "GOMP_SPINCOUNT" not in env


def test_a_wait_policy_or_spin_count_the_user_set_is_kept():
    assert run_environment({"OMP_WAIT_POLICY": "ACTIVE"})["OMP_WAIT_POLICY"] == "ACTIVE"
    env = run_environment({"GOMP_SPINCOUNT": "10000"})
    assert env["GOMP_SPINCOUNT"] == "10000"
    assert "OMP_WAIT_POLICY" not in env


def test_apply_wait_policy_changes_only_an_environment_without_a_choice():
    empty: dict[str, str] = {}
    apply_wait_policy(empty)
    assert empty == {"OMP_WAIT_POLICY": "PASSIVE"}
    chosen = {"OMP_WAIT_POLICY": "active"}
    apply_wait_policy(chosen)
    assert chosen == {"OMP_WAIT_POLICY": "active"}


def test_the_engine_started_directly_computes_with_the_passive_policy(tmp_path):
    """``python -m engine.launch`` sets the policy before torch loads; the recipe (imported after
    torch) sees it in its environment. The recipe here reports it by failing to import."""
    recipe = tmp_path / "probe"
    recipe.mkdir()
    (recipe / "recipe.py").write_text(
        "import os\n"
        "raise RuntimeError('wait policy ' + os.environ.get('OMP_WAIT_POLICY', 'unset'))\n"
    )
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-m", "engine.launch", str(recipe), "--check"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    verdict = json.loads(out.stdout.strip().splitlines()[-1])
    assert verdict["ok"] is False
    assert verdict["error"].endswith("RuntimeError: wait policy PASSIVE")
