"""The user's own training script, through a real MCP client: apply skills to it, launch it,
wait for a step, read its metrics, stop it, list its checkpoints and resume it, under torchrun
too; a script that prints no metrics; and bad input, refused with nothing changed on disk.

The script (tests/mcp/scripts/mlp_train.py) is plain PyTorch: its own model, data, optimizer
and loop, one JSON line per step.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest

from engine import run_dir as rd
from engine import run_metrics
from runner import server_record as sr
from workspace.workspace import record_dir
from tests.mcp.conftest import connect, git, head, is_finite_number, run_note
from tests.sandbox.helpers import AUDIT
from tests.support import untimed

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).parent / "scripts" / "mlp_train.py"


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("script-workspace")


@pytest.fixture(scope="module")
def client(workspace):
    with connect("memory", workspace) as session:
        shutil.copyfile(SCRIPT, workspace / "train.py")
        git(workspace, "add", "train.py")
        git(workspace, "commit", "-q", "-m", "a plain training script")
        yield session


def state(workspace: Path) -> tuple[str, str, str]:
    """Every file of the workspace but git's (where an ended run's note may still be written)
    and the audit log, and git's view of HEAD and of the work tree."""
    digest = hashlib.sha256()
    for folder, dirs, files in os.walk(workspace):
        dirs[:] = sorted(d for d in dirs if Path(folder, d) != workspace / ".git")
        for name in sorted(dirs + files):
            path = Path(folder, name)
            if path != workspace / AUDIT:
                digest.update(str(path.relative_to(workspace)).encode() + b"\0")
                digest.update(path.read_bytes() if path.is_file() and not path.is_symlink() else b"")
    return digest.hexdigest(), head(workspace), git(workspace, "status", "--porcelain", "--untracked-files=all")


def run_files(workspace: Path, run_id: str) -> tuple[rd.RunRecord, sr.ServerRecord, str]:
    run_dir = workspace / "runs" / run_id
    return (rd.read_run(run_dir), sr.read_record(record_dir(workspace, run_id)),
            (run_dir / rd.CONSOLE_LOG).read_text())


def test_a_plain_script_gets_two_skills_then_runs_watched_and_stopped(client, workspace):
    for skill in ("loss-guard", "mixed-precision"):
        applied = client.ok("apply_skill", skill=skill, recipe="train.py")
        assert applied["commit"] == head(workspace)
        assert applied["message"].endswith(
            "; launch_run(recipe='train.py') runs the script as it is (docs/script-to-recipe.md)")
        assert f"Skill-Applied: {skill}@" in git(workspace, "log", "-1", "--format=%B")
    commit = head(workspace)

    launched = client.ok("launch_run", recipe="train.py", args=["--steps", "100000", "--sleep", "0.05"])
    run_id = launched["run_id"]
    assert launched["status"] in ("starting", "running") and launched["code"] == f"code at commit {commit[:10]}"
    progress: list = []
    waited = client.ok("wait_run", progress, run_id=run_id, until_step=5, timeout_s=120)
    assert waited["reason"] == "reached_step" and waited["step"] >= 5 and waited["status"] == "running"
    assert progress and all(message.startswith("step ") for _, _, message in progress)

    tail = client.ok("tail_metrics", run_id=run_id, n=3)
    steps = [record["step"] for record in tail["records"]]
    assert steps == sorted(steps) and len(steps) == 3 and steps[-1] >= 5
    assert all(is_finite_number(r["loss"]) and r["world_size"] == 1 for r in tail["records"])
    assert json.loads(client.read_text(f"run://{run_id}/metrics"))  # the resource reads the same file
    picture, mime = client.read_bytes(f"run://{run_id}/loss.png")
    assert mime == "image/png" and picture.startswith(b"\x89PNG")

    info = client.ok("get_run", run_id=run_id)
    assert info["kind"] == "script"
    assert info["started_at"] and info["started_at"] >= info["created_at"]  # the supervisor records a script's start
    stopped = client.ok("stop_run", run_id=run_id)
    assert stopped["status"] == "stopped"
    report, record, console = run_files(workspace, run_id)
    assert record.kind == report.kind == "script" and record.script == "train.py"
    assert record.script_args == ["--steps", "100000", "--sleep", "0.05"]
    assert record.git_commit == commit and record.recipe_dirty is False and record.isolation == "full"
    snapshot = (workspace / "runs" / run_id / rd.SNAPSHOT_DIRNAME / "train.py").read_text()
    assert snapshot == (workspace / "train.py").read_text() and "autocast" in snapshot
    assert '{"step": 1, "loss": ' in console and "[trainwright] isolation: full" in console
    note = run_note(workspace, commit, run_id)
    assert f"run {run_id}: stopped" in note and "script train.py, 1 process(es)" in note


def test_an_uncommitted_script_runs_as_it_is_and_says_so(client, workspace):
    (workspace / "train.py").write_text((workspace / "train.py").read_text() + "\nprint('edited')\n")
    try:
        launched = client.ok("launch_run", recipe="train.py", args=["--steps", "2"])
        info = client.wait_for_run(launched["run_id"])
    finally:
        git(workspace, "checkout", "train.py")
    assert info["status"] == "completed" and info["recipe_dirty"] is True
    assert any("uncommitted changes (train.py)" in w for w in launched["warnings"])
    patch = workspace / info["run_dir"] / rd.SNAPSHOT_DIRNAME / rd.UNCOMMITTED_PATCH
    assert "+print('edited')" in patch.read_text()
    assert "edited" in (workspace / info["run_dir"] / rd.CONSOLE_LOG).read_text()


def test_a_script_that_prints_no_metrics_runs_with_its_console_and_exit_status(client, workspace):
    (workspace / "quiet").mkdir()
    (workspace / "quiet" / "helper.py").write_text("WORDS = 'no metrics here, only words'\n")
    (workspace / "quiet" / "train.py").write_text(  # a folder's script imports its sibling modules
        "import sys\nfrom helper import WORDS\nprint(WORDS, flush=True)\nsys.exit(3)\n")
    git(workspace, "add", "quiet")
    git(workspace, "commit", "-q", "-m", "a quiet script")
    launched = client.ok("launch_run", recipe="quiet")
    info = client.wait_for_run(launched["run_id"])
    assert info["status"] == "failed" and info["exit_code"] == 3 and info["step"] is None
    assert "no metrics here, only words" in info["console_tail"]
    assert info["error"] == "the run's main process exited with status 3; see console.log"
    assert client.ok("tail_metrics", run_id=launched["run_id"])["records"] == []
    record = run_files(workspace, launched["run_id"])[1]
    assert record.script == "train.py" and record.recipe == "quiet"
    assert sorted(p.name for p in (workspace / info["run_dir"] / rd.SNAPSHOT_DIRNAME).iterdir()) == [
        "helper.py", "train.py"]


def test_script_checkpoints_are_listed_and_a_resume_passes_the_path_after_resume_arg(client, workspace):
    launched = client.ok("launch_run", recipe="train.py", args=["--steps", "6", "--save-every", "3"],
                         resume_arg="--resume")
    first = client.wait_for_run(launched["run_id"])
    assert first["status"] == "completed"
    listed = client.ok("list_checkpoints", run_id=first["run_id"])["checkpoints"]
    assert listed == [{"step": s, "path": f"{first['run_dir']}/checkpoints/ckpt_{s}.pt"} for s in (3, 6)]

    resumed = client.ok("resume_checkpoint", run_id=first["run_id"], step=3)
    second = client.wait_for_run(resumed["run_id"])
    assert second["status"] == "completed" and resumed["resumed_from"]["step"] == 3
    record = run_files(workspace, resumed["run_id"])[1]
    checkpoint = str(workspace / first["run_dir"] / "checkpoints" / "ckpt_3.pt")
    assert record.script_args == ["--steps", "6", "--save-every", "3", "--resume", checkpoint]
    assert record.code_from == "checkpoint" and record.kind == "script"
    original = [untimed(r) for r in run_metrics.read_all_metrics(workspace / first["run_dir"] / rd.METRICS_JSONL)]
    continued = [untimed(r) for r in run_metrics.read_all_metrics(workspace / second["run_dir"] / rd.METRICS_JSONL)]
    # The script restores its own state: the continued losses are the original's, bit for bit (the
    # timing stamped on each line differs between runs).
    assert [r["step"] for r in continued] == [4, 5, 6] and continued == original[3:]
    console = (workspace / second["run_dir"] / rd.CONSOLE_LOG).read_text()
    assert f"resumed from {checkpoint} at step 3" in console

    head_resume = client.ok("resume_checkpoint", run_id=first["run_id"], step=6, code="head")
    assert client.wait_for_run(head_resume["run_id"])["status"] == "completed"
    record = run_files(workspace, head_resume["run_id"])[1]
    assert record.code_from == "head" and record.script_args[-2:] == [
        "--resume", str(workspace / first["run_dir"] / "checkpoints" / "ckpt_6.pt")]
    assert client.ok("tail_metrics", run_id=head_resume["run_id"])["records"] == []  # nothing left to train

    for tool, extra in (("export_checkpoint", {"to": "exports/mlp"}), ("sample", {"prompts": ["x"]}), ("evaluate", {})):
        message = refusal(client.error(tool, run_id=first["run_id"], **extra))
        assert message.startswith(f"bad_input: checkpoint ckpt_6.pt of run {first['run_id']} (a script's) is not a "
                                  "Hugging Face model folder (config.json and weights"), (tool, message)
        assert "docs/script-to-recipe.md says how to make the script a recipe" in message


def test_resuming_a_script_run_launched_without_resume_arg_is_refused_saying_how(client, workspace):
    launched = client.ok("launch_run", recipe="train.py", args=["--steps", "3", "--save-every", "3"])
    assert client.wait_for_run(launched["run_id"])["status"] == "completed"
    before = state(workspace)
    message = refusal(client.error("resume_checkpoint", run_id=launched["run_id"]))
    assert message.startswith("bad_input: ") and "launched without resume_arg" in message
    assert 'resume_arg naming its option for a checkpoint path (e.g. "--resume")' in message
    assert state(workspace) == before


def test_a_script_run_resumed_with_new_args_trains_further(client, workspace):
    launched = client.ok("launch_run", recipe="train.py", args=["--steps", "3", "--save-every", "3"],
                         resume_arg="--resume")
    first = client.wait_for_run(launched["run_id"])
    assert first["status"] == "completed"
    before = state(workspace)
    for bad in ("--steps 6", ["--steps", 6]):
        message = refusal(client.error("resume_checkpoint", run_id=first["run_id"], args=bad))
        assert "args" in message and ("list" in message or "string" in message), message
    message = refusal(client.error("resume_checkpoint", run_id=first["run_id"], args=["--steps\n6"]))
    assert message == "bad_input: args[0] holds a control character (NUL, newline, ...); give plain text"
    assert state(workspace) == before
    resumed = client.ok("resume_checkpoint", run_id=first["run_id"], args=["--steps", "6", "--save-every", "3"])
    second = client.wait_for_run(resumed["run_id"])
    assert second["status"] == "completed" and resumed["resumed_from"]["step"] == 3
    checkpoint = str(workspace / first["run_dir"] / "checkpoints" / "ckpt_3.pt")
    assert run_files(workspace, resumed["run_id"])[1].script_args == [
        "--steps", "6", "--save-every", "3", "--resume", checkpoint]
    continued = run_metrics.read_all_metrics(workspace / second["run_dir"] / rd.METRICS_JSONL)
    assert [r["step"] for r in continued] == [4, 5, 6]  # trained further than the run it continues


def test_trainwright_track_records_metrics_and_is_a_no_op_outside_a_run(client, workspace):
    script = ("import trainwright\nfor step in (1, 2):\n"
              "    trainwright.track(step, loss=1.0 / step, note='text is left out', bad=float('nan'))\n")
    (workspace / "tracked.py").write_text(script)
    git(workspace, "add", "tracked.py")
    git(workspace, "commit", "-q", "-m", "a tracked script")
    launched = client.ok("launch_run", recipe="tracked.py")
    assert client.wait_for_run(launched["run_id"])["status"] == "completed"
    records = client.ok("tail_metrics", run_id=launched["run_id"])["records"]
    assert all(isinstance(r["elapsed_s"], float) for r in records)
    assert [untimed(r) for r in records] == [{"step": 1, "loss": 1.0}, {"step": 2, "loss": 0.5}]

    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRAINWRIGHT_RUN_ID"}
    outside = subprocess.run([sys.executable, str(workspace / "tracked.py")], capture_output=True, text=True,
                             env=env, timeout=60)
    assert outside.returncode == 0 and outside.stdout == ""


@pytest.mark.multiprocess
def test_the_same_script_under_torchrun_with_two_processes(client, workspace):
    launched = client.ok("launch_run", recipe="train.py", nproc=2, args=["--steps", "100000", "--sleep", "0.05"])
    run_id = launched["run_id"]
    waited = client.ok("wait_run", run_id=run_id, until_step=3, timeout_s=180)
    assert waited["reason"] == "reached_step", waited
    tail = client.ok("tail_metrics", run_id=run_id, n=3)
    assert all(r["world_size"] == 2 and is_finite_number(r["loss"]) for r in tail["records"])
    assert client.ok("stop_run", run_id=run_id)["status"] == "stopped"
    record = run_files(workspace, run_id)[1]
    assert record.nproc == 2 and "torch.distributed.run" in record.command
    assert record.command[record.command.index("--nproc-per-node") + 1] == "2"


# ---------------------------------------------------------------------------------------------
# Bad input: a clear error, nothing changed on disk
# ---------------------------------------------------------------------------------------------


def _refused(client, workspace: Path, **arguments) -> str:
    before = state(workspace)
    message = client.error("launch_run", **arguments)
    assert state(workspace) == before, f"launch_run({arguments}) changed the workspace"
    return refusal(message)


def refusal(message: str) -> str:
    """A tool error's own message, without the SDK's ``Error executing tool NAME: ``."""
    return message.split(": ", 1)[1] if message.startswith("Error executing tool ") else message


def test_args_that_are_not_a_list_of_strings_are_refused(client, workspace):
    for args in ("--steps 3", ["--steps", 3], {"steps": 3}):
        message = _refused(client, workspace, recipe="train.py", args=args)
        assert "args" in message and ("list" in message or "string" in message), message
    message = _refused(client, workspace, recipe="train.py", args=["--steps\n3"])
    assert message == "bad_input: args[0] holds a control character (NUL, newline, ...); give plain text"
    message = _refused(client, workspace, recipe="train.py", args=["x"] * 65)
    assert message == "bad_input: args holds 65 items; a script takes at most 64"


def test_a_script_outside_the_workspace_or_through_a_link_or_not_python_is_refused(client, workspace, tmp_path):
    outside = tmp_path / "elsewhere.py"
    outside.write_text("print('never runs')\n")
    assert _refused(client, workspace, recipe=str(outside)).startswith("bad_input: ")
    (workspace / "linked.py").symlink_to(workspace / "train.py")
    (workspace / "notes.txt").write_text("not code\n")
    try:
        message = _refused(client, workspace, recipe="linked.py")
        assert message == ("bad_input: the script 'linked.py' is a link or reached through one; give the "
                           "script's real path ('train.py'): a run's snapshot copies files, not links")
        message = _refused(client, workspace, recipe="notes.txt")
        assert message.startswith("bad_input: 'notes.txt' is not a Python script (.py)"), message
    finally:
        (workspace / "linked.py").unlink()
        (workspace / "notes.txt").unlink()


def test_a_folder_that_is_neither_recipe_nor_script_names_both_forms(client, workspace):
    (workspace / "empty_project").mkdir()
    (workspace / "empty_project" / "model.py").write_text("x = 1\n")
    try:
        message = _refused(client, workspace, recipe="empty_project")
    finally:
        shutil.rmtree(workspace / "empty_project")
    assert message == (
        "not_found: 'empty_project' is neither a recipe folder (a recipe.py defining one Engine subclass; "
        "scaffold_recipe makes one) nor a training script (a .py file, or a folder with a train.py): launch_run "
        "takes either; docs/script-to-recipe.md says what only a recipe gives"
    )


def test_recipe_only_options_on_a_script_and_script_options_on_a_recipe_are_refused(client, workspace):
    message = _refused(client, workspace, recipe="train.py", overrides={"train.max_steps": 3})
    assert message == "bad_input: overrides set a recipe's config keys; a script takes its command line as args"
    message = _refused(client, workspace, recipe="train.py", resume_arg="resume")
    assert message.startswith("bad_input: resume_arg must be the script's option that takes a checkpoint path")


def test_describe_recipe_on_a_script_says_what_runs_it_and_where_the_recipe_page_is(client, workspace):
    message = refusal(client.error("describe_recipe", recipe="train.py"))
    assert message == (
        "bad_input: 'train.py' is a training script, not a recipe: it has no config keys to describe. launch_run "
        "runs it as it is (args: its command line); docs/script-to-recipe.md says what a recipe adds (bit-exact "
        "resume, FSDP2 by the engine, export, sample, evaluate)"
    )
    assert (Path(__file__).parents[2] / "docs" / "script-to-recipe.md").is_file()


def test_a_recipe_py_without_an_engine_subclass_points_to_script_runs(client, workspace):
    (workspace / "ported").mkdir()
    (workspace / "ported" / "recipe.py").write_text("print('a script under the wrong name')\n")
    try:
        message = _refused(client, workspace, recipe="ported")
    finally:
        shutil.rmtree(workspace / "ported")
    assert message.startswith("bad_input: ") and "must define exactly one Engine subclass (found: none); " \
        "a plain training script needs no recipe: launch_run runs a .py file (or a folder's train.py) as it is, " \
        "and docs/script-to-recipe.md says what a recipe adds" in message


def test_a_scripts_tensorboard_scalars_are_its_metrics(client, workspace):
    pytest.importorskip("tensorboard")
    script = ("from torch.utils.tensorboard import SummaryWriter\nwriter = SummaryWriter()\n"
              "for step in (1, 2, 3):\n    writer.add_scalar('loss/train', 4.0 / step, step)\nwriter.close()\n")
    (workspace / "tb.py").write_text(script)
    git(workspace, "add", "tb.py")
    git(workspace, "commit", "-q", "-m", "a script that logs to TensorBoard")
    launched = client.ok("launch_run", recipe="tb.py")
    assert client.wait_for_run(launched["run_id"])["status"] == "completed"
    records = client.ok("tail_metrics", run_id=launched["run_id"])["records"]
    assert records == [{"step": 1, "loss_train": 4.0}, {"step": 2, "loss_train": 2.0},
                       {"step": 3, "loss_train": pytest.approx(4 / 3, rel=1e-6)}]
