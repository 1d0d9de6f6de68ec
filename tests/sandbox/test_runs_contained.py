"""Real training runs through the MCP tools: the server's secrets never reach them, their limits
and network are what the configuration says, stop_run leaves no process behind (the ranks' launcher
and its ranks included), and runs launched at once do not cross."""

from __future__ import annotations

import os
import subprocess
import threading

import pytest

from engine import run_dir as rd
from engine import run_checkpoints
from mcp_server.server import build_server
from workspace import git as workspace_git
from runner import processes
from tests.sandbox.helpers import (
    AUDIT, derived_recipe, error_text, host_pid, live_client, make_workspace, run_pids, wait_final, wait_gone,
    wait_step,
)
from tests.support import TINY, losses

SECRET = "tw-test-secret-0123456789abcdef"
PASSED = "tw-test-passed-value-42"
LONG = {**{k: v for k, v in (item.split("=", 1) for item in TINY)}, "train.max_steps": 100_000}


def overrides(**extra):
    return {**{k: v for k, v in (item.split("=", 1) for item in TINY)}, **extra}


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = make_workspace(tmp_path_factory.mktemp("contained") / "ws", config_yaml=(
        "runs:\n  threads_per_process: 1\n  max_open_files: 777\n  stop_grace_s: 3\n  pass_env: [TW_TEST_PASSED_TOKEN]\n"
    ))
    # pass_env in the workspace may only name what the trusted settings allow
    (root.parent / "trusted.yaml").write_text("runs:\n  pass_env: [TW_TEST_PASSED_TOKEN]\n")
    return root


def launch(client, recipe="recipes/lm", **arguments):
    result = client.call("launch_run", {"recipe": recipe, **arguments})
    assert not result.is_error, error_text(result)
    return result.structured_content["run_id"]


def environ(pid: int) -> dict[str, str]:
    raw = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
    return dict(item.decode(errors="replace").split("=", 1) for item in raw if b"=" in item)


def test_a_secret_never_reaches_a_run_its_logs_or_the_audit(workspace, monkeypatch):
    monkeypatch.setenv("TW_TEST_SERVICE_API_TOKEN", SECRET)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET + "-aws")
    monkeypatch.setenv("DATABASE_URL", f"postgres://u:{SECRET}@db/x")
    monkeypatch.setenv("TW_TEST_PASSED_TOKEN", PASSED)
    with live_client(build_server(workspace, settings=workspace.parent / "trusted.yaml")) as client:
        run_id = launch(client, overrides=LONG)
        run_dir = workspace / "runs" / run_id
        wait_step(run_dir, 2)
        record = rd.read_run(run_dir)
        engine_pid = host_pid(run_dir, record.engine_pid)
        engine = environ(engine_pid)
        supervisor = environ(record.pid)
        limits = open(f"/proc/{engine_pid}/limits").read()
        run_network = os.readlink(f"/proc/{engine_pid}/ns/net")
        info = client.call("get_run", {"run_id": run_id}).structured_content
        stopped = client.call("stop_run", {"run_id": run_id}).structured_content

    for env in (engine, supervisor):
        assert not any(SECRET in value for value in env.values())
        assert {"TW_TEST_SERVICE_API_TOKEN", "AWS_SECRET_ACCESS_KEY", "DATABASE_URL"}.isdisjoint(env)
        assert env["TW_TEST_PASSED_TOKEN"] == PASSED, "a name listed in runs.pass_env gets through"
        assert env["OMP_NUM_THREADS"] == "1" == str(record.threads_per_process)
        assert "OMP_WAIT_POLICY" not in env, "how OpenMP threads wait is the engine's to decide (engine/openmp.py)"
        assert env["TRAINWRIGHT_RUN_ID"] == run_id
    assert "Max open files            777" in limits
    assert info["limits"]["max_open_files"] == 777 and info["network_isolated"] in (True, False)
    assert info["network_note"]
    if info["network_isolated"]:
        assert run_network != os.readlink("/proc/self/ns/net")
    assert stopped["status"] == rd.STOPPED

    wait_final(run_dir)
    notes = subprocess.run(["git", "log", "--notes=trainwright", "-1"], cwd=workspace, capture_output=True, text=True).stdout
    for text in [p.read_text(errors="replace") for p in run_dir.iterdir() if p.is_file()] + [
        (workspace / AUDIT).read_text(), notes,
    ]:
        assert SECRET not in text and PASSED not in text


@pytest.mark.multiprocess
def test_stop_run_ends_the_launcher_its_ranks_and_what_they_detached(workspace):
    derived_recipe(workspace, "detaching", (
        "import subprocess\n\n\n"
        "class Detaching(CausalLM):\n"
        "    def prepare_data(self):\n"
        "        # A helper in a session of its own, as data loaders and tokenizer servers do.\n"
        "        subprocess.Popen(['sleep', '600'], start_new_session=True)\n"
        "        return super().prepare_data()\n"
    ))
    with live_client(build_server(workspace)) as client:
        run_id = launch(client, "recipes/detaching", nproc=2, overrides=LONG)
        run_dir = workspace / "runs" / run_id
        wait_step(run_dir, 2)
        pids = run_pids(run_dir)
        # The supervisor, the ranks' launcher, two ranks and two sleeps (each in a session of its own) at least.
        assert len(pids) >= 6, pids
        sessions = {os.getsid(p) for p in pids}
        assert len(sessions) >= 4, "the run's processes span several sessions"
        stopped = client.call("stop_run", {"run_id": run_id}).structured_content
    assert stopped["status"] == rd.STOPPED and stopped["error"] == "stopped by request"
    assert wait_gone(pids, timeout=5) == set(), "processes outlived stop_run"
    assert processes.marked(run_id) == set()
    assert run_checkpoints.list_checkpoints(run_dir) == [] or all(s >= 0 for s, _ in run_checkpoints.list_checkpoints(run_dir))


@pytest.mark.slow
def test_four_runs_launched_at_once_complete_with_distinct_ids_and_no_crosstalk(workspace):
    seeds = [1, 1, 2, 2]
    run_ids: list[str] = [""] * 4
    with live_client(build_server(workspace)) as client:
        def start(i):
            run_ids[i] = launch(client, overrides=overrides(**{"train.max_steps": 5, "train.seed": seeds[i],
                                                               "checkpoint.every": 0}))
        threads = [threading.Thread(target=start, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        records = [wait_final(workspace / "runs" / run_id, timeout=600) for run_id in run_ids]

    assert len(set(run_ids)) == 4
    curves = [losses(workspace / "runs" / run_id) for run_id in run_ids]
    for run_id, record, curve, seed in zip(run_ids, records, curves, seeds):
        assert record.status == rd.COMPLETED, record.error
        assert record.config["train"]["seed"] == seed
        assert sorted(curve) == [1, 2, 3, 4, 5], f"{run_id} holds another run's records"
        console = (workspace / "runs" / run_id / rd.CONSOLE_LOG).read_text()
        assert f"run {run_id}" in console and not any(other in console for other in run_ids if other != run_id)
    assert curves[0] == curves[1] and curves[2] == curves[3], "the same seed trains the same, bit for bit"
    assert curves[0] != curves[2]
    note = workspace_git.note(workspace_git.open_repo(workspace), records[0].git_commit)
    assert all(f"run {run_id}: completed" in note for run_id in run_ids), "every run's note was written"
