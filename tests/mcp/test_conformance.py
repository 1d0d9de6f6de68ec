"""The official MCP conformance suite and the Inspector's schema check, against ``trainwright
serve --http`` (streamable HTTP, as an MCP host on this machine would reach it).

``@modelcontextprotocol/conformance`` connects as a client and runs its server scenarios: the
0.1 line and the 0.2 line at the 2025-11-25 wire, and the 0.2 line's ``--requirements
2026-07-28`` (what that revision requires, at its stateless wire). A scenario that fails fails
the test with the suite's own output, unless conformance-expected-failures.yaml lists it: only
scenarios that call the suite's own fixture tools, resources and prompts (``test_*``,
``test://``), which a training server does not have, each with why. The suite exits 1 on a
listed scenario that passes, too (the list may not go stale). Inspector 2.12's ``--strict``
check of the tool schemas' portability must report nothing.

Both need Node >= 22: ``make mcp-tools`` (run by ``make test``) installs Node 22 and the tools at
the versions pinned in tests/mcp/node/package-lock.json into ``<venv>/node22`` (npm, from the npm
registry; about 330 MB, 40 s once). Skipped, with the reason, where they are not installed;
``TRAINWRIGHT_MCP_TOOLS`` names another folder. Each suite run takes 3-10 s.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx2 as httpx
import pytest
import yaml

from tests.mcp.conftest import trainwright_command
from tests.mcp.test_server import TOOLS
from tests.sandbox.helpers import make_workspace

Checks = list[tuple[str, str]]  # a scenario's (check id, status), in the order it ran them
HERE = Path(__file__).parent
PINNED = json.loads((HERE / "node" / "package.json").read_text())["dependencies"]
EXPECTED_FAILURES = HERE / "conformance-expected-failures.yaml"
INSTALLED = Path(os.environ.get("TRAINWRIGHT_MCP_TOOLS") or Path(sys.prefix) / "node22")
SUITES = {"0.1": "conformance-0.1", "0.2": "conformance-0.2"}
RUN_TIMEOUT_S = 150
# Scenarios that need nothing of the suite's fixtures; each must be run and pass, so a suite
# that silently stops running one cannot make the test pass.
MUST_PASS = {
    "2025-11-25": {"server-initialize", "ping", "logging-set-level", "completion-complete", "tools-list",
                   "resources-list", "resources-subscribe", "resources-unsubscribe", "prompts-list",
                   "server-sse-multiple-streams", "dns-rebinding-protection"},
    "2026-07-28": {"server-stateless", "completion-complete", "tools-list", "resources-list",
                   "sep-2164-resource-not-found", "prompts-list", "dns-rebinding-protection", "caching",
                   "http-header-validation"},
}

slow = pytest.mark.slow  # every test that runs Node; the list's own check is quick


def _node_tools() -> Path:
    node = INSTALLED / "node_modules" / ".bin" / "node"
    if not node.exists():
        pytest.skip(f"the MCP test tools (Node 22, the conformance suite, the Inspector) are not installed in "
                    f"{INSTALLED}: `make mcp-tools` installs them from the npm registry")
    for package, folder in [("@modelcontextprotocol/inspector", "@modelcontextprotocol/inspector"),
                            *((alias, alias) for alias in SUITES.values())]:
        want = PINNED[package].rsplit("@", 1)[-1]
        manifest = INSTALLED / "node_modules" / folder / "package.json"
        have = json.loads(manifest.read_text())["version"] if manifest.is_file() else None
        assert have == want, f"{folder} {have} is installed in {INSTALLED}, {want} is pinned: run `make mcp-tools`"
    version = subprocess.run([str(node), "--version"], capture_output=True, text=True, timeout=30)
    if version.returncode != 0 or int(version.stdout.strip().lstrip("v").split(".")[0]) < 22:
        pytest.skip(f"{node} does not run here as Node >= 22: {version.stdout.strip()} {version.stderr.strip()[:200]}")
    return node


@pytest.fixture(scope="module")
def node() -> Path:
    return _node_tools()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def url(tmp_path_factory, node):
    """``trainwright serve --http PORT --no-auth`` on a workspace with a recipe: the suite has no
    way to send the bearer token."""
    base = tmp_path_factory.mktemp("conformance")
    root = make_workspace(base / "ws")
    port = _free_port()
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "XDG_STATE_HOME": str(base / "state"), "HOME": str(base)}
    process = subprocess.Popen(
        [*trainwright_command(), "serve", "--http", str(port), "--no-auth", "--workspace", str(root)],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    address = f"http://127.0.0.1:{port}/mcp"
    deadline = time.monotonic() + 60
    while True:
        try:
            httpx.get(address, timeout=1)
            break
        except httpx.TransportError:
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()
                pytest.fail(f"trainwright serve --http did not start: {process.communicate()[1][-3000:]}")
            time.sleep(0.2)
    try:
        yield address
    finally:
        process.terminate()
        process.wait(timeout=10)


def conformance(node: Path, url: str, line: str, out: Path, *args: str) -> dict[str, Checks]:
    """Run one line of the suite's server scenarios with the expected failures; fail with its
    output unless it exits 0. Returns each scenario's checks (from its checks.json)."""
    suite = INSTALLED / "node_modules" / SUITES[line] / "dist" / "index.js"
    command = [str(node), str(suite), "server", "--url", url, "--expected-failures", str(EXPECTED_FAILURES),
               "-o", str(out), *args]
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, cwd=out.parent,
                                env={**os.environ, "HOME": str(out.parent), "NO_COLOR": "1"})
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the conformance suite {line} did not finish within {RUN_TIMEOUT_S} s:\n"
                    f"{(e.stdout or b'')[-8000:]!r}")
    output = re.sub(r"\x1b\[[0-9;]*m", "", result.stdout + result.stderr)
    scenarios: dict[str, Checks] = {}
    listed, why = set(expected_failures()), []
    for checks in sorted(out.glob("server-*/checks.json")):
        name = re.sub(r"-\d{4}-\d\d-\d\dT[\d-]+Z$", "", checks.parent.name.removeprefix("server-"))
        ran = json.loads(checks.read_text())
        scenarios[name] = [(check["id"], check["status"]) for check in ran]
        why += [f"  {name}:{check['id']} {check['status']}: {str(check.get('errorMessage'))[:300]}"
                for check in ran if check["status"] in ("FAILURE", "WARNING")
                and name not in listed and f"{name}:{check['id']}" not in listed]
    if result.returncode != 0:
        pytest.fail(f"{' '.join(command[2:])} exited {result.returncode}:\n{output[-12000:]}\n"
                    f"The checks that failed, not listed (from its checks.json):\n" + "\n".join(why)[-6000:], pytrace=False)
    print(f"\nconformance {PINNED[SUITES[line]]} {' '.join(args)}: {report(scenarios)}")
    return scenarios


def expected_failures() -> dict[str, str]:
    """The listed scenarios (or ``scenario:check``) and the why of each, from the YAML and its comments."""
    listed = yaml.safe_load(EXPECTED_FAILURES.read_text())["server"]
    why = dict(re.findall(r"^\s*- (\S+) # (.+)$", EXPECTED_FAILURES.read_text(), re.M))
    return {entry: why.get(entry, "") for entry in listed}


def failing(checks: Checks) -> set[str]:
    """The ids of the checks that fail, as the suite counts them against a baseline (a warning too)."""
    return {check for check, status in checks if status in ("FAILURE", "WARNING")}


def report(scenarios: dict[str, Checks]) -> str:
    """How the scenarios went: passed, passed but for listed checks, listed, and failed without
    being listed (what the suite runs but does not score, or it would have exited 1)."""
    listed = set(expected_failures())
    failed = {name: failing(checks) for name, checks in scenarios.items() if failing(checks)}
    fixture = {name for name in failed if name in listed}
    partly = {name for name, checks in failed.items() if name not in listed
              and all(f"{name}:{check}" in listed for check in checks)}
    unscored = sorted(set(failed) - fixture - partly)
    return (f"{len(scenarios)} scenarios: {len(scenarios) - len(failed)} passed, {len(partly)} passed but for "
            f"listed fixture checks ({', '.join(sorted(partly)) or '-'}), {len(fixture)} expected failures (fixture), "
            f"{len(unscored)} failed not scored ({', '.join(unscored) or '-'})")


def assert_must_pass(scenarios: dict[str, Checks], wire: str) -> None:
    """Each scenario ran, and every check of it passed but those listed one by one."""
    listed = set(expected_failures())
    for name in MUST_PASS[wire]:
        assert name in scenarios, f"the suite did not run {name}; it ran {sorted(scenarios)}"
        checks = scenarios[name]
        assert any(status == "SUCCESS" for _, status in checks), f"{name}: {checks}"
        assert not {f"{name}:{check}" for check in failing(checks)} - listed, f"{name}: {checks}"


def test_the_expected_failures_are_only_scenarios_of_the_suites_fixtures():
    entries = expected_failures()
    assert entries, "the list is empty"
    for entry, why in entries.items():
        assert re.search(r"fixture (tool|resource|template|prompt)s? (test_\w+|test://\S+)", why), \
            f"{entry}: its comment must name the suite's fixture it calls: {why!r}"
    assert not set(entries) & {name for names in MUST_PASS.values() for name in names}


@slow
def test_the_0_1_line_passes_every_scenario_but_those_of_its_fixtures(node, url, tmp_path):
    scenarios = conformance(node, url, "0.1", tmp_path / "results")
    assert_must_pass(scenarios, "2025-11-25")


@slow
def test_the_0_2_line_passes_every_scenario_but_those_of_its_fixtures(node, url, tmp_path):
    scenarios = conformance(node, url, "0.2", tmp_path / "results")
    assert_must_pass(scenarios, "2025-11-25")
    assert ("wire-schema-valid", "SUCCESS") in scenarios["server-initialize"]  # the messages' schema too


@slow
def test_the_0_2_line_passes_what_2026_07_28_requires_but_its_fixtures(node, url, tmp_path):
    scenarios = conformance(node, url, "0.2", tmp_path / "results", "--requirements", "2026-07-28")
    assert_must_pass(scenarios, "2026-07-28")
    assert sum(status == "SUCCESS" for _, status in scenarios["server-stateless"]) >= 20


def inspector_strict(node: Path, cwd: Path, *target: str) -> subprocess.CompletedProcess:
    inspector = INSTALLED / "node_modules" / "@modelcontextprotocol" / "inspector" / "clients" / "launcher" / "build" \
        / "index.js"
    command = [str(node), str(inspector), "--cli", *target, "--method", "tools/list", "--strict"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, cwd=cwd,
                            env={**os.environ, "HOME": str(cwd), "NO_COLOR": "1"})
    assert result.returncode == 0, f"{' '.join(command)} exited {result.returncode}:\n{result.stderr[-6000:]}"
    return result


@slow
def test_the_inspector_strict_check_finds_nothing_in_the_tool_schemas(node, url, tmp_path):
    result = inspector_strict(node, tmp_path, url)
    assert {tool["name"] for tool in json.loads(result.stdout)["tools"]} == TOOLS
    assert result.stderr.strip() == "", f"Inspector --strict:\n{result.stderr[-6000:]}"


@slow
def test_the_inspector_strict_check_flags_a_schema_that_accepts_anything(node, tmp_path):
    """The check above can fail: a tool taking a list of anything is reported."""
    result = inspector_strict(node, tmp_path, sys.executable, str(HERE / "scripts" / "loose_schema_server.py"))
    assert 'Warning: tool "echo"\n  Path: inputSchema.properties.values.items' in result.stderr
    assert "0 errors, 1 warning across 1 tool." in result.stderr
