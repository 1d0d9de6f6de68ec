"""apply_skill: targets, dry runs and diffs that git accepts, atomic writes, untouched files on errors."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from skills import ApplyResult, RecipeNotFound, SkillError, SkillRefused, apply_skill
from tests.skills.skill_helpers import FIXTURES, copy_recipe


def git_apply(diff: str, root: Path, *options: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "apply", *options, "-"], input=diff, text=True, capture_output=True, cwd=root)


def test_a_recipe_folder_targets_its_recipe_py(tmp_path: Path):
    recipe = copy_recipe("template", tmp_path)
    result = apply_skill("gradient-checkpointing", recipe)
    assert isinstance(result, ApplyResult)
    assert result.target == str(recipe / "recipe.py")
    assert result.diff.startswith("--- a/recipe.py\n+++ b/recipe.py\n")  # relative to the target's folder
    assert result.params == {"every": 1, "target": None}
    assert result.skill == "gradient-checkpointing" and result.version == "1.0.0"
    assert result.acts_on == ("turns on AutoModelForCausalLM or LlamaForCausalLM's own activation checkpointing "
                              "(`gradient_checkpointing_enable`) on `model`: every decoder layer")
    assert result.message == f"gradient-checkpointing changed recipe.py (+1 -0 lines); {result.acts_on}"


def test_a_single_script_is_a_target_too(tmp_path: Path):
    script = copy_recipe("nanogpt_style", tmp_path)
    result = apply_skill("torch-compile", script, params={"mode": "max-autotune"})
    assert result.changed and 'compile_blocks(model, mode="max-autotune")' in script.read_text()


def test_dry_run_leaves_the_file_untouched_and_its_diff_applies_with_git(tmp_path: Path):
    recipe = copy_recipe("template", tmp_path)
    before = (recipe / "recipe.py").read_text()

    dry = apply_skill("loss-guard", recipe, dry_run=True, diff_root=tmp_path)

    assert dry.changed and dry.message.startswith("loss-guard would change recipe.py")
    assert (recipe / "recipe.py").read_text() == before
    assert dry.diff.startswith("--- a/recipe/recipe.py\n")
    assert git_apply(dry.diff, tmp_path, "--check").returncode == 0
    git_apply(dry.diff, tmp_path)
    patched = (recipe / "recipe.py").read_text()
    (recipe / "recipe.py").write_text(before)
    apply_skill("loss-guard", recipe)
    assert (recipe / "recipe.py").read_text() == patched


def test_a_diff_root_that_does_not_hold_the_recipe_is_an_error(tmp_path: Path):
    recipe = copy_recipe("template", tmp_path / "a")
    with pytest.raises(SkillError, match="does not contain the recipe"):
        apply_skill("freeze", recipe, diff_root=tmp_path / "b")


def test_a_file_without_a_final_newline_gets_a_diff_git_accepts(tmp_path: Path):
    script = copy_recipe("nanogpt_style", tmp_path)
    script.write_text(script.read_text().rstrip("\n"))
    dry = apply_skill("mixed-precision", script, dry_run=True)
    assert git_apply(dry.diff, tmp_path, "--check").returncode == 0


def test_writes_are_atomic_and_keep_the_file_mode(tmp_path: Path):
    script = copy_recipe("nanogpt_style", tmp_path)
    os.chmod(script, 0o640)
    apply_skill("gradient-checkpointing", script)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["nanogpt_style.py"]  # no temporary left
    assert script.stat().st_mode & 0o777 == 0o640


def test_a_missing_recipe_is_refused(tmp_path: Path):
    with pytest.raises(RecipeNotFound, match="is not a recipe folder: it has no recipe.py"):
        apply_skill("freeze", tmp_path)
    with pytest.raises(RecipeNotFound, match="neither a recipe folder"):
        apply_skill("freeze", tmp_path / "notes.txt")


def test_a_recipe_that_does_not_parse_is_refused_and_untouched(tmp_path: Path):
    script = tmp_path / "train.py"
    script.write_text("model = GPT(\n")
    with pytest.raises(SkillRefused, match=r"train.py does not parse \(line"):
        apply_skill("freeze", script)
    assert script.read_text() == "model = GPT(\n"


def test_a_result_that_would_not_parse_is_never_written(tmp_path: Path, monkeypatch):
    """Even a buggy codemod cannot write a broken file: the result is parsed first."""
    import libcst as cst

    from skills.codemod_kit import Edits
    from skills.registry import skill

    script = copy_recipe("nanogpt_style", tmp_path)
    before = script.read_text()

    def broken(recipe, params):
        edits = Edits(recipe)
        first = recipe.module.body[-1]
        edits.insert_after(first, [cst.parse_statement("return model\n")])  # outside a function
        return edits

    monkeypatch.setattr(skill("freeze").codemod, "apply", broken)
    with pytest.raises(SkillError, match="the result would not parse"):
        apply_skill("freeze", script)
    assert script.read_text() == before


def test_tab_indented_and_crlf_files_keep_their_style(tmp_path: Path):
    source = (FIXTURES / "nanogpt_style.py").read_text().replace("    ", "\t").replace("\n", "\r\n")
    script = tmp_path / "train.py"
    script.write_bytes(source.encode())

    apply_skill("gradient-checkpointing", script)

    text = script.read_bytes().decode()
    assert "\r\n" in text and "\n" not in text.replace("\r\n", "")
    assert "\tchosen = {id(block)" in text and "    chosen" not in text
    compile(text, "train.py", "exec")


def test_errors_leave_the_file_untouched(tmp_path: Path):
    script = copy_recipe("nanogpt_style", tmp_path)
    before = script.read_bytes()
    stamp = script.stat().st_mtime_ns
    with pytest.raises(SkillRefused):
        apply_skill("tensor-parallel", script)
    assert script.read_bytes() == before and script.stat().st_mtime_ns == stamp


def test_comments_around_edited_statements_are_kept(tmp_path: Path):
    script = copy_recipe("nanogpt_style", tmp_path)
    text = script.read_text()
    text = text.replace(
        "    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)\n",
        "    # clip\n    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # keep norms sane\n",
    )
    text = text.replace("    optimizer.step()\n", "    # update\n    optimizer.step()  # the step\n")
    text = text.replace("    logits, loss = model(x, y)\n", "    # forward\n    logits, loss = model(x, y)  # with the loss\n")
    script.write_text(text)

    apply_skill("loss-guard", script)
    apply_skill("mixed-precision", script)

    assert (
        "    # forward\n"
        "    with torch.autocast(device_type=x.device.type, dtype=torch.bfloat16):\n"
        "        logits, loss = model(x, y)  # with the loss\n"
    ) in script.read_text()
    assert (
        "    # clip\n"
        "    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # keep norms sane\n"
        "    # update\n"
        "    if loss_guard.check(loss, grad_norm):\n"
        "        optimizer.step()  # the step\n"
    ) in script.read_text()
