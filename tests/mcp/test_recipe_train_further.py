"""A recipe launch from an earlier run's checkpoint: ``model.pretrained_path: run:RUN_ID@STEP``
(or ``run:RUN_ID``, its latest), in an override or in the recipe's config.yaml. The server
exports that checkpoint once as a Hugging Face folder where no run writes, the run's sandbox
shows it read-only, and the run's record names the run and step it started from; through a real
MCP client. Unknown runs, missing steps and a reference that is not alone are refused before
anything runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine import run_dir as rd
from engine import run_metrics
from engine.errors import BadInput
from mcp_server.operations.starting_model import START_MODELS_DIRNAME, starting_model
from runner import server_record as sr
from tests.mcp.conftest import connect, tiny_config
from tests.sandbox.helpers import fake_run, make_workspace
from workspace.workspace import STATE_DIRNAME, Workspace, record_dir

pytestmark = pytest.mark.slow  # two short runs and one export

DATA = {"data.paths": ["data/docs.jsonl"], "data.eval_fraction": 0.25}


@pytest.fixture(scope="module")
def setting(tmp_path_factory):
    workspace = make_workspace(tmp_path_factory.mktemp("recipe-further") / "ws")  # recipes/lm: the template
    (workspace / "data").mkdir()
    lines = [json.dumps({"text": f"def f{i}(x):\n    return x * {i} + {i * i}  # line {i}\n"}) for i in range(40)]
    (workspace / "data" / "docs.jsonl").write_text("\n".join(lines) + "\n")
    with connect("memory", workspace) as client:
        first = client.ok("launch_run", recipe="lm", overrides=tiny_config(
            **DATA, **{"train.max_steps": 2, "checkpoint.every": 2, "train.eval_every": 2}))["run_id"]
        assert client.wait_for_run(first)["status"] == "completed", first
        yield client, workspace, first


def metrics(workspace: Path, run_id: str) -> list[dict]:
    return run_metrics.read_all_metrics(workspace / rd.RUNS_DIRNAME / run_id / rd.METRICS_JSONL)


def eval_losses(workspace: Path, run_id: str) -> dict[int, float]:
    return {r["step"]: r["eval_loss"] for r in metrics(workspace, run_id) if "eval_loss" in r}


def test_a_launch_from_run_at_step_starts_from_its_weights_and_names_where_it_started(setting):
    client, workspace, first = setting
    # A learning rate too small to move a float32 weight: after its one step the model is the
    # first run's at step 2, so its evaluation on the same held-out documents is that run's.
    started = client.ok("launch_run", recipe="lm", overrides=tiny_config(
        **DATA, **{"model.pretrained_path": f"run:{first}@2", "train.max_steps": 1, "train.eval_every": 1,
                   "optim.lr": 1e-30}))
    info = client.wait_for_run(started["run_id"])
    assert info["status"] == "completed", info
    assert eval_losses(workspace, started["run_id"])[1] == pytest.approx(eval_losses(workspace, first)[2], rel=1e-6)
    assert [r["step"] for r in metrics(workspace, started["run_id"]) if "loss" in r] == [1]  # its own steps
    folder = f"{STATE_DIRNAME}/{START_MODELS_DIRNAME}/{first}-step-2"
    assert started["resumed_from"] == info["resumed_from"] == {"run_id": first, "step": 2, "path": folder}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in (workspace / folder).iterdir()}
    record = sr.read_record(record_dir(workspace, started["run_id"]))
    assert record.resumed_from is None and record.started_from is not None  # nothing of the run is resumed
    assert record.config["model"]["pretrained_path"] == str(workspace / folder)
    assert str(workspace / folder) in record.sandbox.read_only and str(workspace / folder) not in record.sandbox.writable
    compared = client.ok("compare_runs", run_a=first, run_b=started["run_id"])
    assert f"started from: scratch → run {first} at step 2" in compared["differences"]
    # Its own checkpoint's model is rebuilt from that folder too, shown to the model process.
    sampled = client.ok("sample", run_id=started["run_id"], prompts=["def "], max_new_tokens=2)
    assert sampled["step"] == 1 and sampled["samples"][0]["new_tokens"] >= 1


def test_the_recipes_config_file_may_name_the_latest_checkpoint_and_its_export_is_reused(setting):
    client, workspace, first = setting
    recipe = workspace / "recipes" / "lm"
    (recipe / "config.yaml").write_text((recipe / "config.yaml").read_text() + f"model:\n  pretrained_path: run:{first}\n")
    folder = workspace / STATE_DIRNAME / START_MODELS_DIRNAME / f"{first}-step-2"
    starting_model(Workspace(workspace), recipe, {})  # exported here, unless the test above did
    written = (folder / "model.safetensors").stat().st_mtime_ns
    progress: list = []
    overrides, started = starting_model(Workspace(workspace), recipe, {"train.max_steps": 3},
                                        lambda *args: progress.append(args))
    assert overrides == {"train.max_steps": 3, "model.pretrained_path": str(folder)}
    assert started == rd.ResumedFrom(run_id=first, step=2, path=str(folder))
    assert progress == [] and (folder / "model.safetensors").stat().st_mtime_ns == written  # not exported again


def test_what_names_no_usable_checkpoint_is_refused_and_starts_nothing(setting):
    client, workspace, first = setting
    runs = sorted(p.name for p in (workspace / rd.RUNS_DIRNAME).iterdir())
    exported = start_models(workspace)
    unknown = client.error("launch_run", recipe="lm", overrides={"model.pretrained_path": "run:20990101-000000-nope-0000"})
    assert "not_found: no run '20990101-000000-nope-0000'" in unknown
    missing = client.error("launch_run", recipe="lm", overrides={"model.pretrained_path": f"run:{first}@3"})
    assert f"not_found: run {first} has no complete checkpoint at step 3" in missing
    option = client.error("launch_run", recipe="lm", overrides={"model.pretrained_path": f"--init=run:{first}"})
    assert "name an earlier run's checkpoint as run:RUN_ID or run:RUN_ID@STEP, alone" in option
    script = fake_run(workspace, "20260101-000000-train-0001", kind="script", checkpoints=())
    (script / rd.CHECKPOINTS_DIRNAME).mkdir(exist_ok=True)
    (script / rd.CHECKPOINTS_DIRNAME / "ckpt_2.pt").write_bytes(b"not a model folder")
    runs.append(script.name)
    foreign = client.error("launch_run", recipe="lm", overrides={"model.pretrained_path": f"run:{script.name}@2"})
    assert (f"bad_input: checkpoint ckpt_2.pt of run {script.name} (a script's) is not a Hugging Face model folder "
            "(config.json and weights, or a peft adapter_config.json)") in foreign
    assert sorted(p.name for p in (workspace / rd.RUNS_DIRNAME).iterdir()) == sorted(runs)
    with pytest.raises(BadInput, match="a SLURM job's nodes are not shown an earlier run's checkpoint; "
                                       "export_checkpoint it to a workspace folder"):
        starting_model(Workspace(workspace), workspace / "recipes" / "lm", {"model.pretrained_path": f"run:{first}"},
                       local=False)
    assert start_models(workspace) == exported  # nothing exported, nothing left half-written


def start_models(workspace: Path) -> list[str]:
    folder = workspace / STATE_DIRNAME / START_MODELS_DIRNAME
    return sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []
