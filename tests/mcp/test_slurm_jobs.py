"""Runs as SLURM jobs, through a real MCP client: the job script (checked by shellcheck and by
its exact torchrun line), submission with sbatch, the job followed through squeue and sacct,
scancel, and the script returned where it cannot be submitted.

SLURM's commands are stand-ins written by the test (``sbatch`` answers a job id, ``squeue``,
``sacct`` and ``scontrol`` print the state the test sets, every call is logged), first on PATH;
trainwright runs them as it would run the real ones. They stay for what a real single-machine
SLURM without accounting cannot show (``test_slurm_cluster.py`` runs one): a job over two nodes
with GPUs, sacct's records (TIMEOUT, NODE_FAIL, ``CANCELLED by UID``), a job no command knows,
the exact commands asked, and sbatch missing.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from anyio.from_thread import start_blocking_portal
from mcp import Client

from mcp_server.server import build_server
from tests.mcp.conftest import ToolSession, closing_cleanly, tiny_config
from tests.sandbox.helpers import fake_run, make_workspace

JOB_ID = "4242"


def stub(bin_dir: Path, name: str, body: str) -> None:
    path = bin_dir / name
    path.write_text(f"#!/bin/sh\necho \"{name} $*\" >> {bin_dir / 'calls.log'}\n{body}\n")
    path.chmod(0o755)


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """A workspace, the stand-in commands, and a connected client of a server whose trusted
    settings allow SLURM jobs."""
    root = tmp_path_factory.mktemp("slurm")
    bin_dir = root / "bin"
    bin_dir.mkdir()
    stub(bin_dir, "sbatch", f'cp "$2" {bin_dir / "submitted.sbatch"}\necho "{JOB_ID};cluster"')
    stub(bin_dir, "squeue", f"cat {bin_dir / 'squeue.out'} 2>/dev/null || true")
    stub(bin_dir, "sacct", f"if [ -f {bin_dir / 'sacct.err'} ]; then cat {bin_dir / 'sacct.err'} >&2; exit 1; fi\n"
                           f"cat {bin_dir / 'sacct.out'} 2>/dev/null || true")
    stub(bin_dir, "scontrol", f"cat {bin_dir / 'scontrol.out'} 2>/dev/null || exit 1")
    stub(bin_dir, "scancel", "exit 0")
    settings = root / "settings.yaml"
    settings.write_text("runs:\n  slurm: true\n")
    workspace = make_workspace(root / "ws")
    patch = pytest.MonkeyPatch()
    patch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    with start_blocking_portal() as portal:
        client = Client(build_server(workspace, settings=settings))
        with closing_cleanly(portal.wrap_async_context_manager(client)) as connected:
            yield ToolSession(portal, connected, "memory"), workspace, bin_dir, patch
    patch.undo()


def test_a_slurm_run_is_submitted_followed_to_its_end_and_its_script_passes_shellcheck(slurm):
    session, workspace, bin_dir, _ = slurm
    config = tiny_config(**{"train.max_steps": 50, "data.batch_size": 8, "optim.lr": 0.003})
    launched = session.ok("launch_run", recipe="recipes/lm", nproc=4, nnodes=2, target="slurm", overrides=config,
                          slurm={"partition": "gpu", "time": "02:00:00"})
    run_id = launched["run_id"]
    run_dir = workspace / "runs" / run_id
    assert launched["status"] == "starting"
    assert launched["nodes"] == (f"2 node(s) x 4 process(es), SLURM job {JOB_ID} SUBMITTED; "
                                 f"c10d rendezvous <first node>:29400, id {run_id}")
    script = (run_dir / "job.sbatch").read_text()
    assert launched["slurm_script"] == script
    assert (bin_dir / "submitted.sbatch").read_text() == script
    lines = script.splitlines()
    for directive in ("--nodes=2", "--ntasks-per-node=1", "--gpus-per-node=4", "--time=02:00:00",
                      "--partition=gpu", f"--output=runs/{run_id}/console.log"):
        assert f"#SBATCH {directive}" in lines
    assert 'mapfile -t nodes < <(scontrol show hostnames "$SLURM_JOB_NODELIST")' in lines
    overrides = " ".join(f"--set={key}={value}" for key, value in config.items())
    assert "#SBATCH --no-requeue" in lines  # a node that fails fails the job: it never reruns from step 1
    # Each task's shell adds its node's own address and whether it serves the rendezvous.
    assert lines[-1] == (
        "srun --kill-on-bad-exit=1 bash -c 'exec \"$0\" -m torch.distributed.run --local-addr \"$SLURMD_NODENAME\" "
        "--rdzv-conf \"is_host=$((SLURM_NODEID == 0))\" \"$@\"' "
        f"{sys.executable} --nnodes 2 --nproc-per-node 4 "
        f'--rdzv-backend c10d --rdzv-endpoint "${{head_node}}:29400" --rdzv-id {run_id} -m engine.launch '
        f"{run_dir}/recipe --run-dir {run_dir} {overrides}"
    )
    shellcheck = shutil.which("shellcheck") or str(Path(sys.executable).with_name("shellcheck"))
    checked = subprocess.run([shellcheck, "--shell=bash", str(run_dir / "job.sbatch")], capture_output=True, text=True)
    assert checked.returncode == 0, checked.stdout

    (bin_dir / "squeue.out").write_text("PENDING\n")
    assert session.ok("get_run", run_id=run_id)["status"] == "starting"
    (bin_dir / "squeue.out").write_text("RUNNING\n")
    info = session.ok("get_run", run_id=run_id)
    assert info["status"] == "running"
    assert info["nodes"].endswith(f"SLURM job {JOB_ID} RUNNING (from squeue); c10d rendezvous <first node>:29400, id {run_id}")
    (bin_dir / "squeue.out").unlink()  # squeue forgets ended jobs; sacct remembers
    (bin_dir / "sacct.out").write_text("COMPLETED|0:0\n")
    assert session.ok("get_run", run_id=run_id)["status"] == "completed"
    calls = (bin_dir / "calls.log").read_text().splitlines()
    assert calls[-2:] == [f"squeue -h -j {JOB_ID} -o %T|%r", f"sacct -n -X -P -j {JOB_ID} -o State,ExitCode"]
    assert session.ok("get_run", run_id=run_id)["status"] == "completed"
    assert (bin_dir / "calls.log").read_text().splitlines() == calls  # an ended job is not asked again


def slurm_run(workspace: Path, run_id: str, job_id: str) -> None:
    """A submitted SLURM run as launch_run leaves it (without its launch check)."""
    fake_run(workspace, run_id, status="starting", steps=0, checkpoints=(), target="slurm", slurm_job_id=job_id,
             nnodes=2, rdzv_id=run_id, rdzv_endpoint="<first node>:29400")


def test_job_states_map_to_run_statuses_wait_run_follows_them_an_unknown_one_is_a_warning_and_stop_run_cancels(slurm):
    session, workspace, bin_dir, _ = slurm
    (bin_dir / "squeue.out").write_text("")
    for state, status, error in (
        ("TIMEOUT|0:15", "failed", "SLURM job 77 ended TIMEOUT (exit code 0:15); see console.log"),
        ("NODE_FAIL|0:0", "failed", "SLURM job 78 ended NODE_FAIL (exit code 0:0); see console.log"),
        ("CANCELLED by 1000|0:0", "stopped", "SLURM job 79 cancelled by 1000"),
    ):
        job_id = error.split()[2]
        slurm_run(workspace, f"job-{job_id}", job_id)
        (bin_dir / "sacct.out").write_text(state + "\n")
        info = session.ok("get_run", run_id=f"job-{job_id}")
        assert (info["status"], info["error"]) == (status, error)

    # Without an accounting store, scontrol show job says; its own words name which (a job name
    # that holds "JobState=" does not fool it).
    (bin_dir / "sacct.err").write_text("Slurm accounting storage is disabled\n")
    (bin_dir / "scontrol.out").write_text("JobId=83 JobName=x JobState=COMPLETED ExitCode=0:0 UserId=root(0) "
                                         "JobState=FAILED Reason=NonZeroExitCode ExitCode=2:0 WorkDir=/ws\n")
    slurm_run(workspace, "job-83", "83")
    info = session.ok("get_run", run_id="job-83")
    assert (info["status"], info["exit_code"], info["error"]) == (
        "failed", 2, "SLURM job 83 ended FAILED (exit code 2:0); see console.log")
    assert info["nodes"] == ("2 node(s) x 1 process(es), SLURM job 83 FAILED (from scontrol show job; sacct: Slurm "
                             "accounting storage is disabled); c10d rendezvous <first node>:29400, id job-83")
    (bin_dir / "sacct.err").unlink()
    (bin_dir / "scontrol.out").unlink()

    slurm_run(workspace, "job-81", "81")
    (bin_dir / "sacct.out").write_text("COMPLETED|0:0\n")
    waited = session.ok("wait_run", run_id="job-81", timeout_s=30)
    assert (waited["reason"], waited["status"]) == ("ended", "completed")

    slurm_run(workspace, "job-82", "82")  # ended before the stop: recorded as it ended, not cancelled
    assert session.ok("stop_run", run_id="job-82")["status"] == "completed"
    assert "scancel 82" not in (bin_dir / "calls.log").read_text().splitlines()

    slurm_run(workspace, "job-80", "80")
    (bin_dir / "sacct.out").write_text("")
    info = session.ok("get_run", run_id="job-80")
    assert info["status"] == "starting"
    assert info["warnings"] == ["the state of SLURM job 80 is unknown (sacct: no record of the job; "
                                "scontrol: exit status 1)"]
    stopped = session.ok("stop_run", run_id="job-80")
    assert (stopped["status"], stopped["error"]) == ("stopped", "cancelled (scancel 80)")
    # scancel, then the job's state asked until SLURM says it ended (here: no one knows it)
    assert (bin_dir / "calls.log").read_text().splitlines()[-4:] == [
        "scancel 80", "squeue -h -j 80 -o %T|%r", "sacct -n -X -P -j 80 -o State,ExitCode", "scontrol show job -o 80"]


def test_without_sbatch_the_script_is_written_and_returned_not_submitted(slurm):
    session, workspace, bin_dir, patch = slurm
    # PATH as it was, less every sbatch on it (a real one may be installed beside git)
    without = bin_dir.parent / "path-without-sbatch"
    without.mkdir()
    for folder in reversed(os.environ["PATH"].split(os.pathsep)):
        for command in Path(folder).glob("*") if Path(folder).is_dir() else ():
            if command.name != "sbatch":
                (without / command.name).unlink(missing_ok=True)
                (without / command.name).symlink_to(command)
    path = os.environ["PATH"]
    patch.setenv("PATH", str(without))
    try:
        launched = session.ok("launch_run", recipe="recipes/lm", target="slurm", nnodes=2, overrides=tiny_config(),
                              slurm={"gpus_per_node": 0})
    finally:
        patch.setenv("PATH", path)
    run_id = launched["run_id"]
    assert launched["status"] == "stopped"
    assert launched["warnings"][0] == (f"not submitted: sbatch is not on PATH; submit it on the cluster with "
                                  f"`sbatch runs/{run_id}/job.sbatch`")
    assert launched["slurm_script"] == (workspace / "runs" / run_id / "job.sbatch").read_text()
    assert "#SBATCH --nodes=2" in launched["slurm_script"].splitlines()
    assert not any(line.startswith("#SBATCH --gpus-per-node") for line in launched["slurm_script"].splitlines())


def test_bad_slurm_and_node_settings_are_refused_with_what_to_change(slurm):
    session, workspace, _, _ = slurm
    before = sorted((workspace / "runs").glob("*"))
    cases = [
        ({"target": "slurm", "slurm": {"time": "soon"}},
         "bad_input: slurm time must be a SLURM time limit such as '90', '04:00:00' or '1-12:00:00', got 'soon'"),
        ({"target": "slurm", "slurm": {"nodes": 2}},
         "bad_input: unknown slurm setting 'nodes'; valid: partition, time, gpus_per_node, rdzv_port"),
        ({"slurm": {"partition": "gpu"}},
         "bad_input: slurm settings are for target slurm: pass target='slurm' too, or leave them out"),
        ({"nnodes": 2, "target": "slurm", "rdzv": {"endpoint": "h:1"}},
         "bad_input: with target slurm the rendezvous is on the job's first node: leave rdzv endpoint and "
         "node_rank out (slurm rdzv_port sets its port)"),
        ({"nnodes": 2},
         "bad_input: a run over 2 nodes needs rdzv endpoint 'host:port': an address of the first node that every "
         "node reaches (127.0.0.1:PORT for nodes on this machine)"),
        ({"nnodes": 2, "rdzv": {"endpoint": "node0:70000"}},
         "bad_input: the rendezvous port must be between 1 and 65535, got 70000"),
        ({"nnodes": 2, "rdzv": {"endpoint": "node 0:29400"}},
         "bad_input: rdzv endpoint 'node 0:29400': 'node 0' is not a host name or IPv4 address"),
        ({"nnodes": 2, "rdzv": {"endpoint": "node0:29400", "node_rank": 1}},
         "bad_input: node_rank 1 joins a run: pass rdzv id = the run id that node 0's launch returned (its run "
         "directory must be in this workspace, on a filesystem every node shares)"),
        ({"nnodes": 2, "rdzv": {"endpoint": "node0:29400", "node_rank": 2}},
         "bad_input: node_rank must be between 0 and 1, got 2"),
        ({"nnodes": 2, "rdzv": {"endpoint": "node0:29400"}},
         "bad_input: a run over 2 nodes needs the host's network (its rendezvous and collectives cross machines), "
         "which this server's settings do not allow; the person who starts the server can set runs.multi_node: "
         "true in the file given to `trainwright serve --config` (SECURITY.md)"),
        ({"rdzv": {"endpoint": "node0:29400"}},
         "bad_input: rdzv endpoint is for runs over several nodes: pass nnodes > 1 too, or leave it out"),
        ({"target": "cloud"}, None),  # refused by the tool's schema
    ]
    for arguments, expected in cases:
        message = session.error("launch_run", recipe="recipes/lm", **arguments)
        if expected is not None:
            assert message == f"Error executing tool launch_run: {expected}"
    assert sorted((workspace / "runs").glob("*")) == before
