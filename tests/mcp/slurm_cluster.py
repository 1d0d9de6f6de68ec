"""A real single-machine SLURM for tests: Debian's ``slurm-wlm`` (``slurmctld``, ``slurmd``) with
``munge``, configured in a folder of the test's on 127.0.0.1 and started and stopped by it.

One node (``localhost``, this machine's CPUs), one partition (:data:`PARTITION`, a time limit of
:data:`PARTITION_MAX_TIME` that sbatch enforces, one job at a time on the node so a second job
waits PENDING), process tracking by ``proctrack/linuxproc``, ``task/none`` (no cgroups), no
accounting store (``sacct`` answers "Slurm accounting storage is disabled", as on a cluster
without slurmdbd). The daemons run in the foreground (``-D``) as children of the test; SLURM's
commands find the cluster through ``SLURM_CONF``, which the caller puts in the environment of
whatever runs them. Needs root (slurmd starts jobs as their user) and the binaries; otherwise
:func:`missing` says why, for a skip.

:func:`slurm_cluster` starts the same over several nodes (a :class:`Node` each: its name, its
address, and the prefix its daemons run under, such as a network namespace of
:mod:`tests.netns`); slurmctld runs on the first, and SLURM's commands run there too
(:meth:`Cluster.command`).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

from tests.mcp.conftest import FINAL_STATUSES

BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "sinfo", "scontrol", "scancel")
NODE = "localhost"  # the node's name is its host name: a job's torchrun resolves it for the rendezvous
PARTITION = "tw"
PARTITION_MAX_TIME = "00:10:00"
STARTUP_TIMEOUT_S = 30.0


def missing() -> str | None:
    """Why a real SLURM cannot run here (a skip reason), or None."""
    if os.geteuid() != 0:
        return "a real SLURM needs root here (slurmd starts jobs as their user)"
    absent = [name for name in BINARIES if shutil.which(name) is None]
    if absent:
        return f"{', '.join(absent)} not installed (make slurm: Debian's slurm-wlm and munge)"
    return None


@dataclass(frozen=True)
class Node:
    """A slurmd: its node name, its address, and what its commands run under (``ip netns exec
    NS`` for a node in a network namespace of its own; nothing for this machine's)."""

    name: str
    address: str
    prefix: tuple[str, ...] = ()


LOCAL = Node(NODE, "127.0.0.1")


@dataclass(frozen=True)
class Cluster:
    root: Path
    conf: Path
    partition: str = PARTITION
    nodes: tuple[Node, ...] = field(default=(LOCAL,))

    def env(self) -> dict[str, str]:
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    @property
    def prefix(self) -> tuple[str, ...]:
        """What SLURM's commands run under: the first node (slurmctld's) is the login node."""
        return self.nodes[0].prefix

    def command(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        """One of SLURM's commands against this cluster."""
        return subprocess.run([*self.prefix, *args], env=self.env(), capture_output=True, text=True, timeout=30,
                              check=check)

    def log(self) -> str:
        """The daemons' logs, for a failure message."""
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}"
                         for p in sorted((self.root / "log").glob("*")))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _config(root: Path, cpus: int, nodes: Sequence[Node], slurmd_timeout: int) -> str:
    head = nodes[0]
    return "\n".join([
        "ClusterName=trainwright-test",
        # slurmctld accepts "localhost" as its own name, whatever the machine's host name.
        f"SlurmctldHost=localhost({head.address})",
        "SlurmUser=root",
        "SlurmdUser=root",
        f"SlurmctldPort={_free_port()}",
        f"SlurmdPort={_free_port()}",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        f"AuthInfo=socket={root}/munge/munge.socket",
        f"StateSaveLocation={root}/state",
        f"SlurmdSpoolDir={root}/spool/%n",  # %n: the node's name (several slurmd's share the folder)
        f"SlurmctldPidFile={root}/slurmctld.pid",
        f"SlurmdPidFile={root}/slurmd-%n.pid",
        f"SlurmctldLogFile={root}/log/slurmctld.log",
        f"SlurmdLogFile={root}/log/slurmd-%n.log",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "JobCompType=jobcomp/none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_CPU",
        "SchedulerType=sched/backfill",
        "MpiDefault=none",
        "ReturnToService=2",
        "EnforcePartLimits=ALL",  # sbatch refuses a time over the partition's, as most clusters do
        "KillWait=5",  # seconds from scancel's SIGTERM to SIGKILL
        "MinJobAge=300",  # squeue and scontrol remember an ended job this long
        f"SlurmdTimeout={slurmd_timeout}",  # a node that does not answer this long is down, its jobs NODE_FAIL
        *(f"NodeName={node.name} NodeAddr={node.address} CPUs={cpus} State=UNKNOWN" for node in nodes),
        f"PartitionName={PARTITION} Nodes={','.join(node.name for node in nodes)} Default=YES MaxTime={PARTITION_MAX_TIME} "
        "OverSubscribe=EXCLUSIVE State=UP",
        "",
    ])


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def single_node_slurm(root: Path):
    """munged, slurmctld and slurmd configured under ``root`` and started; on the way out every
    job is cancelled (its processes end) and the daemons are stopped."""
    return slurm_cluster(root, (LOCAL,))


def slurmd_command(node: Node, conf: Path) -> list[str]:
    """A node's slurmd in the foreground (to start it, or start it again after it died)."""
    return [*node.prefix, "slurmd", "-D", "-N", node.name, "-f", str(conf)]


@contextmanager
def slurm_cluster(root: Path, nodes: Sequence[Node], slurmd_timeout: int = 300) -> Iterator[Cluster]:
    """:func:`single_node_slurm` with a slurmd per node, each started under its node's prefix;
    slurmctld runs on the first node (munged's socket is a file: every node shares it). A node
    whose slurmd does not answer for ``slurmd_timeout`` seconds is set down (SLURM's default: 300)."""
    for name in ("munge", "state", "spool", "log"):
        (root / name).mkdir(parents=True, exist_ok=True)
    (root / "munge").chmod(0o700)
    key = root / "munge" / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    cpus = len(os.sched_getaffinity(0))
    conf = root / "slurm.conf"
    conf.write_text(_config(root, cpus, nodes, slurmd_timeout))
    cluster = Cluster(root, conf, nodes=tuple(nodes))
    logs = root / "log"
    commands = {  # the daemons by the name of their console file, in the order they start
        "munged": ["munged", "-F", "--force", f"--key-file={key}", f"--socket={root}/munge/munge.socket",
                   f"--pid-file={root}/munge/munged.pid", f"--seed-file={root}/munge/seed",
                   f"--log-file={logs}/munged.log"],
        "slurmctld": [*nodes[0].prefix, "slurmctld", "-D", "-f", str(conf)],
        **{f"slurmd-{node.name}": slurmd_command(node, conf) for node in nodes},
    }
    daemons: list[subprocess.Popen] = []
    for node in nodes:
        (root / "spool" / node.name).mkdir(exist_ok=True)
    try:
        for label, command in commands.items():
            with open(logs / f"{label}.out", "wb") as out:
                daemons.append(subprocess.Popen(command, env=cluster.env(), stdin=subprocess.DEVNULL, stdout=out,
                                                stderr=subprocess.STDOUT, start_new_session=True))
            if label == "munged":
                _wait_for(lambda: (root / "munge" / "munge.socket").exists(), "munged's socket", cluster)
        names = ",".join(node.name for node in nodes)
        _wait_for(lambda: cluster.command("sinfo", "-h", "-N", "-n", names, "-o", "%t", check=False).stdout.split()
                  == ["idle"] * len(nodes), f"nodes {names} idle in sinfo", cluster)
        yield cluster
    finally:
        if len(daemons) > 1 and daemons[1].poll() is None:  # slurmctld
            cluster.command("scancel", "--user", "root", check=False)
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and cluster.command("squeue", "-h", "-o", "%i", check=False).stdout.strip():
                time.sleep(0.5)
        for process in reversed(daemons):
            _stop(process)


def _wait_for(condition, what: str, cluster: Cluster) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.3)
    raise AssertionError(f"SLURM did not come up: no {what} within {STARTUP_TIMEOUT_S:.0f} s\n{cluster.log()}")


def until_ended(session: Any, run_id: str, timeout: float = 120) -> dict:
    """get_run (which asks SLURM each time) until the run's status is final."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        info = session.ok("get_run", run_id=run_id)
        if info["status"] in FINAL_STATUSES:
            return info
        time.sleep(0.5)
    raise AssertionError(f"SLURM run {run_id} did not end within {timeout} s: {info['status']}, {info['nodes']}")
