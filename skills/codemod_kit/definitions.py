"""Module-level helper definitions that skills write next to the code that calls them."""

from __future__ import annotations

from pathlib import Path

import libcst as cst

from skills.codemod_kit import copied, templates
from skills.codemod_kit.edits import Edits
from skills.codemod_kit.recipe import Recipe

# find_blocks is the engine's own definition (engine/blocks.py: FSDP2 shards the blocks it finds),
# read as text and copied into the recipe once per file.
BLOCKS_MODULE = Path(__file__).parents[2] / "engine" / "blocks.py"
FIND_BLOCKS = copied.definitions(BLOCKS_MODULE, ["find_blocks"])


def insert_definitions(
    recipe: Recipe, edits: Edits, code: str, near: cst.CSTNode, *, after: cst.BaseStatement | None = None
) -> None:
    """Insert top-level definitions before the top-level statement that holds ``near``, right
    after the definitions that precede it (so helpers join the file's other helpers), or right
    after the top-level statement ``after`` when given."""
    new = templates.definitions(recipe.module, code)
    if after is not None:
        edits.insert_after(after, new)
        return
    body = list(recipe.module.body)
    top = recipe.top_level_statement(near)
    index = body.index(top)
    previous_definition = None
    for statement in body[:index]:
        if isinstance(statement, (cst.FunctionDef, cst.ClassDef)):
            previous_definition = statement
    if previous_definition is not None:
        edits.insert_after(previous_definition, new)
    else:
        edits.insert_before(top, new)


def ensure_find_blocks(recipe: Recipe, edits: Edits, near: cst.CSTNode) -> None:
    """Make ``find_blocks(model, skill, target, warn)`` available: one copy in the file, shared
    by every skill that acts on the blocks."""
    if recipe.defines("find_blocks") or pending_definition(edits, "find_blocks"):
        return
    edits.add_import("torch")
    insert_definitions(recipe, edits, FIND_BLOCKS, near)


def pending_definition(edits: Edits, name: str) -> bool:
    for statements in list(edits.before.values()) + list(edits.after.values()):
        for statement in statements:
            if isinstance(statement, (cst.FunctionDef, cst.ClassDef)) and statement.name.value == name:
                return True
    return False
