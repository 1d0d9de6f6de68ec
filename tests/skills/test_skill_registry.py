"""The registry: every skill folder is a valid Agent Skills skill, and the API describes it."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from skills import InvalidParams, SkillInfo, UnknownSkill, get_skill, list_skills
from skills.registry import SKILLS_ROOT, parse_front_matter
from tests.skills.skill_helpers import REPO

SKILL_NAMES = [
    "flash-attention",
    "freeze",
    "gradient-checkpointing",
    "liger-kernel",
    "lora",
    "loss-guard",
    "mixed-precision",
    "muon",
    "qlora",
    "sequence-packing",
    "sequence-parallel",
    "tensor-parallel",
    "torch-compile",
    "vlm-freeze-policy",
]
GPU_SKILLS = {"flash-attention", "liger-kernel"}  # they apply anywhere but only act on a CUDA GPU
SECTIONS = ["Goal", "When to use", "What the codemod changes", "Parameters", "Validation", "Doing it by hand"]


def test_list_skills_returns_every_skill_sorted_by_name():
    assert [s.name for s in list_skills()] == SKILL_NAMES


@pytest.mark.parametrize("name", SKILL_NAMES)
def test_skill_folder_follows_the_agent_skills_format(name: str):
    folder = SKILLS_ROOT / name
    text = (folder / "SKILL.md").read_text()
    front = parse_front_matter(text, folder / "SKILL.md")

    assert front["name"] == folder.name
    assert re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)*", front["name"]) and len(front["name"]) <= 64
    assert 0 < len(front["description"]) <= 1024
    assert set(front) <= {"name", "description", "license", "compatibility", "metadata", "allowed-tools"}
    assert all(isinstance(v, str) for v in front["metadata"].values())  # Agent Skills: string values
    headings = re.findall(r"^## (.+)$", text, flags=re.MULTILINE)
    assert headings == SECTIONS
    assert (folder / "codemod.py").is_file()


@pytest.mark.parametrize("name", SKILL_NAMES)
def test_get_skill_describes_the_skill_and_its_parameters(name: str):
    info = get_skill(name)

    assert isinstance(info, SkillInfo)
    assert info.name == name and info.version == "1.0.0" and info.requires_gpu is (name in GPU_SKILLS)
    assert Path(info.path) == SKILLS_ROOT / name
    assert info.skill_md.startswith("---\nname: " + name)
    assert info.params_schema["type"] == "object"
    assert info.params_schema.get("additionalProperties") is False
    for field in info.params_schema["properties"].values():
        assert field.get("description"), f"{name}: every parameter is documented"


def test_unknown_skill_names_the_valid_ones_and_the_closest():
    with pytest.raises(UnknownSkill) as error:
        get_skill("gradient-checkpoint")
    message = str(error.value)
    assert "did you mean 'gradient-checkpointing'?" in message
    assert "valid skills: flash-attention, freeze, gradient-checkpointing, liger-kernel, lora" in message


def test_unknown_parameter_is_named_with_the_valid_ones(tmp_path: Path):
    from skills import apply_skill

    with pytest.raises(InvalidParams) as error:
        apply_skill("lora", tmp_path, params={"rnak": 4})
    assert str(error.value).startswith("lora: unknown param 'rnak'; valid params: rank: int = 8, alpha")


def test_bad_parameter_value_is_named(tmp_path: Path):
    from skills import apply_skill

    with pytest.raises(InvalidParams) as error:
        apply_skill("gradient-checkpointing", tmp_path, params={"every": 0})
    assert "bad value for 'every' (0)" in str(error.value)


def test_importing_and_applying_skills_never_imports_torch(tmp_path: Path):
    script = (
        "import sys, shutil\n"
        "from pathlib import Path\n"
        "import skills\n"
        "skills.list_skills()\n"
        f"shutil.copytree({str(REPO / 'recipes_template' / 'causal_lm')!r}, {str(tmp_path / 'r')!r})\n"
        f"shutil.copytree({str(REPO / 'recipes_template' / 'vlm')!r}, {str(tmp_path / 'v')!r})\n"
        "refused = {('r', 'vlm-freeze-policy'), ('v', 'sequence-parallel')}\n"
        "for s in skills.list_skills():\n"
        "    for r in ('r', 'v'):\n"
        "        try:\n"
        f"            skills.apply_skill(s.name, Path({str(tmp_path)!r}) / r, dry_run=True)\n"
        "        except skills.SkillRefused:\n"
        "            assert (r, s.name) in refused, (r, s.name)\n"
        "heavy = sorted(m for m in ('torch', 'transformers', 'peft', 'numpy') if m in sys.modules)\n"
        "print(heavy)\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
