"""Attack: a script run writes its own checkpoints, and the server reads the ``config.json`` of
one when a launch starts from it (``check_family``). A run's link there must not make the server
read a file outside the run, nor its size the server's memory."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from engine import run_dir as rd
from engine.errors import BadInput
from mcp_server.operations.starting_model import check_family
from tests.sandbox.helpers import fake_run, make_workspace
from workspace.workspace import Workspace

LLAVA = json.dumps({"architectures": ["LlavaForConditionalGeneration"], "model_type": "llava"})


def script_checkpoint(tmp_path: Path) -> tuple[Path, Path, Path]:
    workspace = make_workspace(tmp_path / "ws")  # recipes/lm: causal_lm
    run_dir = fake_run(workspace, "20260101-000000-train-0001", kind="script", checkpoints=())
    folder = run_dir / rd.CHECKPOINTS_DIRNAME / "checkpoint-2"
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(b"")
    return workspace, run_dir, folder


def test_a_checkpoints_config_linked_out_of_the_run_is_not_read_by_the_server(tmp_path):
    """The server followed a config.json the run linked to a file of its choosing outside the run
    (here one that names a vision-language model: the launch was refused by what it held)."""
    workspace, run_dir, folder = script_checkpoint(tmp_path)
    (tmp_path / "elsewhere.json").write_text(LLAVA)
    (folder / "config.json").symlink_to(tmp_path / "elsewhere.json")
    check_family(Workspace(workspace), workspace / "recipes" / "lm", run_dir, 2)  # not read: left to the launch check


def test_a_checkpoints_config_over_the_bound_is_not_read_whole_by_the_server(tmp_path):
    """read_text read a config.json of any size into the server's memory."""
    workspace, run_dir, folder = script_checkpoint(tmp_path)
    (folder / "config.json").write_text(LLAVA[:-1] + ', "padding": "' + "x" * (5 << 20) + '"}')
    check_family(Workspace(workspace), workspace / "recipes" / "lm", run_dir, 2)  # over 4 MiB: left to the launch check
    shutil.rmtree(folder)
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"")
    (folder / "config.json").write_text(LLAVA)  # a small one is read: refused naming it
    with pytest.raises(BadInput, match="checkpoint-2 is a LlavaForConditionalGeneration"):
        check_family(Workspace(workspace), workspace / "recipes" / "lm", run_dir, 2)



def test_a_checkpoints_config_nested_past_what_json_decodes_is_left_to_the_launch_check(tmp_path):
    """json.loads raised RecursionError on a config.json the run nested 100,000 deep (under the
    4 MiB bound): the launch failed as a trainwright bug instead of leaving it to the launch check."""
    workspace, run_dir, folder = script_checkpoint(tmp_path)
    (folder / "config.json").write_text("[" * 100_000)
    check_family(Workspace(workspace), workspace / "recipes" / "lm", run_dir, 2)  # not JSON it can read: left
