"""What the agent launched is what ran, and the tools say so (through a real MCP client).

- data: a recipe scaffolded with only ``data.paths`` trains on those files, and launch_run /
  get_run name them and count their tokens; nothing falls back to other data silently;
- code: a run executes a snapshot of the recipe; a dirty launch says so (result, get_run, git
  note, the saved patch); a resume runs the checkpoint's code by default — bit-identical to an
  uninterrupted run even after HEAD moved — and the recipe at HEAD with code="head";
- a run in the user's own repository leaves the recipe folder clean;
- errors carry their kind: bad_input, not_found, internal.
"""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest

from engine import run_dir as rd
from tests.mcp.conftest import connect, git, head, run_note, tiny_config
from tests.support import losses

pytestmark = pytest.mark.slow

CORPUS = {"a.txt": "the first document\n", "b.md": "# second\n\ndocument two\n", "sub/c.py": "print('three')\n"}


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """The user's own project: a git repository with history and no .gitignore of ours."""
    root = tmp_path_factory.mktemp("contract") / "project"
    root.mkdir()
    subprocess.run(["git", "init", "-q", str(root)], check=True)
    (root / "README.md").write_text("my project\n")
    for name, text in CORPUS.items():
        (root / "corpus" / name).parent.mkdir(parents=True, exist_ok=True)
        (root / "corpus" / name).write_text(text)
    git(root, "add", ".")
    git(root, "-c", "user.name=me", "-c", "user.email=me@example.com", "commit", "-qm", "my project")
    return root


@pytest.fixture(scope="module")
def client(workspace):
    with connect("memory", workspace) as session:
        yield session


def test_data_paths_alone_train_on_those_files(client, workspace):
    config = tiny_config(**{"data.paths": ["corpus"], "train.max_steps": 2, "data.eval_fraction": 0})
    client.ok("scaffold_recipe", template="causal_lm", name="mine", config=config)
    launched = client.ok("launch_run", recipe="recipes/mine")

    tokens = sum(len(text.encode()) + 1 for text in CORPUS.values())
    expected = {"source": "files", "paths": ["corpus"], "files": 3, "documents": 3, "tokens": tokens}
    assert {k: launched["data"][k] for k in expected} == expected
    assert launched["config_changes"]["data.source"] == "files"
    assert launched["config_changes"]["data.paths"] == ["corpus"]
    info = client.wait_for_run(launched["run_id"])
    assert info["status"] == "completed" and info["data"] == launched["data"]
    console = (workspace / info["run_dir"] / rd.CONSOLE_LOG).read_text()
    assert f"data: files from corpus: 3 files, 3 documents, {tokens} tokens" in console


def test_nothing_falls_back_to_other_data(client, workspace):
    client.ok("scaffold_recipe", template="causal_lm", name="local", config=tiny_config())
    runs_before = sorted((workspace / "runs").iterdir())
    message = client.error("launch_run", recipe="recipes/local", overrides={"data.paths": ["nowhere"]})
    assert "bad_input: data path 'nowhere' does not exist" in message
    message = client.error("launch_run", recipe="recipes/local",
                           overrides={"data": {"paths": ["corpus"], "source": "stdlib"}})
    assert "data.paths is set but data.source=stdlib would ignore it" in message
    # Data kept beside the recipe, not named in data.paths: refused, not replaced by the stdlib.
    (workspace / "recipes" / "local" / "data").mkdir()
    (workspace / "recipes" / "local" / "data" / "notes.txt").write_text("my notes\n")
    message = client.error("launch_run", recipe="recipes/local")
    assert "the recipe has a data/ folder, but data.paths is not set" in message
    assert sorted((workspace / "runs").iterdir()) == runs_before, "a refused launch left a run directory"
    shutil.rmtree(workspace / "recipes" / "local" / "data")


def test_resume_runs_the_checkpoints_code_even_after_head_moved(client, workspace):
    config = tiny_config(**{"train.max_steps": 6, "checkpoint.every": 3, "data.paths": ["corpus"]})
    scaffold = client.ok("scaffold_recipe", template="causal_lm", name="lm", config=config)
    original = client.wait_for_run(client.ok("launch_run", recipe="recipes/lm")["run_id"])
    assert original["code"] == f"code at commit {scaffold['commit'][:10]}" and original["recipe_dirty"] is False

    applied = client.ok("apply_skill", skill="loss-guard", recipe="recipes/lm")
    assert head(workspace) == applied["commit"] != scaffold["commit"]

    same = client.ok("resume_checkpoint", run_id=original["run_id"], step=3)
    same_info = client.wait_for_run(same["run_id"])
    assert same_info["git_commit"] == scaffold["commit"]
    assert same_info["code"] == (
        f"resumed from {original['run_id']} step 3 with that run's code at commit {scaffold['commit'][:10]}"
    )
    reference = losses(workspace / original["run_dir"])
    assert losses(workspace / same_info["run_dir"]) == {s: reference[s] for s in (4, 5, 6)}, "not bit-identical"
    snapshot = (workspace / same_info["snapshot"] / "recipe.py").read_text()
    assert snapshot == git(workspace, "show", f"{scaffold['commit']}:recipes/lm/recipe.py") + "\n"

    at_head = client.wait_for_run(client.ok("resume_checkpoint", run_id=original["run_id"], step=3, code="head")["run_id"])
    assert at_head["git_commit"] == applied["commit"]
    assert "with the recipe as at resume time" in at_head["code"]
    assert (workspace / at_head["snapshot"] / "recipe.py").read_text() == (workspace / "recipes/lm/recipe.py").read_text()

    review = client.ok("list_runs")  # both resumes are listed as runs of the recipe
    assert {same["run_id"], at_head["run_id"]} <= {r["run_id"] for r in review["runs"]}
    note = run_note(workspace, scaffold["commit"], same["run_id"])
    assert f"run {same['run_id']}: completed" in note and "with that run's code" in note
    note = run_note(workspace, applied["commit"], at_head["run_id"])
    assert f"run {at_head['run_id']}: completed" in note


def test_a_dirty_launch_runs_the_changes_and_says_so(client, workspace):
    recipe = workspace / "recipes" / "lm" / "recipe.py"
    recipe.write_text(recipe.read_text() + "\n# a local experiment\n")
    launched = client.ok("launch_run", recipe="recipes/lm", overrides={"train.max_steps": 1})
    assert "uncommitted changes (recipes/lm/recipe.py; the diff: runs/" in launched["code"]
    assert any("uncommitted changes" in w and "uncommitted.patch" in w for w in launched["warnings"])
    info = client.wait_for_run(launched["run_id"])
    assert info["recipe_dirty"] is True and info["git_commit"] == head(workspace)
    patch = (workspace / info["snapshot"] / rd.UNCOMMITTED_PATCH).read_text()
    assert "+# a local experiment" in patch
    assert (workspace / info["snapshot"] / "recipe.py").read_text().endswith("# a local experiment\n")
    note = run_note(workspace, head(workspace), launched["run_id"])
    assert f"run {launched['run_id']}: completed" in note and "+ uncommitted changes" in note
    git(workspace, "checkout", "--", "recipes/lm/recipe.py")


def test_runs_leave_the_recipe_folders_clean_in_the_users_repository(client, workspace):
    assert git(workspace, "status", "--porcelain", "--", "recipes") == ""
    assert not list((workspace / "recipes").rglob("__pycache__"))
    # So the next skill applies without a complaint about uncommitted changes.
    assert client.ok("apply_skill", skill="gradient-checkpointing", recipe="recipes/mine")["changed"] is True


def test_review_shows_each_runs_code_and_data(workspace):
    out = subprocess.run(
        [*__import__("tests.mcp.conftest", fromlist=["x"]).trainwright_command(), "review", "--json",
         "--workspace", str(workspace)], capture_output=True, text=True, check=True,
    ).stdout
    commits = json.loads(out)["commits"]
    runs = [run for commit in commits for run in commit["runs"]]
    assert runs and all(run["code"] for run in runs)
    assert any(run["data"] and run["data"].startswith("data: files from corpus") for run in runs)


def test_errors_say_their_kind(client, monkeypatch):
    assert ": not_found: no run '20990101-000000-x-0000'" in client.error("get_run", run_id="20990101-000000-x-0000")
    assert ": bad_input: run_id '../x' is not a plain name" in client.error("get_run", run_id="../x")
