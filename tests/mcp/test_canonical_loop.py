"""The loop an agent runs — scaffold → apply → launch → wait → stop → resume → wait — in seven
tool calls, through a real MCP client: no polling, no guessing."""

from __future__ import annotations

import json

import pytest

from tests.mcp.conftest import connect, tiny_config

pytestmark = pytest.mark.slow


def test_the_canonical_loop_takes_seven_tool_calls(tmp_path):
    with connect("memory", tmp_path) as client:
        recipe = client.ok("scaffold_recipe", template="causal_lm", name="loop",
                           config=tiny_config(**{"train.max_steps": 100_000, "checkpoint.every": 5}))["path"]
        applied = client.ok("apply_skill", skill="loss-guard", recipe=recipe)
        run = client.ok("launch_run", recipe=recipe)
        progress: list = []
        reached = client.ok("wait_run", progress, run_id=run["run_id"], until_step=10, timeout_s=300)
        stopped = client.ok("stop_run", run_id=run["run_id"])
        resumed = client.ok("resume_checkpoint", run_id=run["run_id"])
        from_step = resumed["resumed_from"]["step"]
        continued = client.ok("wait_run", run_id=resumed["run_id"], until_step=from_step + 3, timeout_s=300)

        calls = [json.loads(line)["tool"] for line in (tmp_path / ".trainwright/audit.jsonl").read_text().splitlines()]
        assert calls == ["scaffold_recipe", "apply_skill", "launch_run", "wait_run", "stop_run",
                         "resume_checkpoint", "wait_run"]
        assert applied["changed"] is True
        assert reached["reason"] == "reached_step" and reached["step"] >= 10 and progress
        assert stopped["status"] == "stopped" and from_step in stopped["checkpoints"] and from_step >= 5
        assert continued["reason"] == "reached_step" and continued["step"] >= from_step + 3
        history = client.ok("tail_metrics", run_id=resumed["run_id"], n=200, follow_resumes=True)
        steps = [r["step"] for r in history["records"]]
        assert steps == list(range(steps[0], steps[-1] + 1))  # one history: no gap, no step twice
        assert steps[0] == 1 or history["truncated"]
        client.ok("stop_run", run_id=resumed["run_id"])
