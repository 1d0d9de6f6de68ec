"""Attack on a SLURM job that resumes from a checkpoint: the server checks the checkpoint when it
submits the job, and the job reads it when SLURM starts it, minutes or hours later. The run the
checkpoint came from may still be running and can rewrite its own folder meanwhile: other
files with a manifest to match (the manifest is the run's own word), or a link in the
checkpoint's place. What the job loads must be what the server checked: the server stages the
checkpoint into its own record of the job (a folder no run writes), verified there, and the job's
script names the copy."""

from __future__ import annotations

import os
import shlex
import shutil
from pathlib import Path

import pytest

from engine import checkpoint_manifest
from engine import run_checkpoints
from engine import run_dir as rd
from engine.errors import BadInput
from engine.seams import LaunchVerdict
from mcp_server.operations import launch as launching
from runner import lifecycle as run_lifecycle
from runner.slurm import SCRIPT_NAME, stage_checkpoint
from tests.sandbox.helpers import fake_run, make_workspace, tree_hash
from workspace.settings import RunLimits
from workspace.workspace import Workspace, record_dir

SOURCE = "20260101-000000-lm-job"
SHARD = "__0_0.distcp"
WEIGHTS = b"the weights the server checked"
POISON = b"weights the source run wrote after the server checked"


@pytest.fixture
def submitted(tmp_path, monkeypatch):
    """A SLURM run with a checkpoint at step 4, and its resume submitted (sbatch a stand-in, the
    launch check's verdict given): the workspace, the checkpoint and the new job's script."""
    workspace = make_workspace(tmp_path / "ws")
    run_dir = fake_run(workspace, SOURCE, steps=4, checkpoints=(4,), target="slurm", config={"train": {"max_steps": 4}},
                       slurm_options={"partition": "debug", "time": "5", "gpus_per_node": 0, "rdzv_port": 29400})
    checkpoint = run_dir / rd.CHECKPOINTS_DIRNAME / run_checkpoints.checkpoint_dir_name(4)
    (checkpoint / SHARD).write_bytes(WEIGHTS)
    checkpoint_manifest.write_manifest(checkpoint)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text("#!/bin/sh\necho '91;cluster'\n")
    (bin_dir / "sbatch").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setattr(run_lifecycle, "check_launch",
                        lambda *args, **kwargs: LaunchVerdict(config={"train": {"max_steps": 8}}))
    resumed = launching.resume_checkpoint(Workspace.open(workspace), SOURCE, step=4, code="head",
                                          overrides={"train.max_steps": 8}, limits=RunLimits(slurm=True))
    return workspace, checkpoint, (workspace / rd.RUNS_DIRNAME / resumed.run_id / SCRIPT_NAME).read_text()


def loaded_by_the_job(script: str) -> Path:
    """The checkpoint the job's engine is told to load (``--resume-from`` in its srun line)."""
    (line,) = [line for line in script.splitlines() if "--resume-from" in line]
    words = shlex.split(line)
    return Path(words[words.index("--resume-from") + 1])


def test_other_files_with_a_matching_manifest_written_after_submission_are_not_what_the_job_loads(submitted):
    workspace, checkpoint, script = submitted
    (checkpoint / SHARD).write_bytes(POISON)  # as the source run can: its folder is its own
    checkpoint_manifest.write_manifest(checkpoint)
    assert checkpoint_manifest.problem(checkpoint, full=True) is None  # a manifest cannot tell

    loaded = loaded_by_the_job(script)
    assert (loaded / SHARD).read_bytes() == WEIGHTS
    assert checkpoint_manifest.problem(loaded, full=True) is None
    assert loaded.is_relative_to(record_dir(workspace, loaded.parent.parent.name))  # the server's record of the job


def test_a_link_put_in_the_checkpoints_place_after_submission_is_not_what_the_job_loads(submitted, tmp_path):
    workspace, checkpoint, script = submitted
    host = tmp_path / "host"
    host.mkdir()
    (host / SHARD).write_bytes(POISON)
    checkpoint_manifest.write_manifest(host)
    shutil.rmtree(checkpoint)
    checkpoint.symlink_to(host)

    loaded = loaded_by_the_job(script)
    assert (loaded / SHARD).read_bytes() == WEIGHTS
    assert checkpoint_manifest.problem(loaded, full=True) is None


def test_a_checkpoint_whose_copy_does_not_verify_is_refused_and_nothing_is_left(tmp_path):
    workspace = make_workspace(tmp_path / "ws")
    run_dir = fake_run(workspace, SOURCE, steps=4, checkpoints=(4,))
    checkpoint = run_dir / rd.CHECKPOINTS_DIRNAME / run_checkpoints.checkpoint_dir_name(4)
    (checkpoint / SHARD).write_bytes(WEIGHTS)
    checkpoint_manifest.write_manifest(checkpoint)
    (checkpoint / SHARD).write_bytes(POISON[: len(WEIGHTS)])  # same size, other bytes
    before = tree_hash(workspace)
    staged = tmp_path / "record" / "resume-from" / checkpoint.name
    why = checkpoint_manifest.copy_verified(checkpoint, staged)
    assert why is not None and why.startswith(f"{SHARD} does not match the digest it was saved with"), why
    assert not staged.exists() and tree_hash(workspace) == before
    with pytest.raises(BadInput, match=f"checkpoint {checkpoint.name} of run {SOURCE} is corrupt: {SHARD} does not"):
        stage_checkpoint(rd.ResumedFrom(run_id=SOURCE, step=4, path=str(checkpoint)), tmp_path / "record2")
    assert not (tmp_path / "record2" / "resume-from" / checkpoint.name).exists()


def test_a_sparse_file_larger_than_the_free_disk_is_refused_before_anything_is_copied(tmp_path, monkeypatch):
    # A file with a hole costs the run nothing on disk; its copy is written out in full (ext4's
    # copy_file_range keeps no hole): staging it would fill the server's disk.
    workspace = make_workspace(tmp_path / "ws")
    run_dir = fake_run(workspace, SOURCE, steps=4, checkpoints=(4,))
    checkpoint = run_dir / rd.CHECKPOINTS_DIRNAME / run_checkpoints.checkpoint_dir_name(4)
    (checkpoint / SHARD).write_bytes(WEIGHTS)
    checkpoint_manifest.write_manifest(checkpoint)
    size = shutil.disk_usage(tmp_path).free + (1 << 30)
    os.truncate(checkpoint / SHARD, size)
    manifest = (checkpoint / checkpoint_manifest.MANIFEST).read_text()
    (checkpoint / checkpoint_manifest.MANIFEST).write_text(manifest.replace(f'"bytes": {len(WEIGHTS)}', f'"bytes": {size}'))
    copied = []
    monkeypatch.setattr(checkpoint_manifest, "_copy_bytes", lambda source, out, count: copied.append(count))
    staged = tmp_path / "record" / "resume-from" / checkpoint.name
    why = checkpoint_manifest.copy_verified(checkpoint, staged)
    assert copied == [] and not staged.exists()
    assert why is not None and why.startswith(f"the checkpoint's {size:,} bytes do not fit"), why
