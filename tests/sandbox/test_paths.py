"""Path confinement, in one place: what ``confine``, ``check_name`` and the workspace accept."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from workspace.paths import PathRefused, check_name, confine, confine_config
from workspace.workspace import NotFound, Workspace
from tests.support import copy_template


@pytest.fixture
def root(tmp_path):
    ws = tmp_path / "ws"
    copy_template(ws / "recipes")
    (tmp_path / "outside").mkdir()
    os.symlink(tmp_path / "outside", ws / "out")
    os.symlink(ws / "recipes", ws / "inside-link")
    (ws / ".git").mkdir()
    return ws


@pytest.mark.parametrize("value", ["recipes/lm", "./recipes/lm", "recipes/../recipes/lm", "inside-link/lm"])
def test_paths_inside_the_workspace_resolve_to_their_real_place(root, value):
    assert confine(root, value) == (root / "recipes" / "lm").resolve()


def test_an_absolute_path_inside_the_workspace_is_accepted(root):
    assert confine(root, str(root / "recipes" / "lm")) == (root / "recipes" / "lm").resolve()


@pytest.mark.parametrize("value, reason", [
    ("..", "outside the workspace"),
    ("../outside", "outside the workspace"),
    ("/etc", "outside the workspace"),
    ("out", "outside the workspace"),
    ("out/anything", "does not exist|outside the workspace"),
    ("recipes/lm\x00", "NUL"),
    ("recipes/lm\n", "control characters"),
    ("", "empty"),
    ("x" * 2000, "longer than 1024"),
    ("~", "does not exist"),
    ("nope", "does not exist"),
])
def test_paths_that_leave_or_are_malformed_are_refused_with_the_reason(root, value, reason):
    with pytest.raises(PathRefused, match=reason):
        confine(root, value)


@pytest.mark.parametrize("value", [5, None, b"recipes/lm", ["recipes/lm"]])
def test_a_path_that_is_not_text_is_refused(root, value):
    with pytest.raises(PathRefused, match="must be a string"):
        confine(root, value)


def test_a_symlink_loop_is_refused_not_followed_forever(root):
    os.symlink("loop", root / "loop")
    with pytest.raises(PathRefused, match="cannot be resolved|does not exist"):
        confine(root, "loop/x")


def test_a_path_that_does_not_exist_yet_is_confined_through_its_existing_parent(root):
    assert confine(root, "recipes/new/file.py", must_exist=False) == (root / "recipes/new/file.py").resolve()
    with pytest.raises(PathRefused, match="outside"):
        confine(root, "out/new/file.py", must_exist=False)


@pytest.mark.parametrize("value", ["lm", "my-recipe_2", "20261130-024512-causal_lm-3f9a", "a.b"])
def test_plain_names_are_accepted(value):
    assert check_name(value, "name") == value


@pytest.mark.parametrize("value", ["", ".", "..", "a/b", "a\\b", ".hidden", "-rf", "a..b", "a b", "a\x00",
                                   "é", "x" * 129, "a;b", "$(x)"])
def test_names_that_are_not_plain_are_refused(value):
    with pytest.raises(PathRefused):
        check_name(value, "name")


@given(st.text(max_size=300))
@settings(max_examples=300, deadline=None)
def test_confine_never_returns_a_path_outside_the_root(tmp_path_factory, text):
    root = tmp_path_factory.getbasetemp() / "prop"
    root.mkdir(exist_ok=True)
    try:
        resolved = confine(root, text, must_exist=False)
    except PathRefused:
        return
    assert resolved == root.resolve() or root.resolve() in resolved.parents


@given(st.text(max_size=200))
@settings(max_examples=300, deadline=None)
def test_check_name_accepts_only_names_without_separators_or_dots_in_front(text):
    try:
        name = check_name(text, "name")
    except PathRefused:
        return
    assert "/" not in name and "\\" not in name and not name.startswith((".", "-")) and ".." not in name
    assert name.isascii() and name.isprintable()


def test_config_values_that_name_files_are_confined(root):
    confine_config(root, {"data.paths": ["recipes/lm/recipe.py"], "train.max_steps": "/etc"})
    for values in ({"data.paths": ["/etc/passwd"]}, {"model.pretrained_path": "../outside"},
                   {"data.paths": ["ok", "out/secret"]}, {"tokenizer_dir": "/"}):
        with pytest.raises(PathRefused, match="must be inside the workspace"):
            confine_config(root, values)


def test_a_recipe_is_never_taken_from_git_or_trainwright_state(root):
    ws = Workspace.open(root)
    assert ws.recipe("lm") == (root / "recipes" / "lm").resolve()  # a bare name finds recipes/<name>
    for value in (".git", ".git/hooks", "runs/x"):
        (root / value).mkdir(parents=True, exist_ok=True)
        with pytest.raises(PathRefused, match="own state"):
            ws.recipe(value)
    with pytest.raises(NotFound):
        ws.recipe("recipes")


def test_run_ids_are_plain_names_and_linked_run_folders_are_not_listed(root, tmp_path):
    ws = Workspace.open(root)
    (root / "runs").mkdir()
    (tmp_path / "outside" / "r1").mkdir()
    (tmp_path / "outside" / "r1" / "run.json").write_text("{}")
    os.symlink(tmp_path / "outside" / "r1", root / "runs" / "r1")
    assert ws.run_ids() == []
    with pytest.raises(NotFound, match="no run 'r1'"):  # a link is never a run folder
        ws.run_dir("r1")
    with pytest.raises(PathRefused, match="not a plain name"):
        ws.run_dir("../r1")
    assert Path(root / "runs" / "r1" / "run.json").read_text() == "{}"


@pytest.mark.parametrize("config", [
    {"data": {"paths": ["/etc/passwd"]}},
    {"data": {"paths": "../outside"}},
    {"model": {"pretrained_path": "/root/.ssh"}},
    {"data.paths": ["~/secret"]},
    {"data": {"paths": ["~"]}},
    {"model.pretrained_path": "~root/weights"},
    {"a": {"b": {"c": {"tokenizer_dir": "/"}}}},
    {"data": {"sources": [{"path": "/etc"}]}},
])
def test_file_values_are_confined_whatever_the_nesting_and_home_is_refused(root, config):
    with pytest.raises(PathRefused, match="inside the workspace"):
        confine_config(root, config)


def test_a_merged_config_inside_the_workspace_passes(root):
    confine_config(root, {"data": {"paths": ["recipes/lm"], "source": "files"}, "model": {"pretrained_path": None},
                          "train": {"max_steps": 5}, "notes": ["/etc"]})
