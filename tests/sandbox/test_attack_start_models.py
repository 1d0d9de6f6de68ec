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


@pytest.fixture(autouse=True)
def _deep_folders_removed(tmp_path):
    """What a failing test leaves nested past the recursion limit would fail pytest's own cleanup."""
    yield
    import subprocess

    subprocess.run(["rm", "-rf", "--", str(tmp_path)], check=False)


def nest(parent: Path, depth: int) -> None:
    """Folders ``depth`` deep under ``parent``, made a name at a time as a run's code can."""
    import os

    fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY)
    for _ in range(depth):
        os.mkdir("d", dir_fd=fd)
        inner = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
        os.close(fd)
        fd = inner
    os.close(fd)


def test_an_export_nested_past_the_recursion_limit_is_refused_removed_and_stops_no_later_launch(tmp_path, monkeypatch):
    """The recipe's export code nested its staging folder 1,500 deep: check_written's fwalk and
    the staging folder's rmtree raised RecursionError, the folder stayed in start-models/, and from
    then on every launch that starts from a checkpoint, and ``trainwright data-cache``, failed in
    start_models' rglob (RecursionError) until someone removed it by hand."""
    import os
    import time

    from mcp_server.operations import starting_model as sm
    from runner.model_process import ModelProcessFailed

    workspace = make_workspace(tmp_path / "ws")
    ws = Workspace(workspace)
    run_dir = fake_run(workspace, "20260101-000000-lm-0001")

    def hostile_export(root, run, verb, step, args, *rest, **kw):
        nest(Path(args[args.index("--to") + 1]), 1500)

    monkeypatch.setattr(sm, "run_model_io", hostile_export)
    with pytest.raises((ModelProcessFailed, BadInput)):
        sm.exported_checkpoint(ws, run_dir, 2)
    assert list(sm.start_models_dir(workspace).iterdir()) == []  # the staging folder removed
    left = sm.start_models_dir(workspace) / "20260101-000000-lm-0009-step-1"  # as an earlier crash left one
    left.mkdir()
    nest(left, 1500)
    assert [name for name, _, _ in sm.start_models(ws)] == [left.name]
    then = time.time() - 2 * sm.START_MODEL_GRACE_S
    os.utime(left, (then, then))
    assert sm.prune_start_models(ws) == [(left.name, 0)]
    assert not left.exists()


def test_an_export_to_the_workspace_nested_past_the_recursion_limit_is_refused_and_removed(tmp_path, monkeypatch):
    """export_checkpoint's staging folder, nested 1,500 deep by the recipe's export code, raised
    RecursionError in check_written and again in its rmtree: the folder stayed in the workspace."""
    from mcp_server.operations import model_tools
    from runner.model_process import ModelProcessFailed

    workspace = make_workspace(tmp_path / "ws")
    run_dir = fake_run(workspace, "20260101-000000-lm-0001")
    shutil.copytree(workspace / "recipes" / "lm", run_dir / rd.SNAPSHOT_DIRNAME)
    monkeypatch.setattr(model_tools, "run_model_io",
                        lambda root, run, verb, step, args, *rest, **kw: nest(Path(args[args.index("--to") + 1]), 1500))
    (workspace / "out").mkdir()
    with pytest.raises(ModelProcessFailed, match="nests folders too deep"):
        model_tools.export_checkpoint(Workspace(workspace), "20260101-000000-lm-0001", "out/model", step=2)
    assert list((workspace / "out").iterdir()) == []
