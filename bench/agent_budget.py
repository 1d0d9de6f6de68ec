"""How much of an agent's context trainwright takes: the ``tools/list`` answer and each result.

1. ``tools/list``: the whole answer as the server sends it (compact JSON, UTF-8 bytes), and per
   tool. An MCP host sends it to the model in every session. Goal: ≤ 20,000 bytes.
2. Typical results on a real small run of the template (one process, a 1-layer model): the
   calls of the canonical loop (scaffold → apply → launch → wait → stop → resume → wait) and the
   reads around it. For each: the text an agent reads (the JSON in the result's text content)
   and the whole result on the wire (text content + structuredContent). Goal: text < 8 KB;
   anything over is flagged.

    python bench/agent_budget.py [--json]

Takes about a minute (two short runs and a few engine checks).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio
from mcp import Client

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

TOOLS_LIST_GOAL = 20_000
RESULT_GOAL = 8 * 1024
SMALL = {
    "model.hidden_size": 32, "model.intermediate_size": 64, "model.num_layers": 1, "model.num_heads": 2,
    "model.num_kv_heads": 1, "data.seq_len": 32, "data.batch_size": 2, "train.log_every": 1,
    "optim.warmup_steps": 2, "train.max_steps": 30, "checkpoint.every": 15,
}


def size(text: str) -> int:
    return len(text.encode())


async def measure() -> dict[str, Any]:
    from mcp_server.server import build_server

    with tempfile.TemporaryDirectory(prefix="trainwright-budget-") as workspace:
        async with Client(build_server(workspace)) as client:
            listing = await client.list_tools()
            answer = listing.model_dump_json(by_alias=True, exclude_none=True)
            per_tool = {tool["name"]: size(json.dumps(tool, separators=(",", ":")))
                        for tool in json.loads(answer)["tools"]}
            results: list[dict[str, Any]] = []

            async def call(label: str, tool: str, **arguments: Any) -> dict[str, Any]:
                started = time.monotonic()
                result = await client.call_tool(tool, arguments)
                text = result.content[0].text if result.content else ""
                if result.is_error:
                    raise SystemExit(f"{tool}({arguments}) failed: {text}")
                results.append({
                    "call": label, "tool": tool, "text_bytes": size(text),
                    "wire_bytes": size(result.model_dump_json(by_alias=True, exclude_none=True)),
                    "seconds": round(time.monotonic() - started, 2),
                })
                return result.structured_content

            await call("list_templates", "list_templates")
            await call("list_skills", "list_skills")
            skills = [s["name"] for s in (await client.call_tool("list_skills", {})).structured_content["skills"]]
            for name in skills:
                await call(f"get_skill {name}", "get_skill", skill=name)
            recipe = (await call("scaffold_recipe (+loss-guard)", "scaffold_recipe", template="causal_lm",
                                 name="lm", config=SMALL, skills=["loss-guard"]))["path"]
            await call("apply_skill dry_run", "apply_skill", skill="gradient-checkpointing", recipe=recipe,
                       dry_run=True)
            await call("apply_skill", "apply_skill", skill="gradient-checkpointing", recipe=recipe)
            await call("describe_recipe", "describe_recipe", recipe=recipe)
            await call("list_recipes", "list_recipes")
            run = (await call("launch_run", "launch_run", recipe=recipe))["run_id"]
            await call("wait_run (to the end)", "wait_run", run_id=run, timeout_s=600)
            await call("get_run", "get_run", run_id=run)
            await call("tail_metrics (default n)", "tail_metrics", run_id=run)
            await call("tail_metrics (n=200: asked for more)", "tail_metrics", run_id=run, n=200)
            await call("list_runs", "list_runs")
            await call("list_checkpoints", "list_checkpoints", run_id=run)
            await call("stop_run", "stop_run", run_id=run)
            resumed = (await call("resume_checkpoint", "resume_checkpoint", run_id=run, step=15))["run_id"]
            await call("wait_run (resumed, to the end)", "wait_run", run_id=resumed, timeout_s=600)
            await call("tail_metrics follow_resumes", "tail_metrics", run_id=resumed, follow_resumes=True)
            await call("get_run (resumed)", "get_run", run_id=resumed)
            await call("sample (defaults)", "sample", run_id=resumed, prompts=["def ", "import "])
            await call("sample (8 prompts x 512 tokens)", "sample", run_id=resumed, prompts=["x"] * 8,
                       max_new_tokens=512, temperature=1.0)
            await call("evaluate", "evaluate", run_id=resumed)
            await call("export_checkpoint", "export_checkpoint", run_id=resumed, to="exports/lm")
    return {"tools_list_bytes": size(answer), "tools": len(per_tool), "per_tool_bytes": per_tool,
            "results": results}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    measured = anyio.run(measure)
    over = [r for r in measured["results"] if r["text_bytes"] >= RESULT_GOAL]
    if args.json:
        print(json.dumps({**measured, "over_result_goal": [r["call"] for r in over]}))
        return 0
    total = measured["tools_list_bytes"]
    verdict = "within" if total <= TOOLS_LIST_GOAL else "OVER"
    print(f"tools/list: {total:,} bytes for {measured['tools']} tools ({verdict} the goal of {TOOLS_LIST_GOAL:,})")
    for name, count in sorted(measured["per_tool_bytes"].items(), key=lambda item: -item[1]):
        print(f"  {name:<20} {count:>6,}")
    print(f"\nresults (goal: the text an agent reads < {RESULT_GOAL:,} bytes)")
    print(f"  {'call':<38} {'text':>7} {'wire':>7} {'s':>6}")
    for r in measured["results"]:
        flag = "  OVER" if r["text_bytes"] >= RESULT_GOAL else ""
        print(f"  {r['call']:<38} {r['text_bytes']:>7,} {r['wire_bytes']:>7,} {r['seconds']:>6.1f}{flag}")
    names = ", ".join(r["call"] for r in over)
    print(f"\n{len(over)} result(s) over {RESULT_GOAL:,} bytes" + (f": {names}" if over else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
