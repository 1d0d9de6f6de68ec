"""Module-level helper definitions that skills write next to the code that calls them."""

from __future__ import annotations

import libcst as cst

from skills.codemod_kit import templates
from skills.codemod_kit.edits import Edits
from skills.codemod_kit.recipe import Recipe

TRANSFORMER_BLOCKS = '''
def transformer_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks of a model: the children of its largest ``nn.ModuleList``.

    Finds Hugging Face decoder layers (``model.model.layers``) and nanoGPT blocks
    (``transformer.h``) alike, without naming the block class.
    """
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) > 0]
    if not lists:
        return []
    return list(max(lists, key=lambda m: sum(p.numel() for p in m.parameters())))
'''


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


def ensure_transformer_blocks(recipe: Recipe, edits: Edits, near: cst.CSTNode) -> None:
    """Make ``transformer_blocks(model)`` available: the engine's, when the recipe already uses
    the engine, else a copy in the file (shared by every skill that needs the blocks)."""
    if recipe.defines("transformer_blocks") or _pending(edits, "transformer_blocks"):
        return
    edits.add_import("torch")
    if any(q.startswith("engine.") for q in recipe.imports.values()):
        edits.add_import("engine.fsdp", "transformer_blocks")
    else:
        insert_definitions(recipe, edits, TRANSFORMER_BLOCKS, near)


def _pending(edits: Edits, name: str) -> bool:
    for statements in list(edits.before.values()) + list(edits.after.values()):
        for statement in statements:
            if isinstance(statement, (cst.FunctionDef, cst.ClassDef)) and statement.name.value == name:
                return True
    return False
