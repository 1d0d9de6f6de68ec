"""A corrupted checkpoint is never resumed as good: each checkpoint carries a manifest (its files'
sizes and SHA-256, written last); listing counts a checkpoint only when its files are there at
their sizes, and resume, export, sample and evaluate check every digest first. A bad one is
refused naming the file and the latest good checkpoint before it.

Runs go through the operations behind the MCP tools; the engine's config check is skipped (as in
test_faults.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from engine import run_dir as rd
from engine import run_checkpoints
from engine import run_metrics
from engine.checkpoint_manifest import MANIFEST
from engine.errors import BadInput, NotFound
from mcp_server.operations import model_tools
from mcp_server.operations import launch as launching
from mcp_server.operations import runs as run_ops
from tests.sandbox.helpers import wait_final
from tests.sandbox.test_faults import ws  # noqa: F401 (the fixture)
from tests.support import TINY, engine_env

SCHEDULE = [*TINY, "train.max_steps=6", "checkpoint.every=2", "checkpoint.keep_last=10"]
DATA = "__0_0.distcp"


@pytest.fixture
def trained(ws):  # noqa: F811
    run_id = launching.launch_run(ws, "recipes/lm", 1, SCHEDULE).run_id
    run_dir = ws.runs_dir / run_id
    assert wait_final(run_dir).status == rd.COMPLETED
    assert [s for s, _ in run_checkpoints.list_checkpoints(run_dir)] == [2, 4, 6]
    return ws, run_dir


def flip_bytes(path: Path) -> None:
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle:middle + 8] = bytes(b ^ 0xFF for b in data[middle:middle + 8])
    path.write_bytes(bytes(data))


def checkpoint(run_dir: Path, step: int) -> Path:
    return run_dir / rd.CHECKPOINTS_DIRNAME / run_checkpoints.checkpoint_dir_name(step)


def test_flipped_bytes_are_refused_at_resume_naming_the_file_and_the_good_checkpoint_before(trained):
    space, run_dir = trained
    flip_bytes(checkpoint(run_dir, 6) / DATA)
    assert [s for s, _ in run_checkpoints.list_checkpoints(run_dir)] == [2, 4, 6]  # sizes alone cannot tell
    with pytest.raises(BadInput) as refused:
        launching.resume_checkpoint(space, run_dir.name, overrides={"train.max_steps": 8})
    message = str(refused.value)
    assert message.startswith(f"checkpoint step-00000006 of run {run_dir.name} is corrupt: {DATA} does not match "
                              "the digest it was saved with (sha256 ")
    assert message.endswith(f"the latest good checkpoint before it is step 4 "
                            f"(resume_checkpoint(run_id={run_dir.name!r}, step=4))")
    assert [p.name for p in space.runs_dir.iterdir()] == [run_dir.name]  # no run was started
    resumed = launching.resume_checkpoint(space, run_dir.name, step=4, overrides={"train.max_steps": 8})
    assert wait_final(space.runs_dir / resumed.run_id).status == rd.COMPLETED


def test_a_truncated_or_missing_file_or_manifest_makes_a_checkpoint_incomplete(trained):
    space, run_dir = trained
    with open(checkpoint(run_dir, 6) / DATA, "r+b") as f:
        f.truncate(100)
    (checkpoint(run_dir, 4) / DATA).unlink()
    (checkpoint(run_dir, 2) / MANIFEST).write_text('{"format": 1, "files": [{"path": "../x", "bytes": 1')
    assert run_checkpoints.list_checkpoints(run_dir) == [] and run_checkpoints.latest_checkpoint(run_dir) is None
    listed = run_ops.list_checkpoints(space, run_dir.name)
    assert listed.checkpoints == [] and [u.split(":")[0] for u in listed.unusable] == [
        "step-00000002", "step-00000004", "step-00000006"]
    unusable = dict(run_checkpoints.unusable_checkpoints(run_dir))
    assert unusable[2].startswith(f"{MANIFEST} is damaged (")
    assert unusable[4] == f"{DATA} is missing"
    assert unusable[6].startswith(f"{DATA} has 100 bytes, ") and unusable[6].endswith(" when it was saved")
    with pytest.raises(BadInput, match=r"^checkpoint step-00000004 of run .* is corrupt: __0_0.distcp is missing; "
                                       r"there is no good checkpoint before it$"):
        launching.resume_checkpoint(space, run_dir.name, step=4)
    with pytest.raises(NotFound, match=r"has no complete checkpoint \(3 not complete: checkpoint step-00000006"):
        launching.resume_checkpoint(space, run_dir.name)
    with pytest.raises(BadInput, match=r"corrupt: __0_0.distcp has 100 bytes"):
        model_tools.sample(space, run_dir.name, ["hello"], step=6)


def test_the_engine_refuses_a_corrupt_checkpoint_it_is_given_directly(trained, tmp_path):
    """``python -m engine.launch --resume-from`` (no server): the run fails at once with the
    file named, and trains nothing on the damaged state."""
    space, run_dir = trained
    flip_bytes(checkpoint(run_dir, 4) / DATA)
    out = subprocess.run(
        [sys.executable, "-m", "engine.launch", str(space.root / "recipes" / "lm"), "--resume-from",
         str(checkpoint(run_dir, 4)), *[a for item in SCHEDULE for a in ("--set", item)]],
        cwd=tmp_path, env=engine_env(), capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stderr[-2000:]
    (resumed,) = (tmp_path / rd.RUNS_DIRNAME).iterdir()
    record = rd.read_run(resumed)
    assert record.error.startswith(f"CheckpointCorrupt: checkpoint step-00000004 of run {run_dir.name} is corrupt: "
                                   f"{DATA} does not match the digest")
    assert record.error.endswith("the latest good checkpoint before it is step 2 "
                                 f"(resume_checkpoint(run_id={run_dir.name!r}, step=2))")
    assert not (resumed / rd.METRICS_JSONL).exists() or run_metrics.read_all_metrics(resumed / rd.METRICS_JSONL) == []


def test_export_sample_and_evaluate_refuse_flipped_bytes_and_write_nothing(trained):
    """The digests are checked before a model is built from a checkpoint: flipped bytes (sizes
    intact, so the listing keeps it) are refused by each reader, naming the file, and export
    writes no folder; the good checkpoint before it still serves."""
    space, run_dir = trained
    flip_bytes(checkpoint(run_dir, 6) / DATA)
    readers = {
        "export": lambda step: model_tools.export_checkpoint(space, run_dir.name, "exports/bad", step=step),
        "sample": lambda step: model_tools.sample(space, run_dir.name, ["hello"], step=step, max_new_tokens=2),
        "evaluate": lambda step: model_tools.evaluate(space, run_dir.name, step=step),
    }
    for name, read in readers.items():
        for step in (None, 6):  # the latest, and by its step
            with pytest.raises(BadInput) as refused:
                read(step)
            assert f"checkpoint step-00000006 of run {run_dir.name} is corrupt: {DATA} does not match" \
                in str(refused.value), name
            assert "step=4" in str(refused.value), name
    assert not (space.root / "exports").exists()
    assert model_tools.export_checkpoint(space, run_dir.name, "exports/good", step=4).path.endswith("exports/good")
