"""Two nodes launched by hand (``launch_run`` with ``nnodes=2`` and an ``rdzv`` endpoint on each
machine, no SLURM), each in a network namespace of its own (:mod:`tests.netns`: ``n1`` at
10.77.0.1 and ``n2`` at 10.77.0.2, joined by a veth pair ``tw0``; the machine's host name
resolves to loopback in both). Each node's launch runs on its machine with
``GLOO_SOCKET_IFNAME=tw0``; they meet at a c10d rendezvous at ``n1:PORT``, node 0 serving it, each
node at its address on the veth pair. The 2x1 run's losses equal a 1-node 2-process run's.
Skipped with the reason where network namespaces cannot be set up.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from engine import run_dir as rd
from tests import netns
from tests.sandbox.helpers import make_workspace
from tests.support import REPO, TINY, losses, run_engine, wait_for

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


def test_two_nodes_launched_by_hand_in_two_namespaces_match_one_node(tmp_path):
    reason = netns.missing()
    if reason:
        pytest.skip(reason)
    workspace = make_workspace(tmp_path / "ws")
    with netns.machines(("n1", "n2")) as (n1, n2):
        rdzv = {"endpoint": f"n1:{PORT}"}
        first = launch_on(n1, workspace, OVERRIDES, rdzv)
        second = launch_on(n2, workspace, None, {**rdzv, "id": first, "node_rank": 1})
        first_dir, second_dir = workspace / "runs" / first, workspace / "runs" / second
        for run_dir, machine in ((first_dir, n1), (second_dir, n2)):
            command = rd.read_run(run_dir).command
            at = command.index("--local-addr")
            assert command[at + 1: at + 4] == [machine.address, "--rdzv-conf", f"is_host={int(machine is n1)}"]
        (tmp_path / "ref").mkdir()
        reference = run_engine(tmp_path / "ref", workspace / "recipes" / "lm",
                               *(f"{k}={v}" for k, v in OVERRIDES.items()), nproc=2, timeout=300)
        wait_for(lambda: ended(first_dir) and ended(second_dir), timeout=300)
        record = rd.read_run(first_dir)
        assert (record.status, record.world_size) == ("completed", 2), (record.status, record.error)
        assert rd.read_run(second_dir).status == "completed"
    one_node, two_nodes = losses(reference), losses(first_dir)
    assert sorted(two_nodes) == list(range(1, MAX_STEPS + 1))
    difference = max(abs(one_node[s] - two_nodes[s]) for s in two_nodes)
    print(f"\n2 nodes x 1 process (two namespaces) vs 1 node x 2 processes: max |loss difference| {difference:.1e}")
    assert difference <= 1e-4, {s: (one_node[s], two_nodes[s]) for s in two_nodes}
