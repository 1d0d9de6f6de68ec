"""Faults: runs killed at random moments (also mid-save) resume bit for bit; a full disk during
a save fails the run with a clear reason and keeps the previous checkpoint; a server killed in
the middle of apply_skill leaves the recipe as it was or as it would be, never half-written.

Runs go through the operations behind the MCP tools (launch_run, resume_checkpoint, get_run);
the engine's config check is skipped here (it is exercised elsewhere and costs a torch import
per launch). Kills come from outside: SIGKILL to the engine's process group.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engine.seams import LaunchVerdict
from engine import run_dir as rd
from engine import run_checkpoints
from mcp_server.operations import launch as launching
from mcp_server.operations import runs as run_ops
from runner import lifecycle as run_lifecycle
from workspace.workspace import Workspace
from tests.sandbox.helpers import derived_recipe, make_workspace, wait_final, wait_step
from tests.support import TINY, losses, wait_for

STEPS = 32
SCHEDULE = [*TINY, f"train.max_steps={STEPS}", "checkpoint.every=2", "checkpoint.keep_last=100"]
KILLS = 6


@pytest.fixture
def ws(tmp_path, monkeypatch):
    # Skip the sandboxed launch check (a torch import in a new process each time): its stand-in
    # resolves the config in this process as the real check does (a resume's from the config
    # the server recorded for its parent).
    def check(workspace, recipe_dir, nproc, overrides, config_json=None, **kwargs):
        from engine.launch import load_recipe_class, resolve_config

        config = resolve_config(load_recipe_class(recipe_dir), recipe_dir, overrides, config_json)
        return LaunchVerdict(config=config.model_dump(mode="json"))

    monkeypatch.setattr(run_lifecycle, "check_launch", check)
    return Workspace.open(make_workspace(tmp_path / "ws"))


def partial_steps(run_dir: Path) -> list[int]:
    root = run_dir / rd.CHECKPOINTS_DIRNAME
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []
    return [int(n.rsplit("-", 1)[1]) for n in names if n.startswith(run_checkpoints.PARTIAL_PREFIX + "step-")]


def kill_engine(run_dir: Path) -> None:
    record = wait_for(lambda: (r := rd.read_run(run_dir)).child_pgid and r, timeout=60)
    os.killpg(record.child_pgid, signal.SIGKILL)


@pytest.mark.slow
def test_sigkill_at_six_random_points_resumes_bit_identical_every_time(ws):
    seed = int(os.environ.get("TW_FAULT_SEED", time.time_ns() % 10**6))  # set it to replay a failure
    rng = random.Random(seed)
    seed_note = f"(TW_FAULT_SEED={seed})"
    reference = ws.runs_dir / launching.launch_run(ws, "recipes/lm", 1, SCHEDULE).run_id
    run_dir = ws.runs_dir / launching.launch_run(ws, "recipes/lm", 1, SCHEDULE).run_id
    start, mid_save_kills = 0, 0
    segments: list[tuple[Path, int, int]] = []
    for kill in range(KILLS):
        if kill % 2 == 0:
            # Inside a save: wait until the save of a checkpoint at least two past the resume
            # point has begun (its .partial- folder exists), then kill at once.
            target = start + 4
            wait_for(lambda: any(s >= target for s in partial_steps(run_dir)), timeout=300, interval=0.001)
            kill_engine(run_dir)
            mid_save_kills += bool(partial_steps(run_dir))
        else:
            wait_step(run_dir, start + rng.randint(3, 4))
            time.sleep(rng.uniform(0, 0.05))
            kill_engine(run_dir)
        record = wait_final(run_dir)
        assert record.status == rd.FAILED and "SIGKILL" in record.error, record
        segments.append((run_dir, start, kill))
        checkpoint = run_checkpoints.latest_checkpoint(run_dir)
        assert checkpoint is not None and checkpoint[0] > start, f"kill {kill} made no progress {seed_note}"
        resumed = launching.resume_checkpoint(ws, run_dir.name)
        assert resumed.resumed_from.step == checkpoint[0]
        run_dir, start = ws.runs_dir / resumed.run_id, checkpoint[0]
    assert wait_final(run_dir).status == rd.COMPLETED
    assert wait_final(reference).status == rd.COMPLETED
    segments.append((run_dir, start, KILLS))

    expected = losses(reference)
    assert sorted(expected) == list(range(1, STEPS + 1))
    for segment, first, kill in segments:
        curve = losses(segment)
        assert curve, f"segment after kill {kill} logged nothing"
        assert min(curve) == first + 1
        assert curve == {s: expected[s] for s in curve}, f"segment from step {first} (kill {kill}) {seed_note}"
    assert max(losses(segments[-1][0])) == STEPS
    assert mid_save_kills >= 2, f"only {mid_save_kills} of {KILLS // 2} kills landed inside a save"
    for segment, _, _ in segments:  # an interrupted save is never listed as a checkpoint
        assert all((p / run_checkpoints.DCP_METADATA).is_file() for _, p in run_checkpoints.list_checkpoints(segment))


FULL_DISK_SCHEDULE = [*TINY, "train.max_steps=10", "checkpoint.every=2", "checkpoint.keep_last=5"]

FAILING_FSYNC = '''import errno
import os


class FullDisk(CausalLM):
    """Saves from step 4 on fail as on a full disk (DCP's fsync raises ENOSPC); resumed runs save."""

    def save_checkpoint(self):
        if self.state.step < 4 or self.resume_from is not None:
            return super().save_checkpoint()
        real_fsync = os.fsync

        def fsync(fd):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        os.fsync = fsync
        try:
            return super().save_checkpoint()
        finally:
            os.fsync = real_fsync
'''


def _mount_tmpfs(path: Path, size: str) -> bool:
    if os.geteuid() != 0:
        return False
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True).returncode == 0


@pytest.mark.slow
@pytest.mark.parametrize("how", ["tmpfs", "injected"])
def test_a_full_disk_during_a_save_fails_the_run_clearly_and_keeps_the_previous_checkpoint(ws, how):
    recipe = "recipes/lm"
    if how == "injected":
        recipe = "recipes/" + derived_recipe(ws.root, "fulldisk", FAILING_FSYNC).name
    launched = launching.launch_run(ws, recipe, 1, FULL_DISK_SCHEDULE)
    run_dir = ws.runs_dir / launched.run_id
    checkpoints = run_dir / rd.CHECKPOINTS_DIRNAME
    mounted = False
    if how == "tmpfs":
        # Room for one checkpoint (1.7 MB), not two: the save at step 4 fills the disk.
        mounted = rd.read_run(run_dir).started_at is None and _mount_tmpfs(checkpoints, "2600k")
        if not mounted:
            run_ops.stop_run(ws, launched.run_id)
            pytest.skip("cannot mount a tmpfs here (needs root); the injected case covers this")
    try:
        record = wait_final(run_dir)
        info = run_ops.get_run(ws, launched.run_id)
        assert record.status == rd.FAILED and info.status == rd.FAILED
        assert info.error.startswith("CheckpointSaveError: could not write the checkpoint of step 4: No space left on device"), info.error
        assert "the previous checkpoint, step 2, is untouched" in info.error
        assert [c.step for c in info.checkpoints] == [2]
        assert partial_steps(run_dir) == [], "the half-written checkpoint was removed"

        resumed = launching.resume_checkpoint(ws, launched.run_id, step=2)
        resumed_dir = ws.runs_dir / resumed.run_id
        assert wait_final(resumed_dir).status == rd.COMPLETED, rd.read_run(resumed_dir).error
        before, after = losses(run_dir), losses(resumed_dir)
        assert sorted(after) == list(range(3, 11))
        assert {s: after[s] for s in before if s > 2} == {s: v for s, v in before.items() if s > 2}
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(checkpoints)], check=False)


APPLY = """
import os, sys, time
real_fsync = os.fsync
def slow_fsync(fd):  # widen the window between the temporary file and its rename
    time.sleep(float(sys.argv[2]))
    real_fsync(fd)
os.fsync = slow_fsync
from mcp_server.operations.skills import apply_skill
from workspace.workspace import Workspace
print(apply_skill(Workspace.open(sys.argv[1]), "gradient-checkpointing", "recipes/lm").commit, flush=True)
"""


def test_a_server_killed_during_apply_skill_leaves_the_recipe_as_before_or_as_after(ws):
    target = ws.root / "recipes" / "lm" / "recipe.py"
    before = target.read_bytes()
    from skills import apply_skill

    after = apply_skill("gradient-checkpointing", target.parent, {}, dry_run=True)
    expected_after = None
    rng = random.Random(7)
    seen = set()
    interrupted_writes = 0
    for attempt in range(10):
        process = subprocess.Popen([sys.executable, "-c", APPLY, str(ws.root), "2"], cwd=ws.root,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        if attempt % 2 == 0:  # while the new file is being written
            wait_for(lambda: list(target.parent.glob(".recipe.py.*.tmp")) or process.poll() is not None,
                     timeout=60, interval=0.002)
        else:
            time.sleep(rng.uniform(0.2, 2.5))
        process.kill()
        process.wait()
        interrupted_writes += bool(list(target.parent.glob(".recipe.py.*.tmp")))
        content = target.read_bytes()
        assert content in (before, expected_after or content), "the recipe is half-written"
        if content != before:
            expected_after = expected_after or content
            assert after.diff and b"checkpoint" in content
        seen.add("before" if content == before else "after")
        subprocess.run(["git", "checkout", "-q", "--", str(target)], cwd=ws.root, check=True)
    assert "before" in seen and interrupted_writes >= 3, (seen, interrupted_writes)
    # Whatever was left (a temporary file of an interrupted write) does not block the next change.
    out = subprocess.run([sys.executable, "-c", APPLY, str(ws.root), "0"], cwd=ws.root, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert list(target.parent.glob(".recipe.py.*.tmp")) == []
    status = subprocess.run(["git", "status", "--porcelain"], cwd=ws.root, capture_output=True, text=True).stdout
    assert status == "", status


FILLS_BETWEEN_CHECKPOINTS = '''import errno
import os


class FillsUp(CausalLM):
    """The disk fills at step 3, between checkpoints: writing the step's metrics fails as on a full disk."""

    def log_step(self, *args, **kwargs):
        if self.state.step >= 3:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.run_dir / "metrics.jsonl"))
        return super().log_step(*args, **kwargs)
'''


def test_a_disk_that_fills_between_checkpoints_is_named_with_where_and_how_much_is_free(ws):
    recipe = "recipes/" + derived_recipe(ws.root, "fillsup", FILLS_BETWEEN_CHECKPOINTS).name
    launched = launching.launch_run(ws, recipe, 1, [*TINY, "train.max_steps=6", "train.log_every=1",
                                                  "checkpoint.every=2"])
    run_dir = ws.runs_dir / launched.run_id
    assert wait_final(run_dir).status == rd.FAILED
    error = run_ops.get_run(ws, launched.run_id).error
    assert error.startswith(f"no space left on the device of {run_dir / 'metrics.jsonl'} ("), error
    assert " bytes free): OSError: [Errno 28] No space left on device" in error
    assert error.endswith("free some space, then resume from the last checkpoint")


def test_a_failure_with_no_word_from_the_engine_on_a_full_disk_is_named_by_the_supervisor(tmp_path):
    """On a full disk the engine may not be able to write its error: the supervisor looks."""
    from runner.supervise import failure_error

    assert failure_error(None, 1, tmp_path, free=4096) == (
        f"no space left on the device of {tmp_path} (4,096 bytes free): the run's main process exited with "
        "status 1; see console.log; free some space, then resume from the last checkpoint")
    assert failure_error(None, 1, tmp_path, free=10 * rd.LOW_SPACE_BYTES) == (
        "the run's main process exited with status 1; see console.log")
    assert failure_error("ValueError: the engine's own words", 1, tmp_path, free=0) == "ValueError: the engine's own words"
