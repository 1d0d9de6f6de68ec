"""SLURM jobs against a real SLURM, through a real MCP client over stdio.

The module's fixture starts a single-machine SLURM (:mod:`tests.mcp.slurm_cluster`: slurmctld,
slurmd and munged on 127.0.0.1, no accounting store, one job at a time on the node) and a
``trainwright serve`` whose environment names it (``SLURM_CONF``) and whose trusted settings
allow jobs. ``launch_run(target="slurm")`` submits with the real ``sbatch``; the job runs the
tiny recipe under ``slurmstepd`` (``srun`` → torchrun → the engine); ``get_run`` follows it
through ``squeue`` and, since ``sacct`` has no store here, ``scontrol show job``. Skipped with
the reason where SLURM is not installed or this is not root (``make slurm`` installs it).

What a single machine without accounting cannot show (a job over several nodes, sacct's
records, TIMEOUT and NODE_FAIL) stays in ``test_slurm_jobs.py``, with stand-in commands.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import time
from pathlib import Path

import pytest
from anyio.from_thread import start_blocking_portal
from mcp import Client

from tests.mcp.conftest import ToolSession, closing_cleanly, stdio_parameters, tiny_config
from tests.mcp.slurm_cluster import PARTITION, missing, single_node_slurm, until_ended
from tests.sandbox.helpers import make_workspace
from workspace import git as workspace_git

NO_STORE = "scontrol show job; sacct: Slurm accounting storage is disabled"
BROKEN = "the data broke"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def job(**extra):
    """slurm settings of a CPU job on the test's partition (rendezvous on a port of its own)."""
    return {"partition": PARTITION, "time": "5", "gpus_per_node": 0, "rdzv_port": free_port(), **extra}


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    reason = missing()
    if reason:
        pytest.skip(reason)
    root = tmp_path_factory.mktemp("slurm-real")
    workspace = make_workspace(root / "ws")
    broken = workspace / "recipes" / "broken"  # passes the launch check, fails at its first batch
    shutil.copytree(workspace / "recipes" / "lm", broken)
    source = (broken / "recipe.py").read_text()
    next_batch = "    def __next__(self) -> dict[str, torch.Tensor]:\n"
    assert next_batch in source
    (broken / "recipe.py").write_text(source.replace(next_batch, f"{next_batch}        raise RuntimeError({BROKEN!r})\n"))
    workspace_git.commit_paths(workspace_git.open_repo(workspace), [broken], "add recipe broken", [])
    settings = root / "settings.yaml"
    settings.write_text("runs:\n  slurm: true\n")
    with single_node_slurm(root / "slurm") as cluster:
        parameters = stdio_parameters(workspace, "--config", str(settings))
        parameters.env = {**(parameters.env or {}), "SLURM_CONF": str(cluster.conf)}
        with start_blocking_portal() as portal:
            with closing_cleanly(portal.wrap_async_context_manager(Client(parameters))) as connected:
                yield ToolSession(portal, connected, "stdio"), workspace, cluster




def processes_of(run_id: str) -> list[str]:
    """Command lines of the processes that name the run (its torchrun agent and workers)."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            line = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if run_id in line and proc.name != str(os.getpid()):
            found.append(f"{proc.name}: {line[:200]}")
    return found


def losses(workspace: Path, run_id: str) -> dict[int, float]:
    metrics = workspace / "runs" / run_id / "metrics.jsonl"
    lines = metrics.read_text().splitlines() if metrics.exists() else []
    return {r["step"]: r["loss"] for r in map(json.loads, lines) if "loss" in r and "step" in r}


@pytest.mark.slow
def test_sbatch_refusals_are_bad_input_in_slurms_own_words_and_leave_nothing(slurm):
    session, workspace, cluster = slurm
    before = sorted((workspace / "runs").glob("*"))
    for settings, words in (
        ({"partition": "nope"}, "sbatch: error: Batch job submission failed: Invalid partition name specified"),
        ({"time": "30:00"},  # over the partition's 10 minutes
         "sbatch: error: Batch job submission failed: Requested time limit is invalid (missing or exceeds some limit)"),
    ):
        message = session.error("launch_run", recipe="recipes/lm", target="slurm", overrides=tiny_config(),
                                slurm=job(**settings))
        assert message == f"Error executing tool launch_run: bad_input: sbatch refused the job: {words}"
    assert sorted((workspace / "runs").glob("*")) == before
    assert cluster.command("squeue", "-h", "-o", "%i").stdout == ""


@pytest.mark.slow
def test_jobs_are_followed_pending_running_completed_failed_resumed_and_cancelled(slurm):
    session, workspace, cluster = slurm
    t0 = time.monotonic()
    config = tiny_config(**{"train.max_steps": 4, "checkpoint.every": 2})
    # Jobs wait while the partition is down (and the node takes one job at a time: the second
    # waits behind the first).
    cluster.command("scontrol", "update", f"PartitionName={PARTITION}", "State=DOWN")
    first = session.ok("launch_run", recipe="recipes/lm", target="slurm", nproc=2, overrides=config,
                       slurm=job())["run_id"]
    broken = session.ok("launch_run", recipe="recipes/broken", target="slurm", overrides=tiny_config(),
                        slurm=job())["run_id"]
    for run_id in (first, broken):
        waiting = session.ok("get_run", run_id=run_id)
        assert waiting["status"] == "starting"
        assert re.search(r"SLURM job \d+ PENDING \(PartitionDown\) \(from squeue\);", waiting["nodes"]), waiting
    cluster.command("scontrol", "update", f"PartitionName={PARTITION}", "State=UP")

    done = until_ended(session, first)
    assert (done["status"], done["exit_code"], done["step"], done["error"]) == ("completed", 0, 4, None)
    assert [c["step"] for c in done["checkpoints"]] == [2, 4]
    assert f"COMPLETED (from {NO_STORE})" in done["nodes"]
    assert done["warnings"] == []
    print(f"\nfirst job completed at {time.monotonic() - t0:.1f} s")

    # The failing job runs once the first has ended: its exit code, SLURM's state and its console.
    failed = until_ended(session, broken)
    job_id = failed["nodes"].split("SLURM job ")[1].split()[0]
    assert (failed["status"], failed["exit_code"]) == ("failed", 1)
    assert failed["error"] == f"SLURM job {job_id} ended FAILED (exit code 1:0); see console.log"
    assert f"FAILED (from {NO_STORE})" in failed["nodes"]
    assert f"RuntimeError: {BROKEN}" in (workspace / "runs" / broken / "console.log").read_text()
    assert "srun: error: localhost: task 0: Exited with exit code 1" in failed["console_tail"]
    assert processes_of(broken) == []
    print(f"failing job ended at {time.monotonic() - t0:.1f} s")

    # A resume of the job's checkpoint is a job again; it continues the first job's losses exactly
    # (same processes, same threads), and stop_run cancels it: its processes end.
    resumed = session.ok("resume_checkpoint", run_id=first, step=2, overrides={"train.max_steps": 10_000})
    run_id = resumed["run_id"]
    assert resumed["nodes"].startswith("1 node(s) x 2 process(es), SLURM job ")
    assert (workspace / "runs" / run_id / "job.sbatch").is_file()
    waited = session.ok("wait_run", run_id=run_id, until_step=4, timeout_s=120)
    assert waited["reason"] == "reached_step" and waited["step"] >= 4  # the job may be further on when it is read
    print(f"resumed job at step 4 at {time.monotonic() - t0:.1f} s")
    assert {s: v for s, v in losses(workspace, run_id).items() if s <= 4} == {
        s: v for s, v in losses(workspace, first).items() if s > 2}
    running = session.ok("get_run", run_id=run_id)
    assert running["status"] == "running" and "RUNNING (from squeue)" in running["nodes"]
    assert (running["resumed_from"]["run_id"], running["resumed_from"]["step"]) == (first, 2)
    # torchrun (its line names torch.distributed.run first) and its 2 workers
    assert len([p for p in processes_of(run_id) if "engine.launch" in p or "torch.distributed.run" in p]) >= 3
    stopped = session.ok("stop_run", run_id=run_id)
    assert stopped["status"] == "stopped"
    assert processes_of(run_id) == []
    print(f"resumed job cancelled at {time.monotonic() - t0:.1f} s")
    info = session.ok("get_run", run_id=run_id)
    job_id = info["nodes"].split("SLURM job ")[1].split()[0]
    assert (info["error"], info["exit_code"]) == (f"cancelled (scancel {job_id})", -15)
    assert f"CANCELLED (from {NO_STORE})" in info["nodes"]
    assert cluster.command("squeue", "-h", "-o", "%i").stdout == ""
