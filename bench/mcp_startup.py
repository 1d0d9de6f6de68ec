"""How fast `trainwright serve` answers an agent, against a minimal MCP server in the same run.

1. Cold start: spawn the server over stdio with the MCP SDK client and time until the
   ``tools/list`` answer arrives (what an MCP host waits for before an agent can use the
   server). Peer: a minimal ``MCPServer`` with one tool, spawned the same way. The two are
   started alternately, ``--repeats`` times each; medians are compared. Goal: ≤ 1.3× the peer.
   Each round also prints the CPU time (user + system) each server's process used from its start
   to its exit, which other processes on a busy machine change far less than the wall time.
2. Tool latency: ``apply_skill`` (gradient-checkpointing: a libcst codemod plus a git commit)
   and its ``dry_run``, against the peer's one tool (a round trip that does nothing); medians
   over one connection, the first call (which loads the codemod) reported apart.

    python bench/mcp_startup.py [--repeats 9] [--json]

The first start on an empty workspace also initialises its git repository and builds the tool
schemas into the bench's own empty schema cache (``TRAINWRIGHT_SCHEMA_CACHE``); it is timed once
and reported apart. Every round's pair is printed, and the load average. Recipes for apply_skill are copied from the template and committed before
timing starts.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import anyio
from mcp import Client, StdioServerParameters

from mcp_server.tool_schemas import CACHE_ENV

REPO = Path(__file__).resolve().parent.parent
TEMPLATE = REPO / "recipes_template" / "causal_lm"
SKILL = "gradient-checkpointing"
GOAL_RATIO = 1.3

MINIMAL_SERVER = textwrap.dedent(
    '''
    from mcp.server.mcpserver import MCPServer

    mcp = MCPServer("minimal")


    @mcp.tool()
    def echo(text: str) -> str:
        """Return the text."""
        return text


    mcp.run("stdio")
    '''
)


def _env() -> dict[str, str] | None:
    return {"PYTHONPATH": os.environ["PYTHONPATH"]} if os.environ.get("PYTHONPATH") else None


def trainwright_server(workspace: Path, schema_cache: Path) -> StdioServerParameters:
    script = Path(sys.executable).with_name("trainwright")
    command = [str(script)] if script.is_file() else [sys.executable, "-m", "mcp_server.cli"]
    return StdioServerParameters(command=command[0], args=[*command[1:], "serve", "--workspace", str(workspace)],
                                 cwd=str(workspace), env={**(_env() or {}), CACHE_ENV: str(schema_cache)})


def minimal_server(script: Path) -> StdioServerParameters:
    return StdioServerParameters(command=sys.executable, args=[str(script)], cwd=str(script.parent), env=_env())


async def time_to_tools_list(server: StdioServerParameters) -> float:
    """Seconds from spawning the server to the tools/list answer (closing is not counted)."""
    return (await start_and_list(server))[0]


async def start_and_list(server: StdioServerParameters) -> tuple[float, float]:
    """Seconds from spawning the server to the tools/list answer (closing is not counted), and
    the CPU seconds (user + system) the server's process used from its start to its exit: a
    figure other processes on the machine change far less than the wall time."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    async with Client(server) as client:
        await client.list_tools()
        elapsed = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)  # the server has exited and been waited for
    return elapsed, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


async def time_calls(server: StdioServerParameters, calls: list[tuple[str, dict]]) -> list[float]:
    """Seconds per tool call, each one checked to have succeeded."""
    times = []
    async with Client(server) as client:
        await client.list_tools()
        for name, arguments in calls:
            started = time.perf_counter()
            result = await client.call_tool(name, arguments)
            times.append(time.perf_counter() - started)
            if result.is_error:
                raise SystemExit(f"{name}({arguments}) failed: {result.content[0].text}")
    return times


def prepare_recipes(workspace: Path, count: int) -> list[str]:
    """``recipes/r0..`` copied from the template and committed (not timed)."""
    names = [f"recipes/r{i}" for i in range(count)]
    for name in names:
        shutil.copytree(TEMPLATE, workspace / name, ignore=shutil.ignore_patterns("__pycache__"))
    env = {**os.environ, "GIT_AUTHOR_NAME": "bench", "GIT_AUTHOR_EMAIL": "bench@localhost",
           "GIT_COMMITTER_NAME": "bench", "GIT_COMMITTER_EMAIL": "bench@localhost"}
    subprocess.run(["git", "add", "recipes"], cwd=workspace, check=True, env=env)
    subprocess.run(["git", "commit", "-q", "-m", "bench: recipes"], cwd=workspace, check=True, env=env)
    return names


def ms(seconds: float) -> str:
    return f"{seconds * 1000:,.0f} ms"


async def measure(repeats: int, root: Path) -> dict:
    workspace = root / "workspace"
    workspace.mkdir()
    peer_script = root / "minimal_server.py"
    peer_script.write_text(MINIMAL_SERVER)
    trainwright, peer = trainwright_server(workspace, root / "schema-cache"), minimal_server(peer_script)

    # Warm the file-system cache and __pycache__ for both, then time the first start on an
    # empty workspace (it initialises the git repository, and builds the tool schemas into an
    # empty schema cache of its own) once.
    await time_to_tools_list(peer)
    fresh_workspace_s = await time_to_tools_list(trainwright)

    starts: dict[str, list[float]] = {"trainwright": [], "minimal": []}
    cpu: dict[str, list[float]] = {"trainwright": [], "minimal": []}
    for _ in range(repeats):
        for name, server in (("minimal", peer), ("trainwright", trainwright)):
            wall, cpu_s = await start_and_list(server)
            starts[name].append(wall)
            cpu[name].append(cpu_s)

    recipes = prepare_recipes(workspace, repeats)
    # One server for all the calls: the first call pays for loading the codemod (and libcst).
    calls = [("apply_skill", {"skill": SKILL, "recipe": r, "dry_run": True}) for r in recipes]
    calls += [("apply_skill", {"skill": SKILL, "recipe": r}) for r in recipes]
    times = await time_calls(trainwright, calls)
    first_call, dry_runs, applies = times[0], times[1:repeats], times[repeats:]
    echoes = (await time_calls(peer, [("echo", {"text": "x"})] * (repeats + 1)))[1:]
    commits = subprocess.run(["git", "rev-list", "--count", "HEAD"], cwd=workspace, capture_output=True,
                             text=True, check=True).stdout.strip()
    assert int(commits) == 2 + repeats, f"expected one commit per apply_skill, found {commits} commits"

    median = statistics.median
    return {
        "repeats": repeats,
        "start_s": {name: median(values) for name, values in starts.items()},
        "start_min_s": {name: min(values) for name, values in starts.items()},
        "start_ratio": median(starts["trainwright"]) / median(starts["minimal"]),
        "starts_s": starts,  # every round, in the order they ran (minimal first in each)
        "cpu_s": cpu,
        "cpu_ratio": median(cpu["trainwright"]) / median(cpu["minimal"]),
        "load_average": os.getloadavg(),
        "fresh_workspace_start_s": fresh_workspace_s,
        "apply_skill_s": median(applies),
        "apply_skill_first_call_s": first_call,
        "apply_skill_dry_run_s": median(dry_runs),
        "minimal_tool_call_s": median(echoes),
    }


def report(result: dict) -> str:
    start, peer = result["start_s"]["trainwright"], result["start_s"]["minimal"]
    ratio = result["start_ratio"]
    verdict = "met" if ratio <= GOAL_RATIO else "NOT met"
    call = result["minimal_tool_call_s"]

    def row(label: str, value: str, note: str = "") -> str:
        return f"  {label:<48}{value:>9}   {note}".rstrip()

    walls, cpus = result["starts_s"], result["cpu_s"]
    rounds = [row(f"round {i + 1}: trainwright / minimal", f"{t / m:.2f}×",
                  f"{ms(t)} vs {ms(m)}; CPU {ms(ct)} vs {ms(cm)} = {ct / cm:.2f}×")
              for i, (t, m, ct, cm) in enumerate(zip(walls["trainwright"], walls["minimal"], cpus["trainwright"],
                                                     cpus["minimal"]))]
    return "\n".join([
        "load average (1, 5, 15 min) at the end: " + ", ".join(f"{x:.2f}" for x in result["load_average"]),
        "cold start to the tools/list answer (every round, interleaved: minimal, then trainwright):",
        *rounds,
        f"cold start to the tools/list answer (median of {result['repeats']}, stdio, SDK client):",
        row("trainwright serve", ms(start), f"min {ms(result['start_min_s']['trainwright'])}"),
        row("minimal MCPServer, one tool", ms(peer), f"min {ms(result['start_min_s']['minimal'])}"),
        row("ratio", f"{ratio:.2f}×", f"goal ≤ {GOAL_RATIO}×: {verdict}"),
        row("CPU time of the server process, start to exit", f"{result['cpu_ratio']:.2f}×",
            f"{ms(statistics.median(cpus['trainwright']))} vs {ms(statistics.median(cpus['minimal']))} (medians)"),
        row("first start (git init, no schema cache yet)", ms(result["fresh_workspace_start_s"])),
        "tool call latency (median, one stdio connection):",
        row(f"apply_skill {SKILL}", ms(result["apply_skill_s"]),
            f"codemod + commit; {result['apply_skill_s'] / call:,.0f}× the minimal tool call"),
        row("apply_skill dry_run", ms(result["apply_skill_dry_run_s"])),
        row("first call after start (loads the codemod)", ms(result["apply_skill_first_call_s"])),
        row("minimal MCPServer tool call", ms(call)),
    ])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=9, help="starts of each server, and calls of each tool")
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="trainwright-bench-") as root:
        result = anyio.run(measure, args.repeats, Path(root))
    print(json.dumps(result) if args.json else report(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
