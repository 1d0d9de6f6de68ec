"""An error means nothing changed: apply_skill refuses a result too large to return, a git-ignored
file and a commit git rejects before (or by undoing) any change, and the audit says so."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from mcp_server.server import build_server
from workspace import git as workspace_git
from tests.sandbox.helpers import AUDIT, DATA_CACHE, error_text, live_client, make_workspace, tree_hash
from tests.support import TEMPLATE


@pytest.fixture
def root(tmp_path):
    return make_workspace(tmp_path / "ws")


def _head(root):
    return workspace_git.open_repo(root).head.commit.hexsha


def _last_audit(root):
    return json.loads((root / AUDIT).read_text().splitlines()[-1])


def _worktree_hash(root):
    """Every file of the workspace but git's internals (a rejected commit may leave unreachable
    objects there; what matters is HEAD, the index's content and the files)."""
    return tree_hash(*(p for p in sorted(root.iterdir()) if p.is_dir() and p.name != ".git"),
                     exclude=(Path(AUDIT.name),), caches=(Path(DATA_CACHE.name),)) + \
        (root / ".gitignore").read_text()


def _refused(root, tool, arguments, expect):
    server = build_server(root)
    before, head = _worktree_hash(root), _head(root)
    with live_client(server) as client:
        result = client.call(tool, arguments)
    assert result.is_error, error_text(result)[:300]
    assert expect in error_text(result), error_text(result)[:500]
    assert _worktree_hash(root) == before, "the workspace changed"
    assert _head(root) == head, "a commit was made"
    assert workspace_git.open_repo(root).git.status("--porcelain") == ""
    entry = _last_audit(root)
    assert entry["tool"] == tool and entry["outcome"] == "error" and "commit" not in entry


def test_a_result_too_large_is_refused_before_anything_is_committed(root):
    params = {"patterns": ["a" * 90_000]}
    _refused(root, "apply_skill", {"skill": "freeze", "recipe": "recipes/lm", "params": params}, "too large")


def test_a_git_ignored_file_is_refused_before_it_is_written(root):
    (root / ".gitignore").write_text((root / ".gitignore").read_text() + "scratch/\n")
    workspace_git.commit_paths(workspace_git.open_repo(root), [root / ".gitignore"], "ignore scratch", [])
    (root / "scratch").mkdir()
    shutil.copy(TEMPLATE / "recipe.py", root / "scratch" / "train.py")
    _refused(root, "apply_skill", {"skill": "gradient-checkpointing", "recipe": "scratch/train.py"}, "ignored by git")


def _reject_commits(root):
    with open(root / ".git" / "config", "a") as f:
        f.write("[commit]\n\tgpgsign = true\n[gpg]\n\tprogram = false\n")


def test_a_commit_git_rejects_puts_the_file_back(root):
    _reject_commits(root)
    _refused(root, "apply_skill", {"skill": "gradient-checkpointing", "recipe": "recipes/lm"}, "could not commit")


def test_a_scaffold_whose_commit_fails_leaves_no_recipe(root):
    _reject_commits(root)
    _refused(root, "scaffold_recipe", {"template": "causal_lm", "name": "fresh"}, "could not commit")
    assert not (root / "recipes" / "fresh").exists()
