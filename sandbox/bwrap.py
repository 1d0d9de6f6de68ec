"""The sandbox of every process that runs recipe code: bubblewrap (``bwrap``).

:func:`wrap` turns a command into ``bwrap [OPTIONS] -- COMMAND`` and says what the command
got. The sandbox has:

- a user namespace (also for root) with every capability dropped, and no nested user
  namespaces (``--disable-userns``): no ``setns``, no ``mount``, no ``ptrace`` of the host;
- a PID namespace with its own ``/proc``: the processes of the server and of other runs do
  not exist there, so their environments cannot be read;
- a network namespace with only loopback (``torchrun --standalone`` and gloo work), unless
  ``runs.network`` is ``shared``; IPC and UTS namespaces of its own;
- a mount view with only the system (``/usr``, a few files of ``/etc``, ``/sys`` read-only),
  the Python environment and the trainwright source it imports (read-only), the paths the
  caller lists (the recipe and data read-only, the run directory writable), an empty ``/tmp``
  and home of its own, and the GPUs (``/dev/nvidia*``) where there are any. The host's other
  files, its ``/tmp`` and its Unix sockets are not there;
- a session of its own, and ``--die-with-parent``: when the process that started ``bwrap``
  dies, or the command's main process exits, every process left in the sandbox is killed.

Where bubblewrap is missing or the kernel refuses user namespaces, :func:`wrap` returns the
command as it is with ``sandboxed`` false and the reason; the caller falls back to what it
can do alone (:mod:`sandbox.network`) and reports the level it got (:func:`fallback_report`).

``TRAINWRIGHT_BWRAP`` (in the server's environment) names the bubblewrap binary; empty
disables the sandbox (the fallback, for hosts where it cannot work).
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Mapping

BWRAP_VARIABLE = "TRAINWRIGHT_BWRAP"
FULL, PARTIAL, NONE = "full", "partial", "none"

# Files of /etc that programs need to start and to resolve "localhost"; the rest of /etc
# (shadow, ssh keys, cloud credentials) stays outside.
ETC_FILES = (
    "ld.so.cache", "ld.so.conf", "ld.so.conf.d", "passwd", "group", "nsswitch.conf", "hosts",
    "host.conf", "gai.conf", "localtime", "timezone", "alternatives", "mime.types",
    "ssl", "ca-certificates", "pki",
)
ETC_SHARED_NETWORK = ("resolv.conf",)
# What hardware discovery reads (CPU count for torch's cpuinfo, GPU topology for NCCL).
SYS_DIRS = ("/sys/block", "/sys/bus", "/sys/class", "/sys/dev", "/sys/devices")
TOP_LEVEL = ("bin", "sbin", "lib", "lib32", "lib64", "libx32")
NAMESPACES = "user, PID, network, IPC and UTS namespaces"


@dataclass
class Wrapped:
    """A command made ready to run, and what containment it gets."""

    command: list[str]
    sandboxed: bool
    reason: str = ""  # why it is not sandboxed
    report: dict = field(default_factory=dict)  # isolation fields for run.json


def find_bwrap(environ: Mapping[str, str] | None = None) -> str | None:
    """The bubblewrap binary to use: ``TRAINWRIGHT_BWRAP`` (empty: none), else ``bwrap`` on PATH."""
    environ = os.environ if environ is None else environ
    if BWRAP_VARIABLE in environ:
        return environ[BWRAP_VARIABLE] or None
    return shutil.which("bwrap") or "/usr/bin/bwrap"


SHARED_NETWORK_REASON = "runs.network is 'shared' in .trainwright/config.yaml"


def _namespace_options(network: str) -> list[str]:
    options = ["--unshare-all", "--unshare-user", "--disable-userns", "--cap-drop", "ALL",
               "--die-with-parent", "--new-session"]
    if network == "shared":
        # The host's name stays: the other nodes of a run reach this one by it.
        options.append("--share-net")
    else:
        # The host's name does not resolve in the sandbox (its /etc/hosts may not list it, and
        # there is no DNS); "localhost" does, so c10d and gloo find their own address.
        options += ["--hostname", "localhost"]
    return options


def probe(bwrap: str | None, network: str = "isolated") -> str | None:
    """None when bubblewrap can create the sandbox here, else why not (a few milliseconds)."""
    if not sys.platform.startswith("linux"):
        return f"bubblewrap needs Linux (this is {sys.platform})"
    if not bwrap:
        return f"the sandbox is disabled ({BWRAP_VARIABLE} is empty)"
    if not os.access(bwrap, os.X_OK):
        return f"bubblewrap is not installed ({bwrap} not found; install the bubblewrap package)"
    true = shutil.which("true") or "/bin/true"
    command = [bwrap, *_namespace_options(network), "--ro-bind", "/", "/", "--proc", "/proc",
               "--dev", "/dev", "--", true]
    try:
        result = subprocess.run(command, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                                errors="replace", timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"bubblewrap could not be run ({e})"
    if result.returncode != 0:
        last = (result.stderr.strip().splitlines() or [f"exit status {result.returncode}"])[-1]
        return f"bubblewrap cannot create the sandbox here ({last[:300]}); user namespaces may be disabled"
    return None


@functools.lru_cache(maxsize=8)
def binds_fds(bwrap: str) -> bool:
    """Whether this bubblewrap has ``--ro-bind-fd`` (0.8 and later)."""
    try:
        result = subprocess.run([bwrap, "--help"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return False
    return "--ro-bind-fd" in result.stdout + result.stderr


def python_paths(environ: Mapping[str, str] | None = None) -> list[Path]:
    """What the Python environment needs: prefixes, import paths, the trainwright source."""
    environ = os.environ if environ is None else environ
    paths = {sys.prefix, sys.exec_prefix, sys.base_prefix, sys.base_exec_prefix,
             os.path.dirname(os.path.dirname(os.path.realpath(sys.executable))),
             str(Path(__file__).resolve().parent.parent)}  # the source tree (editable installs)
    cwd = os.getcwd()
    for entry in [*sys.path[1:], *environ.get("PYTHONPATH", "").split(os.pathsep)]:
        if entry and entry != cwd and os.path.isdir(entry):
            paths.add(entry)
    for name in ("CUDA_HOME", "CUDA_PATH"):
        if environ.get(name):
            paths.add(environ[name])
    return [Path(os.path.abspath(p)) for p in paths if p and os.path.isabs(p) and p != "/" and os.path.isdir(p)]


def gpu_devices() -> list[str]:
    """NVIDIA device nodes (``/dev/nvidia0``, ``nvidiactl``, ``nvidia-uvm``, ``nvidia-caps``...)."""
    try:
        return sorted(f"/dev/{name}" for name in os.listdir("/dev") if name.startswith("nvidia"))
    except OSError:
        return []


def under(path: Path, folder: Path) -> bool:
    """``path`` is ``folder`` or inside it (both absolute, as written)."""
    return path == folder or folder in path.parents


_under = under


def _mounts(read_only: Iterable[Path], writable: Iterable[Path], network: str,
            environ: Mapping[str, str], hidden: Iterable[Path] = (),
            bound_fds: Mapping[Path | str, int] | None = None) -> list[list[str]]:
    """Mount options, parents before children, so that a deeper mount lies over a shallower one."""
    entries: list[tuple[Path, int, list[str]]] = []  # (destination, order, options)

    def add(kind: str, path: Path, order: int, *extra: str) -> None:
        entries.append((path, order, [kind, *extra]))

    for name in TOP_LEVEL:
        path = Path("/") / name
        if path.is_symlink():
            add("--symlink", path, 0, os.readlink(path), str(path))
        elif path.is_dir():
            add("--ro-bind", path, 0, str(path), str(path))
    add("--ro-bind", Path("/usr"), 0, "/usr", "/usr")
    for name in ETC_FILES + (ETC_SHARED_NETWORK if network == "shared" else ()):
        add("--ro-bind-try", Path("/etc") / name, 0, f"/etc/{name}", f"/etc/{name}")
    for folder in SYS_DIRS:
        add("--ro-bind-try", Path(folder), 0, folder, folder)
    add("--proc", Path("/proc"), 0, "/proc")
    add("--dev", Path("/dev"), 0, "/dev")
    for device in gpu_devices():
        add("--dev-bind-try", Path(device), 1, device, device)
    add("--tmpfs", Path("/tmp"), 0, "/tmp")
    home = environ.get("HOME", "")
    if os.path.isabs(home) and home != "/":
        add("--tmpfs", Path(home), 0, home)  # an empty home: no dotfiles, tokens or caches
    ro = [Path(os.path.abspath(p)) for p in read_only]
    rw = [Path(os.path.abspath(p)) for p in writable]
    for path in python_paths(environ):
        add("--ro-bind-try", path, 1, str(path), str(path))
    for path in ro:
        add("--ro-bind", path, 2, str(path), str(path))
    for path in hidden:  # an empty folder over one inside a mounted one; deeper binds come after
        path = Path(os.path.abspath(path))
        if any(_under(path, p) for p in ro + rw) and os.path.isdir(path):
            add("--tmpfs", path, 2, str(path))
    for bound, fd in (bound_fds or {}).items():
        shown = Path(os.path.abspath(bound))
        add("--ro-bind-fd", shown, 2, str(fd), str(shown))
    for path in rw:
        add("--bind", path, 3, str(path), str(path))
    # Parents first; at one depth, the system, then the environment, then the caller's paths.
    entries.sort(key=lambda e: (len(e[0].parts), e[1]))
    options: list[list[str]] = []
    kept: list[tuple[Path, str]] = []
    for path, _, option in entries:
        kind = option[0]
        # A read-only bind inside another read-only bind with nothing between them adds nothing.
        if kind in ("--ro-bind", "--ro-bind-try"):
            covering = [(p, k) for p, k in kept if _under(path, p)]
            if covering and covering[-1][1] in ("--ro-bind", "--ro-bind-try"):
                continue
        kept.append((path, kind))
        options.append(option)
    return options


def _mounted(path: Path, read_only: Iterable[Path], writable: Iterable[Path]) -> bool:
    return any(_under(path, Path(os.path.abspath(p))) for p in [*read_only, *writable])


def wrap(
    command: list[str],
    read_only: Iterable[Path | str],
    writable: Iterable[Path | str],
    network: str = "isolated",
    cwd: Path | str | None = None,
    bwrap: str | None = None,
    environ: Mapping[str, str] | None = None,
    hidden: Iterable[Path | str] = (),
    network_reason: str = SHARED_NETWORK_REASON,
    bound_fds: Mapping[Path | str, int] | None = None,
) -> Wrapped:
    """``command`` inside the sandbox, seeing only ``read_only`` and ``writable`` (and the
    system and Python environment), with the folders ``hidden`` (inside those) empty;
    ``network`` is ``isolated`` or ``shared``. ``bwrap`` defaults (None) to
    :func:`find_bwrap`, ``""`` disables the sandbox; ``environ`` is the environment the
    command will get; ``network_reason`` says why a shared network is shared. ``bound_fds``
    (path -> open descriptor, which the caller passes to the process): shown read-only at that
    path is what the descriptor holds, whatever the path names when the sandbox starts (a link
    swapped in since is not followed)."""
    environ = os.environ if environ is None else environ
    bwrap = find_bwrap() if bwrap is None else bwrap
    reason = probe(bwrap, network)
    if reason is not None:
        return Wrapped(list(command), sandboxed=False, reason=reason)
    assert bwrap  # probe() refused a missing one
    shown = [Path(p) for p in read_only]
    changed = [Path(p) for p in writable]
    options: list[str] = [bwrap, *_namespace_options(network)]
    bound_fds = dict(bound_fds or {})
    if bound_fds and not binds_fds(bwrap):  # bubblewrap before 0.8: by path (a swap is followed)
        shown += [Path(p) for p in bound_fds]
        bound_fds = {}
    for option in _mounts(shown, changed, network, environ, [Path(p) for p in hidden], bound_fds):
        options += option
    directory = Path(os.path.abspath(cwd)) if cwd else None
    if directory is None or not _mounted(directory, shown, changed):
        directory = changed[0] if changed else Path("/tmp")
    options += ["--chdir", str(directory), "--setenv", "TMPDIR", "/tmp"]
    network_isolated = network != "shared"
    devices = gpu_devices()
    note = (f"bubblewrap: {NAMESPACES if network_isolated else NAMESPACES.replace('network, ', '')}; "
            "no capabilities; only the recipe, data, run directory and Python environment are mounted")
    if devices:
        note += f"; GPU devices {', '.join(Path(d).name for d in devices)}"
    if network_isolated:
        level = FULL
    else:
        level = PARTIAL
        note += f"; missing: network isolation ({network_reason})"
    report = {
        "isolation": level,
        "isolation_note": note,
        "network_isolated": network_isolated,
        "network_note": "own network namespace (bubblewrap): loopback only" if network_isolated
        else network_reason,
    }
    return Wrapped([*options, "--", *command], sandboxed=True, report=report)


def fallback_report(reason: str, network_isolated: bool, network_note: str) -> dict:
    """The isolation fields of a run that could not be sandboxed (see the module docstring)."""
    missing = "no PID namespace (the run can read other processes' environments through /proc), " \
              "no mount view (it sees the host's files as the server's user), capabilities kept"
    if network_isolated:
        level, what = PARTIAL, "only the network is isolated and the environment allow-listed"
    else:
        level, what = NONE, "only the environment is allow-listed; the network is the host's"
    return {
        "isolation": level,
        "isolation_note": f"{what}: {reason}; missing: {missing}",
        "network_isolated": network_isolated,
        "network_note": network_note,
    }
