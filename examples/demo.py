"""``make demo``: the whole loop, driven by a real MCP client over stdio.

Starts ``trainwright serve --workspace demo-workspace`` on a fresh workspace and, as an agent
would, calls its tools: scaffold a recipe, apply the gradient-checkpointing skill (one
commit), launch a 2-process FSDP2 run, tail its metrics, stop it once a checkpoint exists
(``--kill``: SIGKILL its engine instead, as a crash would), resume from the checkpoint, tail
again until it completes. Prints a short transcript of each call and finally the workspace's
``git log --notes=trainwright``. Exits non-zero when anything fails.

    python examples/demo.py [--kill] [--workspace DIR]

Takes about 1.5 minutes on 2 CPU cores (two torchrun launches of the built-in tiny model).
"""

from __future__ import annotations

import argparse
import base64
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import anyio
from mcp import Client, StdioServerParameters

REPO = Path(__file__).resolve().parent.parent
DEFAULT_WORKSPACE = REPO / "demo-workspace"
RECIPE = "tiny_lm"
SKILL = "gradient-checkpointing"
CONFIG = {"train.max_steps": 60, "train.log_every": 5, "checkpoint.every": 20}
NPROC = 2
FINAL = ("completed", "failed", "stopped")


class DemoFailed(Exception):
    pass


def say(text: str = "") -> None:
    print(text, flush=True)


def shorten(value: Any, width: int = 60) -> str:
    text = str(value)
    return text if len(text) <= width else text[: width - 1] + "…"


class Agent:
    """Calls tools and prints each call with the result fields that matter."""

    def __init__(self, client: Client):
        self.client = client

    async def call(self, tool: str, quiet: bool = False, **arguments: Any) -> dict[str, Any]:
        result = await self.client.call_tool(tool, arguments)
        if not quiet:
            shown = ", ".join(f"{k}={shorten(v, 40)!s}" for k, v in arguments.items())
            say(f"→ {tool}({shown})")
        if result.is_error:
            raise DemoFailed(f"{tool} failed: {result.content[0].text}")
        return result.structured_content

    async def tail(self, run_id: str, after_step: int | None, until: Any) -> int | None:
        """Print new metrics records until ``until(step, status)``; return the last step seen."""
        say(f"→ tail_metrics(run_id={run_id}, after_step=…)   polled every 2 s")
        while True:
            tail = await self.call("tail_metrics", quiet=True, run_id=run_id, n=50, after_step=after_step)
            for record in tail["records"]:
                after_step = record["step"]
                say(f"    step {record['step']:>3}  loss {record['loss']:.4f}  "
                    f"{record.get('tokens_per_s', 0):>7,.0f} tokens/s  eta {record.get('eta_s', 0):>4.0f} s")
            if until(after_step, tail["status"]):
                return after_step
            if tail["status"] in FINAL:
                raise DemoFailed(f"run {run_id} ended early: {tail['status']}")
            await anyio.sleep(2)

    async def wait_until_ended(self, run_id: str, timeout_s: float = 600) -> dict[str, Any]:
        """get_run until the run has ended and its supervisor has recorded the outcome."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            info = await self.call("get_run", quiet=True, run_id=run_id)
            if info["status"] in FINAL and info["exit_code"] is not None:
                return info
            await anyio.sleep(1)
        raise DemoFailed(f"run {run_id} did not end within {timeout_s:.0f} s")


def trainwright_server(workspace: Path) -> StdioServerParameters:
    script = Path(sys.executable).with_name("trainwright")
    command = [str(script)] if script.is_file() else [sys.executable, "-m", "mcp_server.cli"]
    env = {"PYTHONPATH": os.environ["PYTHONPATH"]} if os.environ.get("PYTHONPATH") else None
    return StdioServerParameters(command=command[0], args=[*command[1:], "serve", "--workspace", str(workspace)],
                                 env=env)


async def demo(workspace: Path, kill: bool) -> None:
    say(f"$ trainwright serve --workspace {workspace.name}   (an MCP client talks to it over stdio)")
    async with Client(trainwright_server(workspace)) as client:
        agent = Agent(client)
        tools = await client.list_tools()
        say(f"→ tools/list: {len(tools.tools)} tools ({', '.join(t.name for t in tools.tools[:4])}, …)")

        templates = await agent.call("list_templates")
        say(f"    templates: {', '.join(t['name'] for t in templates['templates'])}")
        recipe = await agent.call("scaffold_recipe", template="causal_lm", name=RECIPE, config=CONFIG)
        say(f"    created {recipe['path']} (commit {recipe['commit'][:7]})")

        applied = await agent.call("apply_skill", skill=SKILL, recipe=recipe["path"])
        say(f"    {applied['message']}; commit {applied['commit'][:7]}")
        again = await agent.call("apply_skill", quiet=True, skill=SKILL, recipe=recipe["path"])
        say(f"    applying it again: changed={again['changed']} (already applied, no commit)")

        first = await agent.call("launch_run", recipe=recipe["path"], nproc=NPROC)
        run_id = first["run_id"]
        say(f"    run {run_id}: {first['status']} ({NPROC} processes, FSDP2), returned at once")
        say(f"    {first['code']}")
        data = first["data"] or {}
        if data:
            say(f"    data: {data['source']}, {data['documents']:,} documents, {data['tokens']:,} tokens "
                "(counted before the run started)")
        every = CONFIG["checkpoint.every"]
        # Stop after the first record past a checkpoint, so the resumed run retraces logged steps.
        last = await agent.tail(run_id, None, lambda step, status: (step or 0) > every)
        checkpoints = await agent.call("list_checkpoints", run_id=run_id)
        steps = [c["step"] for c in checkpoints["checkpoints"]]
        say(f"    complete checkpoints at steps {steps}")
        if not steps:
            raise DemoFailed("no checkpoint to resume from")

        if kill:
            record = _run_record(workspace, run_id)
            say(f"→ (outside MCP) kill -KILL the engine's process group {record['child_pgid']}, as a crash would")
            os.killpg(record["child_pgid"], signal.SIGKILL)
            ended = await agent.wait_until_ended(run_id)
            say(f"→ get_run(run_id={run_id})\n    {ended['status']}: {ended['error']}")
        else:
            stopped = await agent.call("stop_run", run_id=run_id)
            say(f"    {stopped['status']} at step {stopped['step']} ({stopped['error']})")

        resumed = await agent.call("resume_checkpoint", run_id=run_id)
        new_id = resumed["run_id"]
        source = resumed["resumed_from"]
        say(f"    new run {new_id}, resumed from {source['run_id']} at step {source['step']}")
        await agent.tail(new_id, None, lambda step, status: status in FINAL)
        final = await agent.wait_until_ended(new_id)
        latest = final["latest"] or {}
        say(f"→ get_run(run_id={new_id})\n    {final['status']} at step {final['step']}/{final['max_steps']}, "
            f"loss {latest.get('loss', float('nan')):.4f}, {latest.get('tokens_per_s', 0):,.0f} tokens/s")
        if final["status"] != "completed" or not math.isfinite(latest.get("loss", float("nan"))):
            raise DemoFailed(f"the resumed run did not complete with a finite loss: {final['status']}")

        await compare_losses(agent, run_id, new_id, source["step"], last)
        picture = await client.read_resource(f"run://{new_id}/loss.png")
        png = workspace / "loss.png"
        png.write_bytes(base64.b64decode(picture.contents[0].blob))
        say(f"→ resources/read run://{new_id}/loss.png → {png.relative_to(REPO) if REPO in png.parents else png}")

    await wait_for_notes(workspace, [run_id, new_id])
    say(f"\n$ git -C {workspace.name} log --notes=trainwright --oneline")
    log = subprocess.run(["git", "log", "--notes=trainwright", "--oneline"], cwd=workspace,
                         capture_output=True, text=True, check=True)
    say(log.stdout.rstrip())


async def compare_losses(agent: Agent, first_id: str, resumed_id: str, from_step: int, last_step: int) -> None:
    """The resumed run retraces the steps the first run logged after the checkpoint: same losses."""
    first = await agent.call("tail_metrics", quiet=True, run_id=first_id, n=50, after_step=from_step)
    resumed = await agent.call("tail_metrics", quiet=True, run_id=resumed_id, n=50, after_step=from_step)
    again = {r["step"]: r["loss"] for r in resumed["records"]}
    shared = [(r["step"], r["loss"], again[r["step"]]) for r in first["records"] if r["step"] in again]
    if not shared:
        return
    same = all(a == b for _, a, b in shared)
    steps = ", ".join(str(step) for step, _, _ in shared)
    verdict = "bit-identical to" if same else "DIFFERENT from"
    say(f"    resumed run at step{'s' if len(shared) > 1 else ''} {steps}: loss {verdict} the first run's")


def _run_record(workspace: Path, run_id: str) -> dict[str, Any]:
    return json.loads((workspace / "runs" / run_id / "run.json").read_text())


async def wait_for_notes(workspace: Path, run_ids: list[str], timeout_s: float = 30) -> None:
    """The supervisor writes a run's git note just after recording its outcome."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        notes = subprocess.run(["git", "log", "--notes=trainwright", "--format=%N"], cwd=workspace,
                               capture_output=True, text=True).stdout
        if all(f"run {run_id}:" in notes for run_id in run_ids):
            return
        await anyio.sleep(0.5)
    raise DemoFailed("the runs' git notes were not written")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kill", action="store_true", help="SIGKILL the run's engine instead of stop_run")
    parser.add_argument("--workspace", type=Path, default=DEFAULT_WORKSPACE,
                        help="a fresh workspace is created here (default: demo-workspace/)")
    args = parser.parse_args(argv)
    workspace = args.workspace.resolve()
    shutil.rmtree(workspace, ignore_errors=True)
    workspace.mkdir(parents=True)
    started = time.monotonic()
    try:
        anyio.run(demo, workspace, args.kill)
    except DemoFailed as e:
        say(f"\ndemo FAILED: {e}")
        return 1
    say(f"\ndemo finished in {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
