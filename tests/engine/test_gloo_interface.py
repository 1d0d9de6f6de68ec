"""gloo's interface over several machines: refused with what to set, before gloo retries in vain.

Measured in ``tests/mcp/test_slurm_two_nodes.py``'s namespaces: where the host name resolves to
127.0.0.1 and GLOO_SOCKET_IFNAME is unset, a 2-node run failed after gloo's retries with
"Gloo connectFullMesh failed ... Connection refused, remote=[127.0.0.1]:PORT", naming no cause.
"""

from __future__ import annotations

import socket

import pytest

from engine.distributed import GLOO_INTERFACE_VARIABLE, gloo_interface_problem, init_distributed
from engine.errors import BadInput
from sandbox.environment import run_environment
from sandbox.network import LOOPBACK_ENV

TWO_MACHINES = {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "n1"}


def resolver(table: dict[str, list[str]]):
    return lambda host: table.get(host, [])


@pytest.mark.parametrize("own", [["127.0.0.1"], ["127.0.1.1"], []])
def test_a_host_name_at_loopback_over_several_machines_is_refused_naming_what_to_set(own):
    addresses = resolver({"n1": ["10.77.0.1"], socket.gethostname(): own})
    problem = gloo_interface_problem(TWO_MACHINES, addresses)
    assert problem is not None
    assert f"host name {socket.gethostname()!r}, which {f'resolves to {own[0]}' if own else 'does not resolve'}" in problem
    assert f"Set {GLOO_INTERFACE_VARIABLE} to the network interface the nodes reach each other on" in problem


@pytest.mark.parametrize("env, own", [
    ({**TWO_MACHINES, GLOO_INTERFACE_VARIABLE: "eth0"}, ["127.0.0.1"]),  # told an interface
    (TWO_MACHINES, ["10.0.0.5"]),  # the host name is an address the others reach
    ({**TWO_MACHINES, "MASTER_ADDR": "127.0.0.1"}, ["127.0.0.1"]),  # nodes of one machine, on loopback
    ({"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "n1"}, ["127.0.0.1"]),  # one node
    ({}, ["127.0.0.1"]),  # a world of one
])
def test_gloo_is_left_alone_where_it_finds_the_other_ranks(env, own):
    addresses = resolver({"n1": ["10.77.0.1"], "localhost": ["127.0.0.1"], socket.gethostname(): own})
    assert gloo_interface_problem(env, addresses) is None


def test_init_distributed_refuses_before_the_process_group(monkeypatch):
    """Nothing is dialled: the refusal comes before gloo (the master is TEST-NET-1, served by nobody)."""
    if gloo_interface_problem({**TWO_MACHINES, "MASTER_ADDR": "192.0.2.1"}) is None:
        pytest.skip("this machine's host name resolves to a routable address: gloo would find the other ranks")
    for name, value in {**TWO_MACHINES, "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "192.0.2.1",
                        "MASTER_PORT": "9"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv(GLOO_INTERFACE_VARIABLE, raising=False)
    with pytest.raises(BadInput, match=f"Set {GLOO_INTERFACE_VARIABLE} to the network interface"):
        init_distributed(tp=1)


def test_runs_and_jobs_get_the_gloo_interface_the_server_was_given_and_an_isolated_run_keeps_loopback():
    server = {"PATH": "/usr/bin", GLOO_INTERFACE_VARIABLE: "eth1", "NCCL_SOCKET_IFNAME": "ib0"}
    env = run_environment(source=server)
    assert (env[GLOO_INTERFACE_VARIABLE], env["NCCL_SOCKET_IFNAME"]) == ("eth1", "ib0")
    assert run_environment(source=server, extra=LOOPBACK_ENV)[GLOO_INTERFACE_VARIABLE] == "lo"
