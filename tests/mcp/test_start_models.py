"""The checkpoints launches start from (``mcp_server.operations.starting_model``), without
training (runs as the engine leaves them):

- one of another kind of model than the recipe loads (``check_family``): a vision-language run in
  a causal-LM recipe, a causal LM in vlm_chat, a script checkpoint of the other family — each
  refused before anything is exported or started, naming the run, its template or architecture
  and what the recipe loads;
- the exports in ``.trainwright/start-models/``: listed with their sizes by ``data-cache``, kept
  while a run in ``runs/`` started from one, pruned when no run uses one past the grace period,
  removable by name when unused."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest

from engine import run_dir as rd
from engine.errors import BadInput
from mcp_server.operations.data_cache import data_cache
from mcp_server.operations.starting_model import (START_MODEL_GRACE_S, check_family, prune_start_models,
                                                  start_models_dir, starting_model)
from recipes_template import __file__ as templates_init
from tests.sandbox.helpers import fake_run, make_workspace
from workspace.workspace import Workspace

TEMPLATES = Path(templates_init).parent


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = make_workspace(tmp_path_factory.mktemp("family") / "ws")  # recipes/lm: causal_lm
    shutil.copytree(TEMPLATES / "vlm_chat", root / "recipes" / "chat", ignore=shutil.ignore_patterns("__pycache__"))
    return root


def recipe_run(workspace: Path, run_id: str, template: str) -> Path:
    run_dir = fake_run(workspace, run_id, recipe=f"recipes/{template}")
    (run_dir / rd.SNAPSHOT_DIRNAME).mkdir(exist_ok=True)
    shutil.copy(TEMPLATES / template / "recipe.py", run_dir / rd.SNAPSHOT_DIRNAME / "recipe.py")
    return run_dir


def script_run(workspace: Path, run_id: str, architecture: str) -> Path:
    run_dir = fake_run(workspace, run_id, kind="script", checkpoints=())
    folder = run_dir / rd.CHECKPOINTS_DIRNAME / "checkpoint-2"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"architectures": [architecture], "model_type": "x"}))
    (folder / "model.safetensors").write_bytes(b"")
    return run_dir


def refusal(workspace: Path, recipe: str, run_dir: Path) -> str:
    with pytest.raises(BadInput) as refused:
        starting_model(Workspace(workspace), workspace / "recipes" / recipe, {"model.pretrained_path": f"run:{run_dir.name}"})
    return str(refused.value)


def test_a_vision_language_run_in_a_causal_lm_recipe_is_refused_naming_both_sides(workspace):
    run = recipe_run(workspace, "20260101-000000-chat-0001", "vlm_chat")
    assert refusal(workspace, "lm", run) == (
        f"model.pretrained_path run:{run.name}: run {run.name} is a run of the vlm_chat template (a vision-language "
        "model (AutoModelForImageTextToText)); the recipe recipes/lm (causal_lm template) loads a causal language "
        "model (AutoModelForCausalLM): start from a run of that kind; nothing was started")
    vlm = recipe_run(workspace, "20260101-000000-vlm-0001", "vlm")
    assert "is a run of the vlm template (the vlm template's own vision-language model" in refusal(workspace, "lm", vlm)
    assert "the recipe recipes/chat (vlm_chat template) loads a vision-language model" in refusal(workspace, "chat", vlm)
    assert not start_models_dir(workspace).exists() or not any(start_models_dir(workspace).iterdir())


def test_a_causal_lm_in_vlm_chat_and_a_script_checkpoint_of_the_other_family_are_refused(workspace):
    text = recipe_run(workspace, "20260101-000000-lm-0002", "sft")
    assert "is a run of the sft template (a causal language model (AutoModelForCausalLM)); the recipe recipes/chat " \
           "(vlm_chat template) loads a vision-language model" in refusal(workspace, "chat", text)
    llava = script_run(workspace, "20260101-000000-train-0003", "LlavaForConditionalGeneration")
    assert (f"run {llava.name} is a script run whose checkpoint checkpoint-2 is a LlavaForConditionalGeneration "
            "(a vision-language model") in refusal(workspace, "lm", llava)
    llama = script_run(workspace, "20260101-000000-train-0004", "LlamaForCausalLM")
    assert "is a script run whose checkpoint checkpoint-2 is a LlamaForCausalLM" in refusal(workspace, "chat", llama)
    # The same kind passes the check (the export and the launch check do the rest).
    check_family(Workspace(workspace), workspace / "recipes" / "lm", llama, 2)
    check_family(Workspace(workspace), workspace / "recipes" / "lm", text, 4)
    check_family(Workspace(workspace), workspace / "recipes" / "chat", llava, 2)
    assert not start_models_dir(workspace).exists() or not any(start_models_dir(workspace).iterdir())


def export(workspace: Path, name: str, size: int, age_s: float = 0) -> Path:
    folder = start_models_dir(workspace) / name
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(b"w" * size)
    (folder / "config.json").write_text("{}")
    then = time.time() - age_s
    os.utime(folder, (then, then))
    return folder


def test_exports_are_listed_kept_while_a_run_uses_them_pruned_and_removed_when_none_does(tmp_path):
    workspace = make_workspace(tmp_path / "ws")
    ws = Workspace(workspace)
    used = export(workspace, "20260101-000000-lm-0001-step-2", 1000, age_s=2 * START_MODEL_GRACE_S)
    fake_run(workspace, "20260101-000000-lm-0002", started_from={"run_id": "20260101-000000-lm-0001", "step": 2,
                                                                   "path": str(used)})
    export(workspace, "20260101-000000-lm-0003-step-4", 500, age_s=2 * START_MODEL_GRACE_S)  # its launch was refused
    recent = export(workspace, "20260101-000000-lm-0004-step-4", 300)  # a launch may be about to name it
    listed = data_cache(ws, [])
    assert listed.removed == {"start-models/20260101-000000-lm-0003-step-4": 502}  # old and no run uses it
    assert listed.start_models == {"start-models/20260101-000000-lm-0001-step-2": 1002,
                                   "start-models/20260101-000000-lm-0004-step-4": 302}
    with pytest.raises(BadInput, match=r"start-models/20260101-000000-lm-0001-step-2 is what run\(s\) "
                                       r"20260101-000000-lm-0002 started from .*nothing was removed"):
        data_cache(ws, ["start-models/20260101-000000-lm-0004-step-4", "start-models/20260101-000000-lm-0001-step-2"])
    assert recent.is_dir() and used.is_dir()
    assert data_cache(ws, ["start-models/20260101-000000-lm-0004-step-4"]).removed == {
        "start-models/20260101-000000-lm-0004-step-4": 302}
    assert not recent.exists()
    shutil.rmtree(workspace / rd.RUNS_DIRNAME / "20260101-000000-lm-0002")  # its run deleted: no longer needed
    assert prune_start_models(ws, keep="20260101-000000-lm-0001-step-2") == []  # the one a launch is exporting
    assert data_cache(ws, ["all"]).removed == {"start-models/20260101-000000-lm-0001-step-2": 1002}
    assert data_cache(ws, []).start_models == {}


def test_an_old_export_a_launch_reuses_is_not_pruned_by_another_launch_before_its_run_names_it(tmp_path):
    """A launch reusing an export older than the grace found it, then another launch's prune (or
    ``data-cache``) removed it before the first launch's run record named it: that run started
    from a folder that was gone."""
    from mcp_server.operations.starting_model import exported_checkpoint

    workspace = make_workspace(tmp_path / "ws")
    ws = Workspace(workspace)
    run_dir = fake_run(workspace, "20260101-000000-lm-0001")
    old = export(workspace, "20260101-000000-lm-0001-step-2", 100, age_s=2 * START_MODEL_GRACE_S)
    assert exported_checkpoint(ws, run_dir, 2) == old  # reused as it is: nothing exported
    assert prune_start_models(ws, keep="20260101-000000-lm-0009-step-1") == []  # another launch's prune
    assert data_cache(ws, []).start_models == {"start-models/20260101-000000-lm-0001-step-2": 102}
    assert old.is_dir()
