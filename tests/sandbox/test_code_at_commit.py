"""``code_at_commit``: a recipe's files as a commit holds them, by the snapshot's rules, in a
temporary folder that is gone afterwards (what ``launch_run(commit=...)`` runs)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from engine.errors import BadInput, NotFound
from workspace.git import GitRefused
from runner.provenance import MAX_SNAPSHOT_FILE_BYTES, code_at_commit


def git(root: Path, *args: str) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t"}
    return subprocess.run(["git", *args], cwd=root, env=env, capture_output=True, text=True, check=True).stdout.strip()


@pytest.fixture
def repo(tmp_path) -> Path:
    git(tmp_path, "init", "-q")
    recipe = tmp_path / "recipes" / "lm"
    (recipe / "lib").mkdir(parents=True)
    (recipe / "recipe.py").write_text("VERSION = 1\n")
    (recipe / "config.yaml").write_text("train:\n  max_steps: 3\n")
    (recipe / "lib" / "helper.py").write_text("X = 1\n")
    git(tmp_path, "add", "-A")
    git(tmp_path, "commit", "-qm", "first")
    return tmp_path


def test_the_files_of_the_commit_not_of_the_folder_now(repo):
    first = git(repo, "rev-parse", "HEAD")
    (repo / "recipes/lm/recipe.py").write_text("VERSION = 2\n")
    git(repo, "commit", "-qam", "second")
    (repo / "recipes/lm/recipe.py").write_text("VERSION = 3  # uncommitted\n")
    with code_at_commit(repo, repo / "recipes/lm", "HEAD^") as (folder, origin):
        assert folder.name == "lm" and not folder.is_relative_to(repo)
        assert (folder / "recipe.py").read_text() == "VERSION = 1\n"
        assert sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()) == [
            "config.yaml", "lib/helper.py", "recipe.py"]
        assert (origin.git_commit, origin.recipe_dirty, origin.patch) == (first, False, "")
    assert not folder.parent.exists()  # removed afterwards


def test_links_and_large_files_are_left_out_as_a_snapshot_leaves_them(repo):
    recipe = repo / "recipes/lm"
    os.symlink("/etc", recipe / "data")
    (recipe / "weights.bin").write_bytes(b"\0" * (MAX_SNAPSHOT_FILE_BYTES + 1))
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "data")
    with code_at_commit(repo, recipe, "HEAD") as (folder, _):
        assert not os.path.lexists(folder / "data") and not (folder / "weights.bin").exists()
        assert (folder / "recipe.py").is_file()


def test_a_linked_code_file_is_refused(repo):
    os.symlink("/etc/passwd", repo / "recipes/lm/secrets.py")
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "link")
    with pytest.raises(BadInput, match="secrets.py in the recipe at commit .* is a link or larger than 2 MiB"):
        with code_at_commit(repo, repo / "recipes/lm", "HEAD"):
            pass


def test_a_revision_is_never_an_option_and_an_unknown_one_is_not_found(repo):
    for rev in ("--output=/tmp/x", "", "HEAD\n"):
        with pytest.raises(GitRefused, match="commit must be a commit id or revision"):
            with code_at_commit(repo, repo / "recipes/lm", rev):
                pass
    with pytest.raises(NotFound, match="no commit 'nope' in the workspace's repository"):
        with code_at_commit(repo, repo / "recipes/lm", "nope"):
            pass
    (repo / "other").mkdir()
    (repo / "other" / "recipe.py").write_text("")
    with pytest.raises(NotFound, match="holds no recipe at 'other'"):
        with code_at_commit(repo, repo / "other", "HEAD"):
            pass
