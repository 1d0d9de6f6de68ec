"""The supervisor of a run, on commands that need no engine: what the run's processes get
(network, limits, environment) and that nothing of a run outlives it."""

from __future__ import annotations

import errno
import json
import os
import signal
import sys
import time

import pytest

from engine import run_dir as rd
from runner import server_record as sr
from sandbox import network
from runner import processes
from runner.lifecycle import stop_run
from tests.sandbox.helpers import record_folder, supervise, wait_final, wait_gone
from tests.support import wait_for

PROBE = """
import json, os, resource
print("PROBE " + json.dumps({
    "net": os.readlink("/proc/self/ns/net"),
    "nofile": resource.getrlimit(resource.RLIMIT_NOFILE)[0],
    "address_space": resource.getrlimit(resource.RLIMIT_AS)[0],
    "pgid": os.getpgid(0), "pid": os.getpid(), "sid": os.getsid(0),
    "env": sorted(os.environ),
}), flush=True)
"""


def probe(run_dir):
    line = next(x for x in (run_dir / rd.CONSOLE_LOG).read_text().splitlines() if x.startswith("PROBE "))
    return json.loads(line[len("PROBE "):])


def isolation_possible() -> bool:
    import subprocess

    code = "from sandbox.network import isolate_network; import sys; sys.exit(0 if isolate_network()[0] else 1)"
    return subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_a_run_gets_its_own_network_process_group_and_limits(tmp_path):
    run_dir = tmp_path / "run"
    supervise(run_dir, [sys.executable, "-c", PROBE],
              {"network": "isolated", "max_open_files": 321, "max_memory_bytes": 8 * 2**30}).wait(60)
    record = wait_final(run_dir)
    seen = probe(run_dir)
    assert record.status == rd.COMPLETED and record.exit_code == 0
    if record.isolation == "full":
        # A PID namespace of its own: bwrap's init is pid 1 and leads the sandbox's own session.
        assert seen["pid"] == 2 and seen["pgid"] == seen["sid"] == 1, "a session and group of its own"
    else:
        assert seen["pgid"] == seen["pid"] == seen["sid"] == record.child_pgid, "a session and group of its own"
    assert seen["nofile"] == 321 and seen["address_space"] == 8 * 2**30
    assert "TRAINWRIGHT_RUN_ID" in seen["env"]
    if isolation_possible():
        assert record.network_isolated is True and "loopback only" in record.network_note
        assert seen["net"] != os.readlink("/proc/self/ns/net")
        assert {"GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"} <= set(seen["env"])
    else:
        assert record.network_isolated is False and "unavailable" in record.network_note


def test_network_shared_by_configuration_is_recorded_as_off(tmp_path):
    run_dir = tmp_path / "run"
    supervise(run_dir, [sys.executable, "-c", PROBE], {"network": "shared"}).wait(60)
    record = wait_final(run_dir)
    assert record.network_isolated is False and "'shared'" in record.network_note
    assert probe(run_dir)["net"] == os.readlink("/proc/self/ns/net")


def test_where_namespaces_are_refused_isolation_falls_back_and_says_why(monkeypatch):
    before = os.readlink("/proc/self/ns/net")
    monkeypatch.setattr(network, "_unshare", lambda flags: errno.EPERM)
    isolated, note = network.isolate_network()
    assert isolated is False and "Operation not permitted" in note and "shares the host's network" in note
    assert os.readlink("/proc/self/ns/net") == before


def test_in_an_isolated_run_only_loopback_answers(tmp_path):
    if not isolation_possible():
        pytest.skip("network namespaces are not available here")
    code = (
        "import socket\n"
        "s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen(); port = s.getsockname()[1]\n"
        "socket.create_connection(('127.0.0.1', port), timeout=2).close()\n"
        "try:\n"
        "    socket.create_connection(('1.1.1.1', 53), timeout=2); print('REACHED')\n"
        "except OSError as e:\n"
        "    print('UNREACHABLE', e.errno)\n"
    )
    run_dir = tmp_path / "run"
    supervise(run_dir, [sys.executable, "-c", code], {"network": "isolated"}).wait(60)
    assert wait_final(run_dir).status == rd.COMPLETED
    assert "UNREACHABLE" in (run_dir / rd.CONSOLE_LOG).read_text()


DETACHING = """
import subprocess, sys, time
subprocess.Popen(["sleep", "600"], start_new_session=True)      # its own session: outside our group
subprocess.Popen([sys.executable, "-c", "import os, time\\nif os.fork(): os._exit(0)\\nos.setsid(); time.sleep(600)"])
print("STARTED", flush=True)
time.sleep(float(sys.argv[1]))
"""


def test_processes_that_detach_do_not_outlive_a_run_that_ends(tmp_path):
    run_dir = tmp_path / "run"
    supervisor = supervise(run_dir, [sys.executable, "-c", DETACHING, "1"], {"stop_grace_s": 1})
    wait_for(lambda: "STARTED" in (run_dir / rd.CONSOLE_LOG).read_text(), timeout=30)
    marked = processes.marked("20260101-000000-sup-0000")
    assert len(marked) >= 3, marked  # the child, the sleep, the double-forked daemon
    supervisor.wait(60)
    assert wait_final(run_dir).status == rd.COMPLETED
    assert wait_gone(marked, timeout=5) == set()


def test_stop_ends_every_process_and_records_stopped(tmp_path):
    run_dir = tmp_path / "run"
    supervise(run_dir, [sys.executable, "-c", DETACHING, "600"], {"stop_grace_s": 1})
    wait_for(lambda: "STARTED" in (run_dir / rd.CONSOLE_LOG).read_text(), timeout=30)
    marked = processes.marked("20260101-000000-sup-0000") | {rd.read_run(run_dir).pid}
    started = time.monotonic()
    record = stop_run(record_folder(run_dir))
    assert record.status == rd.STOPPED and record.reason == "stopped by request"
    assert wait_gone(marked, timeout=5) == set()
    assert time.monotonic() - started < 15


def test_stop_when_the_supervisor_is_gone_still_ends_the_run(tmp_path):
    run_dir = tmp_path / "run"
    supervisor = supervise(run_dir, [sys.executable, "-c", DETACHING, "600"])
    wait_for(lambda: "STARTED" in (run_dir / rd.CONSOLE_LOG).read_text(), timeout=30)
    marked = processes.marked("20260101-000000-sup-0000")
    os.kill(supervisor.pid, signal.SIGKILL)
    supervisor.wait()
    record = stop_run(record_folder(run_dir))
    assert (record.status, record.error) == (rd.FAILED, sr.SUPERVISOR_GONE)  # the failure stays; its processes end
    assert wait_gone(marked, timeout=10) == set()


def test_the_wall_time_limit_stops_the_run_and_says_so(tmp_path):
    run_dir = tmp_path / "run"
    supervise(run_dir, [sys.executable, "-c", "import time; time.sleep(600)"],
              {"wall_time_s": 1, "stop_grace_s": 1}).wait(60)
    record = wait_final(run_dir)
    assert record.status == rd.STOPPED and record.reason == "wall-time limit of 1 s reached"


def test_a_child_that_ignores_sigterm_is_killed_after_the_grace(tmp_path):
    code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('STARTED', flush=True); time.sleep(600)"
    run_dir = tmp_path / "run"
    supervise(run_dir, [sys.executable, "-c", code], {"stop_grace_s": 1})
    wait_for(lambda: "STARTED" in (run_dir / rd.CONSOLE_LOG).read_text(), timeout=30)
    started = time.monotonic()
    assert stop_run(record_folder(run_dir)).status == rd.STOPPED
    assert time.monotonic() - started < 10


def test_a_failing_command_is_recorded_as_failed_with_its_exit_code(tmp_path):
    run_dir = tmp_path / "run"
    supervise(run_dir, [sys.executable, "-c", "raise SystemExit(3)"]).wait(60)
    record = wait_final(run_dir)
    assert record.status == rd.FAILED and record.exit_code == 3 and "status 3" in record.error


def test_a_command_that_cannot_start_is_recorded_as_failed(tmp_path):
    run_dir = tmp_path / "run"
    supervise(run_dir, ["/nonexistent/python"]).wait(60)
    record = wait_final(run_dir)
    assert record.status == rd.FAILED and "could not be started" in record.error
