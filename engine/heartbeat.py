"""A run over several nodes ends soon after a node stops answering, not at gloo's time limit.

A node whose processes die is noticed at once: its kernel resets their connections, and every
peer's collective fails. A node whose network is cut (a cable, a switch port, a machine that
lost power) resets nothing: its peers would wait in their collective until the process group's
time limit (10 minutes) ended them, and the cut-off node likewise. A shorter process-group
limit is no cure: a collective waits as long as the slowest rank's step, a checkpoint or an
evaluation, and a healthy slow step must not end a run.

So the first process of every node beats, from a thread of its own and whatever its training
is doing, every :data:`BEAT_INTERVAL_S` at the run's store (the TCPStore that torchrun's agent
of node 0 serves its workers at ``MASTER_ADDR:MASTER_PORT``), and rank 0 reads every node's
beats. A node not heard from for :data:`SILENCE_S` ends the run, with an error that names it
(its ranks and its address); a node that cannot reach the store for as long ends itself,
naming the store's node. Either side is over within about ``SILENCE_S + BEAT_INTERVAL_S``
(then torchrun's agent stops the node's other processes). Silence means no beat at all: a
slow step beats on. The cost: one small store request per node per interval, and rank 0 reads
one counter per node.
"""

from __future__ import annotations

import datetime
import os
import socket
import threading
import time
from dataclasses import dataclass
from typing import Callable

import torch.distributed as dist

BEAT_INTERVAL_S = 5.0
SILENCE_S = 30.0  # torchrun's own rendezvous calls a node dead after 3 missed 5 s beats: 15 s
KEY_PREFIX = "trainwright/heartbeat"


@dataclass(frozen=True)
class NodeOfRun:
    """This process's node in a run over several nodes, as torchrun's environment says it."""

    node: int  # torchrun's GROUP_RANK
    nodes: int
    processes_per_node: int
    store_host: str
    store_port: int
    attempt: int = 0  # torchrun's restart count: beats of an earlier attempt are not this one's

    def ranks(self, node: int) -> str:
        first = node * self.processes_per_node
        last = first + self.processes_per_node - 1
        return f"rank {first}" if first == last else f"ranks {first}-{last}"

    def key(self, what: str, node: int) -> str:
        return f"{KEY_PREFIX}/{self.attempt}/{what}/{node}"


def node_of_run(env=os.environ) -> NodeOfRun | None:
    """This process's node when it is the first process of a node in a run over several nodes
    started by torchrun (the one that beats), else None."""
    try:
        world, local = int(env["WORLD_SIZE"]), int(env["LOCAL_WORLD_SIZE"])
        node, local_rank = int(env["GROUP_RANK"]), int(env["LOCAL_RANK"])
        host, port = env["MASTER_ADDR"], int(env["MASTER_PORT"])
    except (KeyError, ValueError):
        return None
    if local_rank != 0 or local <= 0 or world <= local:
        return None
    return NodeOfRun(node, world // local, local, host, port, int(env.get("TORCHELASTIC_RESTART_COUNT", "0") or 0))


def node_label(run: NodeOfRun, env=os.environ) -> str:
    """How this node is named to people: its SLURM node name, else its address on the route to
    the store (as ``runner.nodes.route_source`` finds torchrun's ``--local-addr``)."""
    if env.get("SLURMD_NODENAME"):
        return env["SLURMD_NODENAME"]
    try:
        family, kind, _, _, address = socket.getaddrinfo(run.store_host, run.store_port, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, kind) as probe:
            probe.connect(address)  # nothing is sent
            return str(probe.getsockname()[0])
    except OSError:
        return socket.gethostname()


class NodeHeartbeat:
    """Beats for this node at ``store`` and, with ``watch`` (rank 0), reads every node's beats;
    calls ``on_silence`` with a message, once, from its own thread, when a node or the store
    has been silent for ``silence_s``. ``on_silence`` is expected to end the process."""

    def __init__(self, store, run: NodeOfRun, label: str, watch: bool, on_silence: Callable[[str], None],
                 interval_s: float = BEAT_INTERVAL_S, silence_s: float = SILENCE_S):
        self.store, self.run, self.label, self.watch = store, run, label, watch
        self.on_silence, self.interval_s, self.silence_s = on_silence, interval_s, silence_s
        self.stopped = threading.Event()
        now = time.monotonic()
        self.answered_at = now  # the last time the store answered a whole round
        self.heard: dict[int, tuple[int, float]] = {n: (0, now) for n in range(run.nodes) if n != run.node and watch}
        self.labels: dict[int, str] = {}  # each node's label, read once it has beaten
        self.threads = [threading.Thread(target=self._beat, name="trainwright-heartbeat", daemon=True),
                        threading.Thread(target=self._watch, name="trainwright-heartbeat-watch", daemon=True)]

    def start(self) -> NodeHeartbeat:
        self.store.set(self.run.key("label", self.run.node), self.label)
        for thread in self.threads:
            thread.start()
        return self

    def stop(self) -> None:
        """No more beats nor verdicts (a run that ends, on every node alike)."""
        self.stopped.set()

    def _beat(self) -> None:
        while not self.stopped.is_set():
            try:
                self.store.add(self.run.key("beat", self.run.node), 1)
                counts = {n: self.store.add(self.run.key("beat", n), 0) for n in self.heard} if self.watch else {}
            except Exception:  # noqa: BLE001 - the store did not answer: the watch decides by time
                self.stopped.wait(self.interval_s)
                continue
            now = time.monotonic()
            self.answered_at = now
            for node, count in counts.items():
                if count != self.heard[node][0]:
                    self.heard[node] = (count, now)
                    if node not in self.labels:  # a node sets its label before its first beat
                        self.labels[node] = self._read_label(node)
            self.stopped.wait(self.interval_s)

    def _watch(self) -> None:
        while not self.stopped.wait(self.interval_s):
            message = self.silence(time.monotonic())
            if message is not None and not self.stopped.is_set():
                self.stopped.set()
                self.on_silence(message)

    def silence(self, now: float) -> str | None:
        """What has been silent for too long at ``now``, as the run's error, or None."""
        run, limit = self.run, self.silence_s
        if now - self.answered_at > limit:
            return (f"the run's store at {run.store_host}:{run.store_port} on node 0 ({run.ranks(0)}) stopped "
                    f"answering node {run.node} ({self.label}) for {limit:g} s: this node may have lost its "
                    f"network (its peers' processes may still be running). A run over {run.nodes} nodes ends when "
                    "one stops answering; resume it from its last checkpoint once the nodes reach each other")
        for node, (_, heard_at) in sorted(self.heard.items()):
            if now - heard_at > limit:
                label = self.labels.get(node, "never heard from")
                return (f"node {node} of {run.nodes} ({run.ranks(node)}, {label}) stopped answering: "
                        f"no heartbeat for {limit:g} s; its network may be cut (its processes may still be "
                        f"running). A run over {run.nodes} nodes ends when one stops answering; resume it from its "
                        "last checkpoint once the node is reachable again")
        return None

    def _read_label(self, node: int) -> str:
        try:
            return self.store.get(self.run.key("label", node)).decode(errors="replace")[:100]
        except Exception:  # noqa: BLE001 - the name is a courtesy; the verdict stands without it
            return "address unknown"


def start_heartbeat(is_main: bool, on_silence: Callable[[str], None]) -> NodeHeartbeat | None:
    """This node's heartbeat, started, when this process is the first of a node in a run over
    several nodes (rank 0 also watches every node); None otherwise."""
    run = node_of_run()
    if run is None:
        return None
    store = dist.TCPStore(run.store_host, run.store_port, is_master=False, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=SILENCE_S))
    return NodeHeartbeat(store, run, node_label(run), is_main, on_silence).start()
