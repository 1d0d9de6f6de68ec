"""No network for a run: a network namespace of its own, with only loopback up.

``torchrun --standalone`` and gloo talk over loopback, so a run works as before; it cannot reach
any other host (no data exfiltration, no downloads the user did not provide). It needs
``unshare(CLONE_NEWNET)``: root (CAP_SYS_ADMIN) can, and an ordinary user can where the kernel
allows unprivileged user namespaces (then a user namespace maps the user to itself). Where
neither works — macOS, containers without the capability — the run keeps the host's network and
records why, so ``get_run`` says whether the run was isolated.

``python -m sandbox.network -- COMMAND ...`` runs a command isolated (or not, where it cannot be),
for short helper processes such as the engine's ``--check``.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import socket
import struct
import sys

CLONE_NEWNET = 0x40000000
CLONE_NEWUSER = 0x10000000
SIOCGIFFLAGS = 0x8913
SIOCSIFFLAGS = 0x8914
IFF_UP = 0x1

# Variables that make the distributed back ends use loopback rather than the address the host
# name resolves to (that address does not exist inside the namespace).
LOOPBACK_ENV = {"GLOO_SOCKET_IFNAME": "lo", "TP_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"}


def _unshare(flags: int) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(ctypes.c_int(flags)) != 0:
        return ctypes.get_errno()
    return 0


def _setns(fd: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(ctypes.c_int(fd), ctypes.c_int(CLONE_NEWNET)) != 0:
        raise OSError(ctypes.get_errno(), "setns")


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _loopback_up() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        request = struct.pack("16sH14s", b"lo", 0, b"")
        flags = struct.unpack("16sH", fcntl.ioctl(s, SIOCGIFFLAGS, request)[:18])[1]
        fcntl.ioctl(s, SIOCSIFFLAGS, struct.pack("16sH14s", b"lo", flags | IFF_UP, b""))


def isolate_network() -> tuple[bool, str]:
    """Move this process (and its future children) into a namespace with only loopback.

    Returns ``(isolated, note)``; on failure the process keeps the network it had.
    """
    if not sys.platform.startswith("linux"):
        return False, f"network isolation needs Linux network namespaces (this is {sys.platform})"
    try:
        original = os.open("/proc/self/ns/net", os.O_RDONLY)
    except OSError as e:
        return False, f"network isolation unavailable: cannot open /proc/self/ns/net ({e.strerror})"
    try:
        error = _unshare(CLONE_NEWNET)
        how = "network namespace"
        if error in (errno.EPERM, errno.EACCES):  # not privileged: a user namespace may do
            uid, gid = os.getuid(), os.getgid()
            error = _unshare(CLONE_NEWUSER | CLONE_NEWNET)
            how = "user and network namespace"
            if not error:
                try:
                    _write("/proc/self/setgroups", "deny")
                    _write("/proc/self/uid_map", f"{uid} {uid} 1")
                    _write("/proc/self/gid_map", f"{gid} {gid} 1")
                except OSError as e:
                    return False, f"network isolation unavailable: mapping the user failed ({e.strerror})"
        if error:
            return False, f"network isolation unavailable: unshare failed ({os.strerror(error)}); the run shares the host's network"
        try:
            _loopback_up()
        except OSError as e:
            _setns(original)  # without loopback torchrun cannot start: go back
            return False, f"network isolation unavailable: cannot bring up loopback ({e.strerror})"
        return True, f"own {how}: loopback only"
    finally:
        os.close(original)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv:
        print("usage: python -m sandbox.network -- COMMAND [ARG ...]", file=sys.stderr)
        return 2
    isolated, _ = isolate_network()
    env = dict(os.environ)
    if isolated:
        for key, value in LOOPBACK_ENV.items():
            env.setdefault(key, value)
    os.execvpe(argv[0], argv, env)
    return 127  # not reached


if __name__ == "__main__":
    sys.exit(main())
