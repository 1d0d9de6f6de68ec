"""How a run's OpenMP threads wait (engine/openmp.py): libgomp spins while the cores are the
run's, and is throttled while another process waits for them; the user's own choice is kept."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from engine import openmp
from engine.openmp import (
    BUSY_ABOVE, QUIET_BELOW, QUIET_WINDOWS, WaitDecision, WaitGovernor, prepare_wait_policy, run_queue_wait_ns,
    sleep_while_waiting,
)
from sandbox.environment import run_environment

REPO = Path(__file__).resolve().parents[2]


def test_a_run_environment_leaves_the_wait_policy_to_the_engine():
    env = run_environment({"PATH": "/usr/bin"})
    assert "OMP_WAIT_POLICY" not in env and "GOMP_SPINCOUNT" not in env


def test_a_wait_policy_or_spin_count_the_user_set_is_kept():
    assert run_environment({"OMP_WAIT_POLICY": "ACTIVE"})["OMP_WAIT_POLICY"] == "ACTIVE"
    env = run_environment({"GOMP_SPINCOUNT": "10000"})
    assert env["GOMP_SPINCOUNT"] == "10000"
    assert "OMP_WAIT_POLICY" not in env
    chosen = {"GOMP_SPINCOUNT": "10000"}
    sleep_while_waiting(chosen)
    prepare_wait_policy(chosen)
    assert chosen == {"GOMP_SPINCOUNT": "10000"}


def test_a_script_which_the_engine_cannot_govern_sleeps_while_it_waits():
    env: dict[str, str] = {}
    sleep_while_waiting(env)
    assert env == {"OMP_WAIT_POLICY": "PASSIVE"}


def test_without_run_queue_times_a_process_sleeps_while_it_waits(monkeypatch, tmp_path):
    env: dict[str, str] = {}
    prepare_wait_policy(env)
    assert env == {}, "this kernel reports run-queue times: the governor decides"
    monkeypatch.setattr(openmp, "TASKS", tmp_path / "absent")
    monkeypatch.setattr(openmp.run_queue_wait_ns, "__defaults__", (tmp_path / "absent",))
    prepare_wait_policy(env)
    assert env == {"OMP_WAIT_POLICY": "PASSIVE"}


def test_run_queue_wait_is_the_sum_of_each_threads_second_schedstat_field(tmp_path):
    for tid, line in (("11", "5000 700 3\n"), ("12", "9 40 1\n")):
        (tmp_path / tid).mkdir()
        (tmp_path / tid / "schedstat").write_text(line)
    assert run_queue_wait_ns(tmp_path) == 740
    (tmp_path / "13").mkdir()  # a thread that ended while it was read: skipped
    assert run_queue_wait_ns(tmp_path) == 740
    (tmp_path / "14").mkdir()
    (tmp_path / "14" / "schedstat").write_text("garbage\n")
    assert run_queue_wait_ns(tmp_path) is None
    assert run_queue_wait_ns() is not None  # this process, on this kernel


def test_the_decision_throttles_at_once_and_spins_again_only_after_quiet_windows():
    decision = WaitDecision()
    assert decision.observe(BUSY_ABOVE * 0.9) is False and not decision.throttled
    assert decision.observe(BUSY_ABOVE * 1.5) is True and decision.throttled
    for _ in range(QUIET_WINDOWS - 1):
        assert decision.observe(QUIET_BELOW / 2) is False and decision.throttled
    assert decision.observe(QUIET_BELOW * 2) is False, "a busier window starts the count again"
    for _ in range(QUIET_WINDOWS - 1):
        assert decision.observe(0.0) is False
    assert decision.observe(0.0) is True and not decision.throttled


def test_the_governor_holds_enough_idle_teams_to_outnumber_the_cores_while_throttled():
    held: list[threading.Event] = []
    ended = threading.Event()

    def hold(release: threading.Event) -> None:
        held.append(release)
        release.wait()
        ended.set()

    governor = WaitGovernor(threads=3, cores=5, read_wait=lambda: None, hold=hold)
    assert governor.teams == 3  # 3 + 3 × 2 workers > 5 cores
    governor.window(waited_ns=int(0.6e9), seconds=0.5)  # 40% of 3 threads' time waited
    deadline = time.monotonic() + 10
    while len(held) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(held) == 3 and governor.decision.throttled
    governor.window(waited_ns=int(0.4e9), seconds=0.5)
    assert len(held) == 3, "no new teams while throttled"
    for _ in range(QUIET_WINDOWS):
        governor.window(waited_ns=0, seconds=0.5)
    assert ended.wait(10) and all(release.is_set() for release in held)
    assert governor.changes == 2


PROBE = """
import json, resource, sys, threading, time
from engine import openmp
import torch
torch.set_num_threads(2)
x = torch.ones(1 << 20)

def user_cpu_of_short_regions():
    start = resource.getrusage(resource.RUSAGE_SELF).ru_utime
    for _ in range(100):
        x.add_(1.0)       # a parallel region...
        time.sleep(0.003)  # ...then a gap, in which libgomp's idle threads spin or sleep
    return resource.getrusage(resource.RUSAGE_SELF).ru_utime - start

spinning = user_cpu_of_short_regions()
release = threading.Event()
threading.Thread(target=openmp.hold_team, args=(release,), daemon=True).start()
time.sleep(0.5)
throttled = user_cpu_of_short_regions()
release.set()
time.sleep(0.5)
print(json.dumps({"spinning": spinning, "throttled": throttled, "again": user_cpu_of_short_regions()}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="libgomp's throttling is measured on Linux")
def test_an_idle_team_makes_libgomp_throttle_its_spinning_and_releasing_it_restores_it(tmp_path):
    """The mechanism itself, in the torch this project installs: between short regions, spinning
    threads burn the gaps; with an idle team held, they sleep; released, they spin again."""
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "2"}
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    cpu = json.loads(out.stdout.strip().splitlines()[-1])
    assert cpu["throttled"] < 0.5 * cpu["spinning"], cpu
    assert cpu["again"] > 2 * cpu["throttled"], cpu


def test_the_engine_started_directly_leaves_libgomp_spinning_for_the_governor(tmp_path):
    """``python -m engine.launch`` decides before torch loads; the recipe (imported after torch)
    sees the environment it decided. The recipe here reports it by failing to import."""
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
    assert verdict["error"].endswith("RuntimeError: wait policy unset")
