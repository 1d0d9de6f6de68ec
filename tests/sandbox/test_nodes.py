"""The node settings of a run over several machines: torchrun's exact options, the endpoints
accepted, and who may allow the host network such a run needs."""

from __future__ import annotations

import ipaddress
import sys
from pathlib import Path

import pytest

from engine.errors import BadInput
from workspace.settings import RunLimits, tighten
from runner.nodes import Nodes, check_allowed, check_endpoint, check_nodes, route_source, torchrun_args
from runner.lifecycle import engine_command

RECIPE, RUN = Path("/ws/runs/r0/recipe"), Path("/ws/runs/r0")


def test_the_ranks_of_one_node_start_under_the_torch_free_launcher():
    assert engine_command(RECIPE, RUN, 2, ["train.max_steps=5"]) == [
        sys.executable, "-m", "runner.local_ranks", "--nproc-per-node", "2", "-m", "engine.launch", str(RECIPE),
        "--run-dir", str(RUN), "--set=train.max_steps=5",
    ]
    assert engine_command(RECIPE, RUN, 1, []) == [sys.executable, "-m", "engine.launch", str(RECIPE), "--run-dir", str(RUN)]


def test_a_script_on_one_node_is_torchrun_standalone_on_loopback():
    assert torchrun_args(Nodes(), 2, "r0") == ["--standalone", "--local-addr", "127.0.0.1", "--nproc-per-node", "2"]


def test_nodes_meet_at_a_c10d_rendezvous_and_nodes_of_one_machine_get_their_own_loopback_address():
    rendezvous = ["-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d"]
    second = check_nodes(2, {"endpoint": "127.0.0.1:29500", "id": "r0", "node_rank": 1})
    assert engine_command(RECIPE, RUN, 1, [], nodes=second, rdzv_id="r0") == [
        sys.executable, *rendezvous, "--rdzv-endpoint", "127.0.0.1:29500", "--rdzv-id", "r0",
        "--local-addr", "127.0.0.2", "-m", "engine.launch", str(RECIPE), "--run-dir", str(RUN),
    ]


def test_a_node_of_machines_of_their_own_is_at_its_address_on_the_route_to_the_rendezvous_and_node_0_serves_it():
    rendezvous = ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d"]
    source = route_source(check_nodes(2, {"endpoint": "10.0.0.5:29500"}))
    for rank in (0, 1):
        node = check_nodes(2, {"endpoint": "10.0.0.5:29500", "id": "r0", "node_rank": rank})
        assert engine_command(RECIPE, RUN, 1, [], nodes=node, rdzv_id="r0")[3:18] == [
            *rendezvous, "--rdzv-endpoint", "10.0.0.5:29500", "--rdzv-id", "r0",
            "--local-addr", source, "--rdzv-conf", f"is_host={int(rank == 0)}", "-m",
        ]
    # Not the host name (which may resolve to loopback): the source address of a socket to the
    # rendezvous host, which for this machine's own address is that address.
    assert not ipaddress.ip_address(source).is_loopback
    assert route_source(check_nodes(2, {"endpoint": f"{source}:29500"})) == source


def test_a_rendezvous_host_this_machine_cannot_reach_is_refused_before_the_launch():
    nodes = check_nodes(2, {"endpoint": "node0.invalid:29400"})
    with pytest.raises(BadInput, match="rdzv endpoint node0.invalid:29400: this machine finds no route to 'node0.invalid'"):
        check_allowed(nodes, RunLimits(multi_node=True))


@pytest.mark.parametrize("endpoint, expected", [
    ("node0:29500", "node0:29500"), ("10.0.0.5", "10.0.0.5:29400"), ("[fe80::1]:7000", "[fe80::1]:7000"),
    (" localhost:1 ", "localhost:1"),
])
def test_endpoints_are_host_and_port(endpoint, expected):
    assert check_endpoint(endpoint) == expected


@pytest.mark.parametrize("endpoint, words", [
    ("", "must be 'host:port'"), ("node_0:1", "is not a host name"), ("node0:0", "between 1 and 65535"),
    ("[nope]:1", "is not an IPv6 address"), ("a;rm -rf /:1", "is not a host name"), (29400, "must be 'host:port'"),
])
def test_bad_endpoints_are_refused(endpoint, words):
    with pytest.raises(BadInput, match=".*" + words.replace("(", r"\(")):
        check_endpoint(endpoint)


def test_the_host_network_of_several_nodes_is_the_servers_choice_and_a_workspace_cannot_make_it():
    nodes = check_nodes(2, {"endpoint": "127.0.0.1:29400"})
    with pytest.raises(BadInput, match="runs.multi_node: true"):
        check_allowed(nodes, RunLimits())
    check_allowed(nodes, RunLimits(multi_node=True))
    check_allowed(nodes, RunLimits(network="shared"))
    check_allowed(check_nodes(1), RunLimits())
    limits, warnings = tighten(RunLimits(), RunLimits(multi_node=True, slurm=True), {"multi_node", "slurm"})
    assert (limits.multi_node, limits.slurm) == (False, False)
    assert [w.split(" in ")[0] for w in warnings] == ["runs.multi_node = True", "runs.slurm = True"]
    limits, warnings = tighten(RunLimits(multi_node=True), RunLimits(multi_node=False), {"multi_node"})
    assert limits.multi_node is False and not warnings
