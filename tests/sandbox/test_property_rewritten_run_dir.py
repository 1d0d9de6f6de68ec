"""A property of every tool: recipe code may rewrite its run directory in any way (every field of
run.json with any type and value, garbage, links to host files, FIFOs, folders in place of
files, links among its checkpoints) while it trains, and then

- no tool fails as ``internal`` (only errors of the one family: bad_input, not_found);
- no process outside the run is signalled (a bystander lives; the run's own processes end on
  stop_run);
- no host file is read (a secret file the links point at never shows in any result);
- the git note and ``review`` show the server's values (its commit, recipe and provenance).

The run's processes are stand-ins (``sleep``), its server record is written as the launcher
writes it; the sandboxed model process and the launch check are replaced by refusals (they
start no recipe code here), so each example takes well under a second.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
from pathlib import Path
from typing import Any

import anyio
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine import run_dir as rd
from engine import run_checkpoints
from engine.checkpoint_manifest import write_manifest
from runner import server_record as sr
from workspace.workspace import record_dir
from engine.errors import TrainwrightError
from mcp_server.operations import model_tools, recipe_info, review, waiting
from mcp_server.operations import launch as launching
from mcp_server.operations import runs as run_ops
from workspace import git as workspace_git
from runner import lifecycle as run_lifecycle
from runner.model_process import ModelProcessFailed
from engine.run_dir import pid_alive as alive
from runner.processes import RUN_ID_VARIABLE
from runner.supervise import Supervisor
from workspace.workspace import Workspace
from tests.sandbox.helpers import make_workspace

SECRET = f"HOST-SECRET-{secrets.token_hex(8)}"

JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-2**70, max_value=2**70) | st.floats()
    | st.text(max_size=40) | st.sampled_from(["$BYSTANDER", "$SERVER", "-F$SECRET", "--user=root", "\x1b]52;c;eA==\x07"]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)
# Values of the right type for the fields the server would act on, so that the rewritten file
# often is a valid run record.
FORGED = st.fixed_dictionaries({}, optional={
    "pid": st.sampled_from([None, -1, 0, 1, "$BYSTANDER", "$SERVER"]),
    "child_pgid": st.sampled_from([None, -1, 0, 1, "$BYSTANDER", "$SERVER"]),
    "engine_pid": st.sampled_from([None, 1, "$BYSTANDER"]),
    "status": st.sampled_from(["starting", "running", "completed", "failed", "stopped"]),
    "target": st.sampled_from(["local", "slurm"]),
    "slurm_job_id": st.sampled_from([None, "--user=root", "123", "-j 1"]),
    "git_commit": st.sampled_from([None, "-F$SECRET", "--output=/tmp/x", "0" * 40]),
    "workspace": st.sampled_from([None, "/", "$SECRET"]),
    "recipe": st.sampled_from(["forged", "../../etc", "recipes/lm\nrun x: completed"]),
    "recipe_dirty": st.booleans(), "dirty_files": st.lists(st.sampled_from(["forged.py", "$SECRET"]), max_size=2),
    "isolation": st.sampled_from(["none", "partial", "full"]), "isolation_note": st.just("forged isolation"),
    "resumed_from": st.sampled_from([None, {"run_id": "../x", "step": 1, "path": "$SECRET"}]),
    "snapshot_digest": st.sampled_from([None, "0" * 64]),
    "limits": st.sampled_from([{}, {"stop_grace_s": 10**9}, {"stop_grace_s": "x"}]),
    "warnings": st.lists(st.text(max_size=30), max_size=3),
    "metrics_destinations": st.sampled_from([[], [{"kind": "mlflow", "location": "$SECRET"}]]),
})
RUN_JSON = st.one_of(
    st.tuples(st.just("forged"), FORGED, st.dictionaries(st.sampled_from(sorted(rd.RunRecord.model_fields)), JSON_VALUES,
                                                         max_size=6)),
    st.tuples(st.sampled_from(["garbage", "link", "fifo", "folder", "missing", "huge-nesting"]), st.just({}), st.just({})),
)
PLANTS = st.lists(st.sampled_from([
    "metrics-link", "metrics-fifo", "metrics-garbage", "console-link", "console-fifo", "console-escapes",
    "checkpoints-link", "step-link", "metadata-link", "snapshot-link", "lock-fifo", "lock-link",
]), unique=True, max_size=6)


@pytest.fixture(scope="module")
def setting(tmp_path_factory):
    root = tmp_path_factory.mktemp("prop")
    workspace = make_workspace(root / "ws")
    repo = workspace_git.open_repo(workspace)
    (workspace / "recipes" / "lm" / "NOTES.md").write_text("tuned\n")
    head = workspace_git.commit_paths(repo, [workspace / "recipes" / "lm" / "NOTES.md"], "tune",
                                    [(workspace_git.TOOL_TRAILER, "apply_skill")])
    secret = root / "secret.txt"
    secret.write_text(SECRET + "\n")
    (root / "host-dir").mkdir()
    (root / "host-dir" / run_checkpoints.DCP_METADATA).write_text(SECRET)
    return workspace, head, secret


def _sleeper(env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen(["sleep", "600"], start_new_session=True, env=env, stdin=subprocess.DEVNULL)


def _substitute(value: Any, names: dict[str, Any]) -> Any:
    if isinstance(value, str):
        if value in names:
            return names[value]
        for key, text in names.items():
            if isinstance(text, str):
                value = value.replace(key, text)
        return value
    if isinstance(value, list):
        return [_substitute(v, names) for v in value]
    if isinstance(value, dict):
        return {str(_substitute(k, names)): _substitute(v, names) for k, v in value.items()}
    return value


def _plant_run_json(run_dir: Path, kind: str, forged: dict, random_fields: dict, names: dict, secret: Path) -> None:
    path = run_dir / rd.RUN_JSON
    current = json.loads(path.read_text())
    path.unlink()
    if kind == "forged":
        data = {**current, **_substitute(forged, names), **_substitute(random_fields, names)}
        path.write_text(json.dumps(data, default=str))
    elif kind == "garbage":
        path.write_bytes(b"\x00\xff{not json" + SECRET.encode())
    elif kind == "link":
        path.symlink_to(secret)
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "folder":
        path.mkdir()
    elif kind == "huge-nesting":
        path.write_text("[" * 100_000 + "]" * 100_000)


def _plant(run_dir: Path, plants: list[str], secret: Path) -> None:
    host_dir = secret.parent / "host-dir"
    for plant in plants:
        what, _, how = plant.partition("-")
        if what in ("metrics", "console"):
            path = run_dir / (rd.METRICS_JSONL if what == "metrics" else rd.CONSOLE_LOG)
            path.unlink(missing_ok=True)
            if how == "link":
                path.symlink_to(secret)
            elif how == "fifo":
                os.mkfifo(path)
            elif how == "garbage":
                path.write_text('{"step": "x"}\n{"step": 10, "loss": "nan", "\\u001b[2J": 1}\n[1,2]\n' + "{" * 50 + "\n")
            else:
                path.write_text("line \x1b]0;title\x07\x1b[2J\r\n")
        elif plant == "checkpoints-link":
            checkpoints = run_dir / rd.CHECKPOINTS_DIRNAME
            os.rename(checkpoints, run_dir / "kept-checkpoints")
            checkpoints.symlink_to(host_dir)
        elif plant == "step-link":
            target = run_dir / rd.CHECKPOINTS_DIRNAME / run_checkpoints.checkpoint_dir_name(99)
            if (run_dir / rd.CHECKPOINTS_DIRNAME).is_dir() and not (run_dir / rd.CHECKPOINTS_DIRNAME).is_symlink():
                target.symlink_to(host_dir)
        elif plant == "metadata-link":
            step = run_dir / rd.CHECKPOINTS_DIRNAME / run_checkpoints.checkpoint_dir_name(98)
            if (run_dir / rd.CHECKPOINTS_DIRNAME).is_dir() and not (run_dir / rd.CHECKPOINTS_DIRNAME).is_symlink():
                step.mkdir()
                (step / run_checkpoints.DCP_METADATA).symlink_to(secret)
        elif plant == "snapshot-link":
            snapshot = run_dir / rd.SNAPSHOT_DIRNAME
            os.rename(snapshot, run_dir / "kept-snapshot")
            snapshot.symlink_to(host_dir)
        elif plant.startswith("lock"):
            lock = run_dir / ".run.json.lock"
            lock.unlink(missing_ok=True)
            os.mkfifo(lock) if how == "fifo" else lock.symlink_to(secret)


def _new_run(workspace: Path, head: str, supervisor: subprocess.Popen) -> tuple[str, Path]:
    run_id = f"20260101-000000-prop-{secrets.token_hex(4)}"
    run_dir = workspace / rd.RUNS_DIRNAME / run_id
    record = sr.ServerRecord(
        id=run_id, recipe="recipes/lm", git_commit=head, recipe_dirty=False, status=rd.RUNNING,
        nproc=1, world_size=1, created_at=rd.utc_now(), workspace=str(workspace), run_dir=str(run_dir),
        config={"train": {"max_steps": 4}}, isolation="full", isolation_note="bubblewrap", limits={"stop_grace_s": 1},
        pid=supervisor.pid, supervisor=sr.identify(supervisor.pid),
    )
    rd.create_run(run_dir, rd.RunRecord.model_validate(record.model_dump()))
    sr.create_record(record_dir(workspace, run_id), record)
    (run_dir / rd.SNAPSHOT_DIRNAME).mkdir()
    (run_dir / rd.SNAPSHOT_DIRNAME / "recipe.py").write_text("# the code that ran\n")
    checkpoint = run_dir / rd.CHECKPOINTS_DIRNAME / run_checkpoints.checkpoint_dir_name(2)
    checkpoint.mkdir()
    (checkpoint / run_checkpoints.DCP_METADATA).write_bytes(b"")
    write_manifest(checkpoint)
    (run_dir / rd.METRICS_JSONL).write_text('{"step": 1, "loss": 2.5}\n{"step": 2, "loss": 2.0}\n')
    (run_dir / rd.CONSOLE_LOG).write_text("step 2\n")
    return run_id, run_dir


def _call_every_tool(ws: Workspace, run_id: str) -> list[str]:
    """Every tool on the run; returns what they returned and the error messages."""
    shown: list[str] = []
    calls = [
        lambda: run_ops.get_run(ws, run_id),
        lambda: run_ops.list_runs(ws),
        lambda: run_ops.tail_metrics(ws, run_id),
        lambda: run_ops.tail_metrics(ws, run_id, follow_resumes=True),
        lambda: run_ops.list_checkpoints(ws, run_id),
        lambda: anyio.run(waiting.wait_run, ws, run_id, None, 0.05),
        lambda: review.review(ws),
        lambda: recipe_info.list_recipes(ws),
        lambda: launching.resume_checkpoint(ws, run_id),
        lambda: launching.resume_checkpoint(ws, run_id, code="head"),
        lambda: model_tools.export_checkpoint(ws, run_id, f"exports/{secrets.token_hex(4)}"),
        lambda: model_tools.sample(ws, run_id, ["hello"]),
        lambda: model_tools.evaluate(ws, run_id),
    ]
    for call in calls:
        try:
            result = call()
        except TrainwrightError as e:
            shown.append(f"{e.kind}: {e}")
            continue
        shown.append(result.model_dump_json())
    return shown


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(run_json=RUN_JSON, plants=PLANTS)
def test_a_run_that_rewrites_its_run_directory_cannot_steer_any_tool(setting, monkeypatch, run_json, plants):
    workspace, head, secret = setting

    def refused(*args, **kwargs):
        raise run_lifecycle.LaunchRefused("no launch check in this test")

    def no_model(*args, **kwargs):
        raise ModelProcessFailed("no model process in this test")

    monkeypatch.setattr(run_lifecycle, "check_launch", refused)
    monkeypatch.setattr(model_tools, "run_model_io", no_model)
    bystander = _sleeper()
    supervisor = _sleeper()
    try:
        run_id, run_dir = _new_run(workspace, head, supervisor)
        helper = _sleeper({**os.environ, RUN_ID_VARIABLE: run_id})  # one of the run's own processes
        names = {"$BYSTANDER": bystander.pid, "$SERVER": os.getpid(), "$SECRET": str(secret)}
        kind, forged, random_fields = run_json
        _plant_run_json(run_dir, kind, forged, random_fields, names, secret)
        _plant(run_dir, plants, secret)
        ws = Workspace.open(workspace)

        shown = _call_every_tool(ws, run_id)
        # The git note and the review: the server's values.
        Supervisor(ws.record_dir(run_id)).write_git_note(sr.read_record(ws.record_dir(run_id)))
        note = workspace_git.open_repo(workspace).git.notes(f"--ref={workspace_git.NOTES_REF}", "show", head)
        line = next(x for x in note.splitlines() if x.startswith(f"run {run_id}:"))
        assert "recipe recipes/lm" in line and f"commit {head[:10]}" in line and "forged" not in line
        runs = [r for c in review.review(ws).commits if c.sha == head for r in c.runs if r.run_id == run_id]
        assert len(runs) == 1 and "uncommitted" not in runs[0].code and head[:10] in runs[0].code

        stopped = run_ops.stop_run(ws, run_id)
        shown.append(stopped.model_dump_json())
        assert stopped.status == rd.STOPPED
        helper.wait(timeout=20)  # the run's process ended
        assert not alive(supervisor.pid) or supervisor.wait(timeout=20) is not None
        assert bystander.poll() is None and os.getpid() > 0  # nothing outside the run was signalled
        assert all(SECRET not in text for text in [*shown, note])
        assert sr.read_record(ws.record_dir(run_id)).git_commit == head
    finally:
        for process in (bystander, supervisor):
            process.kill()
            process.wait()
