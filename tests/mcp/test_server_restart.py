"""Runs outlive the server: a restarted `trainwright serve` sees every run as it truly is.

MCP hosts restart their servers often (and end them by killing the server's process group).
The run directories are the source of truth, so a new server must report a run that kept
going as running, one that ended meanwhile as completed, and must still be able to stop the
one that is running.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from engine import run_dir as rd
from engine import run_metrics
from tests.mcp.conftest import ENDLESS_RUN, connect, git, process_group_alive, run_note, tiny_config
from tests.support import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]


def server_pids(workspace: Path) -> list[int]:
    """Processes running `trainwright serve --workspace WORKSPACE` (Linux: /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"serve" in argv and os.fsencode(str(workspace)) in argv:
            found.append(int(entry.name))
    return found


@pytest.mark.skipif(not Path("/proc/self/cmdline").exists(), reason="needs /proc to find the server process")
def test_a_restarted_server_sees_the_true_status_of_runs_that_went_on_without_it(tmp_path):
    with connect("stdio", tmp_path) as first:
        recipe = first.ok("scaffold_recipe", template="causal_lm", name="lm", config=tiny_config())["path"]
        endless = first.ok("launch_run", recipe=recipe, nproc=2, overrides=ENDLESS_RUN)
        short = first.ok("launch_run", recipe=recipe, overrides={"train.max_steps": 8})
        step_seen = first.wait_for_step(endless["run_id"], 1)["step"]
        (first_server,) = server_pids(tmp_path)
    assert not rd.pid_alive(first_server), "the first server is still running"

    # No server now. The short run ends; the endless one goes on.
    short_dir, endless_dir = tmp_path / short["run_dir"], tmp_path / endless["run_dir"]
    wait_for(lambda: rd.read_run(short_dir).exit_code is not None, timeout=300, interval=0.3)
    wait_for(lambda: run_metrics.read_metrics_tail(endless_dir / rd.METRICS_JSONL, 1)[0][-1]["step"] > step_seen,
             timeout=120, interval=0.3)

    with connect("stdio", tmp_path) as second:
        statuses = {run["run_id"]: run["status"] for run in second.ok("list_runs")["runs"]}
        assert statuses == {endless["run_id"]: "running", short["run_id"]: "completed"}

        completed = second.ok("get_run", run_id=short["run_id"])
        assert completed["status"] == "completed" and completed["step"] == 8 and completed["exit_code"] == 0

        running = second.ok("get_run", run_id=endless["run_id"])
        assert running["status"] == "running" and running["world_size"] == 2
        assert running["step"] > step_seen

        record = rd.read_run(endless_dir)
        stopped = second.ok("stop_run", run_id=endless["run_id"])
        assert stopped["status"] == "stopped"
        assert not rd.pid_alive(record.pid) and not process_group_alive(record.child_pgid)

    notes = run_note(tmp_path, git(tmp_path, "rev-parse", "HEAD"), short["run_id"])
    assert f"run {short['run_id']}: completed; step 8/8" in notes
    wait_for(lambda: f"run {endless['run_id']}: stopped" in git(tmp_path, "log", "--notes=trainwright", "-1",
                                                                   "--format=%N"), timeout=30)
