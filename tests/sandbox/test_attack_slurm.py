"""Attack on how a SLURM job's state is read: a job may rename itself and set its own comment
(``scontrol update JobId=$SLURM_JOB_ID JobName=... Comment=...``), and both are printed in
``scontrol show job -o``'s one line, the job name before its state and the comment after. Text
there that spells ``JobState=`` must not decide the run's status: a failed job must not read as
completed."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from runner.slurm import JobState, query_state


def stand_ins(bin_dir: Path, scontrol_line: str) -> dict[str, str]:
    """squeue has forgotten the job, sacct has no accounting store, scontrol prints ``scontrol_line``."""
    bin_dir.mkdir()
    for name, body in (("squeue", "exit 0"),
                       ("sacct", "echo 'Slurm accounting storage is disabled' >&2; exit 1"),
                       ("scontrol", f"cat {bin_dir / 'scontrol.out'}")):
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod(0o755)
    (bin_dir / "scontrol.out").write_text(scontrol_line + "\n")
    return {"PATH": f"{bin_dir}:{os.environ['PATH']}"}


def scontrol_line(name: str = "job-1", comment: str | None = None) -> str:
    """``scontrol show job -o`` of an ended job as SLURM 22.05 prints it (fields in its order)."""
    line = (f"JobId=91 JobName={name} UserId=u(1000) GroupId=u(1000) MCS_label=N/A Priority=1 Nice=0 "
            "Account=(null) QOS=(null) JobState=FAILED Reason=NonZeroExitCode Dependency=(null) Requeue=1 "
            "Restarts=0 BatchFlag=1 Reboot=0 ExitCode=1:0 RunTime=00:00:05 TimeLimit=01:00:00 "
            "Partition=debug NodeList=n1 NumNodes=1 Command=/ws/runs/job-1/job.sbatch WorkDir=/ws")
    if comment is not None:
        line += f" Comment={comment}"
    return line + " StdErr=/ws/runs/job-1/console.log StdIn=/dev/null StdOut=/ws/runs/job-1/console.log Power="


SPOOFED = "x JobState=COMPLETED Reason=None Dependency=(null) Requeue=1 Restarts=0 BatchFlag=1 Reboot=0 ExitCode=0:0"


def test_the_state_scontrol_prints_is_read(tmp_path):
    answer = query_state("91", stand_ins(tmp_path / "bin", scontrol_line()))
    assert answer == JobState("FAILED", "1:0", "scontrol show job; sacct: Slurm accounting storage is disabled")


@pytest.mark.parametrize("where", ["name", "comment"])
def test_a_job_that_spells_its_state_in_its_name_or_comment_does_not_read_as_completed(tmp_path, where):
    line = scontrol_line(name=SPOOFED) if where == "name" else scontrol_line(comment=SPOOFED)
    answer = query_state("91", stand_ins(tmp_path / "bin", line))
    assert (answer.state, answer.exit_code) != ("COMPLETED", "0:0")
    assert answer == JobState(None, note=(
        "the state of SLURM job 91 is unknown (sacct: Slurm accounting storage is disabled; scontrol: its answer "
        "names JobState 2 times (a job name or comment spells it), so it says nothing sure)"))


def test_hostile_slurm_output_reaches_get_run_on_one_bounded_line_without_control_characters(tmp_path):
    """squeue's reason and sacct's complaint, as a broken or hostile cluster might print them:
    escapes that would clear a terminal or set its title, a newline with 'JobState=', and 100 KB."""
    from anyio.from_thread import start_blocking_portal
    from mcp import Client

    from mcp_server.server import build_server
    from tests.mcp.conftest import ToolSession, closing_cleanly
    from tests.sandbox.helpers import fake_run, make_workspace

    bin_dir = tmp_path / "bin"
    stand_ins(bin_dir, "")
    hostile = "Resources\x1b]0;owned\x07\x1b[2J\rJobState=COMPLETED\n" + "A" * 100_000
    (bin_dir / "squeue.out").write_text(f"PENDING|{hostile}\n")
    (bin_dir / "squeue").write_text(f"#!/bin/sh\ncat {bin_dir / 'squeue.out'}\n")
    workspace = make_workspace(tmp_path / "ws")
    fake_run(workspace, "job-1", status="starting", steps=0, checkpoints=(), target="slurm", slurm_job_id="91",
             nnodes=2, rdzv_id="job-1", rdzv_endpoint="<first node>:29400")
    patch = pytest.MonkeyPatch()
    patch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    try:
        with start_blocking_portal() as portal:
            with closing_cleanly(portal.wrap_async_context_manager(Client(build_server(workspace)))) as connected:
                session = ToolSession(portal, connected, "memory")
                info = session.ok("get_run", run_id="job-1")
                assert info["status"] == "starting"
                assert info["nodes"].startswith("2 node(s) x 1 process(es), SLURM job 91 PENDING (Resources")
                assert not any(ord(c) < 32 for c in info["nodes"])
                assert len(info["nodes"]) < 400
                (bin_dir / "squeue.out").write_text("")  # forgotten; sacct complains in escapes
                (bin_dir / "sacct").write_text(f"#!/bin/sh\nprintf 'err\\033[2J\\033]0;owned\\007 {'B' * 5000}' >&2; exit 1\n")
                (bin_dir / "scontrol.out").write_text("")
                warnings = session.ok("get_run", run_id="job-1")["warnings"]
                assert warnings and all(not any(ord(c) < 32 for c in w) and len(w) < 1200 for w in warnings)
    finally:
        patch.undo()
