"""Two nodes launched by hand (``launch_run`` with ``nnodes=2`` and an ``rdzv`` endpoint on each
machine, no SLURM), each in a network namespace of its own (:mod:`tests.netns`: ``n1`` at
10.77.0.1 and ``n2`` at 10.77.0.2, joined by a veth pair ``tw0``; the machine's host name
resolves to loopback in both). Each node's launch runs on its machine with
``GLOO_SOCKET_IFNAME=tw0``; they meet at a c10d rendezvous at ``n1:PORT``, node 0 serving it, each
node at its address on the veth pair. The 2x1 run's losses equal a 1-node 2-process run's; then
n2's network is cut and the run ends in bounded time (engine/heartbeat.py), and resumes.
Skipped with the reason where network namespaces cannot be set up.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from engine import run_checkpoints
from engine import run_dir as rd
from mcp_server.operations.launch import resume_checkpoint
from tests import netns
from tests.sandbox.helpers import make_workspace
from tests.support import REPO, TINY, losses, run_engine, wait_for
from workspace.settings import RunLimits
from workspace.workspace import Workspace

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

MAX_STEPS = 6
OVERRIDES = {**dict(item.split("=", 1) for item in TINY), "train.max_steps": MAX_STEPS}
PORT = 29431  # in the namespaces' own networks, which no other test shares
LAUNCH = """
import json, sys
from mcp_server.operations.launch import launch_run
from workspace.settings import RunLimits
from workspace.workspace import Workspace
ws, args = Workspace.open(sys.argv[1]), json.loads(sys.argv[2])
print(launch_run(ws, "recipes/lm", 1, args["overrides"], limits=RunLimits(multi_node=True, threads_per_process=1),
                 nnodes=2, rdzv=args["rdzv"]).run_id)
"""
# gloo alone would wait out the process group's 10 minutes; the heartbeat ends the run after
# heartbeat.SILENCE_S (30 s) of silence, plus a beat and torchrun stopping the node's processes.
CUT_BOUND_S = 90


def launch_on(machine: netns.Machine, workspace, overrides, rdzv) -> str:
    """``launch_run`` of one node, run on ``machine``; the run id it returned."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": netns.INTERFACE}
    command = machine.run_in(sys.executable, "-c", LAUNCH, str(workspace),
                             json.dumps({"overrides": overrides, "rdzv": rdzv}))
    done = subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.split()[-1]


def ended(run_dir) -> bool:
    record = rd.read_run(run_dir)
    return record.effective_status() in rd.FINAL_STATUSES and not rd.pid_alive(record.pid)


def test_two_nodes_in_two_namespaces_match_one_node_and_a_node_cut_off_ends_the_run_in_bounded_time(tmp_path):
    """One 2-node run proves both (the suite's time is short): its losses equal a 1-node
    2-process run's; then n2's network is cut (its processes alive, nothing reset), and both
    nodes' runs end within CUT_BOUND_S, n1's naming n2, where gloo alone would wait out the
    process group's 10 minutes; with the network back, the run resumes from its checkpoint."""
    reason = netns.missing()
    if reason:
        pytest.skip(reason)
    workspace = make_workspace(tmp_path / "ws")
    # It trains until the cut, a checkpoint every 2 steps; a constant learning rate after
    # warm-up, so that the reference, which stops at MAX_STEPS, has the same schedule.
    overrides = {**OVERRIDES, "train.max_steps": 100_000, "checkpoint.every": 2, "optim.min_lr_ratio": 1.0}
    with netns.machines(("n1", "n2")) as (n1, n2):
        rdzv = {"endpoint": f"n1:{PORT}"}
        first = launch_on(n1, workspace, overrides, rdzv)
        second = launch_on(n2, workspace, None, {**rdzv, "id": first, "node_rank": 1})
        first_dir, second_dir = workspace / "runs" / first, workspace / "runs" / second
        for run_dir, machine in ((first_dir, n1), (second_dir, n2)):
            command = rd.read_run(run_dir).command
            at = command.index("--local-addr")
            assert command[at + 1: at + 4] == [machine.address, "--rdzv-conf", f"is_host={int(machine is n1)}"]
        (tmp_path / "ref").mkdir()
        reference = run_engine(tmp_path / "ref", workspace / "recipes" / "lm",
                               *(f"{k}={v}" for k, v in {**overrides, "train.max_steps": MAX_STEPS}.items()),
                               nproc=2, timeout=300)
        wait_for(lambda: len(losses(first_dir)) >= MAX_STEPS and run_checkpoints.list_checkpoints(first_dir),
                 timeout=300, interval=0.2)
        assert rd.read_run(first_dir).world_size == 2 and n2.pids()
        one_node, two_nodes = losses(reference), losses(first_dir)
        difference = max(abs(one_node[s] - two_nodes[s]) for s in range(1, MAX_STEPS + 1))
        print(f"\n2 nodes x 1 process (two namespaces) vs 1 node x 2 processes: max |loss difference| {difference:.1e}")
        assert difference <= 1e-4, {s: (one_node[s], two_nodes[s]) for s in one_node}

        n2.set_link(up=False)  # the cable is pulled: n2's processes live on, no reset reaches n1
        cut = time.monotonic()
        wait_for(lambda: ended(first_dir), timeout=CUT_BOUND_S, interval=0.5)
        first_ended = time.monotonic() - cut
        wait_for(lambda: ended(second_dir), timeout=CUT_BOUND_S - first_ended, interval=0.5)
        print(f"n2's network cut: n1's run ended {first_ended:.0f} s later, n2's {time.monotonic() - cut:.0f} s")
        record, joined = rd.read_run(first_dir), rd.read_run(second_dir)
        assert (record.status, joined.status) == ("failed", "failed"), (record.error, joined.error)
        assert f"node 1 of 2 (rank 1, {n2.address}) stopped answering: no heartbeat for 30 s" in record.error, record.error
        console = (second_dir / rd.CONSOLE_LOG).read_text()
        assert f"stopped answering node 1 ({n2.address}) for 30 s" in console, console[-3000:]

        n2.set_link(up=True)
        step, _ = run_checkpoints.list_checkpoints(first_dir)[-1]
        resumed = resume_checkpoint(Workspace.open(workspace), first, step=step, overrides={"train.max_steps": step + 2},
                                    limits=RunLimits(threads_per_process=1)).run_id  # resume_checkpoint starts one node
        resumed_dir = workspace / "runs" / resumed
        wait_for(lambda: ended(resumed_dir), timeout=240)
        done = rd.read_run(resumed_dir)
        assert (done.status, done.final_step) == ("completed", step + 2), done.error
    before, after = losses(first_dir), losses(resumed_dir)
    assert sorted(after) == [step + 1, step + 2]
    shared = set(before) & set(after)  # steps the cut run took past its checkpoint: 2 ranks then, 1 now
    assert all(abs(before[s] - after[s]) <= 1e-4 for s in shared), {s: (before[s], after[s]) for s in shared}
