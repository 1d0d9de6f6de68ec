"""Git operations on the workspace: the record humans review.

Every change an agent makes is one commit with trailers that say what produced it; every run
is tied to the commit it was launched from, and a note on that commit records its outcome.
"""

from __future__ import annotations

from pathlib import Path

import git

NOTES_REF = "trainwright"
AGENT_NAME = "trainwright"
AGENT_EMAIL = "trainwright@localhost"


def open_repo(root: Path) -> git.Repo | None:
    try:
        return git.Repo(root, search_parent_directories=False)
    except (git.InvalidGitRepositoryError, git.NoSuchPathError):
        return None


def head_commit(root: Path) -> str | None:
    repo = open_repo(root)
    if repo is None:
        return None
    try:
        return repo.head.commit.hexsha
    except ValueError:  # no commits yet
        return None
