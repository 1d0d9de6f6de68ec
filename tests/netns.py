"""Machines for tests: network namespaces joined by a veth pair, set up and torn down by a test.

Each :class:`Machine` is a network namespace of its own (``ip netns add``) with its own
loopback and one end of a veth pair named :data:`INTERFACE` in every namespace (as a cluster's
nodes each have ``eth0``), addressed :data:`SUBNET`'s ``.1``, ``.2``, ... Namespaces are
separate networks, so two pairs never collide, whatever their addresses. A machine's
``/etc/hosts`` (``/etc/netns/NAME/hosts``, mounted over ``/etc/hosts`` by :meth:`Machine.run_in`)
names every machine by its address; the host name of this machine is left to its usual
``/etc/hosts`` line (127.0.0.1 here), which is what a process that picks an interface by its
host name finds. Everything else (the filesystem, processes, Unix sockets) is shared, as
a cluster shares its filesystem.

Needs root, ``ip`` (iproute2), ``nsenter`` and ``unshare`` with namespaces and veth allowed; otherwise :func:`missing`
says why, for a skip. Commands run in a machine through :meth:`Machine.run_in`.
"""

from __future__ import annotations

import ipaddress
import os
import shutil
import signal
import subprocess
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

INTERFACE = "tw0"
SUBNET = ipaddress.IPv4Network("10.77.0.0/24")
NETNS_ETC = Path("/etc/netns")
COMMAND_TIMEOUT_S = 20


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)


def missing() -> str | None:
    """Why network namespaces cannot be set up here (a skip reason), or None."""
    if os.geteuid() != 0:
        return "network namespaces need root here (ip netns add)"
    absent = [name for name in ("ip", "nsenter", "unshare") if shutil.which(name) is None]
    if absent:
        return f"{', '.join(absent)} not installed (iproute2, util-linux)"
    name = f"twprobe-{uuid.uuid4().hex[:8]}"
    added = _ip("netns", "add", name)
    if added.returncode != 0:
        return f"the kernel or container refuses network namespaces: ip netns add: {added.stderr.strip()[:200]}"
    try:
        veth = _ip("-n", name, "link", "add", "a0", "type", "veth", "peer", "name", "a1")
        if veth.returncode != 0:
            return f"the kernel or container refuses veth pairs: ip link add: {veth.stderr.strip()[:200]}"
    finally:
        _ip("netns", "del", name)
    return None


@dataclass(frozen=True)
class Machine:
    name: str  # the node's name, in every machine's /etc/hosts
    netns: str
    address: str

    def run_in(self, *command: str) -> list[str]:
        """``command`` as run inside this machine's network namespace, with its hosts file over
        ``/etc/hosts`` (in a mount namespace of its own). Not ``ip netns exec``, which also mounts a
        fresh ``/sys`` without the cgroup filesystems that slurmd reads."""
        hosts = NETNS_ETC / self.netns / "hosts"
        return ["nsenter", f"--net=/run/netns/{self.netns}", "--", "unshare", "--mount", "--propagation", "private",
                "--", "sh", "-c", 'mount --bind "$0" /etc/hosts && exec "$@"', str(hosts), *command]

    def pids(self) -> list[int]:
        """The processes whose network is this machine's."""
        listed = _ip("netns", "pids", self.netns)
        return [int(word) for word in listed.stdout.split() if word.isdigit()]

    def set_link(self, up: bool) -> None:
        """This machine's end of the veth pair up or down: down, its network is cut (no reset
        reaches anyone, its processes live on), as when a cable is pulled."""
        _check(_ip("-n", self.netns, "link", "set", INTERFACE, "up" if up else "down"),
               f"ip link set {INTERFACE} in {self.netns}")

    def kill_all(self) -> list[int]:
        """SIGKILL every process of this machine (a machine dies); the pids killed."""
        killed = []
        for pid in self.pids():
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            except ProcessLookupError:
                pass
        return killed


def _check(result: subprocess.CompletedProcess, what: str) -> None:
    if result.returncode != 0:
        raise AssertionError(f"{what} failed: {result.stderr.strip()[:500]}")


@contextmanager
def machines(names: tuple[str, ...] = ("n1", "n2")) -> Iterator[list[Machine]]:
    """One network namespace per name, all on one link; on the way out every process left in
    them is killed and the namespaces and their hosts files are removed."""
    if len(names) != 2:
        raise ValueError("a veth pair joins two machines")
    tag = uuid.uuid4().hex[:8]
    hosts = list(SUBNET.hosts())
    made = [Machine(name, f"tw{tag}-{name}", str(hosts[i])) for i, name in enumerate(names)]
    created: list[Machine] = []
    try:
        for machine in made:
            _check(_ip("netns", "add", machine.netns), f"ip netns add {machine.netns}")
            created.append(machine)
            folder = NETNS_ETC / machine.netns
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "hosts").write_text(
                "127.0.0.1 localhost\n" + "".join(f"{m.address} {m.name}\n" for m in made) + _own_host_line())
        first, second = made
        _check(_ip("link", "add", "name", INTERFACE, "netns", first.netns, "type", "veth",
                   "peer", "name", INTERFACE, "netns", second.netns), "ip link add (veth)")
        for machine in made:
            _check(_ip("-n", machine.netns, "addr", "add", f"{machine.address}/{SUBNET.prefixlen}", "dev", INTERFACE),
                   f"ip addr add in {machine.netns}")
            for link in ("lo", INTERFACE):
                _check(_ip("-n", machine.netns, "link", "set", link, "up"), f"ip link set {link} up in {machine.netns}")
        yield made
    finally:
        for machine in created:
            machine.kill_all()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(m.pids() for m in created):
            time.sleep(0.2)
        for machine in created:
            _ip("netns", "del", machine.netns)
            shutil.rmtree(NETNS_ETC / machine.netns, ignore_errors=True)


def _own_host_line() -> str:
    """This machine's own host name as /etc/hosts gives it (a process that resolves its host name
    finds what it would outside the namespace, as on a machine whose host name is loopback)."""
    try:
        text = Path("/etc/hosts").read_text()
    except OSError:
        return ""
    host = os.uname().nodename
    lines = [line for line in text.splitlines() if host in line.split("#")[0].split()[1:]]
    return "".join(f"{line}\n" for line in lines)
