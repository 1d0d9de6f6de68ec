"""Process group, device and the device mesh.

One process per device. ``torchrun`` sets ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``; a plain
``python -m engine.launch`` is a world of one. The backend is NCCL on GPUs and gloo on CPUs.
The mesh has three dimensions, ``("dp", "sp", "tp")``: tensor parallelism inside groups of
``tp`` neighbouring ranks, sequence parallelism (each sequence split over ``sp`` ranks) across
those, data parallelism across the rest. The ranks of one ``sp`` group read the same sequences
and hold the same weights, so FSDP2 shards the weights, and sums the gradients, over ``dp`` and
``sp`` together: ``DistInfo.fsdp_mesh``, the two flattened into one dimension ``"dp_sp"``.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import socket
from dataclasses import dataclass
from typing import Callable, Mapping

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from engine.errors import BadInput
from engine.rank_store import STORE_FD_VARIABLE


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    mesh: DeviceMesh | None
    fsdp_mesh: DeviceMesh | None = None  # "dp" and "sp" flattened: the ranks that hold different tokens

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def dp_size(self) -> int:
        return self.mesh["dp"].size() if self.mesh is not None else 1

    @property
    def dp_rank(self) -> int:
        return self.mesh["dp"].get_local_rank() if self.mesh is not None else 0

    @property
    def tp_size(self) -> int:
        return self.mesh["tp"].size() if self.mesh is not None else 1

    @property
    def sp_size(self) -> int:
        return self.mesh["sp"].size() if self.mesh is not None else 1

    @property
    def sp_rank(self) -> int:
        return self.mesh["sp"].get_local_rank() if self.mesh is not None else 0

    @property
    def fsdp_size(self) -> int:
        """Ranks over which FSDP2 shards weights and averages gradients: dp × sp."""
        return self.fsdp_mesh.size() if self.fsdp_mesh is not None else self.dp_size * self.sp_size


def world_size_from_env() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def pick_device(local_rank: int) -> torch.device:
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def set_cpu_threads(local_world_size: int) -> None:
    """Split the CPU cores between the processes on this machine (unless OMP_NUM_THREADS says)."""
    if "OMP_NUM_THREADS" in os.environ:
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    torch.set_num_threads(max(1, (cores or 1) // max(1, local_world_size)))


GLOO_INTERFACE_VARIABLE = "GLOO_SOCKET_IFNAME"


def host_addresses(host: str) -> list[str]:
    """The addresses ``host`` resolves to here (none when it does not resolve)."""
    try:
        return sorted({info[4][0] for info in socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)})
    except (OSError, UnicodeError):
        return []


def _loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address.split("%")[0]).is_loopback
    except ValueError:
        return False


def gloo_interface_problem(env: Mapping[str, str],
                           addresses: Callable[[str], list[str]] = host_addresses) -> str | None:
    """Why gloo cannot connect the nodes of this world, or None.

    Unless told an interface (``GLOO_SOCKET_IFNAME``), gloo listens at the address this
    machine's host name resolves to and falls back to loopback when there is none. Where the
    host name resolves to loopback only (127.0.1.1 on Debian, 127.0.0.1 on many containers),
    each rank tells the others to connect to its own loopback: across machines that is refused
    after gloo's retries, with an error that names no cause. Nodes that meet on loopback (a
    run over several nodes of one machine, ``MASTER_ADDR`` a loopback address) are fine."""
    world, local = int(env.get("WORLD_SIZE", "1")), int(env.get("LOCAL_WORLD_SIZE", env.get("WORLD_SIZE", "1")))
    master = env.get("MASTER_ADDR", "127.0.0.1")
    if world <= local or env.get(GLOO_INTERFACE_VARIABLE):
        return None
    if any(_loopback(a) for a in [master, *addresses(master)]):
        return None
    host = socket.gethostname()
    found = addresses(host)
    if found and not all(_loopback(a) for a in found):
        return None
    where = f"resolves to {', '.join(found)}" if found else "does not resolve"
    return (f"gloo, the CPU backend, would connect the {world} ranks of this run over several machines at the "
            f"address of this machine's host name {host!r}, which {where}: the other nodes cannot reach it there. "
            f"Set {GLOO_INTERFACE_VARIABLE} to the network interface the nodes reach each other on (e.g. eth0) in "
            "the environment trainwright is started with (it passes GLOO_* and NCCL_* on to runs and jobs)")


def init_distributed(tp: int, sp: int = 1) -> DistInfo:
    """Start the process group (always, also for a world of one) and build the mesh."""
    rank = int(os.environ.get("RANK", "0"))
    world_size = world_size_from_env()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", str(world_size)))
    set_cpu_threads(local_world_size)
    device = pick_device(local_rank)
    if world_size % (tp * sp) != 0:
        raise ValueError(f"parallel.tp × parallel.sp = {tp} × {sp} does not divide the world size {world_size}")

    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        problem = gloo_interface_problem(os.environ) if backend == "gloo" else None
        if problem:
            raise BadInput(problem)
        dist.init_process_group(
            backend=backend,
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(minutes=10),
            device_id=device if device.type == "cuda" else None,
            store=own_store(rank, world_size),
        )
    mesh = init_device_mesh(
        device.type, (world_size // (tp * sp), sp, tp), mesh_dim_names=("dp", "sp", "tp")
    )
    fsdp_mesh = mesh["dp", "sp"]._flatten("dp_sp")
    return DistInfo(rank, world_size, local_rank, device, mesh, fsdp_mesh)


def shutdown_distributed(synchronize: bool = True) -> None:
    """Destroy the process group; with ``synchronize``, first wait for every rank to get here,
    so that no rank tears down its connections while a peer is still on a collective.

    On an error path pass ``synchronize=False``: a peer that is stuck elsewhere would never
    reach the barrier. (What else it takes to exit cleanly: ``launch.exit_without_finalizing``.)
    """
    if dist.is_initialized():
        if synchronize and dist.get_world_size() > 1:
            dist.barrier()
        dist.destroy_process_group()


def own_store(rank: int, world_size: int) -> dist.Store | None:
    """The store of a run this process can serve without a port chosen in advance, else None
    (``env://``: torchrun's, at ``MASTER_ADDR:MASTER_PORT``).

    A world of one started without torchrun needs no peer to find it: an in-process store. Rank
    0 of ranks started by :mod:`runner.local_ranks` serves the store on the listening socket the
    launcher bound and handed down (``TRAINWRIGHT_STORE_FD``); the others join it by the
    environment's address (:mod:`engine.rank_store`). (Picking a free port and binding it later lost the port, now and then,
    to another run or connection started in between: EADDRINUSE.)"""
    fd = os.environ.pop(STORE_FD_VARIABLE, None)
    if world_size == 1 and "MASTER_ADDR" not in os.environ:
        return dist.HashStore()
    if fd is None:
        return None
    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                         is_master=rank == 0, timeout=datetime.timedelta(minutes=10),
                         master_listen_fd=int(fd) if rank == 0 else None)


def dp_all_reduce_sum(value: torch.Tensor, info: DistInfo) -> torch.Tensor:
    """Sum over the ranks that hold different tokens: the data-parallel ranks and, within each,
    the sequence-parallel ranks (each holds one part of the same sequences). Tensor-parallel
    ranks hold the same value: no double count."""
    if info.fsdp_size > 1:
        group = info.fsdp_mesh.get_group() if info.fsdp_mesh is not None else None
        dist.all_reduce(value, op=dist.ReduceOp.SUM, group=group)
    return value


def all_gather_floats(values: list[float], info: DistInfo) -> list[list[float]]:
    """``values`` of every rank, in rank order (each rank gives as many)."""
    tensor = torch.tensor(values, dtype=torch.float64, device=info.device)
    if info.world_size == 1:
        return [values]
    gathered = [torch.empty_like(tensor) for _ in range(info.world_size)]
    dist.all_gather(gathered, tensor)
    return [t.tolist() for t in gathered]
