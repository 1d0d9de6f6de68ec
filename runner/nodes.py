"""Runs over several nodes: torchrun's c10d rendezvous settings, checked in one place.

A run over ``nnodes`` machines starts one torchrun agent per node, each with ``nproc``
processes; the agents meet at the rendezvous endpoint (``host:port``, reachable from every
node; the agent on that host serves it) under one rendezvous id, and c10d hands out the ranks.
Here, one launch starts this machine's node:

- ``node_rank`` 0 creates the run; its rendezvous id is its run id unless one is given;
- a node with ``node_rank`` > 0 joins that run: its ``rdzv_id`` names node 0's run, which must
  be in this workspace (a shared filesystem, as on a cluster), because every rank writes its
  checkpoint shards into one run directory. It gets a run record of its own (its processes,
  console and outcome) whose ``joins`` names node 0's.

Every node needs the host's network (the rendezvous and the collectives cross machines; two
sandboxes on one machine do not even share loopback), which the server's settings must allow:
``runs.multi_node: true`` (or ``runs.network: shared``). The run records it as ``partial``
isolation with the reason (SECURITY.md).
"""

from __future__ import annotations

import ipaddress
import re
import socket
from dataclasses import dataclass
from typing import Any, Mapping

from engine.errors import BadInput
from workspace.settings import RunLimits

MAX_NNODES = 1024
DEFAULT_RDZV_PORT = 29400  # torchrun's own default for c10d
_HOST = re.compile(r"^(?=.{1,253}$)[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*$")
_RDZV_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
RDZV_KEYS = ("endpoint", "id", "node_rank")
LOOPBACK_NAMES = ("localhost",)


# The rendezvous host of a SLURM job's nodes, known only when the job runs (its first node).
JOB_FIRST_NODE = "<first node>"


@dataclass(frozen=True)
class Nodes:
    """How many nodes a run spans and how they meet (``nnodes`` 1: this machine alone)."""

    nnodes: int = 1
    node_rank: int = 0
    rdzv_endpoint: str | None = None  # host:port
    rdzv_id: str | None = None  # None: the run id of node 0

    @property
    def multi(self) -> bool:
        return self.nnodes > 1

    @property
    def rdzv_host(self) -> str:
        return (self.rdzv_endpoint or "").rsplit(":", 1)[0].strip("[]")

    @property
    def local_endpoint(self) -> bool:
        """The rendezvous is on this machine's loopback (nodes that are processes of one machine)."""
        host = self.rdzv_host
        if host in LOOPBACK_NAMES:
            return True
        try:
            return ipaddress.ip_address(host).is_loopback
        except ValueError:
            return False

    def describe(self) -> str:
        return f"{self.nnodes} nodes, c10d rendezvous {self.rdzv_endpoint} (id {self.rdzv_id})"


def _int(value: object, name: str, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadInput(f"{name} must be an integer, got {value!r}")
    if not low <= value <= high:
        raise BadInput(f"{name} must be between {low} and {high}, got {value}")
    return value


def check_endpoint(endpoint: object) -> str:
    """``host:port`` (a name, an IPv4 address or a bracketed IPv6 one); port defaults to 29400."""
    if not isinstance(endpoint, str) or not endpoint.strip():
        raise BadInput(f"rdzv endpoint must be 'host:port' (e.g. node0:29400), got {endpoint!r}")
    text = endpoint.strip()
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        port_text = rest[1:] if rest.startswith(":") else (rest or None)
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise BadInput(f"rdzv endpoint {endpoint!r}: {host!r} is not an IPv6 address") from None
        shown = f"[{host}]"
    else:
        host, sep, port_text = text.rpartition(":")
        if not sep:
            host, port_text = text, None
        if not _HOST.fullmatch(host or ""):
            raise BadInput(f"rdzv endpoint {endpoint!r}: {host!r} is not a host name or IPv4 address")
        shown = host
    if port_text in (None, ""):
        port = DEFAULT_RDZV_PORT
    else:
        if not port_text.isdigit():
            raise BadInput(f"rdzv endpoint {endpoint!r}: the port must be a number from 1 to 65535")
        port = _int(int(port_text), "the rendezvous port", 1, 65535)
    return f"{shown}:{port}"


def check_nodes(nnodes: object = 1, rdzv: Mapping[str, Any] | None = None) -> Nodes:
    """The node settings of a launch, or :class:`BadInput` that says what to change."""
    nnodes = _int(nnodes, "nnodes", 1, MAX_NNODES)
    rdzv = dict(rdzv or {})
    unknown = sorted(str(k) for k in rdzv if k not in RDZV_KEYS)
    if unknown:
        raise BadInput(f"unknown rdzv setting {unknown[0]!r}; valid: {', '.join(RDZV_KEYS)}")
    if nnodes == 1:
        given = [k for k in RDZV_KEYS if rdzv.get(k) not in (None, 0)]
        if given:
            raise BadInput(f"rdzv {given[0]} is for runs over several nodes: pass nnodes > 1 too, or leave it out")
        return Nodes()
    if rdzv.get("endpoint") is None:
        raise BadInput(
            f"a run over {nnodes} nodes needs rdzv endpoint 'host:port': an address of the first node that "
            "every node reaches (127.0.0.1:PORT for nodes on this machine)"
        )
    endpoint = check_endpoint(rdzv["endpoint"])
    node_rank = _int(rdzv.get("node_rank", 0) or 0, "node_rank", 0, nnodes - 1)
    rdzv_id = rdzv.get("id")
    if rdzv_id is not None and (not isinstance(rdzv_id, str) or not _RDZV_ID.fullmatch(rdzv_id)):
        raise BadInput(f"rdzv id must be letters, digits, '_', '.', '-' (at most 128), got {rdzv_id!r}")
    if node_rank > 0 and rdzv_id is None:
        raise BadInput(
            f"node_rank {node_rank} joins a run: pass rdzv id = the run id that node 0's launch returned "
            "(its run directory must be in this workspace, on a filesystem every node shares)"
        )
    return Nodes(nnodes=nnodes, node_rank=node_rank, rdzv_endpoint=endpoint, rdzv_id=rdzv_id)


def check_allowed(nodes: Nodes, limits: RunLimits) -> None:
    """A run over several nodes needs the host network: refused unless the server allows it, and
    a route to its rendezvous host."""
    if nodes.multi and not (limits.multi_node or limits.network == "shared"):
        raise BadInput(
            f"a run over {nodes.nnodes} nodes needs the host's network (its rendezvous and collectives cross "
            "machines), which this server's settings do not allow; the person who starts the server can set "
            "runs.multi_node: true in the file given to `trainwright serve --config` (SECURITY.md)"
        )
    if nodes.multi and not nodes.local_endpoint:
        route_source(nodes)  # a rendezvous host this machine cannot reach is refused before anything is written


def torchrun_args(nodes: Nodes, nproc: int, rdzv_id: str) -> list[str]:
    """torchrun's options for one node of ``nodes`` (``--standalone`` for one node)."""
    if not nodes.multi:
        # One node: the rendezvous and the workers talk over loopback, which is also all that
        # an isolated run has.
        return ["--standalone", "--local-addr", "127.0.0.1", "--nproc-per-node", str(nproc)]
    args = ["--nnodes", str(nodes.nnodes), "--nproc-per-node", str(nproc), "--rdzv-backend", "c10d",
            "--rdzv-endpoint", str(nodes.rdzv_endpoint), "--rdzv-id", rdzv_id]
    if nodes.rdzv_host == JOB_FIRST_NODE:
        pass  # a SLURM job's: its job script gives each node's torchrun its address (runner.slurm.NODE_OPTIONS)
    elif nodes.local_endpoint:
        # Nodes that are processes of this machine meet on loopback, each at an address of its
        # own: c10d tells nodes apart by (address, pid), and in their sandboxes' PID namespaces
        # the agents' pids are alike.
        args += ["--local-addr", str(ipaddress.IPv4Address("127.0.0.1") + nodes.node_rank)]
    else:
        # Machines of their own: torchrun would take this machine's host name for both, which may
        # resolve to loopback. This node is at the address it reaches the rendezvous host from,
        # and node 0 (whose address the endpoint is) serves the rendezvous.
        args += ["--local-addr", route_source(nodes), "--rdzv-conf", f"is_host={int(nodes.node_rank == 0)}"]
    return args


def route_source(nodes: Nodes) -> str:
    """This machine's address on the route to the rendezvous host (the source address of a UDP
    socket connected there; nothing is sent), or :class:`BadInput` when there is none."""
    host, port = nodes.rdzv_host, int(str(nodes.rdzv_endpoint).rsplit(":", 1)[1])
    try:
        family, kind, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, kind) as probe:
            probe.connect(address)
            return probe.getsockname()[0]
    except OSError as error:
        raise BadInput(f"rdzv endpoint {nodes.rdzv_endpoint}: this machine finds no route to {host!r} ({error}); "
                       "give an address of the first node that every node reaches") from None
