"""codemod_kit: a new standard-library import joins its section, and an optimizer class that a
skill wrote (MuonWithAdamW) is an optimizer anchor like torch.optim's."""

from __future__ import annotations

from pathlib import Path

from skills.codemod_kit import anchors
from skills.codemod_kit.edits import Import, merge_imports
from skills.codemod_kit.recipe import Recipe

SOURCE = '''"""A script."""

import math
from dataclasses import dataclass

import torch

optimizer = MuonWithAdamW(model, lr=1e-3)
optimizer.step()
'''


def test_a_standard_library_import_goes_at_the_end_of_its_section_without_a_blank_line():
    recipe = Recipe(Path("script.py"), SOURCE)

    code = merge_imports(recipe.module, [Import("typing", "Callable")], recipe).code

    assert "from dataclasses import dataclass\nfrom typing import Callable\n\nimport torch\n" in code


def test_an_optimizer_written_by_a_skill_is_an_optimizer_anchor():
    recipe = Recipe(Path("script.py"), SOURCE)

    (constructor,) = anchors.optimizer_constructors(recipe)
    ((step, receiver),) = anchors.optimizer_step_calls(recipe)

    assert recipe.code(constructor) == "MuonWithAdamW(model, lr=1e-3)"
    assert receiver == "optimizer"
