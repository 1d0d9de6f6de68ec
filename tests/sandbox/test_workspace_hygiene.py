"""What trainwright leaves in a user's repository: a .gitignore for its own folders with the first
scaffold, exports whose files are 0644 (folders 0755) under the settings' size cap, and adapter
configs that name their base model relative to the export, never by a path of this machine."""

from __future__ import annotations

import os
import stat
import subprocess

import pytest

from engine.errors import BadInput
from mcp_server.operations import model_tools
from mcp_server.operations import recipes as recipe_ops
from workspace.workspace import Workspace
from tests.mcp.conftest import git, tiny_config


def user_repository(root, gitignore: str | None = None):
    root.mkdir(parents=True)
    subprocess.run(["git", "init", "-q", str(root)], check=True)
    (root / "README.md").write_text("my project\n")
    if gitignore is not None:
        (root / ".gitignore").write_text(gitignore)
    git(root, "add", ".")
    git(root, "-c", "user.name=me", "-c", "user.email=me@example.com", "commit", "-qm", "my project")
    return root


def test_the_first_scaffold_in_a_users_repository_ignores_trainwrights_folders(tmp_path):
    root = user_repository(tmp_path / "project", gitignore="*.log")  # no newline at its end
    recipe_ops.scaffold_recipe(Workspace.open(root), "causal_lm", "lm", config=tiny_config())
    assert (root / ".gitignore").read_text() == "*.log\n# trainwright's own folders\nruns/\nexports/\n.trainwright/\n"
    assert git(root, "status", "--porcelain", "--", ".gitignore") == ""  # committed with the recipe
    assert ".gitignore" in git(root, "show", "--name-only", "--format=", "HEAD").splitlines()
    (root / "exports" / "m").mkdir(parents=True)
    (root / "exports" / "m" / "model.safetensors").write_bytes(b"x")
    assert git(root, "status", "--porcelain", "--untracked-files=all", "--", "exports") == ""
    # The next scaffold finds every line there: nothing is added twice.
    recipe_ops.scaffold_recipe(Workspace.open(root), "causal_lm", "lm2", config=tiny_config())
    assert (root / ".gitignore").read_text().count("runs/") == 1
    assert ".gitignore" not in git(root, "show", "--name-only", "--format=", "HEAD").splitlines()


def test_a_gitignore_with_the_users_own_uncommitted_changes_is_left_alone(tmp_path):
    root = user_repository(tmp_path / "project", gitignore="*.log\n")
    (root / ".gitignore").write_text("*.log\n*.tmp\n")  # the user's, not committed
    recipe_ops.scaffold_recipe(Workspace.open(root), "causal_lm", "lm", config=tiny_config())
    assert (root / ".gitignore").read_text() == "*.log\n*.tmp\n"


def test_exported_files_are_0644_and_folders_0755_whatever_the_recipe_set(tmp_path):
    export = tmp_path / "export"
    (export / "base").mkdir(parents=True)
    (export / "model.safetensors").write_bytes(b"w" * 100)
    (export / "base" / "config.json").write_text("{}")
    os.chmod(export / "model.safetensors", 0o600)
    os.chmod(export / "base" / "config.json", 0o4777)
    os.chmod(export / "base", 0o700)
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        model_tools.check_written(fd, "export")
        with pytest.raises(BadInput, match=r"larger than runs.max_export_bytes \(101 bytes\)"):
            model_tools.check_written(fd, "export", max_bytes=101)
    finally:
        os.close(fd)
    modes = {p.relative_to(tmp_path).as_posix(): stat.S_IMODE(p.stat().st_mode) for p in [export, *export.rglob("*")]}
    assert modes == {"export": 0o755, "export/base": 0o755, "export/model.safetensors": 0o644,
                     "export/base/config.json": 0o644}


def test_the_export_cap_is_a_trusted_setting(tmp_path):
    from workspace.settings import limits_from_mapping

    assert limits_from_mapping({"max_export_bytes": "2GiB"}).max_export_bytes == 2 * 2**30
    assert limits_from_mapping({}).max_export_bytes is None


def test_an_adapters_base_is_named_relative_to_the_export(tmp_path):
    from engine.hf_export import adapter_base_reference

    (tmp_path / "exports" / "sft_model").mkdir(parents=True)
    assert adapter_base_reference(str(tmp_path / "exports" / "sft_model"), tmp_path / "exports" / "lora") == \
        "../sft_model"
    assert adapter_base_reference("HuggingFaceTB/SmolLM2-135M", tmp_path / "exports" / "lora") == \
        "HuggingFaceTB/SmolLM2-135M"
