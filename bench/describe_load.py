"""Read-only tools under load: N client sessions at once over `trainwright serve --http`.

Each session (its own MCP client over streamable HTTP, on 127.0.0.1) calls, ``--calls`` times in
turn, ``list_runs``, ``get_run``, ``tail_metrics``, ``list_skills`` and ``describe_recipe`` of one
recipe. Printed per tool: the slowest of the sessions' first calls (``describe_recipe``'s first
calls wait for the cold one: the sandboxed launch check, unless an earlier session count ran it),
then p50 and p99 of every later call, with the session count. Goal: every
read-only tool under 1 s at p99 with 32 sessions.

    python bench/describe_load.py [--sessions 1,8,32] [--calls 5]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import anyio
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import create_mcp_http_client

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
TOOLS = ("list_runs", "get_run", "tail_metrics", "list_skills", "describe_recipe")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prepare(base: Path) -> tuple[Path, str]:
    from tests.sandbox.helpers import fake_run, make_workspace

    root = make_workspace(base / "ws")  # recipes/lm: the template, committed
    run_id = "20260101-000000-lm-0000"
    fake_run(root, run_id, steps=50)
    return root, run_id


async def session(url: str, token: str, run_id: str, calls: int,
                  times: dict[str, list[tuple[int, float]]]) -> None:
    client = create_mcp_http_client(headers={"Authorization": f"Bearer {token}"})
    arguments = {"list_runs": {}, "get_run": {"run_id": run_id}, "tail_metrics": {"run_id": run_id},
                 "list_skills": {}, "describe_recipe": {"recipe": "recipes/lm"}}
    async with Client(streamable_http_client(url, http_client=client)) as mcp:
        for round_index in range(calls):
            for tool in TOOLS:
                started = time.perf_counter()
                result = await mcp.call_tool(tool, arguments[tool])
                if result.is_error:
                    raise SystemExit(f"{tool} failed: {result.content[0].text}")
                times[tool].append((round_index, time.perf_counter() - started))


def measure(url: str, token: str, run_id: str, sessions: int, calls: int) -> dict[str, list[tuple[int, float]]]:
    times: dict[str, list[tuple[int, float]]] = {tool: [] for tool in TOOLS}

    async def main() -> None:
        with anyio.fail_after(600):
            async with anyio.create_task_group() as group:
                for _ in range(sessions):
                    group.start_soon(session, url, token, run_id, calls, times)

    anyio.run(main)
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sessions", default="1,8,32")
    parser.add_argument("--calls", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp)
        root, run_id = prepare(base)
        port = free_port()
        env = {**os.environ, "XDG_STATE_HOME": str(base / "state")}
        server = subprocess.Popen([sys.executable, "-m", "mcp_server.cli", "serve", "--http", str(port),
                                   "--workspace", str(root)], env=env, stderr=subprocess.DEVNULL,
                                  stdout=subprocess.DEVNULL)
        try:
            token_file = base / "state" / "trainwright" / "http-token"
            deadline = time.monotonic() + 60
            while not token_file.exists() and time.monotonic() < deadline:
                time.sleep(0.2)
            time.sleep(1.0)
            url, token = f"http://127.0.0.1:{port}/mcp", token_file.read_text().strip()
            print(f"load average at start: {os.getloadavg()[0]:.2f}")
            for sessions in (int(n) for n in args.sessions.split(",")):
                times = measure(url, token, run_id, sessions, args.calls)
                print(f"\n{sessions} session(s), {args.calls} rounds of {len(TOOLS)} calls each "
                      f"(load {os.getloadavg()[0]:.1f})")
                worst = 0.0
                for tool in TOOLS:
                    first = max(s for r, s in times[tool] if r == 0)
                    rest = sorted(s for r, s in times[tool] if r > 0) or [first]
                    p99 = rest[min(len(rest) - 1, int(len(rest) * 0.99))]
                    worst = max(worst, p99)
                    print(f"  {tool:<16} first {first * 1000:7.0f} ms   p50 {statistics.median(rest) * 1000:6.0f} ms"
                          f"   p99 {p99 * 1000:6.0f} ms")
                print(f"  slowest p99 {worst * 1000:.0f} ms (goal < 1000 ms)")
        finally:
            server.terminate()
            server.wait(timeout=30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
