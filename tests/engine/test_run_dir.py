"""The run directory format: metrics tails, complete checkpoints, run.json updates, status."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from engine import run_dir as rd
from engine import run_checkpoints
from engine import run_metrics
from engine.checkpoint_manifest import write_manifest


def write_metrics(path, steps):
    with open(path, "w") as f:
        for step in steps:
            f.write(json.dumps({"step": step, "loss": 1.0 / step}) + "\n")


@pytest.mark.parametrize("block_size", [7, 64, 65536])
def test_tail_returns_the_last_n_records_in_order(tmp_path, block_size):
    path = tmp_path / "metrics.jsonl"
    write_metrics(path, range(1, 101))
    records, truncated = run_metrics.read_metrics_tail(path, 5, block_size=block_size)
    assert [r["step"] for r in records] == [96, 97, 98, 99, 100]
    assert truncated is True


@pytest.mark.parametrize("block_size", [7, 65536])
def test_tail_after_step_returns_only_newer_records(tmp_path, block_size):
    path = tmp_path / "metrics.jsonl"
    write_metrics(path, range(1, 101))
    records, truncated = run_metrics.read_metrics_tail(path, 50, after_step=97, block_size=block_size)
    assert [r["step"] for r in records] == [98, 99, 100]
    assert truncated is False
    records, truncated = run_metrics.read_metrics_tail(path, 2, after_step=90, block_size=block_size)
    assert [r["step"] for r in records] == [99, 100]
    assert truncated is True


def test_tail_of_a_short_file_is_the_whole_file_untruncated(tmp_path):
    path = tmp_path / "metrics.jsonl"
    write_metrics(path, [1, 2, 3])
    records, truncated = run_metrics.read_metrics_tail(path, 20, block_size=5)
    assert [r["step"] for r in records] == [1, 2, 3]
    assert truncated is False


def test_tail_skips_a_line_that_is_still_being_written(tmp_path):
    path = tmp_path / "metrics.jsonl"
    write_metrics(path, [1, 2])
    with open(path, "a") as f:
        f.write('{"step": 3, "lo')
    records, _ = run_metrics.read_metrics_tail(path, 10)
    assert [r["step"] for r in records] == [1, 2]


def test_tail_of_a_missing_file_is_empty(tmp_path):
    assert run_metrics.read_metrics_tail(tmp_path / "none.jsonl", 5) == ([], False)


def test_only_published_checkpoints_with_metadata_count(tmp_path):
    checkpoints = tmp_path / "checkpoints"
    for name, complete in [
        ("step-00000010", True),
        ("step-00000020", True),
        (".partial-step-00000030", True),  # fully written but never published
        ("step-00000040", False),  # published name without DCP metadata
        ("step-50", True),  # not the checkpoint name format
    ]:
        (checkpoints / name).mkdir(parents=True)
        if complete:
            (checkpoints / name / run_checkpoints.DCP_METADATA).write_bytes(b"x")
            write_manifest(checkpoints / name)
    assert [s for s, _ in run_checkpoints.list_checkpoints(tmp_path)] == [10, 20]
    assert run_checkpoints.latest_checkpoint(tmp_path)[0] == 20


def test_update_run_merges_fields(tmp_path):
    run = tmp_path / "run"
    rd.create_run(run, rd.RunRecord(id="r1"))
    rd.update_run(run, status=rd.RUNNING, pid=123)
    assert rd.read_run(run) == rd.RunRecord(id="r1", status=rd.RUNNING, pid=123)
    with pytest.raises(FileExistsError):
        rd.create_run(run, rd.RunRecord(id="r1"))


def test_run_json_is_read_and_written_only_as_a_run_record(tmp_path):
    run = tmp_path / "run"
    rd.create_run(run, rd.RunRecord(id="r1"))
    with pytest.raises(TypeError, match="RunRecord has no field 'stauts'"):
        rd.update_run(run, stauts=rd.RUNNING)
    with pytest.raises(ValueError, match="status"):
        rd.update_run(run, status="finished")
    assert rd.read_run(run).status == rd.STARTING  # a refused update changes nothing


def test_a_live_status_whose_process_is_gone_reads_as_failed():
    finished = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(finished.stdout)
    assert rd.RunRecord(id="r", status=rd.RUNNING, pid=dead_pid).effective_status() == rd.FAILED
    assert rd.RunRecord(id="r", status=rd.COMPLETED, pid=dead_pid).effective_status() == rd.COMPLETED
    import os

    assert rd.RunRecord(id="r", status=rd.RUNNING, pid=os.getpid()).effective_status() == rd.RUNNING


def test_run_ids_are_plain_names_that_sort_by_time():
    first = rd.new_run_id("my recipe/../x")
    assert rd.RUN_ID_PATTERN.match(first)
    assert "/" not in first and ".." not in first


def test_importing_the_run_dir_format_does_not_import_torch():
    code = "import sys, engine.run_dir; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_warnings_are_kept_in_order_and_once(tmp_path):
    run = tmp_path / "run"
    rd.create_run(run, rd.RunRecord(id="r1"))
    for message in ("first", "second", "first"):
        rd.append_warning(run, message)
    assert rd.read_run(run).warnings == ["first", "second"]


def test_latest_metrics_keep_each_keys_latest_value(tmp_path):
    """A recipe may log its own record after the step's (DPO's rewards, an evaluation): the
    latest metrics still show the step's loss, and every key's newest value."""
    path = tmp_path / "metrics.jsonl"
    with open(path, "w") as f:
        for record in ({"step": 10, "loss": 0.9, "eval_loss": 1.5}, {"step": 10, "reward_accuracy": 0.5},
                       {"step": 20, "loss": 0.7}, {"step": 20, "reward_accuracy": 0.75}):
            f.write(json.dumps(record) + "\n")
    assert run_metrics.latest_metrics(path) == {"step": 20, "loss": 0.7, "eval_loss": 1.5, "reward_accuracy": 0.75}
    assert run_metrics.latest_metrics(tmp_path / "none.jsonl") is None


def test_get_run_latest_shows_the_loss_under_a_recipes_own_record(tmp_path):
    from mcp_server.operations.runs import get_run
    from workspace.workspace import Workspace

    ws = Workspace.open(tmp_path)
    run_id = "20260101-000000-dpo-abcd"
    rd.create_run(ws.runs_dir / run_id, rd.RunRecord(id=run_id, recipe="recipes/dpo", max_steps=20))
    with open(ws.runs_dir / run_id / rd.METRICS_JSONL, "w") as f:
        f.write(json.dumps({"step": 20, "loss": 0.4, "tokens_per_s": 100.0}) + "\n")
        f.write(json.dumps({"step": 20, "reward_accuracy": 0.8}) + "\n")
    info = get_run(ws, run_id)
    assert info.step == 20
    assert info.latest["loss"] == 0.4 and info.latest["reward_accuracy"] == 0.8
