"""Git in the workspace: which repository holds the commits, and what a commit contains."""

from __future__ import annotations

import subprocess
from pathlib import Path

import git
import pytest

from workspace import git as workspace_git


def run_git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout


@pytest.fixture
def parent(tmp_path):
    run_git(tmp_path, "init", "-q")
    (tmp_path / ".gitignore").write_text("ignored/\n")
    run_git(tmp_path, "add", ".gitignore")
    run_git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "init")
    return tmp_path


def test_a_fresh_folder_gets_its_own_repository_with_runs_ignored(tmp_path):
    repo = workspace_git.ensure_repo(tmp_path)
    assert Path(repo.working_tree_dir) == tmp_path
    assert "runs/" in (tmp_path / ".gitignore").read_text()
    assert repo.head.commit.message.startswith("trainwright: initialise workspace")


def test_a_subfolder_tracked_by_an_enclosing_repository_uses_it(parent):
    workspace = parent / "project"
    workspace.mkdir()
    repo = workspace_git.ensure_repo(workspace)
    assert Path(repo.working_tree_dir) == parent
    assert not (workspace / ".git").exists()


def test_a_subfolder_its_enclosing_repository_ignores_gets_its_own(parent):
    workspace = parent / "ignored" / "ws"
    workspace.mkdir(parents=True)
    assert workspace_git.open_repo(workspace) is None
    repo = workspace_git.ensure_repo(workspace)
    assert Path(repo.working_tree_dir) == workspace


def test_commit_paths_commits_only_those_paths_and_keeps_other_staged_work(tmp_path):
    repo = workspace_git.ensure_repo(tmp_path)
    (tmp_path / "mine.py").write_text("x = 1\n")
    (tmp_path / "theirs.py").write_text("y = 2\n")
    run_git(tmp_path, "add", "theirs.py")
    sha = workspace_git.commit_paths(repo, [tmp_path / "mine.py"], "add mine", [("Trainwright-Tool", "test")])
    assert run_git(tmp_path, "show", "--name-only", "--format=", sha).split() == ["mine.py"]
    assert "A  theirs.py" in run_git(tmp_path, "status", "--porcelain")
    assert run_git(tmp_path, "log", "-1", "--format=%(trailers:key=Trainwright-Tool,valueonly)").strip() == "test"
    assert git.Repo(tmp_path).head.commit.author.name == workspace_git.AGENT_NAME


def test_require_clean_names_the_uncommitted_files(tmp_path):
    repo = workspace_git.ensure_repo(tmp_path)
    recipe = tmp_path / "recipes" / "lm"
    recipe.mkdir(parents=True)
    (recipe / "recipe.py").write_text("x = 1\n")
    with pytest.raises(workspace_git.GitRefused, match=r"recipes/lm has uncommitted changes \(recipes/lm/recipe.py\)"):
        workspace_git.require_clean(repo, recipe, "recipes/lm")
    workspace_git.commit_paths(repo, [recipe], "add", [])
    workspace_git.require_clean(repo, recipe, "recipes/lm")


def test_notes_append_one_line_per_run(tmp_path):
    repo = workspace_git.ensure_repo(tmp_path)
    sha = repo.head.commit.hexsha
    assert workspace_git.add_note(tmp_path, sha, "run a: completed")
    assert workspace_git.add_note(tmp_path, sha, "run b: failed")
    assert workspace_git.note(repo, sha).splitlines() == ["run a: completed", "", "run b: failed"]


def test_notes_of_runs_that_end_together_are_all_kept(tmp_path):
    """Twelve runs ending at once contend for the notes ref; each waits its turn."""
    from concurrent.futures import ThreadPoolExecutor

    repo = workspace_git.ensure_repo(tmp_path)
    sha = repo.head.commit.hexsha
    with ThreadPoolExecutor(12) as pool:
        written = list(pool.map(lambda i: workspace_git.add_note(tmp_path, sha, f"run {i}: completed"), range(12)))
    assert all(written)
    assert sorted(line for line in workspace_git.note(repo, sha).splitlines() if line) == sorted(
        f"run {i}: completed" for i in range(12))


def test_a_subject_cannot_pass_for_another_commits_fields(tmp_path):
    """``review`` reads agent commits from one ``git log``: a subject holding the separators of
    an older reader (written with plain git, by anyone with a shell) is its own commit's subject."""
    repo = workspace_git.ensure_repo(tmp_path)
    other = repo.head.commit.hexsha
    (tmp_path / "a.txt").write_text("a\n")
    run_git(tmp_path, "add", "a.txt")
    run_git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m",
            f"innocent\x1e{other}\x1fdecoy subject\x1f2020-01-01T00:00:00+00:00\x1f\n\n"
            f"{workspace_git.TOOL_TRAILER}: apply_skill")
    (listed,) = workspace_git.agent_commits(repo, None)
    assert listed.sha == repo.head.commit.hexsha != other
    assert listed.subject.startswith("innocent")
