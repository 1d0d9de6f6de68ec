"""launch_run, list_runs, get_run, wait_run, tail_metrics, stop_run, list_checkpoints,
resume_checkpoint and the run:// resources, through a real MCP client (in memory and over stdio).

Runs use the tiny model (tests.support.TINY) on one process: a few seconds each.
"""

from __future__ import annotations

import functools
import json
import os
import re
import signal
import time

import pytest

from engine import run_dir as rd
from mcp_server.limits import text_bytes
from tests.mcp.conftest import (
    ENDLESS_RUN, SHORT_RUN, git, head, is_finite_number, process_group_alive, tiny_config,
)
from tests.support import wait_for

pytestmark = pytest.mark.slow

NO_RUN = "20990101-000000-lm-0000"


@pytest.fixture(scope="module")
def recipe(client) -> str:
    return client.ok("scaffold_recipe", template="causal_lm", name="lm", config=tiny_config(**SHORT_RUN))["path"]


@pytest.fixture(scope="module")
def launched(client, recipe) -> dict:
    """The launch_run result of a 6-step run with checkpoints at steps 3 and 6."""
    started = time.monotonic()
    result = client.ok("launch_run", recipe=recipe)
    result["seconds_to_answer"] = time.monotonic() - started
    return result


@pytest.fixture(scope="module")
def finished(client, launched) -> dict:
    """get_run of that run once it has ended."""
    return client.wait_for_run(launched["run_id"])


@pytest.fixture(scope="module")
def endless(client, recipe):
    """The launch_run result of a run that goes on until it is stopped: wait_run watches it, then
    stop_run ends it (one run for both: a launch is most of each test's time)."""
    run = client.ok("launch_run", recipe=recipe, overrides=ENDLESS_RUN)
    yield run
    client.ok("stop_run", run_id=run["run_id"])  # already stopped when both tests ran


@pytest.fixture(scope="module")
def resumed(client, finished) -> dict:
    """resume_checkpoint from step 3 of the finished run, and get_run once it has ended."""
    launch = client.ok("resume_checkpoint", run_id=finished["run_id"], step=3)
    return {"launch": launch, "final": client.wait_for_run(launch["run_id"])}


def test_launch_run_returns_a_handle_at_once(launched, workspace):
    assert launched["status"] in ("starting", "running")
    assert launched["run_dir"] == f"runs/{launched['run_id']}"
    assert launched["resumed_from"] is None
    # The engine checks the config first (an import of torch); the run itself takes longer.
    assert launched["seconds_to_answer"] < 60
    assert (workspace / launched["run_dir"] / "run.json").is_file()


def test_get_run_reports_the_finished_run_its_latest_metrics_and_checkpoints(finished, launched, workspace,
                                                                           recipe):
    assert finished["status"] == "completed", finished
    assert finished["run_id"] == launched["run_id"] and finished["recipe"] == recipe
    assert finished["step"] == 6 and finished["max_steps"] == 6
    assert finished["nproc"] == 1 and finished["exit_code"] == 0
    assert finished["git_commit"] == head(workspace)
    assert is_finite_number(finished["latest"]["loss"]) and finished["latest"]["step"] == 6
    assert finished["eta_s"] is None  # only while running
    assert [c["step"] for c in finished["checkpoints"]] == [3, 6]
    assert finished["console_tail"] is None and finished["error"] is None


def test_list_runs_shows_runs_newest_first_with_their_latest_loss(client, finished):
    runs = client.ok("list_runs")["runs"]
    mine = next(r for r in runs if r["run_id"] == finished["run_id"])
    assert mine["status"] == "completed" and mine["step"] == 6 and mine["max_steps"] == 6
    assert mine["loss"] == finished["latest"]["loss"]
    assert [r["run_id"] for r in runs] == sorted((r["run_id"] for r in runs), reverse=True)
    assert client.ok("list_runs", limit=1)["truncated"] is (len(runs) > 1)


def test_tail_metrics_is_bounded_and_polls_after_a_step(client, finished):
    run_id = finished["run_id"]

    last_two = client.ok("tail_metrics", run_id=run_id, n=2)
    assert [r["step"] for r in last_two["records"]] == [5, 6]
    assert last_two["truncated"] is True and last_two["status"] == "completed"

    after_four = client.ok("tail_metrics", run_id=run_id, after_step=4)
    assert [r["step"] for r in after_four["records"]] == [5, 6]
    assert after_four["truncated"] is False

    assert client.ok("tail_metrics", run_id=run_id, after_step=6)["records"] == []
    everything = client.ok("tail_metrics", run_id=run_id, n=200)["records"]
    assert [r["step"] for r in everything] == [1, 2, 3, 4, 5, 6]
    assert all(is_finite_number(r["loss"]) and is_finite_number(r["tokens_per_s"]) for r in everything)


def test_list_checkpoints_lists_the_complete_checkpoints(client, finished):
    result = client.ok("list_checkpoints", run_id=finished["run_id"])
    assert result["run_id"] == finished["run_id"]
    assert result["checkpoints"] == [
        {"step": 3, "path": f"runs/{finished['run_id']}/checkpoints/step-00000003"},
        {"step": 6, "path": f"runs/{finished['run_id']}/checkpoints/step-00000006"},
    ]


def test_resuming_a_recipe_run_with_a_scripts_args_is_refused(client, finished):
    message = client.error("resume_checkpoint", run_id=finished["run_id"], args=["--steps", "9"])
    assert message.endswith(f"bad_input: args are a script's command line; run {finished['run_id']} ran a recipe: "
                            "change its config with overrides")


def test_resume_checkpoint_continues_as_a_new_run_with_the_same_losses(client, finished, resumed):
    launch, final = resumed["launch"], resumed["final"]
    assert launch["run_id"] != finished["run_id"]
    assert launch["resumed_from"] == {
        "run_id": finished["run_id"], "step": 3,
        "path": f"runs/{finished['run_id']}/checkpoints/step-00000003",
    }
    assert final["status"] == "completed" and final["resumed_from"] == launch["resumed_from"]

    continued = client.ok("tail_metrics", run_id=launch["run_id"])["records"]
    original = client.ok("tail_metrics", run_id=finished["run_id"], after_step=3)["records"]
    assert [r["step"] for r in continued] == [4, 5, 6]
    # On CPU a resumed run is bit-identical to the uninterrupted one.
    assert [r["loss"] for r in continued] == [r["loss"] for r in original]


def test_tail_metrics_can_follow_the_resume_chain(client, finished, resumed):
    child = resumed["launch"]["run_id"]

    history = client.ok("tail_metrics", run_id=child, follow_resumes=True)

    # Steps 1-3 only exist in the parent's metrics: the history is the parent's up to the
    # resume step, then the child's.
    assert [r["step"] for r in history["records"]] == [1, 2, 3, 4, 5, 6]
    assert history["resumes"] == [{"run_id": child, "step": 3}] and history["truncated"] is False
    parent = client.ok("tail_metrics", run_id=finished["run_id"])["records"]
    assert history["records"][:3] == parent[:3]
    assert history["records"][3:] == client.ok("tail_metrics", run_id=child)["records"]

    newest = client.ok("tail_metrics", run_id=child, n=4, follow_resumes=True)
    assert [r["step"] for r in newest["records"]] == [3, 4, 5, 6] and newest["truncated"] is True
    after = client.ok("tail_metrics", run_id=child, after_step=1, follow_resumes=True)
    assert [r["step"] for r in after["records"]] == [2, 3, 4, 5, 6] and after["truncated"] is False
    own = client.ok("tail_metrics", run_id=child)
    assert [r["step"] for r in own["records"]] == [4, 5, 6] and own["resumes"] == []
    # The resources show the history.
    resource = json.loads(client.read_text(f"run://{child}/metrics"))
    assert [r["step"] for r in resource["records"]] == [1, 2, 3, 4, 5, 6]
    picture, _ = client.read_bytes(f"run://{child}/loss.png")
    assert picture.startswith(b"\x89PNG\r\n\x1a\n")


def test_wait_run_returns_at_the_asked_step_with_progress_while_the_server_answers(client, endless):
    run = endless
    progress = []

    async def on_progress(value, total, message):
        progress.append((value, total, message))

    arguments = {"run_id": run["run_id"], "until_step": 40, "timeout_s": 300}
    pending = client.portal.start_task_soon(
        functools.partial(client.client.call_tool, "wait_run", arguments, progress_callback=on_progress)
    )
    started = time.monotonic()
    assert client.ok("list_runs")["runs"]
    assert time.monotonic() - started < 2.0
    assert not pending.done(), "the run reached step 40 first: nothing was measured"

    result = pending.result(timeout=300)
    assert not result.is_error, result.content[0].text
    waited = result.structured_content
    assert waited["reason"] == "reached_step" and waited["status"] == "running"
    assert waited["step"] >= 40 and waited["latest"]["step"] == waited["step"] and waited["max_steps"] == 100_000
    assert progress, "no progress notification"
    steps = [value for value, _, _ in progress]
    assert steps == sorted(steps) and steps[-1] == waited["step"]
    assert progress[-1][1] == 100_000
    assert re.fullmatch(rf"step {waited['step']}/100000, loss \d+\.\d{{4}}", progress[-1][2])

    default_tail = client.ok("tail_metrics", run_id=run["run_id"])  # what an agent gets by default
    assert len(default_tail["records"]) == 10 and text_bytes(default_tail) < 8 * 1024

    timed_out = client.ok("wait_run", run_id=run["run_id"], until_step=10**9, timeout_s=1)
    assert timed_out["reason"] == "timeout" and timed_out["status"] == "running"
    assert 1 <= timed_out["waited_s"] < 10 and timed_out["step"] > waited["step"]


def test_wait_run_on_a_finished_run_returns_at_once(client, finished):
    ended = client.ok("wait_run", run_id=finished["run_id"])
    assert ended["reason"] == "ended" and ended["status"] == "completed" and ended["step"] == 6
    assert ended["waited_s"] < 1 and ended["error"] is None
    reached = client.ok("wait_run", run_id=finished["run_id"], until_step=3)
    assert reached["reason"] == "reached_step" and reached["step"] == 6


def test_a_finished_run_leaves_a_git_note_with_its_outcome(workspace, finished, resumed):
    run_id = finished["run_id"]

    def note() -> str:
        try:
            return git(workspace, "notes", "--ref=trainwright", "show", finished["git_commit"])
        except Exception:
            return ""

    text = wait_for(lambda: run_id in note() and resumed["launch"]["run_id"] in note(), timeout=30) and note()
    line = next(line for line in text.splitlines() if line.startswith(f"run {run_id}:"))
    assert line.startswith(f"run {run_id}: completed; step 6/6; loss {finished['latest']['loss']:.4f}; ")
    assert " tokens/s; recipe recipes/lm, 1 process(es)" in line
    log = git(workspace, "log", "--notes=trainwright", "-1", "--format=%N", finished["git_commit"])
    assert f"run {resumed['launch']['run_id']}: completed" in log and f"resumed from {run_id} step 3" in log


def test_the_run_resources_give_metrics_log_and_a_loss_curve(client, finished):
    run_id = finished["run_id"]
    uris = client.resource_templates()
    assert {"run://{run_id}/metrics", "run://{run_id}/log", "run://{run_id}/loss.png"} <= set(uris)

    metrics = json.loads(client.read_text(f"run://{run_id}/metrics"))
    assert [r["step"] for r in metrics["records"]] == [1, 2, 3, 4, 5, 6]
    assert f"[trainwright] run {run_id} completed (exit code 0)" in client.read_text(f"run://{run_id}/log")
    picture, mime_type = client.read_bytes(f"run://{run_id}/loss.png")
    assert mime_type == "image/png" and picture.startswith(b"\x89PNG\r\n\x1a\n")
    assert client.read_error(f"run://{NO_RUN}/log") == f"not_found: no run '{NO_RUN}' in this workspace; list_runs shows the runs"


def test_stop_run_ends_a_running_run_and_all_its_processes(client, workspace, endless):
    run = endless
    client.wait_for_step(run["run_id"], 1)
    record = rd.read_run(workspace / run["run_dir"])
    running = client.ok("get_run", run_id=run["run_id"])
    assert running["status"] == "running" and is_finite_number(running["eta_s"])

    stopped = client.ok("stop_run", run_id=run["run_id"])

    assert stopped["status"] == "stopped" and stopped["error"] == "stopped by request"
    listed = client.ok("list_checkpoints", run_id=run["run_id"])["checkpoints"]
    assert stopped["step"] >= 1 and stopped["checkpoints"] == [c["step"] for c in listed]
    assert not rd.pid_alive(record.pid) and not process_group_alive(record.child_pgid)
    assert client.ok("stop_run", run_id=run["run_id"])["status"] == "stopped"  # idempotent
    assert client.ok("tail_metrics", run_id=run["run_id"])["status"] == "stopped"
    ended = client.ok("wait_run", run_id=run["run_id"], until_step=10**9)
    assert ended["reason"] == "ended" and ended["status"] == "stopped" and ended["error"] == "stopped by request"


def test_a_run_whose_engine_is_killed_is_failed_with_the_console_tail(client, workspace, recipe):
    run = client.ok("launch_run", recipe=recipe, overrides=ENDLESS_RUN)
    client.wait_for_step(run["run_id"], 1)
    os.killpg(rd.read_run(workspace / run["run_dir"]).child_pgid, signal.SIGKILL)  # the OOM killer, say

    failed = client.wait_for_run(run["run_id"])

    assert failed["status"] == "failed" and failed["error"] == "killed by SIGKILL"
    assert re.search(r"step +\d+/100000 \| loss ", failed["console_tail"])  # the tail is bounded
    assert failed["console_tail"].rstrip().endswith(f"run {run['run_id']} failed (exit code -9)")


@pytest.mark.parametrize(
    "tool", ["get_run", "wait_run", "tail_metrics", "stop_run", "list_checkpoints", "resume_checkpoint"]
)
def test_an_unknown_run_is_a_tool_error_that_says_how_to_list_runs(client, tool):
    message = client.error(tool, run_id=NO_RUN)
    assert message == f"Error executing tool {tool}: not_found: no run '{NO_RUN}' in this workspace; list_runs shows the runs"


@pytest.mark.parametrize(
    "tool, arguments, expected",
    [
        ("get_run", {"run_id": "../../etc"}, "run_id '../../etc' is not a plain name"),
        ("tail_metrics", {"n": 0}, "n must be an integer between 1 and 200"),
        ("tail_metrics", {"n": 201}, "n must be an integer between 1 and 200"),
        ("tail_metrics", {"n": "many"}, "n\n  Input should be a valid integer"),
        ("tail_metrics", {"after_step": "last"}, "after_step\n  Input should be a valid integer"),
        ("list_runs", {"limit": 0}, "limit must be an integer between 1 and 100"),
        ("resume_checkpoint", {"step": 5}, "no complete checkpoint at step 5; available steps: 3, 6"),
        ("resume_checkpoint", {"nproc": 0}, "nproc must be between 1 and"),
        ("wait_run", {"timeout_s": 601}, "timeout_s must be a number of seconds above 0 and at most 600"),
        ("wait_run", {"timeout_s": 0}, "timeout_s must be a number of seconds above 0 and at most 600"),
        ("wait_run", {"until_step": -1}, "until_step must be a step number (0 or more) or null"),
    ],
)
def test_bad_run_arguments_are_tool_errors_that_say_what_to_change(client, finished, tool, arguments, expected):
    arguments = {"run_id": finished["run_id"], **arguments} if tool != "list_runs" else arguments
    assert expected in client.error(tool, **arguments)


@pytest.mark.parametrize(
    "arguments, expected",
    [
        ({"overrides": {"train.max_stpes": 3}}, "unknown config key 'train.max_stpes' (did you mean 'train.max_steps'?)"),
        ({"recipe": "recipes/nope"}, "not_found: no recipe 'recipes/nope' in the workspace"),
        ({"recipe": ".."}, "recipe '..' resolves outside the workspace"),
        ({"nproc": 0}, "nproc must be between 1 and"),
        ({"nproc": "two"}, "nproc\n  Input should be a valid integer"),
        ({"overrides": ["train.max_steps"]}, "overrides\n  Input should be a valid dictionary"),
    ],
)
def test_a_bad_launch_is_a_tool_error_and_leaves_no_run(client, workspace, recipe, arguments, expected):
    runs_before = sorted(p.name for p in (workspace / "runs").iterdir()) if (workspace / "runs").exists() else []
    assert expected in client.error("launch_run", **{"recipe": recipe, **arguments})
    runs_after = sorted(p.name for p in (workspace / "runs").iterdir()) if (workspace / "runs").exists() else []
    assert runs_after == runs_before


def test_a_missing_argument_names_the_parameter(client):
    assert "recipe\n  Field required" in client.error("launch_run")
    message = client.error("no_such_tool")
    assert "unknown tool" in message.lower() and "no_such_tool" in message
