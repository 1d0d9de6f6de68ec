"""Two "nodes" on one machine: two torchrun agents of one process each, meeting at a c10d
rendezvous on 127.0.0.1, each started by a launch of its own, as on two machines.

One pair of runs: a 2-process run on one node (the reference: the engine's two ranks as a
one-node run starts them, under ``runner.local_ranks``) and the 2-node run. The 2-node
run's losses match the reference's; then one node is killed as a machine dies (its supervisor,
its sandbox and everything in them at once), the other node's run fails with a status that
says why, and no process of either node is left.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from engine import run_dir as rd
from engine import run_checkpoints
from mcp_server.operations import launch as launching
from mcp_server.operations import runs as run_ops
from workspace.settings import RunLimits
from runner.processes import marked
from workspace.workspace import Workspace
from tests.sandbox.helpers import make_workspace
from tests.support import TINY, engine_command, engine_env, kill_group, losses, wait_for

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

KILL_AFTER_STEP = 4
# Long enough to be still running when node 1 dies; the reference is stopped at the same step.
OVERRIDES = {**dict(item.split("=", 1) for item in TINY), "train.max_steps": 100_000, "checkpoint.every": 2}
LIMITS = RunLimits(multi_node=True, threads_per_process=1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def logged(run_dir: Path, step: int) -> bool:
    record = rd.read_run(run_dir)
    if record.effective_status() in rd.FINAL_STATUSES:
        raise AssertionError(f"{run_dir.name} ended ({record.status}: {record.error}) before step {step}")
    return bool(losses(run_dir)) and max(losses(run_dir)) >= step


def ended(run_dir: Path) -> bool:
    record = rd.read_run(run_dir)
    return record.effective_status() in rd.FINAL_STATUSES and not rd.pid_alive(record.pid)


def test_two_nodes_match_one_node_and_a_dead_node_fails_the_run_leaving_no_process(tmp_path):
    ws = Workspace.open(make_workspace(tmp_path / "ws"))

    # The reference, two ranks of one node (runner.local_ranks), runs meanwhile: start-ups overlap.
    t0 = time.monotonic()
    (tmp_path / "ref").mkdir()
    reference = subprocess.Popen(
        engine_command(ws.root / "recipes" / "lm", *(f"{k}={v}" for k, v in OVERRIDES.items()), nproc=2),
        cwd=tmp_path / "ref", env=engine_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        _two_nodes(ws, tmp_path / "ref" / "runs", t0)
    finally:
        kill_group(reference)


def _two_nodes(ws: Workspace, reference_runs: Path, t0: float) -> None:
    runs = ws.runs_dir
    rdzv = {"endpoint": f"127.0.0.1:{free_port()}"}
    first = launching.launch_run(ws, "recipes/lm", 1, OVERRIDES, limits=LIMITS, nnodes=2, rdzv=rdzv)
    second = launching.launch_run(ws, "recipes/lm", 1, None, limits=LIMITS, nnodes=2,
                                rdzv={**rdzv, "id": first.run_id, "node_rank": 1})
    print(f"\nlaunched in {time.monotonic() - t0:.1f} s")
    assert second.nodes.startswith(f"2 node(s) x 1 process(es), this is node 1 (joins run {first.run_id})")
    first_dir, second_dir = runs / first.run_id, runs / second.run_id
    wait_for(lambda: reference_runs.is_dir() and any(reference_runs.iterdir()), timeout=300)
    (reference_dir,) = reference_runs.iterdir()
    wait_for(lambda: logged(reference_dir, KILL_AFTER_STEP), timeout=300)
    wait_for(lambda: logged(first_dir, KILL_AFTER_STEP), timeout=300)
    print(f"step {KILL_AFTER_STEP} at {time.monotonic() - t0:.1f} s")

    # Both nodes write into node 0's run: the metrics, and each rank's checkpoint shard.
    assert rd.read_run(first_dir).world_size == 2
    assert not (second_dir / rd.METRICS_JSONL).exists()
    step, checkpoint = run_checkpoints.list_checkpoints(first_dir)[0]
    assert sorted(p.name for p in checkpoint.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    for run_dir in (first_dir, second_dir):
        record = rd.read_run(run_dir)
        assert record.isolation == "partial"
        assert f"a run over 2 nodes uses the host's network for its rendezvous ({rdzv['endpoint']})" in record.isolation_note

    # A machine dies: its supervisor and its sandbox (bwrap's session: the agent and its worker).
    dead = rd.read_run(second_dir)
    for group in (dead.pid, dead.child_pgid):
        os.killpg(group, signal.SIGKILL)
    wait_for(lambda: ended(first_dir), timeout=120)
    print(f"node 0 ended at {time.monotonic() - t0:.1f} s")

    one_node, two_nodes = losses(reference_dir), losses(first_dir)
    shared = sorted(set(one_node) & set(two_nodes))
    assert shared[:KILL_AFTER_STEP] == list(range(1, KILL_AFTER_STEP + 1))
    difference = max(abs(one_node[s] - two_nodes[s]) for s in shared)
    print(f"\n2 nodes x 1 process vs 1 node x 2 processes: max |loss difference| {difference:.1e} over steps 1-{shared[-1]}")
    assert difference <= 1e-4, {s: (one_node[s], two_nodes[s]) for s in shared}

    survivor = run_ops.get_run(ws, first.run_id)
    assert survivor.status == "failed"
    assert survivor.error.startswith(
        "node 0 of a run over 2 nodes failed; a run over several nodes fails when any node fails or leaves "
        f"(rendezvous {first.run_id} at {rdzv['endpoint']})"
    ), survivor.error
    assert run_ops.get_run(ws, second.run_id).status == "failed"  # its supervisor is gone
    wait_for(lambda: not (marked(first.run_id) | marked(second.run_id)), timeout=30)
    left = [pid for pid in os.listdir("/proc") if pid.isdigit() and _mentions(int(pid), str(first_dir))]
    assert not left, left


def _mentions(pid: int, text: str) -> bool:
    try:
        return text.encode() in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
