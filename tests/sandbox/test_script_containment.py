"""The user's own script against its sandbox: the probe of test_containment.py, run as a plain
script (``launch_run`` on a ``.py`` file) instead of from a recipe, gets what recipe code gets:
no server secret, no host network, no host Unix sockets, no git or trainwright state."""

from __future__ import annotations

import json
import os
import secrets
import socket

import pytest

from engine import run_dir as rd
from mcp_server.server import build_server
from workspace import git as workspace_git
from tests.sandbox.helpers import live_client, make_workspace, wait_final
from tests.sandbox.test_containment import HOSTILE, SECRET, Listener, needs_bwrap

# The probe without the recipe class it ends with: a script, not a recipe. It looks at the
# workspace's state folders from the workspace (a script starts in its run directory).
IMPORTS = "import ctypes, json, os, socket\n"
PROBE = HOSTILE.split("class Hostile(")[0].replace(IMPORTS, IMPORTS + "os.chdir(WORKSPACE)\n", 1)


@pytest.fixture(scope="module")
def script_run(tmp_path_factory):
    base = tmp_path_factory.mktemp("script-containment")
    workspace = make_workspace(base / "ws")
    tcp = Listener(socket.AF_INET, ("127.0.0.1", 0))
    unix = Listener(socket.AF_UNIX, str(base / "host.sock"))
    abstract_name = f"\0trainwright-test-{secrets.token_hex(6)}"
    abstract = Listener(socket.AF_UNIX, abstract_name)
    (workspace / "probe.py").write_text(
        f"PORT, UNIX, ABSTRACT, SERVER_PID = {tcp.address[1]}, {unix.address!r}, {abstract_name!r}, {os.getpid()}\n"
        f"WORKSPACE = {str(workspace)!r}\n"
        + PROBE)
    workspace_git.commit_paths(workspace_git.ensure_repo(workspace), [workspace / "probe.py"], "a probe script", [])
    os.environ["TW_CONTAIN_SERVICE_TOKEN"] = SECRET
    try:
        with live_client(build_server(workspace)) as client:
            result = client.call("launch_run", {"recipe": "probe.py"})
            assert not result.is_error, result.content
            run_dir = workspace / "runs" / result.structured_content["run_id"]
            record = wait_final(run_dir)
            info = client.call("get_run", {"run_id": run_dir.name}).structured_content
        console = (run_dir / rd.CONSOLE_LOG).read_text(errors="replace")
        probes = [json.loads(line[len("PROBE "):]) for line in console.splitlines() if line.startswith("PROBE ")]
        yield {"record": record, "info": info, "console": console, "probes": probes,
               "tcp": tcp, "unix": unix, "abstract": abstract}
    finally:
        del os.environ["TW_CONTAIN_SERVICE_TOKEN"]
        for listener in (tcp, unix, abstract):
            listener.close()


@needs_bwrap
def test_a_script_cannot_read_the_servers_secrets_or_state(script_run):
    assert script_run["record"].status == rd.COMPLETED and script_run["record"].kind == "script"
    (probe,) = script_run["probes"]  # a script has no launch check: one probe, the run's
    assert probe["secrets"] == [] and probe["processes"] < 10
    # Of .trainwright/ only the tokenized-data cache is bound in (SECURITY.md).
    assert probe["state"][".git"] == [] and probe["state"][".trainwright"] in ([], ["data-cache"])
    assert probe["state"]["runs"] == [script_run["record"].id]  # only its own run directory
    assert SECRET not in script_run["console"] and SECRET not in json.dumps(script_run["info"])


@needs_bwrap
def test_a_script_cannot_reach_the_network_or_host_sockets(script_run):
    (probe,) = script_run["probes"]
    for attempt in ("setns", "setns_server", "tcp", "unix", "abstract"):
        assert probe[attempt].startswith("refused"), (attempt, probe[attempt])
    assert script_run["tcp"].connections == script_run["unix"].connections == script_run["abstract"].connections == 0
    assert script_run["info"]["isolation"] == "full" and script_run["info"]["network_isolated"] is True
