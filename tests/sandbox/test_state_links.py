"""State that cannot be redirected: ``.trainwright/``, ``runs/``, ``recipes/`` and the state files
must be real; a link put there — before the server starts, or swapped in while it serves or
while a scaffold is slow — never makes trainwright write outside the workspace."""

from __future__ import annotations

import os

import pytest

from mcp_server.operations import recipes as recipe_ops
from mcp_server.server import build_server
from workspace.paths import PathRefused
from workspace.workspace import Workspace
from tests.sandbox.helpers import AUDIT, error_text, live_client, make_workspace, tree_hash


@pytest.fixture
def root(tmp_path):
    return make_workspace(tmp_path / "ws")


@pytest.fixture
def outside(tmp_path):
    folder = tmp_path / "outside"
    folder.mkdir()
    (folder / "victim.txt").write_text("must not change\n")
    return folder


def _replace_by_link(path, target):
    if path.exists():
        path.rename(path.with_name(path.name + "-moved"))
    os.symlink(target, path)


@pytest.mark.parametrize("read_only", [False, True])
@pytest.mark.parametrize("folder", [".trainwright", "runs", "recipes"])
def test_a_state_folder_that_is_a_link_is_refused_at_start(root, outside, folder, read_only):
    (root / "runs").mkdir(exist_ok=True)
    _replace_by_link(root / folder, outside)
    before = tree_hash(outside)
    with pytest.raises(PathRefused, match=f"{folder}/ in the workspace is a symbolic link"):
        build_server(root, read_only=read_only)
    assert tree_hash(outside) == before


@pytest.mark.parametrize("name", ["audit.jsonl", "changes.lock", "config.yaml"])
def test_a_state_file_that_is_a_link_is_refused_at_start(root, outside, name):
    path = root / ".trainwright" / name
    path.unlink(missing_ok=True)
    os.symlink(outside / "victim.txt", path)
    with pytest.raises(PathRefused, match="symbolic link"):
        build_server(root, read_only=True)
    assert (outside / "victim.txt").read_text() == "must not change\n"


@pytest.mark.parametrize("read_only", [False, True])
def test_swapping_the_state_folder_after_start_does_not_redirect_the_audit(root, outside, read_only):
    server = build_server(root, read_only=read_only)
    with live_client(server) as client:
        assert not client.call("list_templates").is_error
        _replace_by_link(root / ".trainwright", outside)
        before = tree_hash(outside)
        assert not client.call("list_skills").is_error
    assert tree_hash(outside) == before
    moved = (root / ".trainwright-moved" / AUDIT.name).read_text()
    assert '"tool":"list_skills"' in moved  # written to the folder held from the start


def test_swapping_the_audit_file_for_a_link_is_refused(root, outside):
    with live_client(build_server(root)) as client:
        client.call("list_templates")
        (root / AUDIT).unlink()
        os.symlink(outside / "victim.txt", root / AUDIT)
        result = client.call("list_skills")
        assert result.is_error and "symbolic link" in error_text(result), error_text(result)[:300]
    assert (outside / "victim.txt").read_text() == "must not change\n"


def test_recipes_swapped_for_a_link_during_a_slow_scaffold_receives_nothing(root, outside, monkeypatch):
    real_check = recipe_ops.check_launch

    def slow_check(*args, **kwargs):
        config = real_check(*args, **kwargs)
        _replace_by_link(root / "recipes", outside)  # an agent's own tools, during the check
        return config

    monkeypatch.setattr(recipe_ops, "check_launch", slow_check)
    before = tree_hash(outside)
    with pytest.raises(PathRefused):
        recipe_ops.scaffold_recipe(Workspace.open(root), "causal_lm", "fresh", {"train.max_steps": 5})
    assert tree_hash(outside) == before
    assert not (root / "recipes-moved" / "fresh").exists()
