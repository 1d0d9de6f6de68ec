"""A SLURM job over two nodes, each a network namespace of its own, through a real MCP client.

The fixture sets up two machines (:mod:`tests.netns`: network namespaces ``n1`` at 10.77.0.1
and ``n2`` at 10.77.0.2, each with its own loopback and one end of a veth pair named ``tw0``)
and a real SLURM over them (:mod:`tests.mcp.slurm_cluster`: slurmctld and a slurmd on ``n1``,
a slurmd on ``n2``; munged's socket and the filesystem are shared, as a cluster's are). The
server runs on ``n1``, the login node, with ``GLOO_SOCKET_IFNAME=tw0`` in its environment (the
nodes' host name resolves to loopback, as on many machines, so gloo must be told the
interface). ``launch_run(target="slurm", nnodes=2, nproc=1)`` submits with the real
``sbatch``; srun starts a torchrun agent on each node; they meet at a c10d rendezvous on
``n1`` and train with gloo over the veth pair.

The job's losses equal a 2-process job's on one node, step for step; then node ``n2``'s
processes of the job are killed (SIGKILL, as a machine dies), the job ends failed, and
``resume_checkpoint`` of its last checkpoint is a new 2-node job that completes, its losses
again those of the one-node job. Skipped with the reason where SLURM or network namespaces
cannot run (not root, not installed, a kernel or container that refuses them).
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
from anyio.from_thread import start_blocking_portal
from mcp import Client

from engine import run_checkpoints
from tests import netns
from tests.mcp.conftest import ToolSession, closing_cleanly, stdio_parameters, tiny_config
from tests.mcp.slurm_cluster import PARTITION, Node, missing, slurm_cluster, slurmd_command, until_ended
from tests.sandbox.helpers import make_workspace

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

MAX_STEPS = 16  # the one-node reference; the two-node job goes on until n2 dies, often past step 8
RESUMED_STEPS = 4  # the resumed job trains this many steps past its checkpoint (within MAX_STEPS)
KILL_AFTER_STEP = 4
SLURMD_TIMEOUT_S = 10  # how soon SLURM sets a node that died down (its default: 300 s)
NO_STORE = "scontrol show job; sacct: Slurm accounting storage is disabled"


def job(port: int) -> dict:
    """slurm settings of a CPU job; the rendezvous port is in the nodes' own networks, which no
    other test shares, so a fixed one does."""
    return {"partition": PARTITION, "time": "5", "gpus_per_node": 0, "rdzv_port": port}


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    reason = missing() or netns.missing()
    if reason:
        pytest.skip(reason)
    root = tmp_path_factory.mktemp("slurm-two-nodes")
    workspace = make_workspace(root / "ws")
    settings = root / "settings.yaml"
    # One thread per process on both jobs: the 2-node job and the 1-node job compute alike.
    settings.write_text("runs:\n  slurm: true\n  threads_per_process: 1\n")
    with netns.machines(("n1", "n2")) as machines:
        nodes = [Node(m.name, m.address, tuple(m.run_in())) for m in machines]
        with slurm_cluster(root / "slurm", nodes, slurmd_timeout=SLURMD_TIMEOUT_S) as cluster:
            # The server runs on n1, the login node (SLURM's commands reach slurmctld there).
            parameters = stdio_parameters(workspace, "--config", str(settings))
            parameters.args = [*cluster.prefix[1:], parameters.command, *parameters.args]
            parameters.command = cluster.prefix[0]
            parameters.env = {**(parameters.env or {}), "SLURM_CONF": str(cluster.conf),
                              "GLOO_SOCKET_IFNAME": netns.INTERFACE}
            with start_blocking_portal() as portal:
                with closing_cleanly(portal.wrap_async_context_manager(Client(parameters))) as connected:
                    yield ToolSession(portal, connected, "stdio"), workspace, cluster, machines




def losses(workspace: Path, run_id: str) -> dict[int, float]:
    metrics = workspace / "runs" / run_id / "metrics.jsonl"
    lines = metrics.read_text().splitlines() if metrics.exists() else []
    return {r["step"]: r["loss"] for r in map(json.loads, lines) if "loss" in r and "step" in r}


def job_processes(machine: netns.Machine, run_id: str) -> list[int]:
    """The processes of ``machine`` that name the run (its torchrun agent and worker)."""
    found = []
    for pid in machine.pids():
        try:
            if run_id.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(pid)
        except OSError:
            pass
    return found


def test_two_nodes_in_two_namespaces_match_one_node_and_a_dead_node_resumes(two_nodes):
    session, workspace, cluster, (n1, n2) = two_nodes
    t0 = time.monotonic()
    # A constant learning rate after warm-up: the 2-node job runs on (until its node dies) and the
    # reference stops at MAX_STEPS, so their schedules must not depend on max_steps.
    config = tiny_config(**{"train.max_steps": MAX_STEPS, "checkpoint.every": 2, "optim.min_lr_ratio": 1.0})

    # The reference: one node, two processes. The 2-node job waits behind it (a job a node).
    one_node = session.ok("launch_run", recipe="recipes/lm", target="slurm", nproc=2, overrides=config,
                          slurm=job(29411))["run_id"]
    two = session.ok("launch_run", recipe="recipes/lm", target="slurm", nproc=1, nnodes=2,
                     overrides={**config, "train.max_steps": 100_000}, slurm=job(29412))["run_id"]
    assert session.ok("get_run", run_id=two)["nodes"].startswith("2 node(s) x 1 process(es), SLURM job ")
    done = until_ended(session, one_node, timeout=180)
    assert (done["status"], done["exit_code"], done["step"]) == ("completed", 0, MAX_STEPS), done
    print(f"\none-node job completed at {time.monotonic() - t0:.1f} s")

    waited = session.ok("wait_run", run_id=two, until_step=KILL_AFTER_STEP, timeout_s=180)
    assert waited["reason"] == "reached_step", waited
    print(f"two-node job at step {waited['step']} at {time.monotonic() - t0:.1f} s")
    running = session.ok("get_run", run_id=two)
    assert running["status"] == "running" and "RUNNING (from squeue)" in running["nodes"], running
    # A worker on each machine, each with one rank's checkpoint shard in the one run directory.
    assert job_processes(n1, two) and job_processes(n2, two)
    deadline = time.monotonic() + 60
    while not [c for c in run_checkpoints.list_checkpoints(workspace / "runs" / two) if c[0] >= KILL_AFTER_STEP]:
        assert time.monotonic() < deadline, f"no checkpoint at step {KILL_AFTER_STEP} or later within 60 s"
        time.sleep(0.2)
    _, checkpoint = run_checkpoints.list_checkpoints(workspace / "runs" / two)[-1]
    assert sorted(p.name for p in checkpoint.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]

    # n2 dies: every process on it (its slurmd, the job's slurmstepd, torchrun agent and worker).
    assert n2.kill_all()
    print(f"n2 killed at {time.monotonic() - t0:.1f} s")
    failed = until_ended(session, two, timeout=120)
    print(f"two-node job ended {failed['status']} at {time.monotonic() - t0:.1f} s: {failed['error']}")
    # SLURM sets n2 down once it has not answered for SlurmdTimeout, and ends the job (not
    # requeued: the script says --no-requeue); n1's worker had already lost its peer.
    assert failed["status"] == "failed", failed
    # (Its exit code is the batch script's: 1:0 when n1's agent had exited, 0:15 when SLURM ended it first.)
    assert re.fullmatch(r"SLURM job \d+ ended NODE_FAIL \(exit code (1:0|0:15)\); see console.log", failed["error"]), failed
    assert "srun: error: Node failure on n2" in (workspace / "runs" / two / "console.log").read_text()
    deadline = time.monotonic() + 30
    while job_processes(n1, two) or job_processes(n2, two):
        assert time.monotonic() < deadline, "the failed job's processes are still there after 30 s"
        time.sleep(0.5)

    reference, crashed = losses(workspace, one_node), losses(workspace, two)
    shared = sorted(set(reference) & set(crashed))
    assert shared[:KILL_AFTER_STEP] == list(range(1, KILL_AFTER_STEP + 1))
    difference = max(abs(crashed[s] - reference[s]) for s in shared)
    print(f"2 nodes x 1 process vs 1 node x 2 processes: max |loss difference| {difference:.1e} over steps 1-{shared[-1]}")
    # Bit for bit: the same ranks, threads, batches and gloo reductions, only across a veth pair.
    assert {s: crashed[s] for s in shared} == {s: reference[s] for s in shared}

    # n2 comes back (its slurmd starts again and registers), and the job's resume from its last
    # checkpoint is a new 2-node job that completes.
    with restarted_slurmd(cluster, cluster.nodes[1]):
        _resume(session, workspace, cluster, two, failed, reference, t0)


def _resume(session, workspace, cluster, two, failed, reference, t0) -> None:
    last = max(c["step"] for c in failed["checkpoints"])
    assert KILL_AFTER_STEP <= last < MAX_STEPS, f"the job saved step {last} before n2 died: past the reference's end"
    until = min(last + RESUMED_STEPS, MAX_STEPS)
    resumed = session.ok("resume_checkpoint", run_id=two, step=last, overrides={"train.max_steps": until})
    assert resumed["nodes"].startswith("2 node(s) x 1 process(es), SLURM job ")
    finished = until_ended(session, resumed["run_id"], timeout=180)
    print(f"resumed job (from step {last}) {finished['status']} at {time.monotonic() - t0:.1f} s")
    assert (finished["status"], finished["exit_code"], finished["step"]) == ("completed", 0, until), finished
    assert f"COMPLETED (from {NO_STORE})" in finished["nodes"]
    after = losses(workspace, resumed["run_id"])
    assert sorted(after) == list(range(last + 1, until + 1))
    assert after == {s: reference[s] for s in after}
    assert cluster.command("squeue", "-h", "-o", "%i").stdout == ""


@contextmanager
def restarted_slurmd(cluster, node: Node):
    """``node``'s slurmd started again, until it is idle in sinfo; stopped on the way out."""
    with open(cluster.root / "log" / f"slurmd-{node.name}-again.out", "wb") as out:
        daemon = subprocess.Popen(slurmd_command(node, cluster.conf), env=cluster.env(), stdin=subprocess.DEVNULL,
                                  stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while cluster.command("sinfo", "-h", "-n", node.name, "-o", "%t", check=False).stdout.strip() != "idle":
            assert time.monotonic() < deadline, f"{node.name} not idle again within 60 s\n{cluster.log()}"
            time.sleep(0.5)
        yield
    finally:
        daemon.terminate()
        try:
            daemon.wait(timeout=15)
        except subprocess.TimeoutExpired:
            daemon.kill()
            daemon.wait()
