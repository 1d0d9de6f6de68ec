"""Helpers of the sandbox suites: a workspace with a committed recipe, fake and real runs, a hash
of everything on disk, a live in-memory MCP client, and the processes of a run."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import stat
import time
from pathlib import Path
from typing import Any, Iterator

from anyio.from_thread import start_blocking_portal
from mcp import Client

from engine import run_dir as rd
from engine import run_checkpoints
from engine import run_metrics
from engine.checkpoint_manifest import write_manifest
from runner import server_record as sr
from workspace.workspace import record_dir
from workspace import git as workspace_git
from runner import processes
from tests.support import TEMPLATE, TINY, wait_for

AUDIT = Path(".trainwright") / "audit.jsonl"
# The tokenized-data cache (engine/token_store.py): a cache like the audit log, not state an error may not touch.
DATA_CACHE = Path(".trainwright") / "data-cache"


def make_workspace(root: Path, config_yaml: str | None = "runs:\n  threads_per_process: 1\n") -> Path:
    """A workspace that is a git repository with ``recipes/lm`` (the template) committed."""
    root.mkdir(parents=True, exist_ok=True)
    recipe = root / "recipes" / "lm"
    shutil.copytree(TEMPLATE, recipe, ignore=shutil.ignore_patterns("__pycache__"))
    repo = workspace_git.ensure_repo(root)
    workspace_git.commit_paths(repo, [recipe], "add recipe lm", [])
    if config_yaml is not None:
        (root / ".trainwright").mkdir(exist_ok=True)
        (root / ".trainwright" / "config.yaml").write_text(config_yaml)
    return root


def fake_run(workspace: Path, run_id: str, status: str = rd.COMPLETED, steps: int = 4,
             checkpoints: tuple[int, ...] = (2, 4), server_record: bool = True, **fields: Any) -> Path:
    """A run directory as the engine leaves it, without training (for tests that only read),
    with the server's record of it (as a run the server launched) unless ``server_record`` is
    False."""
    run_dir = workspace / rd.RUNS_DIRNAME / run_id
    values = {
        "id": run_id, "recipe": "recipes/lm", "status": status, "nproc": 1, "world_size": 1,
        "created_at": rd.utc_now(), "resumed_from": None, "git_commit": None, "pid": None,
        "config": {"train": {"max_steps": steps}}, **fields,
    }
    rd.create_run(run_dir, rd.RunRecord.model_validate(values))
    if server_record:
        pid = values.get("pid")
        # A live pid is recorded as that process's identity; a dead one as an identity no
        # process has.
        supervisor = (sr.identify(pid) or sr.ProcessIdentity(pid=pid, start_ticks=0, session=pid)) if pid else None
        sr.create_record(record_dir(workspace, run_id),
                         sr.ServerRecord.model_validate({**values, "run_dir": str(run_dir),
                                                         "workspace": str(workspace), "supervisor": supervisor}))
    with open(run_dir / rd.METRICS_JSONL, "w") as f:
        for step in range(1, steps + 1):
            f.write(json.dumps({"step": step, "loss": 5.0 - 0.1 * step}) + "\n")
    for step in checkpoints:
        checkpoint = run_dir / rd.CHECKPOINTS_DIRNAME / run_checkpoints.checkpoint_dir_name(step)
        checkpoint.mkdir(parents=True)
        (checkpoint / run_checkpoints.DCP_METADATA).write_bytes(b"")
        write_manifest(checkpoint)  # what makes a published checkpoint complete
    (run_dir / rd.CONSOLE_LOG).write_text("step 1\n")
    return run_dir


def record_folder(run_dir: Path, workspace: Path | None = None) -> Path:
    """The folder of the server's record of the run in ``run_dir`` (for :func:`supervise`'s
    runs, whose id need not be the folder's name: the workspace is found as it chose it)."""
    if workspace is not None:
        return record_dir(workspace, run_dir.name)
    return record_dir(_workspace_of(run_dir), rd.read_run(run_dir).id)


def _workspace_of(run_dir: Path) -> Path:
    """A workspace's runs/<id>, or any folder (its parent stands for the workspace)."""
    return run_dir.parent.parent if run_dir.parent.name == rd.RUNS_DIRNAME else run_dir.parent


def tree_hash(*roots: Path, exclude: tuple[Path, ...] = (AUDIT,), caches: tuple[Path, ...] = (DATA_CACHE,)) -> str:
    """One hash of every file, folder and link under ``roots`` (contents, modes and link targets);
    ``exclude``: entries left out (a folder's contents still count); ``caches``: folders left out whole."""
    digest = hashlib.sha256()
    for root in roots:
        root = Path(root)
        excluded = {root / e for e in (*exclude, *caches)}
        skipped = {root / c for c in caches}
        for folder, dirs, files in os.walk(root, followlinks=False):
            dirs[:] = sorted(d for d in dirs if Path(folder) / d not in skipped)
            for name in sorted(dirs + files):
                path = Path(folder) / name
                if path in excluded:
                    continue
                info = path.lstat()
                digest.update(f"{path.relative_to(root)}\0{stat.S_IFMT(info.st_mode)}\0{info.st_mode & 0o777}\0".encode())
                if stat.S_ISLNK(info.st_mode):
                    digest.update(os.readlink(path).encode())
                elif stat.S_ISREG(info.st_mode):
                    digest.update(path.read_bytes())
    return digest.hexdigest()


class LiveClient:
    """A real MCP SDK client on an in-memory server, callable from synchronous tests."""

    def __init__(self, portal, client):
        self.portal = portal
        self.client = client

    def call(self, tool: str, arguments: dict[str, Any] | None = None):
        return self.portal.call(self.client.call_tool, tool, arguments or {})

    def list_tools(self):
        return self.portal.call(self.client.list_tools).tools

    def read_resource(self, uri: str):
        return self.portal.call(self.client.read_resource, uri)


@contextlib.contextmanager
def live_client(server) -> Iterator[LiveClient]:
    with start_blocking_portal() as portal:
        with portal.wrap_async_context_manager(Client(server)) as client:
            yield LiveClient(portal, client)


def error_text(result) -> str:
    return "".join(getattr(part, "text", "") for part in result.content)


# ---------------------------------------------------------------------------------------------
# Real runs
# ---------------------------------------------------------------------------------------------


def run_overrides(*items: str) -> list[str]:
    return [*TINY, *items]


def wait_final(run_dir: Path, timeout: float = 300) -> rd.RunRecord:
    """Wait until the run's supervisor has recorded an outcome and exited."""
    def done():
        record = rd.read_run(run_dir)
        return record if record.status in rd.FINAL_STATUSES and not rd.pid_alive(record.pid) else None
    return wait_for(done, timeout=timeout, interval=0.1)


def wait_step(run_dir: Path, step: int, timeout: float = 300) -> None:
    def reached():
        latest, _ = run_metrics.read_metrics_tail(run_dir / rd.METRICS_JSONL, 1)
        if latest and latest[-1].get("step", 0) >= step:
            return True
        record = rd.read_run(run_dir)
        if record.status in rd.FINAL_STATUSES:
            raise AssertionError(f"the run ended ({record.status}) before step {step}: {record.error}")
        return False
    wait_for(reached, timeout=timeout, interval=0.02)


def run_pids(run_dir: Path) -> set[int]:
    """Every live process of a run: the supervisor, its descendants, and those marked with its id."""
    record = rd.read_run(run_dir)
    pids = processes.marked(record.id)
    if record.pid and rd.pid_alive(record.pid):
        pids |= {record.pid} | processes.descendants(record.pid)
    return {p for p in pids if rd.pid_alive(p)}


def host_pid(run_dir: Path, pid_in_run: int) -> int:
    """The host's pid of the run's process that the run itself knows as ``pid_in_run`` (in a
    sandbox with a PID namespace of its own, the two differ)."""
    for pid in run_pids(run_dir):
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        numbers = [int(n) for n in status.split("NSpid:")[1].split("\n")[0].split()]
        if numbers[-1] == pid_in_run:
            return pid
    raise AssertionError(f"no process of the run is {pid_in_run} inside it")


def processes_with_argument(token: str) -> set[int]:
    """Live processes whose command line contains ``token`` (test helpers get a unique one)."""
    found = set()
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if token.encode() in Path(f"/proc/{name}/cmdline").read_bytes():
                    found.add(int(name))
            except OSError:
                pass
    return found


def wait_gone(pids: set[int], timeout: float = 30) -> set[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        left = {p for p in pids if rd.pid_alive(p)}
        if not left:
            return set()
        time.sleep(0.1)
    return {p for p in pids if rd.pid_alive(p)}


def derived_recipe(workspace: Path, name: str, body: str) -> Path:
    """``recipes/<name>``: the template's recipe as ``base_recipe.py`` and a ``recipe.py`` whose one
    Engine subclass (defined in ``body``) changes what a test needs; committed."""
    recipe = workspace / "recipes" / name
    recipe.mkdir(parents=True)
    shutil.copy(TEMPLATE / "recipe.py", recipe / "base_recipe.py")
    shutil.copy(TEMPLATE / "config.yaml", recipe / "config.yaml")
    (recipe / "recipe.py").write_text(f'"""A test recipe: {name}."""\n\nfrom base_recipe import CausalLM\n\n{body}')
    repo = workspace_git.open_repo(workspace)
    workspace_git.commit_paths(repo, [recipe], f"add recipe {name}", [])
    return recipe


def supervise(run_dir: Path, command: list[str], limits: dict[str, Any] | None = None,
              run_id: str = "20260101-000000-sup-0000", env: dict[str, str] | None = None, timeout: float = 60,
              sandbox: dict[str, Any] | None = None, **record_fields: Any):
    """Run ``python -m runner.supervise`` on a run whose command is ``command`` (no engine, no torch);
    ``sandbox`` is run.json's ``sandbox`` section (default: the supervisor's own choice);
    ``record_fields``: more fields of the server's record (``kind="script"``, ...)."""
    import subprocess
    import sys

    from sandbox.environment import run_environment

    workspace = _workspace_of(run_dir)
    record = sr.ServerRecord(id=run_id, command=command, limits=limits or {},
                             workspace=str(workspace), recipe="none", run_dir=str(run_dir),
                             sandbox=rd.SandboxMounts.model_validate(sandbox) if sandbox is not None else None,
                             **record_fields)
    rd.create_run(run_dir, record)
    folder = record_dir(workspace, run_id)
    sr.create_record(folder, record)
    with open(run_dir / rd.CONSOLE_LOG, "ab") as console:
        process = subprocess.Popen(
            [sys.executable, "-m", "runner.supervise", str(folder)],
            env=run_environment(extra={processes.RUN_ID_VARIABLE: run_id, **(env or {})}),
            stdout=console, stderr=subprocess.STDOUT, start_new_session=True,
        )
    return process


# TensorBoard event files as a script writes them, built by hand (the CRCs are not checked).
def protobuf_varint(value: int) -> bytes:
    out = b""
    while True:
        byte, value = value & 0x7F, value >> 7
        out += bytes([byte | (0x80 if value else 0)])
        if not value:
            return out


def protobuf_field(number: int, payload: bytes) -> bytes:
    """A length-delimited protobuf field."""
    return protobuf_varint(number << 3 | 2) + protobuf_varint(len(payload)) + payload


def tfrecord(event: bytes) -> bytes:
    import struct

    return struct.pack("<Q", len(event)) + b"\0" * 4 + event + b"\0" * 4


def scalar_event(step: int, tag: str, value: float) -> bytes:
    """One TFRecord of a TensorBoard Event holding one ``simple_value`` scalar."""
    import struct

    summary_value = protobuf_field(1, tag.encode()) + b"\x15" + struct.pack("<f", value)
    return tfrecord(b"\x10" + protobuf_varint(step) + protobuf_field(5, protobuf_field(1, summary_value)))


def tensor_event(step: int, tag: str, tensor: bytes, plugin: str = "scalars") -> bytes:
    """One TFRecord of a TensorBoard Event holding a ``TensorProto`` value under ``plugin``."""
    metadata = protobuf_field(1, protobuf_field(1, plugin.encode()))
    summary_value = protobuf_field(1, tag.encode()) + protobuf_field(9, metadata) + protobuf_field(8, tensor)
    return tfrecord(b"\x10" + protobuf_varint(step) + protobuf_field(5, protobuf_field(1, summary_value)))
