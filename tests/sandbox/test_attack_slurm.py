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
