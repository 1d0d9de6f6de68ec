"""Every config field of every template has a description: describe_recipe is how an agent learns
what a key does, and an empty one leaves it guessing (dpo.beta, dpo.sft_weight, data.max_turns)."""

from __future__ import annotations

import pytest
from pydantic import BaseModel

from tests.support import REPO

TEMPLATES = sorted(p.name for p in (REPO / "recipes_template").iterdir() if (p / "recipe.py").is_file())


def undescribed(model_class: type[BaseModel], prefix: str = "") -> list[str]:
    missing = []
    for name, field in model_class.model_fields.items():
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            missing += undescribed(annotation, f"{prefix}{name}.")
        elif not (field.description or "").strip():
            missing.append(f"{prefix}{name}")
    return missing


def test_there_are_templates():
    assert {"causal_lm", "sft", "dpo", "vlm"} <= set(TEMPLATES)


@pytest.mark.parametrize("template", TEMPLATES)
def test_every_config_field_of_the_template_has_a_description(template):
    from engine.launch import load_recipe_class

    recipe_class = load_recipe_class(REPO / "recipes_template" / template)
    assert undescribed(recipe_class.config_class) == []
