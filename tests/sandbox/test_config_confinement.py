"""Confinement on the resolved config: file values are checked after the recipe's config.yaml
and the overrides are merged, and the engine itself refuses a data file that a link leads out to."""

from __future__ import annotations

import os

import pytest

from engine import run_dir as rd
from mcp_server.operations import launch as launching
from workspace import git as workspace_git
from engine.errors import BadInput
from workspace.workspace import Workspace
from tests.sandbox.helpers import make_workspace, run_overrides


@pytest.fixture
def workspace(tmp_path):
    root = make_workspace(tmp_path / "ws")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_text("the secret document " * 50)
    return root, outside


def test_a_path_in_the_recipes_own_config_yaml_is_checked_after_merging(workspace):
    root, outside = workspace
    config = root / "recipes" / "lm" / "config.yaml"
    config.write_text(config.read_text() + f"data:\n  source: files\n  paths: [{outside}]\n")
    workspace_git.commit_paths(workspace_git.open_repo(root), [config], "point the data outside", [])
    # The engine's launch check reads the merged config's data paths, confined: refused there.
    with pytest.raises(BadInput, match="leads outside the workspace"):
        launching.launch_run(Workspace.open(root), "recipes/lm", 1, run_overrides("train.max_steps=2"))
    assert not (root / rd.RUNS_DIRNAME).exists() or not any((root / rd.RUNS_DIRNAME).iterdir())


def test_a_committed_link_in_a_data_folder_that_leads_out_is_refused_with_a_clear_error(workspace):
    root, outside = workspace
    data = root / "data"
    data.mkdir()
    (data / "inside.txt").write_text("an ordinary document " * 50)
    os.symlink(outside / "secret.txt", data / "leak.txt")
    workspace_git.commit_paths(workspace_git.open_repo(root), [data], "data with a link", [])
    ws = Workspace.open(root)
    # The launch check counts the data it would read (the data summary), so the link is found
    # before a run directory exists.
    with pytest.raises(BadInput, match="leads outside the workspace") as refused:
        launching.launch_run(ws, "recipes/lm", 1, run_overrides("train.max_steps=2", "data.source=files", "data.paths=[data]"))
    assert "leak.txt" in str(refused.value)
    assert not (root / rd.RUNS_DIRNAME).exists() or not any((root / rd.RUNS_DIRNAME).iterdir())
