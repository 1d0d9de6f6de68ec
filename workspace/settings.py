"""What runs may do: the ``runs:`` limits, set by the person who starts the server.

The trusted settings live outside the workspace, where an agent's own editing tools do not
reach: ``trainwright serve --config FILE`` (also ``run`` and ``resume``), by default
``$XDG_CONFIG_HOME/trainwright/config.yaml`` (``~/.config/trainwright/config.yaml``). The
workspace's ``.trainwright/config.yaml`` may only *tighten* them (:func:`tighten`): lower
numbers, ``network: isolated`` where the server allows ``shared``, a subset of ``pass_env``.
A setting there that would loosen a limit is ignored, and the run records a warning that says
so (``get_run`` shows it). Both files are read at each launch, so an edit applies to the next
run, and the limits a run got are recorded in its ``run.json`` (``limits``). Every field is
optional; a missing file means the defaults below, which are these:

    runs:
      wall_time_s: null           # stop a run after this long, recorded as stopped (null: none)
      max_open_files: 4096        # RLIMIT_NOFILE of every process of a run
      max_processes: null         # RLIMIT_NPROC (per user; the kernel ignores it for root)
      max_memory: null            # RLIMIT_AS per process: bytes or "16GiB" (CPU runs only:
                                  #   CUDA reserves far more address space than it uses)
      stop_grace_s: 10            # after SIGTERM, SIGKILL the run's processes this much later
      network: isolated           # isolated: a network namespace with only loopback (torchrun
                                  #   --standalone works), where the platform allows; shared
      threads_per_process: null   # OMP_NUM_THREADS of a run (default: CPU cores / processes)
      pass_env: []                # server variables a run gets although they look like secrets
      max_concurrent_runs: null   # runs starting or running at once (default: 2 x CPU cores)
      max_total_processes: null   # training processes of all those runs (default: 4 x CPU cores)
      multi_node: false           # allow runs over several nodes (nnodes > 1), which need the
                                  #   host's network (SECURITY.md)
      slurm: false                # submit target=slurm jobs with sbatch (they run on the cluster,
                                  #   outside this sandbox); otherwise the job script is returned
      allow_pickled_weights: false  # a model by Hub id may have .bin/.pt weights (loading them
                                  #   can run code; inside the sandbox); otherwise safetensors only
      trust_remote_code: false    # fetch a Hub model repo's own Python files (remote code)
      max_export_bytes: null      # export_checkpoint refuses (and removes) an export larger than
                                  #   this: bytes or "20GiB" (null: no cap)
"""

from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, Mapping

from engine.errors import BadInput

CONFIG_FILENAME = "config.yaml"
NETWORK_MODES = ("isolated", "shared")
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
          "KI": 2**10, "MI": 2**20, "GI": 2**30, "TI": 2**40}


class ConfigRefused(BadInput):
    """``.trainwright/config.yaml`` is not valid; the message names the key and what is allowed."""


@dataclass(frozen=True)
class RunLimits:
    """Limits and containment the supervisor applies to every process of a run."""

    wall_time_s: float | None = None  # stop the run after this long
    max_open_files: int | None = 4096  # RLIMIT_NOFILE
    max_processes: int | None = None  # RLIMIT_NPROC (ignored for root by the kernel)
    max_memory_bytes: int | None = None  # RLIMIT_AS per process; CUDA needs a lot of address space
    stop_grace_s: float = 10.0  # SIGTERM, then SIGKILL after this long
    network: str = "isolated"  # "isolated" (loopback only, where possible) or "shared"
    threads_per_process: int | None = None  # OMP_NUM_THREADS; None: CPU cores / processes
    pass_env: tuple[str, ...] = ()  # server variables passed although they look like secrets
    max_concurrent_runs: int | None = None  # per workspace; None: 2 x CPU cores
    max_total_processes: int | None = None  # per workspace, summed over running runs; None: 4 x CPU cores
    multi_node: bool = False  # runs over several nodes (they need the host's network)
    slurm: bool = False  # submit SLURM jobs (they run outside this sandbox)
    allow_pickled_weights: bool = False  # Hub models with .bin/.pt weights (runner/hub.py)
    trust_remote_code: bool = False  # fetch a Hub model repo's Python files
    max_export_bytes: int | None = None  # an export's files in all; None: no cap


_KEYS = {f.name for f in fields(RunLimits)} - {"max_memory_bytes"} | {"max_memory"}


def parse_size(value: object, key: str) -> int | None:
    """``17179869184``, ``"16GiB"``, ``"500M"`` → bytes."""
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        size = value
    elif isinstance(value, str) and (match := _SIZE.match(value)):
        unit = (match.group(2) or "").upper().rstrip("B")
        size = int(float(match.group(1)) * _UNITS[unit])
    else:
        raise ConfigRefused(f"runs.{key} must be a number of bytes or a size like '16GiB', got {value!r}")
    if size <= 0:
        raise ConfigRefused(f"runs.{key} must be positive, got {value!r}")
    return size


def _positive(value: object, key: str, kind: type) -> Any:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not isinstance(value, int)):
        raise ConfigRefused(f"runs.{key} must be a positive {kind.__name__} or null, got {value!r}")
    if value <= 0:
        raise ConfigRefused(f"runs.{key} must be positive, got {value!r}")
    return kind(value)


def limits_from_mapping(section: object) -> RunLimits:
    """The ``runs:`` section of the config file → :class:`RunLimits`."""
    if section is None:
        return RunLimits()
    if not isinstance(section, dict):
        raise ConfigRefused("runs: must be a mapping of settings")
    unknown = sorted(str(k) for k in section if k not in _KEYS)
    if unknown:
        raise ConfigRefused(f"unknown setting runs.{unknown[0]}; valid: {', '.join(sorted(_KEYS))}")
    defaults = RunLimits()
    network = section.get("network", defaults.network)
    if network not in NETWORK_MODES:
        raise ConfigRefused(f"runs.network must be one of {', '.join(NETWORK_MODES)}, got {network!r}")
    pass_env = section.get("pass_env") or []
    if isinstance(pass_env, str):
        pass_env = [n.strip() for n in pass_env.split(",")]
    if not isinstance(pass_env, list) or not all(isinstance(n, str) and n for n in pass_env):
        raise ConfigRefused("runs.pass_env must be a list of environment variable names")
    grace = _positive(section.get("stop_grace_s", defaults.stop_grace_s), "stop_grace_s", float)
    return RunLimits(
        wall_time_s=_positive(section.get("wall_time_s", defaults.wall_time_s), "wall_time_s", float),
        max_open_files=_positive(section.get("max_open_files", defaults.max_open_files), "max_open_files", int),
        max_processes=_positive(section.get("max_processes", defaults.max_processes), "max_processes", int),
        max_memory_bytes=parse_size(section.get("max_memory"), "max_memory"),
        stop_grace_s=grace if grace is not None else defaults.stop_grace_s,
        network=network,
        threads_per_process=_positive(section.get("threads_per_process"), "threads_per_process", int),
        pass_env=tuple(pass_env),
        max_concurrent_runs=_positive(section.get("max_concurrent_runs"), "max_concurrent_runs", int),
        max_total_processes=_positive(section.get("max_total_processes"), "max_total_processes", int),
        multi_node=_flag(section.get("multi_node", defaults.multi_node), "multi_node"),
        slurm=_flag(section.get("slurm", defaults.slurm), "slurm"),
        allow_pickled_weights=_flag(section.get("allow_pickled_weights", False), "allow_pickled_weights"),
        trust_remote_code=_flag(section.get("trust_remote_code", False), "trust_remote_code"),
        max_export_bytes=parse_size(section.get("max_export_bytes"), "max_export_bytes"),
    )


def _flag(value: object, key: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigRefused(f"runs.{key} must be true or false, got {value!r}")
    return value


def cpu_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def capacity(limits: RunLimits) -> tuple[int, int]:
    """``(concurrent runs, training processes)`` a workspace allows, defaults from the core count."""
    cores = cpu_cores()
    return (limits.max_concurrent_runs or 2 * cores, limits.max_total_processes or 4 * cores)


def user_config_path(environ: Mapping[str, str] | None = None) -> Path:
    """The trusted settings file by default: ``$XDG_CONFIG_HOME/trainwright/config.yaml``."""
    source: Mapping[str, str] = os.environ if environ is None else environ
    base = source.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "trainwright" / CONFIG_FILENAME


def _read_section(path: Path) -> dict[str, Any] | None:
    """The ``runs:`` section of a settings file (None without the file); links are not followed."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise ConfigRefused(f"{path} cannot be read ({os.strerror(e.errno or 0)}; a link is not followed)") from None
    import yaml  # only when there is a file: the server's start stays light (~13 ms)

    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ConfigRefused(f"{path} is not a regular file")
        with os.fdopen(fd, encoding="utf-8", closefd=False) as f:
            data = yaml.safe_load(f.read()) or {}
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        raise ConfigRefused(f"{path} cannot be read: {e}") from None
    finally:
        os.close(fd)
    if not isinstance(data, dict):
        raise ConfigRefused(f"{path} must be a mapping with a runs: section")
    section = data.get("runs")
    if section is not None and not isinstance(section, dict):
        raise ConfigRefused(f"{path}: runs: must be a mapping of settings")
    return section or {}


def load_limits_file(path: Path) -> RunLimits:
    """The limits of one settings file (the defaults without it)."""
    try:
        return limits_from_mapping(_read_section(Path(path)))
    except ConfigRefused as e:
        raise ConfigRefused(e if str(e).startswith(str(path)) else f"{path}: {e}") from None


def load_run_limits(state_dir: Path) -> RunLimits:
    """The limits of a workspace's own ``<state_dir>/config.yaml`` alone (defaults without it)."""
    return load_limits_file(Path(state_dir) / CONFIG_FILENAME)


def tighten(trusted: RunLimits, wanted: RunLimits, given: set[str], source: str = "the workspace") -> tuple[RunLimits, list[str]]:
    """``trusted`` with each setting of ``wanted`` named in ``given`` that tightens it; a setting
    that would loosen it is ignored, with a warning."""
    changes: dict[str, Any] = {}
    warnings: list[str] = []
    for field in fields(RunLimits):
        name = field.name
        key = "max_memory" if name == "max_memory_bytes" else name
        if key not in given:
            continue
        limit, value = getattr(trusted, name), getattr(wanted, name)
        if name == "network":
            ok = NETWORK_MODES.index(value) <= NETWORK_MODES.index(limit)
        elif name == "pass_env":
            ok = set(value) <= set(limit)
            if not ok:
                changes[name] = tuple(n for n in value if n in limit)
        elif name in ("max_concurrent_runs", "max_total_processes"):
            defaults = dict(zip(("max_concurrent_runs", "max_total_processes"), capacity(trusted)))
            ok = value is not None and value <= defaults[name]  # None: the core-count default
        elif isinstance(limit, (int, float)) or isinstance(value, (int, float)):
            ok = value is not None and (limit is None or value <= limit)  # None: no limit
        else:
            ok = value == limit
        if ok:
            changes[name] = value
        else:
            warnings.append(
                f"runs.{key} = {_shown(value)} in {source} would loosen the server's setting "
                f"{_shown(limit)}: ignored (only the person who starts the server can raise it, "
                "in the file given to `trainwright serve --config`)"
            )
    return replace(trusted, **changes), warnings


def _shown(value: Any) -> str:
    return "null" if value is None else repr(list(value)) if isinstance(value, tuple) else repr(value)


def trusted_limits(path: Path | None) -> RunLimits:
    """The trusted settings: ``path`` (which must exist), or the user's default file if any."""
    if path is not None and not Path(path).is_file():
        raise ConfigRefused(f"the settings file {path} does not exist (given with --config)")
    return load_limits_file(user_config_path() if path is None else Path(path))


def effective_limits(trusted_file: Path | None, state_dir: Path) -> tuple[RunLimits, list[str]]:
    """The limits for the next run: the trusted file's (default :func:`user_config_path`),
    tightened by the workspace's ``.trainwright/config.yaml``; and the warnings for the run."""
    trusted = trusted_limits(trusted_file)
    path = Path(state_dir) / CONFIG_FILENAME
    try:
        section = _read_section(path)
        wanted = limits_from_mapping(section)
    except ConfigRefused as e:
        raise ConfigRefused(e if str(e).startswith(str(path)) else f"{path}: {e}") from None
    return tighten(trusted, wanted, set(section or {}), source=".trainwright/config.yaml")
