"""A run may rewrite its own run.json (it is in the run directory, the one folder the run
writes). The server decides from its own record of the run (runner.server_record), so nothing a
run writes there makes the server signal a process it did not start, read a host file into a
git note, call a run that trains "completed", run SLURM commands with the run's arguments, or
show a reviewer provenance the run chose.

Each test is one finding of an attack on the server through run.json; the broadcast-signal
ones run the server's stop inside a PID namespace of their own (``unshare --pid --fork
--mount-proc``), so that a failure cannot reach the host's processes.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from engine.seams import LaunchVerdict
from engine import run_dir as rd
from engine import run_checkpoints
from engine import run_files
from runner import server_record as sr
from workspace.workspace import RECORD_JSON, record_dir, records_root
from engine.errors import BadInput
from mcp_server.operations import launch as launching
from mcp_server.operations import runs as run_ops
from workspace import git as workspace_git
from runner import lifecycle as run_lifecycle
from runner import processes
from runner.capacity import check_capacity
from runner import slurm
from workspace.workspace import Workspace
from tests.sandbox.helpers import fake_run, make_workspace, record_folder, supervise, wait_gone
from tests.support import REPO, wait_for

RUN_ID = "20260101-000000-forged-0000"
SLEEPER = [sys.executable, "-c", "print('STARTED', flush=True); import time; time.sleep(600)"]


def forge(run_dir: Path, **fields) -> None:
    """Rewrite run.json as the run's code can: any field, any value."""
    try:
        current = json.loads((run_dir / rd.RUN_JSON).read_text())
    except (OSError, ValueError):
        current = {}
    run_files.write_json_atomic(run_dir / rd.RUN_JSON, {**current, **fields})


def start_sleeper(workspace: Path, limits: dict | None = None) -> Path:
    run_dir = workspace / rd.RUNS_DIRNAME / RUN_ID
    supervise(run_dir, SLEEPER, {"stop_grace_s": 1, **(limits or {})}, run_id=RUN_ID)
    wait_for(lambda: "STARTED" in (run_dir / rd.CONSOLE_LOG).read_text(), timeout=60)
    return run_dir


# ---------------------------------------------------------------------------------------------
# Kill every process: pid/child_pgid of 1 or -1
# ---------------------------------------------------------------------------------------------


def _unshare_works() -> bool:
    unshare = shutil.which("unshare")
    if unshare is None:
        return False
    result = subprocess.run([unshare, "--pid", "--fork", "--mount-proc", "true"], capture_output=True, timeout=30)
    return result.returncode == 0


@pytest.mark.skipif(not _unshare_works(), reason="unshare --pid --fork --mount-proc is not permitted here")
@pytest.mark.parametrize("pid, child_pgid", [("null", "1"), ("-1", "null"), ("1", "-1"), ("0", "0")])
def test_a_forged_pid_or_group_never_makes_stop_run_signal_another_process(tmp_path, pid, child_pgid):
    """``pid: null, child_pgid: 1`` made stop_run send SIGKILL to group 1 (glibc: kill(-1)):
    every process the server's user can signal died; ``pid: -1``: SIGTERM to all."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    result = subprocess.run(
        ["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-m", "tests.sandbox.forged_record_probe",
         str(tmp_path), pid, child_pgid],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=180,
    )
    lines = [line for line in result.stdout.splitlines() if line.startswith("PROBE ")]
    assert lines, result.stdout[-2000:] + result.stderr[-2000:]
    probe = json.loads(lines[-1][len("PROBE "):])
    assert probe == {"bystander_survived": True, "status": rd.STOPPED, "error": None}


def test_identities_refuse_pids_that_name_groups_or_everything():
    assert sr.identify(1) is None and sr.identify(0) is None and sr.identify(-1) is None and sr.identify(True) is None
    assert not processes.kill_group(1, 0) and not processes.kill_group(-1, 0) and not processes.kill_group(0, 0)
    assert not rd.pid_alive(-1) and not rd.pid_alive(1)
    with pytest.raises(ValueError):
        sr.ServerRecord(id="r", child_pgid=1)
    # A recorded identity whose start time is not the live process's is not that process.
    me = sr.identify(os.getpid())
    assert me is not None and me.alive()
    assert not me.model_copy(update={"start_ticks": me.start_ticks + 1}).alive()
    assert not me.model_copy(update={"start_ticks": me.start_ticks + 1}).send_signal(0)



@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs util-linux unshare")
def test_a_server_in_a_container_knows_its_own_processes():
    """In a container (a PID namespace whose session leader is outside it) /proc shows session
    0 for every process: a live process there is still a process, and still signalled."""
    probe = ("import os, signal; from runner import server_record as sr; me = sr.identify(os.getpid()); "
             "print('PROBE', me is not None and me.session == 0 and me.alive() and me.send_signal(0))")
    done = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "sh", "-c", '"$0" -c "$1"',
                           sys.executable, probe], cwd=REPO, capture_output=True, text=True, timeout=60)
    if done.returncode != 0 and "PROBE" not in done.stdout:
        pytest.skip(f"no PID namespace here: {done.stderr.strip()[-200:]}")
    assert "PROBE True" in done.stdout, done.stdout + done.stderr

# ---------------------------------------------------------------------------------------------
# Unstoppable runs: status "completed", target "slurm"
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("forged", [{"status": "completed"}, {"target": "slurm"},
                                    {"status": "stopped", "target": "slurm", "slurm_job_id": "--user=root"}])
def test_a_run_that_says_it_ended_still_counts_as_running_and_stops(tmp_path, forged):
    workspace = make_workspace(tmp_path / "ws", "runs:\n  max_concurrent_runs: 1\n")
    run_dir = start_sleeper(workspace)
    ws = Workspace.open(workspace)
    marked = processes.marked(RUN_ID)
    assert marked
    forge(run_dir, **forged)
    assert run_ops.get_run(ws, RUN_ID).status == rd.RUNNING
    assert [s.status for s in run_ops.list_runs(ws).runs] == [rd.RUNNING]
    with pytest.raises(run_lifecycle.LaunchRefused, match="max_concurrent_runs is 1"):
        check_capacity(records_root(workspace), 1, ws.run_limits())
    assert run_ops.stop_run(ws, RUN_ID).status == rd.STOPPED
    assert wait_gone(marked, timeout=20) == set()
    assert sr.read_record(ws.record_dir(RUN_ID)).status == rd.STOPPED


# ---------------------------------------------------------------------------------------------
# Arguments into SLURM commands
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def slurm_commands(tmp_path, monkeypatch) -> Path:
    """squeue, sacct, scancel and sbatch on PATH that only write down how they were called."""
    bin_dir, calls = tmp_path / "bin", tmp_path / "slurm-calls"
    bin_dir.mkdir()
    for name in ("squeue", "sacct", "scontrol", "scancel", "sbatch"):
        (bin_dir / name).write_text(f'#!/bin/sh\necho "{name} $*" >> {calls}\n')
        (bin_dir / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    return calls


def test_a_local_run_that_names_a_slurm_job_never_reaches_slurm(tmp_path, slurm_commands):
    workspace = make_workspace(tmp_path / "ws")
    run_dir = fake_run(workspace, "r1", status=rd.RUNNING, pid=2**22 + 7)
    forge(run_dir, target="slurm", slurm_job_id="--user=root", status=rd.RUNNING)
    ws = Workspace.open(workspace)
    run_ops.get_run(ws, "r1")
    run_ops.stop_run(ws, "r1")
    assert not slurm_commands.exists()


def test_slurm_commands_take_only_job_ids(slurm_commands):
    answer = slurm.query_state("--user=root", {"PATH": os.environ["PATH"]})
    assert answer.state is None and "no valid SLURM job id" in answer.note
    assert not slurm_commands.exists()
    with pytest.raises(ValueError):
        sr.ServerRecord(id="r", target="slurm", slurm_job_id="--user=root")


# ---------------------------------------------------------------------------------------------
# Host files into git notes; forged provenance
# ---------------------------------------------------------------------------------------------


def test_a_forged_commit_never_reaches_git(tmp_path):
    from runner.supervise import Supervisor

    workspace = make_workspace(tmp_path / "ws")
    repo = workspace_git.open_repo(workspace)
    head = repo.head.commit.hexsha
    run_dir = fake_run(workspace, "r1", status=rd.RUNNING, git_commit=head, recipe_dirty=False)
    supervisor = Supervisor(record_folder(run_dir, workspace))
    forge(run_dir, git_commit="-F/proc/self/environ", recipe_dirty=True, dirty_files=["forged.py"], id="forged",
          recipe="forged", status="completed")
    supervisor.finish(0)
    note = repo.git.notes(f"--ref={workspace_git.NOTES_REF}", "show", head)
    assert note.startswith("run r1: completed") and "recipes/lm" in note
    assert "forged" not in note and "PATH=" not in note and "uncommitted" not in note
    assert workspace_git.add_note(workspace, "-F/etc/hostname", "x") is False
    assert workspace_git.add_note(workspace, head[:10], "x") is False  # only a full id


def test_a_resume_takes_the_commit_and_provenance_from_the_servers_record(tmp_path, monkeypatch):
    workspace = make_workspace(tmp_path / "ws")
    head = workspace_git.open_repo(workspace).head.commit.hexsha
    run_dir = fake_run(workspace, "r1", git_commit=head, recipe_dirty=False, config={"train": {"max_steps": 4}})
    (run_dir / rd.SNAPSHOT_DIRNAME).mkdir()
    (run_dir / rd.SNAPSHOT_DIRNAME / "recipe.py").write_text("# the code that ran\n")
    forge(run_dir, git_commit="-F/proc/self/environ", recipe_dirty=True, dirty_files=["x"],
          config={"train": {"max_steps": 4}, "data": {"paths": ["/etc"]}}, snapshot_digest="0" * 64)
    seen = {}

    def check(workspace, recipe_dir, nproc, overrides, config_json=None, **kwargs):
        seen["config"] = rd.RunRecord.model_validate_json(Path(config_json).read_bytes()).config
        resolved = {**seen["config"], "train": {"max_steps": 8}}  # the override, as the engine resolves it
        return LaunchVerdict(config=resolved)

    def start(workspace, runs_root, plan):
        seen["origin"] = plan.origin
        raise BadInput("not started in this test")

    monkeypatch.setattr(run_lifecycle, "check_launch", check)
    monkeypatch.setattr(run_lifecycle, "start_run", start)
    with pytest.raises(BadInput, match="not started in this test"):
        launching.resume_checkpoint(Workspace.open(workspace), "r1", overrides={"train.max_steps": 8})
    assert (seen["origin"].git_commit, seen["origin"].recipe_dirty, seen["origin"].dirty_files) == (head, False, [])
    assert seen["config"] == {"train": {"max_steps": 4}}  # the server's config, not the rewritten one


def test_get_run_and_review_show_the_servers_provenance(tmp_path):
    from mcp_server.operations import review

    workspace = make_workspace(tmp_path / "ws")
    head = workspace_git.open_repo(workspace).head.commit.hexsha
    run_dir = fake_run(workspace, "r1", git_commit=head, recipe_dirty=False, isolation="full",
                       isolation_note="bubblewrap")
    forge(run_dir, recipe_dirty=True, dirty_files=["forged.py"], isolation="none", isolation_note="forged",
          git_commit="f" * 40, status="failed", recipe="forged")
    ws = Workspace.open(workspace)
    info = run_ops.get_run(ws, "r1")
    assert (info.git_commit, info.recipe_dirty, info.isolation, info.isolation_note, info.status, info.recipe) == (
        head, False, "full", "bubblewrap", rd.COMPLETED, "recipes/lm")
    assert "forged" not in info.code
    runs = {r.run_id: r for c in review.review(ws).commits for r in c.runs}
    assert all("forged" not in r.code for r in runs.values())


def test_a_run_the_server_did_not_start_is_shown_as_its_claim_and_never_acted_on(tmp_path):
    workspace = make_workspace(tmp_path / "ws")
    fake_run(workspace, "r1", status=rd.RUNNING, server_record=False, pid=1, child_pgid=1,
             git_commit="a" * 40, isolation="full")
    ws = Workspace.open(workspace)
    info = run_ops.get_run(ws, "r1")
    assert info.git_commit is None and info.isolation is None
    assert any("not started by trainwright's server" in w for w in info.warnings)
    with pytest.raises(BadInput, match="not started by this server"):
        run_ops.stop_run(ws, "r1")
    with pytest.raises(BadInput, match="not started by this server"):
        launching.resume_checkpoint(ws, "r1")


def test_the_servers_record_is_outside_every_writable_folder_of_the_runs_sandbox(tmp_path):
    """The run's sandbox binds its run directory writable and shows .trainwright/ as an empty
    folder: the record the server trusts is not reachable, let alone writable."""
    from sandbox import bwrap

    workspace = make_workspace(tmp_path / "ws")
    run_dir = workspace / rd.RUNS_DIRNAME / RUN_ID
    read_only, writable, hidden = [workspace], [run_dir], processes.hidden_state(workspace)
    run_dir.mkdir(parents=True)
    record = record_dir(workspace, RUN_ID)
    options = [o for option in bwrap._mounts(read_only, writable, "isolated", {}, hidden) for o in [option]]
    binds = [Path(o[-1]) for o in options if o[0] == "--bind"]
    assert binds == [run_dir] and not any(bwrap.under(record, b) for b in binds)
    assert ["--tmpfs", str(workspace / ".trainwright")] in options


def test_a_sandboxed_run_cannot_change_the_servers_record(tmp_path):
    """In the sandbox the record's folder is not there (an empty .trainwright/): whatever the run
    writes at its path, the server's record is as the supervisor wrote it."""
    from sandbox.bwrap import find_bwrap, probe

    if probe(find_bwrap()) is not None:
        pytest.skip(f"bubblewrap cannot run here: {probe(find_bwrap())}")
    workspace = make_workspace(tmp_path / "ws")
    run_dir = workspace / rd.RUNS_DIRNAME / RUN_ID
    record = record_dir(workspace, RUN_ID) / RECORD_JSON
    code = (f"import json, os, pathlib; p = pathlib.Path({str(record)!r}); print('SEEN', p.exists(), flush=True); "
            "p.parent.mkdir(parents=True, exist_ok=True); "
            "p.write_text(json.dumps({'id': 'x', 'status': 'completed', 'git_commit': '-F/etc/passwd'}))")
    supervise(run_dir, [sys.executable, "-c", code], run_id=RUN_ID, sandbox={
        "bwrap": find_bwrap(), "read_only": [str(workspace)], "writable": [str(run_dir)],
        "hidden": [str(p) for p in processes.hidden_state(workspace)]}).wait(60)
    assert "SEEN False" in (run_dir / rd.CONSOLE_LOG).read_text()
    kept = sr.read_record(record_dir(workspace, RUN_ID))
    assert kept.id == RUN_ID and kept.status == rd.COMPLETED and kept.isolation == "full"


# ---------------------------------------------------------------------------------------------
# The smaller findings
# ---------------------------------------------------------------------------------------------


def test_terminal_escapes_from_a_run_are_escaped_in_the_cli_and_in_tool_errors(tmp_path, capsys):
    from mcp_server import cli
    from mcp_server.server import AuditedToolError, Tools

    workspace = make_workspace(tmp_path / "ws")
    run_dir = fake_run(workspace, "r1")
    escapes = "\x1b]52;c;cm0gLXJmIH4=\x07\x1b[2J\x1b]0;title\x07\x1b]8;;http://x\x1b\\link\x9b\r"
    forge(run_dir, warnings=[f"warn {escapes}"])
    with open(run_dir / rd.METRICS_JSONL, "a") as f:
        f.write(json.dumps({"step": 9, "loss": 1.0, f"name{escapes}": 2.0}) + "\n")
    assert cli.main(["status", "r1", "--workspace", str(workspace)]) == 0
    assert cli.main(["tail", "r1", "--workspace", str(workspace)]) == 0
    out = capsys.readouterr().out
    assert "warn \\x1b]52;c;" in out
    assert not any(c in out for c in "\x1b\x07\x9b\r")
    with pytest.raises(AuditedToolError) as refused:
        Tools(Workspace.open(workspace)).refuse("get_run", {}, f"bad_input: {escapes}")
    assert not any(c in str(refused.value) for c in "\x1b\x07\x9b\r") and "\\x1b" in str(refused.value)


def test_a_value_the_redactor_flags_does_not_enter_a_run_unless_passed_by_name():
    from sandbox.environment import run_environment

    source = {"PATH": "/usr/bin", "HF_HOME": "https://user:hunter2-password@example.org/x", "LANG": "C.UTF-8"}
    assert "HF_HOME" not in run_environment(source) and run_environment(source)["LANG"] == "C.UTF-8"
    assert run_environment(source, pass_env=["HF_HOME"])["HF_HOME"] == source["HF_HOME"]


@pytest.mark.parametrize("target", ["exists", "missing"])
def test_list_checkpoints_follows_no_link_inside_a_checkpoint(tmp_path, target):
    """A ``.metadata`` link made ``step-N`` count as a checkpoint exactly when the host path it
    names exists: an oracle for any path on the host."""
    host = tmp_path / "host-file"
    if target == "exists":
        host.write_text("x")
    workspace = make_workspace(tmp_path / "ws")
    run_dir = fake_run(workspace, "r1", checkpoints=(2,))
    planted = run_dir / rd.CHECKPOINTS_DIRNAME / run_checkpoints.checkpoint_dir_name(8)
    planted.mkdir()
    (planted / run_checkpoints.DCP_METADATA).symlink_to(host)
    assert [c.step for c in run_ops.list_checkpoints(Workspace.open(workspace), "r1").checkpoints] == [2]


def test_a_malformed_verdict_field_is_the_checks_refusal(tmp_path, monkeypatch):
    from mcp_server.operations import recipe_info

    workspace = make_workspace(tmp_path / "ws")
    verdict = {"ok": True, "config": {}, "config_changes": {}, "fields": [{"key": 3, "type": None, "x": 1}]}
    monkeypatch.setattr(run_lifecycle, "run_contained", lambda *a, **k: (json.dumps(verdict) + "\n", ""))
    with pytest.raises(run_lifecycle.LaunchRefused, match="no valid 'fields'"):
        recipe_info.describe_recipe(Workspace.open(workspace), "recipes/lm")


@pytest.mark.parametrize("uri", ["sqlite:////tmp/metrics.db", "sqlite:///relative.db", "file:///tmp/mlruns", "/tmp/mlruns"])
def test_a_local_mlflow_store_outside_the_run_directory_is_refused_at_the_check(uri):
    from engine.config import ConfigError, MetricsConfig
    from engine.metrics.optional import check_backends

    with pytest.raises(ConfigError, match="outside the run directory"):
        check_backends(MetricsConfig.model_validate({"backends": ["mlflow"], "mlflow": {"tracking_uri": uri}}))


@pytest.mark.parametrize("scheme", ["Bearer", "bearer", "BEARER"])
def test_the_bearer_scheme_is_case_insensitive(scheme):
    import anyio

    from mcp_server.http_auth import BearerToken

    reached = []

    async def app(scope, receive, send):
        reached.append(scope["path"])

    async def call(header: bytes):
        async def send(message):
            pass
        await BearerToken(app, "tok123")({"type": "http", "path": "/mcp", "headers": [(b"authorization", header)]},
                                         None, send)

    anyio.run(call, f"{scheme} tok123".encode())
    anyio.run(call, f"{scheme} tok1234".encode())
    assert reached == ["/mcp"]


@pytest.mark.parametrize("tool, arguments", [
    ("wait_run", {"run_id": "r1", "until_step": True, "timeout_s": 1}),
    ("wait_run", {"run_id": "r1", "timeout_s": True}),
    ("tail_metrics", {"run_id": "r1", "n": True}),
    ("tail_metrics", {"run_id": "r1", "after_step": False}),
    ("list_runs", {"limit": True}),
])
def test_booleans_are_not_numbers(tmp_path, tool, arguments):
    from mcp_server.server import build_server
    from tests.sandbox.helpers import error_text, live_client

    workspace = make_workspace(tmp_path / "ws")
    fake_run(workspace, "r1")
    with live_client(build_server(workspace)) as client:
        result = client.call(tool, arguments)
    assert result.is_error and "bad_input" in error_text(result)


def test_stop_keeps_the_failure_of_a_run_whose_supervisor_is_gone_and_ends_what_it_left(tmp_path):
    """A supervisor killed without recording an outcome: the run has failed. ``stop`` ends the
    processes it left (marked with the run's id) and records that failure, not "stopped by request"."""
    from runner.processes import RUN_ID_VARIABLE

    workspace = make_workspace(tmp_path / "ws")
    leftover = subprocess.Popen(SLEEPER, stdout=subprocess.DEVNULL, env={**os.environ, RUN_ID_VARIABLE: RUN_ID})
    try:
        dead = subprocess.Popen([sys.executable, "-c", "pass"])
        dead.wait()
        fake_run(workspace, RUN_ID, status=rd.RUNNING, pid=dead.pid)
        ws = Workspace.open(workspace)
        assert run_ops.get_run(ws, RUN_ID).status == rd.FAILED
        stopped = run_ops.stop_run(ws, RUN_ID)
        assert (stopped.status, stopped.error) == (rd.FAILED, sr.SUPERVISOR_GONE)
        assert leftover.wait(timeout=10) is not None
        record = sr.read_record(record_dir(workspace, RUN_ID))
        assert (record.status, record.error, record.reason) == (rd.FAILED, sr.SUPERVISOR_GONE, None)
        assert rd.read_run(workspace / rd.RUNS_DIRNAME / RUN_ID).status == rd.FAILED
        assert run_ops.stop_run(ws, RUN_ID).status == rd.FAILED  # and again: nothing changes
    finally:
        leftover.kill()


def test_a_checkpoint_manifest_never_makes_the_server_read_or_size_a_host_file_through_a_link(tmp_path):
    """The manifest is the run's: a file it names under a folder the run made a link (or a link
    itself) is missing to the server, never stat-ed or hashed where it leads. Before, the size of
    any host file reached list_checkpoints.unusable, and a matching manifest listed it."""
    import hashlib

    from engine.checkpoint_manifest import MANIFEST, write_manifest

    host = tmp_path / "host"
    host.mkdir()
    (host / "secret").write_bytes(b"s" * 12_345)
    workspace = make_workspace(tmp_path / "ws")
    run_dir = fake_run(workspace, "r1", checkpoints=(2, 4))
    for step, size, digest in ((2, 1, "0" * 64), (4, 12_345, hashlib.sha256(b"s" * 12_345).hexdigest())):
        checkpoint = run_dir / rd.CHECKPOINTS_DIRNAME / run_checkpoints.checkpoint_dir_name(step)
        (checkpoint / "sub").symlink_to(host)
        (checkpoint / "direct").symlink_to(host / "secret")
        write_manifest(checkpoint)
        manifest = json.loads((checkpoint / MANIFEST).read_text())
        manifest["files"] += [{"path": "sub/secret", "bytes": size, "sha256": digest}]
        (checkpoint / MANIFEST).write_text(json.dumps(manifest))
    (run_dir / rd.CHECKPOINTS_DIRNAME / run_checkpoints.checkpoint_dir_name(2) / "sub").unlink()
    (run_dir / rd.CHECKPOINTS_DIRNAME / run_checkpoints.checkpoint_dir_name(2) / "sub").symlink_to(host / "secret")
    listed = run_ops.list_checkpoints(Workspace.open(workspace), "r1")
    assert listed.checkpoints == []
    assert listed.unusable == ["step-00000002: sub/secret is missing", "step-00000004: sub/secret is missing"]
    assert "12,345" not in " ".join(listed.unusable)


@pytest.mark.parametrize("grace", [0, -5, 0.0])
def test_a_record_whose_stop_grace_is_not_above_0_still_warns_before_it_kills(grace):
    """The settings never give a grace of 0 or less; a record edited to hold one gets the
    default, as the supervisor and stop_run always gave it (SIGTERM, then SIGKILL later)."""
    record = sr.ServerRecord(id="r1", limits={"stop_grace_s": grace, "wall_time_s": 5})
    assert record.run_limits().stop_grace_s == 10.0
    assert record.run_limits().wall_time_s == 5


def test_a_run_that_rewrites_its_run_json_changes_no_limit_or_shape_the_server_acts_on(tmp_path):
    """The limits a stop and a wall-time kill use, and the shape a resume copies (processes,
    threads), are the server's record's: a run that rewrites its own run.json (its directory is
    writable in its sandbox) with a zero grace, the host network, no wall time, more processes
    and threads, changes none of them (their writers are declared: engine.run_dir.Owner)."""
    workspace = make_workspace(tmp_path / "ws")
    limits = {"stop_grace_s": 30.0, "network": "isolated", "wall_time_s": 60.0}
    run_dir = fake_run(workspace, RUN_ID, limits=limits, threads_per_process=2)
    forged = rd.read_run(run_dir).model_dump(mode="json")
    forged.update(limits={"stop_grace_s": 0, "network": "shared", "wall_time_s": None}, nproc=8, world_size=8,
                  threads_per_process=64)
    run_files.write_json_atomic(run_dir / rd.RUN_JSON, forged)
    known = sr.known_run(workspace, run_dir)
    assert (known.run_limits().stop_grace_s, known.run_limits().network, known.run_limits().wall_time_s) == \
        (30.0, "isolated", 60.0)
    assert (known.nproc, known.threads_per_process) == (1, 2)
