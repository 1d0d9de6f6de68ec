"""Git operations on the workspace: the record humans review.

Every change an agent makes is one commit of exactly the files it changed (:func:`commit_files`
writes them and commits, or puts them back), with trailers that say which tool produced it
(``Trainwright-Tool``) and with what (``Skill-Applied``, ``Skill-Params``, ``Scaffolded-From``,
``Recipe-Config``): their names are this module's ``*_TRAILER`` constants. Every run records
the commit it was launched from, and when it ends a note under ``refs/notes/trainwright`` on
that commit records its outcome, so ``git log --notes=trainwright`` shows what each agent
commit produced.

Git runs with the workspace's own settings, which an agent can edit with its own tools. So
every git command trainwright runs goes through :func:`_harden`: hooks off
(``core.hooksPath`` pointed at nothing: ``.git/hooks/post-commit`` never runs),
``core.fsmonitor`` off, and the values of the server's secrets blanked from git's environment.
"""

from __future__ import annotations

import fcntl
import itertools
import json
import os
import random
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from engine.errors import MAX_QUOTED_CHARS, BadInput, NotFound
from sandbox.environment import looks_secret
from sandbox.redact import secret_values
from workspace.files import as_before_on_failure, write_atomically, write_files


def _lazy(name: str):
    """``name`` imported at the first use of one of its attributes (importlib's LazyLoader):
    GitPython costs ~30 ms, and the server answers initialize and tools/list without it."""
    import importlib.util
    import sys

    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.find_spec(name)
    assert spec is not None and spec.loader is not None, name
    spec.loader = importlib.util.LazyLoader(spec.loader)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


if TYPE_CHECKING:
    import git
else:
    git = _lazy("git")

NOTES_REF = "trainwright"
AGENT_NAME = "trainwright"
AGENT_EMAIL = "trainwright@localhost"
# The trailers of an agent's commit, by these names alone: written by the tools (commit_files,
# commit_paths), read back by review, describe_recipe, compare_runs and ab (path_commits,
# agent_commits; both parse git's own trailer output in _log).
TOOL_TRAILER = "Trainwright-Tool"  # the tool that made the commit
SKILL_APPLIED_TRAILER = "Skill-Applied"  # <skill>@<version> (:func:`skill_applied`)
SKILL_PARAMS_TRAILER = "Skill-Params"  # the skill's validated params, compact JSON (:func:`compact_json`)
SCAFFOLDED_FROM_TRAILER = "Scaffolded-From"  # the template a recipe was scaffolded from
RECIPE_CONFIG_TRAILER = "Recipe-Config"  # the overrides a recipe was scaffolded with, compact JSON
# trainwright's own folders in a workspace: never committed (runs, exports and the server's state).
OWN_FOLDERS = ("runs/", "exports/", ".trainwright/")
WORKSPACE_GITIGNORE = "".join(f"{folder}\n" for folder in OWN_FOLDERS) + "__pycache__/\n"
# Settings given on every git command line (``git -c ...``): they win over the repository's.
SAFE_CONFIG = ("core.hooksPath=/dev/null", "core.fsmonitor=false", "core.untrackedCache=false")
COMMIT_ID = re.compile(r"^[0-9a-f]{40}([0-9a-f]{24})?$")  # a full commit id, SHA-1 or SHA-256, as git prints it


class GitRefused(BadInput):
    """A git precondition does not hold (uncommitted changes, not a repository)."""


def _identity_env() -> dict[str, str]:
    """Commits are authored by trainwright; the committer falls back to it when git has none."""
    env = {"GIT_AUTHOR_NAME": AGENT_NAME, "GIT_AUTHOR_EMAIL": AGENT_EMAIL}
    for key, value in (("GIT_COMMITTER_NAME", AGENT_NAME), ("GIT_COMMITTER_EMAIL", AGENT_EMAIL)):
        env[key] = os.environ.get(key, value)
    return env


def worktree(repo: git.Repo) -> Path:
    """The repository's working tree (trainwright never opens a bare repository)."""
    assert repo.working_tree_dir is not None, "a bare repository"
    return Path(repo.working_tree_dir).resolve()


def scrubbed_environment() -> dict[str, str]:
    """Blank values for the server's secret variables (GitPython starts from ``os.environ``)."""
    secrets = secret_values(os.environ)
    return {name: "" for name, value in os.environ.items() if looks_secret(name) or value in secrets}


def _harden(repo: git.Repo) -> git.Repo:
    """Every later command of ``repo`` runs without hooks, fsmonitor or the server's secrets."""
    repo.git.set_persistent_git_options(c=list(SAFE_CONFIG))
    repo.git.update_environment(**scrubbed_environment())
    return repo


def open_repo(root: Path) -> git.Repo | None:
    """The repository that can hold the workspace's commits: its own, or an enclosing one.

    An enclosing repository that ignores the workspace (``demo-workspace/`` inside a clone of
    trainwright) cannot take its commits, so it does not count.
    """
    try:
        repo = git.Repo(root, search_parent_directories=True)
    except (git.InvalidGitRepositoryError, git.NoSuchPathError):
        return None
    _harden(repo)
    if worktree(repo) != Path(root).resolve() and repo.ignored(str(root)):
        return None
    return repo


def ensure_workspace_repo(root: Path) -> None:
    """At the server's start: make sure the workspace has a repository, without loading GitPython
    when the workspace's own ``.git`` is there (the common case: ~30 ms of a cold start)."""
    if (Path(root) / ".git" / "HEAD").is_file():
        return
    ensure_repo(root)


def ensure_repo(root: Path) -> git.Repo:
    """Open the workspace's repository, or initialise one of its own with a first commit."""
    repo = open_repo(root)
    if repo is not None:
        return repo
    repo = _harden(git.Repo.init(root))
    gitignore = Path(root) / ".gitignore"
    if not gitignore.exists():
        gitignore.write_text(WORKSPACE_GITIGNORE)
    with repo.git.custom_environment(**_identity_env()):
        repo.git.add("--", ".gitignore")
        repo.git.commit("-q", "-m", "trainwright: initialise workspace\n", "--", ".gitignore")
    return repo


def ignore_own_folders(repo: git.Repo, root: Path) -> Path | None:
    """Add the lines of :data:`OWN_FOLDERS` that ``root``'s ``.gitignore`` lacks (creating it);
    returns the file when it changed, to be committed with the change that needed it. A
    ``.gitignore`` with uncommitted changes of its own, or one that is not a regular file, is left
    as it is (its changes are not trainwright's to commit)."""
    path = Path(root) / ".gitignore"
    if path.is_symlink() or (path.exists() and not path.is_file()):
        return None
    text = path.read_text(errors="replace") if path.exists() else ""
    present = {line.strip() for line in text.splitlines()}
    missing = [f for f in OWN_FOLDERS if f not in present and f.rstrip("/") not in present
               and f"/{f}" not in present and f"/{f.rstrip('/')}" not in present]
    if not missing:
        return None
    if path.exists() and repo.git.status("--porcelain", "--", _rel(repo, path)).strip():
        return None
    prefix = "" if not text or text.endswith("\n") else "\n"
    write_atomically(path, text + prefix + "# trainwright's own folders\n" + "".join(f"{f}\n" for f in missing))
    return path


def head_commit(root: Path) -> str | None:
    repo = open_repo(root)
    if repo is None:
        return None
    try:
        return repo.head.commit.hexsha
    except ValueError:  # no commits yet
        return None


def _rel(repo: git.Repo, path: Path) -> str:
    return Path(path).resolve().relative_to(worktree(repo)).as_posix()


def uncommitted(repo: git.Repo, path: Path) -> list[str]:
    """Files under ``path`` that differ from HEAD or are untracked (ignored files excepted)."""
    out = repo.git.status("--porcelain", "--untracked-files=all", "--", _rel(repo, path))
    return [line[3:] for line in out.splitlines() if line.strip()]


def ignored_files(repo: git.Repo, path: Path) -> list[str]:
    """Untracked files under ``path`` that git ignores (each file, not its folder)."""
    out = repo.git.ls_files("--others", "--ignored", "--exclude-standard", "--", _rel(repo, path))
    return [line for line in out.splitlines() if line.strip()]


def diff_against_head(repo: git.Repo, path: Path, dirty: list[str] | None = None) -> str:
    """The uncommitted changes under ``path`` as one patch: tracked files against HEAD, and
    each untracked file as a new file."""
    rel = _rel(repo, path)
    parts = []
    try:
        parts.append(repo.git.diff("HEAD", "--binary", "--", rel))
    except git.GitCommandError:  # no commit yet: everything is new
        pass
    tracked = set(repo.git.ls_files("--", rel).splitlines())
    root = worktree(repo)
    for name in dirty if dirty is not None else uncommitted(repo, path):
        if name not in tracked and (root / name).is_file():
            parts.append(repo.git.execute(
                ["git", "diff", "--no-index", "--binary", "--", "/dev/null", name], with_exceptions=False
            ))
    return "\n".join(part for part in parts if part) + "\n" if any(parts) else ""


def require_clean(repo: git.Repo, path: Path, what: str) -> None:
    dirty = uncommitted(repo, path)
    if dirty:
        shown = ", ".join(dirty[:5]) + (f" and {len(dirty) - 5} more" if len(dirty) > 5 else "")
        raise GitRefused(
            f"{what} has uncommitted changes ({shown}); commit or discard them first, "
            "so that the review diff shows exactly this change"
        )


def require_not_ignored(repo: git.Repo, path: Path, what: str) -> None:
    """Refuse a file git ignores: its change could not be committed, so it is not made."""
    if repo.ignored(_rel(repo, path)):
        raise GitRefused(
            f"{what} is ignored by git (.gitignore), so a change to it cannot be committed for "
            "review; move it out of the ignored folder or change .gitignore first"
        )


def skill_applied(skill: str, version: str) -> str:
    """The value of a :data:`SKILL_APPLIED_TRAILER`: ``<skill>@<version>``."""
    return f"{skill}@{version}"


def applied_skill_name(value: str) -> str:
    """The skill a :data:`SKILL_APPLIED_TRAILER` value names (its version left off)."""
    return value.split("@")[0]


def compact_json(value: object) -> str:
    """A trailer's JSON value (:data:`SKILL_PARAMS_TRAILER`, :data:`RECIPE_CONFIG_TRAILER`): keys
    sorted, no spaces, on one line."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def _parse_trailers(text: str) -> list[tuple[str, str]]:
    """``(key, value)`` pairs of git's ``%(trailers:only,unfold)`` output, in order (a trailer
    given twice is listed twice)."""
    found = []
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            found.append((key.strip(), value.strip()))
    return found


def commit_files(repo: git.Repo, files: Mapping[Path, str | bytes], message: str,
                 trailers: list[tuple[str, str]]) -> str:
    """Write each of ``files`` (path → new content) atomically and commit exactly those files, as
    one commit with ``trailers``; return its sha. On any failure (a write, git refusing the
    commit, an interruption) every file is put back as it was: nothing is lost, nothing is left
    half-written, nothing is committed."""
    with as_before_on_failure(files):
        write_files(files)
        return commit_paths(repo, list(files), message, trailers)


def commit_paths(repo: git.Repo, paths: list[Path], message: str, trailers: list[tuple[str, str]]) -> str:
    """Commit exactly ``paths`` (whatever else is staged stays staged); return the new sha.

    When git refuses, the paths are unstaged again and :class:`GitRefused` says why; the caller
    puts its files back (:func:`commit_files` does both).
    """
    rel = [_rel(repo, p) for p in paths]
    args = ["-q", "-m", message.rstrip("\n") + "\n"]
    for key, value in trailers:
        args += ["--trailer", f"{key}: {value}"]
    with repo.git.custom_environment(**_identity_env()):
        try:
            repo.git.add("-A", "--", *rel)
            repo.git.commit(*args, "--only", "--", *rel)
        except git.GitCommandError as e:
            try:
                repo.git.reset("-q", "--", *rel)
            except git.GitCommandError:
                pass  # no HEAD yet, or the index is locked: nothing was staged by us then
            detail = (str(e.stderr or e).strip().splitlines() or ["unknown error"])[-1]
            raise GitRefused(f"git could not commit the change ({detail[:MAX_QUOTED_CHARS]}); nothing was committed") from None
    return repo.head.commit.hexsha


def add_note(root: Path, sha: str, text: str, patience_s: float = 30.0) -> bool:
    """Append ``text`` to the trainwright note of commit ``sha``; False when it cannot.

    ``git notes append`` reads the note, then writes it back: two runs that end together would
    each write the note without the other's line. So appends take turns under a lock file in the
    repository's git folder (waited for up to ``patience_s``, with jittered backoff; a loaded
    machine can hold it for seconds), and a ref lock held by a person's own git is retried.
    ``sha`` must be a full commit id, and git is told where its options end: it is never read
    as an option (``-F/proc/self/environ`` would put a file's content into the note)."""
    if not isinstance(sha, str) or not COMMIT_ID.fullmatch(sha):
        return False
    repo = open_repo(root)
    if repo is None:
        return False
    deadline = time.monotonic() + patience_s
    try:
        fd = os.open(Path(repo.git_dir) / "trainwright-notes.lock",
                     os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o600)
    except OSError:
        return False
    try:
        for attempt in itertools.count():
            pause = min(1.0, 0.05 * 2**attempt) * (0.5 + random.random())
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if time.monotonic() + pause > deadline:
                    return False
                time.sleep(pause)  # another run's note is being written
                continue
            try:
                with repo.git.custom_environment(**_identity_env()):
                    repo.git.notes(f"--ref={NOTES_REF}", "append", "-m", text, "--end-of-options", sha)
                return True
            except git.GitCommandError as e:
                if "lock" not in str(e).lower() or time.monotonic() + pause > deadline:
                    return False
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
            time.sleep(pause)
    finally:
        os.close(fd)
    return False


def note(repo: git.Repo, sha: str) -> str | None:
    try:
        return repo.git.notes(f"--ref={NOTES_REF}", "show", sha)
    except git.GitCommandError:
        return None


@dataclass
class AgentCommit:
    sha: str
    subject: str
    trailers: dict[str, str]
    files_changed: int
    insertions: int
    deletions: int
    note: str | None


@dataclass
class PathCommit:
    sha: str
    subject: str
    committed_at: str
    trailers: list[tuple[str, str]]


def path_commits(repo: git.Repo, path: Path, limit: int = 200, rev: str | None = None) -> list[PathCommit]:
    """The newest ``limit`` commits that touch ``path`` (in the history of ``rev``, default
    HEAD), newest first, with their trailers (one ``git log``; a trailer that occurs twice is
    listed twice)."""
    try:
        return _log(repo, limit, rev, _rel(repo, path))
    except git.GitCommandError:  # no commits yet
        return []


def _log(repo: git.Repo, limit: int, rev: str | None, path: str | None = None) -> list[PathCommit]:
    """The newest ``limit`` commits of ``rev`` (default HEAD), of ``path`` when given, newest
    first, with their trailers: one ``git log``, the one reader of commits' trailers."""
    # NUL between fields and (-z) between commits: the one byte no commit message can hold, so
    # a subject cannot pass for another commit's fields.
    fields = "%H%x00%s%x00%cI%x00%(trailers:only,unfold)"
    out = repo.git.log("-z", f"--max-count={limit}", f"--format={fields}", *([rev] if rev else []), "--",
                       *([path] if path is not None else []), strip_newline_in_stdout=False)
    parts = out.split("\x00") if out else []
    found = []
    for at in range(0, len(parts) - 3, 4):
        sha, subject, committed_at, trailer_text = parts[at: at + 4]
        if not COMMIT_ID.fullmatch(sha):
            raise GitRefused(f"git log gave {sha[:60]!r} where a commit id belongs")
        found.append(PathCommit(sha=sha, subject=subject, committed_at=committed_at,
                                trailers=_parse_trailers(trailer_text)))
    return found


def agent_commits(repo: git.Repo, base: str | None, limit: int = 200) -> list[AgentCommit]:
    """Commits since ``base`` (exclusive; all when None) made through trainwright's tools."""
    if base is not None and (not isinstance(base, str) or base.startswith("-") or not base.strip()):
        raise GitRefused(f"base must be a commit or ref, got {base!r}")
    try:
        commits = _log(repo, limit, f"{base}..HEAD" if base else "HEAD")
    except git.GitCommandError as e:
        raise GitRefused(f"cannot read the history from {base or 'the start'}: {e}") from None
    found = []
    for commit in commits:
        trailers = dict(commit.trailers)  # a trailer given twice: its last value
        if TOOL_TRAILER not in trailers:
            continue
        stats = repo.commit(commit.sha).stats.total
        found.append(
            AgentCommit(
                sha=commit.sha,
                subject=commit.subject,
                trailers=trailers,
                files_changed=stats.get("files", 0),
                insertions=stats.get("insertions", 0),
                deletions=stats.get("deletions", 0),
                note=note(repo, commit.sha),
            )
        )
    return found


def resolve_commit(repo: git.Repo, rev: object) -> str:
    """The full id of the commit ``rev`` names: a commit id (short or full), or a ref or
    revision such as ``HEAD~1`` or ``<sha>^`` (its parent). Never read as an option."""
    if not isinstance(rev, str) or not rev.strip() or rev.startswith("-") or len(rev) > 200 or not rev.isprintable():
        raise GitRefused(f"commit must be a commit id or revision (abc1234, HEAD~1, <sha>^), got {rev!r}")
    try:
        sha = repo.git.rev_parse("--verify", "--quiet", "--end-of-options", f"{rev}^{{commit}}").strip()
    except git.GitCommandError:
        sha = ""
    if not COMMIT_ID.fullmatch(sha):
        raise NotFound(f"no commit {rev!r} in the workspace's repository; `git log` lists them")
    return sha


@dataclass
class TreeFile:
    path: str  # relative to the folder asked for
    size: int
    link: bool
    read: Callable[[], bytes]


def tree_files(repo: git.Repo, sha: str, folder: Path) -> list[TreeFile] | None:
    """The files under ``folder`` as commit ``sha`` holds them (submodules left out); None when
    the commit has no such folder."""
    commit = repo.commit(sha)
    rel = _rel(repo, folder)
    try:
        tree = commit.tree / rel if rel not in ("", ".") else commit.tree
    except KeyError:
        return None
    if tree.type != "tree":
        return None
    found = []
    for item in tree.traverse():
        if not isinstance(item, git.Blob):  # a submodule's commit has no files here
            continue
        path = Path(str(item.path)).relative_to(str(tree.path)).as_posix() if tree.path else str(item.path)
        found.append(TreeFile(path=path, size=item.size, link=item.mode == 0o120000, read=_reader(item)))
    return found


def tree_file(repo: git.Repo, sha: str, path: Path) -> TreeFile | None:
    """The one file at ``path`` as commit ``sha`` holds it (its ``path`` is its name); None when
    the commit has no file there."""
    try:
        item = repo.commit(sha).tree / _rel(repo, path)
    except KeyError:
        return None
    if not isinstance(item, git.Blob):
        return None
    return TreeFile(path=Path(path).name, size=item.size, link=item.mode == 0o120000, read=_reader(item))


def _reader(blob: git.Blob) -> Callable[[], bytes]:
    return lambda: blob.data_stream.read()
