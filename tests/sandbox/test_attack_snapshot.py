"""A recipe folder the snapshot cannot hold is refused before anything is written: no run
directory is left behind, and the error is the caller's (``bad_input``), not a crash."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

from mcp_server.server import build_server
from tests.sandbox.helpers import AUDIT, error_text, live_client, make_workspace, tree_hash
from tests.support import TEMPLATE


def _deep(root: Path, levels: int) -> None:
    """``root/a/a/.../a/f.py``, ``levels`` folders deep (made relative to descriptors: the path
    is near PATH_MAX)."""
    top = os.open(root, os.O_RDONLY)
    current = top
    for _ in range(levels):
        os.mkdir("a", dir_fd=current)
        below = os.open("a", os.O_RDONLY, dir_fd=current)
        if current != top:
            os.close(current)
        current = below
    os.close(os.open("f.py", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=current))
    os.close(current)
    os.close(top)


def _many(root: Path, count: int) -> None:
    (root / "many").mkdir()
    for i in range(count):
        (root / "many" / f"m{i}.txt").write_text("x")


@pytest.mark.parametrize("shape", ["deep", "many"])
def test_a_recipe_folder_the_snapshot_refuses_leaves_no_run_behind(tmp_path, shape):
    root = make_workspace(tmp_path / "ws")
    recipe = root / "recipes" / "odd"
    shutil.copytree(TEMPLATE, recipe, ignore=shutil.ignore_patterns("__pycache__"))
    if shape == "deep":
        _deep(recipe, 1500)
    else:
        _many(recipe, 2100)
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(10_000)  # this test's own walks (the hash, the clean-up) go 1,500 deep
    try:
        with live_client(build_server(root)) as client:
            # git refreshes its index's stat cache when it looks for uncommitted changes; the empty
            # runs/ folder is the server's state.
            ignored = (AUDIT, Path(".git") / "index", Path("runs"))
            before = tree_hash(root, exclude=ignored)
            result = client.call("launch_run", {"recipe": "recipes/odd", "overrides": {"train.max_steps": 1}})
            message = error_text(result)
            assert result.is_error, message
            assert "bad_input:" in message and "internal" not in message, message
            assert tree_hash(root, exclude=ignored) == before, "a refused launch changed files"
            assert not (root / "runs").exists() or not any((root / "runs").iterdir()), "a run directory was left"
    finally:  # pytest's own clean-up of its temporary folders would not get 1,500 levels down
        shutil.rmtree(root)
        sys.setrecursionlimit(limit)


def test_a_recipe_file_cannot_pose_as_the_record_of_uncommitted_changes(tmp_path):
    """runs/<id>/recipe/uncommitted.patch is what a reviewer reads as the diff a run had: a
    committed file of that name in a clean recipe would be copied there as a fake one."""
    from workspace import git as workspace_git

    root = make_workspace(tmp_path / "ws")
    fake = root / "recipes" / "lm" / "uncommitted.patch"
    fake.write_text("--- a/recipe.py\n+++ b/recipe.py\n@@ -1 +1 @@\n-harmless\n+harmless\n")
    workspace_git.commit_paths(workspace_git.open_repo(root), [fake], "a file named like the record", [])
    with live_client(build_server(root)) as client:
        result = client.call("launch_run", {"recipe": "recipes/lm", "overrides": {"train.max_steps": 1}})
    message = error_text(result)
    assert result.is_error and "bad_input:" in message and "uncommitted.patch" in message, message
    assert not (root / "runs").exists() or not any((root / "runs").iterdir())


@pytest.mark.parametrize("shape", ["linked module", "huge module", "linked config"])
def test_code_the_snapshot_would_leave_out_is_refused_at_launch(tmp_path, shape):
    """The check imports the recipe folder, the run its snapshot: a module the snapshot skips (a
    link, a file over its size cap) was there for the check and missing, or another, in the run."""
    root = make_workspace(tmp_path / "ws")
    recipe = root / "recipes" / "lm"
    (root / "lib").mkdir()
    (root / "lib" / "helper.py").write_text("VALUE = 1\n")
    if shape == "linked module":
        (recipe / "helper.py").symlink_to("../../lib/helper.py")
    elif shape == "huge module":
        (recipe / "helper.py").write_text("VALUE = 1\n" + "#" * (3 * 2**20) + "\n")
    else:
        (root / "lib" / "config.yaml").write_text((recipe / "config.yaml").read_text())
        (recipe / "config.yaml").unlink()
        (recipe / "config.yaml").symlink_to("../../lib/config.yaml")
    with live_client(build_server(root)) as client:
        result = client.call("launch_run", {"recipe": "recipes/lm", "overrides": {"train.max_steps": 1}})
    message = error_text(result)
    assert result.is_error and "bad_input:" in message, message
    assert ("helper.py" if "module" in shape else "config.yaml") in message, message
    assert not (root / "runs").exists() or not any((root / "runs").iterdir())
