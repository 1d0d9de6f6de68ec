"""The parts of a vision-language model (LLaVA-style): vision tower, projector, language model.

Shared by the skills that act on parts (``freeze`` with ``parts``, ``gradient-checkpointing`` on
both towers, ``vlm-freeze-policy``). The parts are found by their module names, transformers'
own first (``LlavaForConditionalGeneration``: ``model.vision_tower``, ``model.multi_modal_projector``,
``model.language_model``, with ``lm_head``), then common alternatives (Qwen2-VL's ``visual`` and
``visual.merger``, LLaVA's original ``mm_projector``, ``llm``). The written helper finds them at run
time; the codemod refuses a model it can see has none (a text-only Hugging Face class, a class of
the file without such attributes), listing what it saw.
"""

from __future__ import annotations

import re
from pathlib import Path

import libcst as cst

from skills.codemod_kit import copied
from skills.codemod_kit.definitions import pending_definition, insert_definitions
from skills.codemod_kit.edits import Edits
from skills.codemod_kit.reach import ModelShape
from skills.codemod_kit.recipe import Recipe
from skills.errors import SkillRefused

# Module names of each part, in the order they are looked for.
NAMES = {
    "vision_tower": ("vision_tower", "visual", "vision_model", "vision_encoder", "image_encoder"),
    "projector": ("multi_modal_projector", "mm_projector", "projector", "merger", "connector", "aligner"),
    "language_model": ("language_model", "llm", "text_model"),
}
# Hugging Face classes with a vision tower (``LlavaForConditionalGeneration``, ``Qwen2VLForConditionalGeneration``,
# ``AutoModelForImageTextToText``, ``AutoModelForVision2Seq``).
_VISION_LANGUAGE_CLASS = re.compile(r"Llava|VL|Vision|ImageTextToText|ConditionalGeneration|Idefics|Pali|Blip")

# The helpers are a real module of the engine (engine/vision_language.py: the estimate finds the
# parts with them too), read as text and copied into the recipe once per file.
HELPERS_MODULE = Path(__file__).parents[2] / "engine" / "vision_language.py"


def ensure_helper(recipe: Recipe, edits: Edits, near: cst.CSTNode) -> None:
    """Write ``vision_language_parts``/``vision_language_parameters`` once into the file."""
    if recipe.defines("vision_language_parts") or pending_definition(edits, "vision_language_parts"):
        return
    insert_definitions(recipe, edits, copied.definitions(HELPERS_MODULE), near)
    for name in copied.imports(HELPERS_MODULE):
        edits.add_import(*name)


def is_vision_language(found: ModelShape) -> bool:
    """Does the code say the model has a vision tower? A Hugging Face vision-language class, or
    a class of the file with a vision-tower attribute."""
    if found.hf:
        return bool(_VISION_LANGUAGE_CLASS.search(found.hf_class or found.name))
    return any(name in NAMES["vision_tower"] for name in found.attributes)


def check_parts(recipe: Recipe, skill: str, found: ModelShape, parts: list[str], instead: str) -> str:
    """Refuse parts that the model, as far as the code shows, does not have; return how the
    parts are described in ``acts_on``. A model whose class the codemod cannot see (a factory
    of another module) is checked at run time by the helper."""
    where = recipe.where(found.model.statement)
    if found.hf and not is_vision_language(found):
        raise SkillRefused(
            f"{skill}: {found.name} ({where}) is a text-only model: it has no {' or '.join(p for p in parts)} "
            f"part (those are parts of a vision-language model such as LlavaForConditionalGeneration); {instead}"
        )
    if found.cls is not None and not found.hf:
        missing = [p for p in parts if not any(n in NAMES[p] for n in found.attributes)]
        if missing:
            seen = ", ".join(f"`{n}`" for n in found.attributes) or "none"
            raise SkillRefused(
                f"{skill}: {found.name} ({where}) has no {' or '.join(missing)} (an attribute named one of "
                f"{', '.join(n for p in missing for n in NAMES[p])}); its submodules: {seen}; {instead}"
            )
    checked = "" if found.hf or found.cls is not None else " (found by name at run time)"
    return f"{' and '.join(p.replace('_', ' ') for p in parts)} of {found.name}{checked}"
