"""Every tool result has a bounded size, and says when it cut something.

The workspace is made as bad as a long, noisy project gets: 150 runs, a run with 300 complete
checkpoints, metrics records of 10 kB each, a 5 MB console log, an error message of 1 MB and a
thousand warnings. Each tool's result must stay under the budget an agent's client accepts.
"""

from __future__ import annotations

import json

import pytest

from engine import run_dir as rd
from mcp_server.limits import AGENT_BUDGET_CHARS, MAX_RESULT_CHARS
from mcp_server.server import build_server
from tests.sandbox.helpers import fake_run, live_client, make_workspace

BIG = "20260101-000000-lm-big0"


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    root = make_workspace(tmp_path_factory.mktemp("bounds") / "ws")
    for i in range(150):
        fake_run(root, f"20250101-{i:06d}-lm-{'r' * 200}"[:128], checkpoints=())
    run_dir = fake_run(root, BIG, status=rd.FAILED, steps=0, checkpoints=tuple(range(1, 301)),
                       error="E" * 1_000_000, warnings=["W" * 5000] * 1000)
    with open(run_dir / rd.METRICS_JSONL, "w") as f:
        for step in range(1, 501):
            f.write(json.dumps({"step": step, "loss": 1.0, "notes": "n" * 10_000}) + "\n")
    (run_dir / rd.CONSOLE_LOG).write_text("console line\n" * 400_000)
    with live_client(build_server(root)) as c:
        yield c


def result_of(client, tool, arguments):
    result = client.call(tool, arguments)
    assert not result.is_error, result.content
    size = len(json.dumps(result.structured_content))
    assert size <= MAX_RESULT_CHARS, f"{tool} returned {size} characters"
    return result.structured_content


def test_list_runs_is_bounded_and_says_it_cut(client):
    out = result_of(client, "list_runs", {"limit": 100})
    assert len(out["runs"]) == 100 and out["truncated"] is True


def test_get_run_cuts_the_error_warnings_checkpoints_and_console(client):
    out = result_of(client, "get_run", {"run_id": BIG})
    assert len(out["error"]) < 1100 and "[cut:" in out["error"]
    assert len(out["warnings"]) == 6 and all(len(w) < 400 for w in out["warnings"])
    assert out["warnings"][-1].startswith("… and 995 more warnings")
    assert [c["step"] for c in out["checkpoints"]] == list(range(291, 301))
    assert len(out["console_tail"]) <= 1501
    assert out["latest"]["step"] == 500 and len(json.dumps(out["latest"])) < 2000


def test_tail_metrics_keeps_the_newest_records_that_fit(client):
    out = result_of(client, "tail_metrics", {"run_id": BIG, "n": 200})
    assert out["truncated"] is True
    assert out["records"][-1]["step"] == 500
    steps = [r["step"] for r in out["records"]]
    assert steps == list(range(steps[0], 501))


def test_list_checkpoints_keeps_the_newest_fifty(client):
    out = result_of(client, "list_checkpoints", {"run_id": BIG})
    assert out["truncated"] is True and [c["step"] for c in out["checkpoints"]] == list(range(251, 301))


def test_stop_run_on_a_finished_run_is_bounded_too(client):
    out = result_of(client, "stop_run", {"run_id": BIG})
    assert out["status"] == rd.FAILED


@pytest.mark.parametrize("tool, arguments", [
    ("list_skills", {}), ("list_templates", {}), ("get_skill", {"skill": "lora"}),
    ("apply_skill", {"skill": "gradient-checkpointing", "recipe": "recipes/lm", "dry_run": True}),
])
def test_the_other_tools_are_bounded(client, tool, arguments):
    result_of(client, tool, arguments)


def test_the_run_log_resource_is_bounded(client):
    contents = client.read_resource(f"run://{BIG}/log").contents
    assert len(contents[0].text) <= 20_001


@pytest.mark.parametrize("tool, arguments", [
    ("list_runs", {}), ("get_run", {"run_id": BIG}), ("tail_metrics", {"run_id": BIG}),
    ("list_checkpoints", {"run_id": BIG}), ("list_skills", {}), ("list_templates", {}),
    *[("get_skill", {"skill": name}) for name in ("muon", "lora", "sequence-packing", "flash-attention")],
    *[("apply_skill", {"skill": name, "recipe": "recipes/lm", "dry_run": True})
      for name in ("muon", "sequence-packing", "loss-guard", "tensor-parallel")],
])
def test_default_results_stay_inside_an_agents_budget(client, tool, arguments):
    """With default arguments, even on this workspace, a result is under 8 KB of JSON."""
    result = client.call(tool, arguments)
    assert not result.is_error, result.content
    size = len(json.dumps(result.structured_content, separators=(",", ":")))
    assert size <= AGENT_BUDGET_CHARS, f"{tool} returned {size:,} characters"
