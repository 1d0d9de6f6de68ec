"""Train further: a launch of a script whose args name an earlier script run's checkpoint
(``run:RUN_ID@STEP``, or ``run:RUN_ID`` for its latest) gets that checkpoint's path in its place,
read-only in its sandbox, and its record names the run and step it started from; through a real
MCP client. Unknown runs, missing steps, a recipe run's engine checkpoint and two references
are refused before anything runs."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from engine import run_dir as rd
from engine import run_metrics
from tests.mcp.conftest import connect, git
from tests.support import untimed

pytestmark = pytest.mark.slow  # three short script runs

SCRIPT = Path(__file__).parent / "scripts" / "mlp_train.py"


@pytest.fixture(scope="module")
def setting(tmp_path_factory):
    workspace = tmp_path_factory.mktemp("train-further")
    with connect("memory", workspace) as client:
        shutil.copyfile(SCRIPT, workspace / "train.py")
        git(workspace, "add", "train.py")
        git(workspace, "commit", "-q", "-m", "a training script")
        first = client.ok("launch_run", recipe="train.py", args=["--steps", "4", "--save-every", "2"])["run_id"]
        assert client.wait_for_run(first)["status"] == "completed", first
        yield client, workspace, first


def metrics(workspace: Path, run_id: str) -> list[dict]:
    return [untimed(r) for r in run_metrics.read_all_metrics(workspace / rd.RUNS_DIRNAME / run_id / rd.METRICS_JSONL)]


def test_a_launch_from_run_at_step_continues_its_losses_and_names_where_it_started(setting):
    client, workspace, first = setting
    started = client.ok("launch_run", recipe="train.py", args=["--steps", "6", "--resume", f"run:{first}@2"])
    info = client.wait_for_run(started["run_id"])
    assert info["status"] == "completed", info
    # The script loaded step 2's checkpoint: its steps 3 and 4 are the first run's, bit for bit.
    continued = metrics(workspace, started["run_id"])
    assert [r["step"] for r in continued] == [3, 4, 5, 6]
    assert continued[:2] == metrics(workspace, first)[2:]
    checkpoint = f"{rd.RUNS_DIRNAME}/{first}/{rd.CHECKPOINTS_DIRNAME}/ckpt_2.pt"
    assert info["resumed_from"] == {"run_id": first, "step": 2, "path": checkpoint}
    console = (workspace / rd.RUNS_DIRNAME / started["run_id"] / rd.CONSOLE_LOG).read_text()
    assert f"resumed from {workspace / checkpoint} at step 2" in console
    compared = client.ok("compare_runs", run_a=first, run_b=started["run_id"])
    assert f"started from: scratch → run {first} at step 2" in compared["differences"]


def test_run_alone_names_its_latest_checkpoint_as_an_options_value(setting):
    client, workspace, first = setting
    started = client.ok("launch_run", recipe="train.py", args=["--steps", "5", f"--resume=run:{first}"])
    info = client.wait_for_run(started["run_id"])
    assert info["status"] == "completed" and info["resumed_from"]["step"] == 4, info
    assert [r["step"] for r in metrics(workspace, started["run_id"])] == [5]


def test_what_names_no_usable_checkpoint_is_refused_and_starts_nothing(setting):
    client, workspace, first = setting
    runs = sorted(p.name for p in (workspace / rd.RUNS_DIRNAME).iterdir())
    unknown = client.error("launch_run", recipe="train.py", args=["--resume", "run:20990101-000000-nope-0000"])
    assert "not_found: no run '20990101-000000-nope-0000'" in unknown
    missing = client.error("launch_run", recipe="train.py", args=["--resume", f"run:{first}@3"])
    assert f"not_found: run {first} has no complete checkpoint at step 3" in missing
    two = client.error("launch_run", recipe="train.py", args=["--a", f"run:{first}", "--b", f"run:{first}@2"])
    assert "args name 2 runs' checkpoints (run:RUN_ID[@STEP]); a run starts from one" in two
    assert sorted(p.name for p in (workspace / rd.RUNS_DIRNAME).iterdir()) == runs
