"""`trainwright ab SKILL RECIPE --steps N`: the skill's commit (b) against its parent (a), runs
interleaved a b b a with one config, the verdict over the rounds, and ``--note``.

One A/B of gradient checkpointing on a tiny causal_lm (four runs of 4 steps, a module's worth,
run once through the real CLI) checks the verdict, the order and the code each run ran; bad
input is refused before anything runs, and leaves the workspace as it was.
"""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
from pathlib import Path

import pytest

from engine import run_dir as rd
from runner import server_record as sr
from workspace.workspace import record_dir, records_root
from engine.config import overrides_to_dict
from engine.errors import BadInput, NotFound
from mcp_server import cli
from mcp_server.operations import recipes as recipe_ops
from mcp_server.operations import launch as launching
from workspace.workspace import Workspace
from tests.mcp.conftest import connect
from tests.support import TINY

# Activations dominate the peak: 16 × 256 positions through 6 layers of the tiny width (as in
# tests/mcp/test_compare_runs.py), so checkpointing's lower peak stands out of the noise.
HEAVY = (*TINY, "model.num_layers=6", "data.seq_len=256", "data.batch_size=16", "metrics.tensorboard=false")


def trainwright(root: Path, *args: str) -> tuple[int, dict, str]:
    """The CLI in this process: exit code, its JSON, and what it wrote on stderr."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main([*args, "--workspace", str(root), "--json"])
    return code, json.loads(out.getvalue()), err.getvalue()


def sets(*items: str) -> list[str]:
    return [arg for item in items for arg in ("--set", item)]


def git(root: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, check=True).stdout


def state(root: Path) -> tuple[str, str, str, list[str], list[str]]:
    """What bad input must leave unchanged: HEAD, git status, the notes, runs and records."""
    notes = subprocess.run(["git", "notes", "--ref=trainwright", "list"], cwd=root, capture_output=True, text=True)
    runs = sorted(p.name for p in (root / rd.RUNS_DIRNAME).iterdir()) if (root / rd.RUNS_DIRNAME).is_dir() else []
    records = records_root(root)
    return (git(root, "rev-parse", "HEAD"), git(root, "status", "--porcelain"), notes.stdout, runs,
            sorted(p.name for p in records.iterdir()) if records.is_dir() else [])


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("ab")
    ws = Workspace.open(root)
    recipe_ops.scaffold_recipe(ws, "causal_lm", "lm", skills=["gradient-checkpointing"])
    recipe_ops.scaffold_recipe(ws, "causal_lm", "plain")
    return root


@pytest.fixture(scope="module")
def measured(workspace) -> tuple[int, dict, str]:
    return trainwright(workspace, "ab", "gradient-checkpointing", "recipes/lm", "--steps", "4", *sets(*HEAVY), "--note")


@pytest.mark.slow
def test_checkpointing_measures_memory_better_and_loss_no_different(measured):
    code, result, _ = measured
    assert code == 0 and result["outcome"] == "completed", result
    verdict = {m["metric"]: m for m in result["verdict"]}
    assert set(verdict) == {"loss", "tokens_per_s", "step_time_s", "peak_mem_mb", "first_step_s", "wall_s"}  # steps_to_loss: one run a side
    assert verdict["loss"]["verdict"] == "no difference" and verdict["loss"]["evidence"].startswith("bit-equal")
    assert verdict["peak_mem_mb"]["verdict"] == "better"
    assert verdict["peak_mem_mb"]["ratio"] < 0.95  # 0.89 measured
    # Pooled over both rounds: each run's 3 windows after its warm-up, two runs a side.
    assert verdict["tokens_per_s"]["evidence"].startswith("medians of 6 and 6 windows after the warm-up")
    assert [r["round"] for r in result["per_round"]] == [1, 2]
    assert all({m["metric"]: m["verdict"] for m in r["metrics"]}["peak_mem_mb"] == "better" for r in result["per_round"])
    assert result["differences"][0].startswith("commit: ")
    assert result["differences"][1].startswith("skills: only a: none; only b: gradient-checkpointing@")


@pytest.mark.slow
def test_the_runs_take_turns_a_b_b_a_each_after_the_last_ended(measured, workspace):
    _, result, progress = measured
    order = [(r["round"], r["side"]) for r in result["runs"]]
    assert order == [(1, "a"), (1, "b"), (2, "b"), (2, "a")]
    records = [sr.read_record(record_dir(workspace, r["run_id"])) for r in result["runs"]]
    for before, after in zip(records, records[1:]):
        assert before.ended_at is not None and after.created_at is not None
        assert before.ended_at <= after.created_at  # one at a time: the next starts after the last ended
    parent, commit = result["commit_a"], result["commit_b"]
    assert git(workspace, "rev-parse", f"{commit}^").strip() == parent
    assert [r.git_commit for r in records] == [parent, commit, commit, parent]
    assert all(r.recipe_dirty is False for r in records)
    for run, record in zip(result["runs"], records):  # each ran its commit's code, and the same config
        snapshot = (workspace / rd.RUNS_DIRNAME / run["run_id"] / rd.SNAPSHOT_DIRNAME / "recipe.py").read_text()
        assert snapshot == git(workspace, "show", f"{record.git_commit}:recipes/lm/recipe.py")
        assert record.config == records[0].config
        assert record.config["train"]["max_steps"] == 4 and record.config["checkpoint"]["every"] == 0
    assert "round 1/2 a: run " in progress and "round 2: " in progress  # progress went to stderr


@pytest.mark.slow
def test_note_puts_the_verdict_into_the_skill_commits_note(measured, workspace):
    _, result, _ = measured
    assert result["note_written"] is True
    note = git(workspace, "notes", "--ref=trainwright", "show", result["commit_b"])
    block = note[note.index("A/B of gradient-checkpointing@"):].splitlines()
    assert block[0].endswith(f"against {result['commit_a'][:10]} (a, before it), 2 round(s) of 4 steps, interleaved")
    assert block[1].startswith("  loss no difference ×1 (") and block[1].endswith(" bit-equal")
    assert [line.split()[0] for line in block[1:7]] == ["loss", "tokens_per_s", "step_time_s", "peak_mem_mb",
                                                        "first_step_s", "wall_s"]
    assert block[4].startswith("  peak_mem_mb better ×0.")
    command = block[7].removeprefix("  command: ").split(" ")
    assert command[:8] == ["trainwright", "ab", "gradient-checkpointing", "recipes/lm", "--steps", "4", "--rounds", "2"]
    assert command[-1] == "--note"
    # The overrides as they were read (a later value of a key wins): the command runs the same A/B again.
    assert overrides_to_dict(command[9:-1:2]) == overrides_to_dict(list(HEAVY))
    assert command[8:-1:2] == ["--set"] * len(overrides_to_dict(list(HEAVY)))
    assert "A/B of" not in (git(workspace, "notes", "--ref=trainwright", "show", result["commit_a"]))


@pytest.mark.parametrize("args, code, message", [
    (("ab", "no-such-skill", "recipes/lm", "--steps", "4"), 3, "no skill named 'no-such-skill'"),
    (("ab", "gradient-checkpointing", "recipes/nope", "--steps", "4"), 3, "no recipe 'recipes/nope'"),
    (("ab", "gradient-checkpointing", "recipes/lm", "--steps", "0"), 2, "steps must be between 3 and 1000, got 0"),
    (("ab", "gradient-checkpointing", "recipes/lm", "--steps", "2"), 2, "a speed verdict needs two after it"),
    (("ab", "gradient-checkpointing", "recipes/lm", "--steps", "1000000"), 2, "an A/B is short"),
    (("ab", "gradient-checkpointing", "recipes/lm", "--steps", "4", "--rounds", "0"), 2, "rounds must be between 1"),
    (("ab", "gradient-checkpointing", "recipes/lm", "--steps", "4", "--set", "train.max_steps=9"), 2,
     "--steps sets train.max_steps"),
    (("ab", "gradient-checkpointing", "recipes/plain", "--steps", "4"), 2,
     "gradient-checkpointing is not applied to recipes/plain (no commit of it has a Skill-Applied: "
     "gradient-checkpointing trailer), so no commit holds its change to measure; apply it first "
     "(`trainwright apply gradient-checkpointing recipes/plain`, or apply_skill)"),
    (("ab", "gradient-checkpointing", "recipes/lm", "--steps", "4", "--set", "train.max_stpes=3"), 2,
     "unknown config key 'train.max_stpes'"),
])
def test_bad_input_is_refused_and_changes_nothing(workspace, args, code, message):
    before = state(workspace)
    exit_code, result, _ = trainwright(workspace, *args)
    assert (exit_code, message in result["error"]) == (code, True), result
    assert state(workspace) == before


def test_launch_run_at_a_commit_refuses_what_no_commit_holds(workspace):
    ws = Workspace.open(workspace)
    before = state(workspace)
    with pytest.raises(NotFound, match="no commit 'no-such-rev'"):
        launching.launch_run(ws, "recipes/lm", overrides=list(TINY), commit="no-such-rev")
    first = git(workspace, "rev-list", "--max-parents=0", "HEAD").strip()
    with pytest.raises(NotFound, match=f"commit {first[:10]} holds no recipe at 'lm'"):
        launching.launch_run(ws, "recipes/lm", overrides=list(TINY), commit=first)
    with pytest.raises(BadInput, match="commit must be a commit id or revision"):
        launching.launch_run(ws, "recipes/lm", commit="--output=/tmp/x")
    assert state(workspace) == before


def test_launch_run_takes_the_commit_over_mcp(workspace):
    commit = git(workspace, "log", "-1", "--format=%H", "--grep=gradient-checkpointing", "--", "recipes/lm").strip()
    with connect("memory", workspace) as session:
        started = session.ok("launch_run", recipe="recipes/lm", overrides={"train.max_steps": 2}, commit=f"{commit}^")
        session.ok("stop_run", run_id=started["run_id"])
        refused = session.error("launch_run", recipe="recipes/lm", commit="no-such-rev")
    assert started["code"] == f"code at commit {git(workspace, 'rev-parse', commit + '^').strip()[:10]}"
    assert refused == ("Error executing tool launch_run: not_found: no commit 'no-such-rev' in the workspace's repository; "
                       "`git log` lists them")
