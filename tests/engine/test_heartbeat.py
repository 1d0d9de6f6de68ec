"""The heartbeat of a run over several nodes (engine/heartbeat.py), in one process: two nodes'
heartbeats at one in-memory store, fast beats. A slow step is not silence; a node whose network
is cut (its store requests never answered) is named by rank 0, and names the store itself.
The same over two network namespaces, end to end: tests/sandbox/test_nodes_two_namespaces.py."""

from __future__ import annotations

import threading
import time

import torch.distributed as dist

from engine.heartbeat import NodeHeartbeat, NodeOfRun, node_of_run

INTERVAL_S, SILENCE_S = 0.05, 1.0  # a loaded machine may keep a thread waiting a few tenths of a second
RUN = NodeOfRun(node=0, nodes=2, processes_per_node=2, store_host="10.77.0.1", store_port=29500)


class CuttableStore:
    """A store whose requests, once cut, never come back (a pulled cable: no reset, no answer)."""

    def __init__(self, store):
        self.store, self.cut, self.released = store, threading.Event(), threading.Event()

    def __getattr__(self, name):
        method = getattr(self.store, name)

        def call(*args):
            if self.cut.is_set():
                self.released.wait()
                raise RuntimeError("the connection timed out")
            return method(*args)
        return call


def two_nodes(store, store_of_node_1=None):
    """Node 0 (rank 0: it watches) and node 1 at one store (node 1 through ``store_of_node_1``);
    their heartbeats, and the verdicts each gave."""
    verdicts: dict[int, list[str]] = {0: [], 1: []}
    beats = [NodeHeartbeat(store, RUN, "10.77.0.1", True, verdicts[0].append, INTERVAL_S, SILENCE_S),
             NodeHeartbeat(store_of_node_1 or store, NodeOfRun(1, 2, 2, "10.77.0.1", 29500), "10.77.0.2", False,
                           verdicts[1].append, INTERVAL_S, SILENCE_S)]
    return beats, verdicts


def test_a_slow_step_is_not_silence():
    beats, verdicts = two_nodes(dist.HashStore())
    for beat in beats:
        beat.start()
    end = time.monotonic() + 2.5 * SILENCE_S  # a step in Python, longer than the silence allowed
    while time.monotonic() < end:
        sum(range(10_000))
    for beat in beats:
        beat.stop()
    assert verdicts == {0: [], 1: []}


def test_a_node_whose_network_is_cut_is_named_by_rank_0_and_names_the_store():
    store = dist.HashStore()
    cut = CuttableStore(store)  # node 0 is the store's own machine: only node 1 is cut off
    beats, verdicts = two_nodes(store, cut)
    try:
        for beat in beats:
            beat.start()
        time.sleep(1.5 * SILENCE_S)
        assert verdicts == {0: [], 1: []}
        cut.cut.set()
        started = time.monotonic()
        while not (verdicts[0] and verdicts[1]) and time.monotonic() - started < 5 * SILENCE_S:
            time.sleep(INTERVAL_S)
        took = time.monotonic() - started
    finally:
        cut.released.set()
        for beat in beats:
            beat.stop()
    assert SILENCE_S - 2 * INTERVAL_S <= took <= 2 * SILENCE_S, took
    assert verdicts[0] == ["node 1 of 2 (ranks 2-3, 10.77.0.2) stopped answering: no heartbeat for 1 s; its network "
                           "may be cut (its processes may still be running). A run over 2 nodes ends when one stops "
                           "answering; resume it from its last checkpoint once the node is reachable again"]
    assert verdicts[1] == ["the run's store at 10.77.0.1:29500 on node 0 (ranks 0-1) stopped answering node 1 "
                           "(10.77.0.2) for 1 s: this node may have lost its network (its peers' processes may "
                           "still be running). A run over 2 nodes ends when one stops answering; resume it from its "
                           "last checkpoint once the nodes reach each other"]


def test_only_the_first_process_of_each_node_of_a_run_over_several_nodes_beats():
    env = {"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "1", "LOCAL_RANK": "0",
           "MASTER_ADDR": "n1", "MASTER_PORT": "29500", "TORCHELASTIC_RESTART_COUNT": "0"}
    assert node_of_run(env) == NodeOfRun(1, 2, 4, "n1", 29500, 0)
    assert node_of_run({**env, "LOCAL_RANK": "1"}) is None
    assert node_of_run({**env, "WORLD_SIZE": "4"}) is None  # one node
    assert node_of_run({"WORLD_SIZE": "1"}) is None  # no torchrun
