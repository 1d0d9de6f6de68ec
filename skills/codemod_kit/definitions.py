"""Module-level helper definitions that skills write next to the code that calls them."""

from __future__ import annotations

import libcst as cst

from skills.codemod_kit import templates
from skills.codemod_kit.edits import Edits
from skills.codemod_kit.recipe import Recipe

FIND_BLOCKS = '''
def find_blocks(
    model: torch.nn.Module, skill: str, target: torch.nn.Module | None = None, warn=None
) -> tuple[str, list[torch.nn.Module]]:
    """The repeated blocks of a model and where they are (``"LlamaForCausalLM.model.layers"``):
    the children of ``target`` when it is an ``nn.ModuleList``/``nn.Sequential`` (``[target]``
    for another module), else those of the model's largest ``nn.ModuleList`` or ``nn.Sequential``
    of modules of one class: Hugging Face decoder layers, nanoGPT's ``transformer.h``, a U-Net's
    down blocks. A model without blocks is an error (``warn`` instead, when given: the run goes
    on without the change), never a change that quietly does nothing.
    """
    names = {id(m): n for n, m in model.named_modules()}

    def place(module: torch.nn.Module) -> str:
        name = names.get(id(module), "")
        return f"{type(model).__name__}.{name}" if name else type(model).__name__

    if target is not None:
        if isinstance(target, (torch.nn.ModuleList, torch.nn.Sequential)):
            return place(target), list(target)
        return place(target), [target]
    containers = [
        m
        for m in model.modules()
        if (isinstance(m, torch.nn.ModuleList) and len(m) > 0)
        or (isinstance(m, torch.nn.Sequential) and len(m) > 1 and len({type(c) for c in m}) == 1)
    ]
    if containers:
        largest = max(containers, key=lambda m: sum(p.numel() for p in m.parameters()))
        return place(largest), list(largest)
    message = (
        f"{skill}: {type(model).__name__} has no repeated blocks (an nn.ModuleList, or an "
        "nn.Sequential of modules of one class), so the change does nothing; name the module to "
        f"act on with the skill's target parameter"
    )
    if warn is None:
        raise ValueError(message)
    warn(message)
    return "", []
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


def ensure_find_blocks(recipe: Recipe, edits: Edits, near: cst.CSTNode) -> None:
    """Make ``find_blocks(model, skill, target, warn)`` available: one copy in the file, shared
    by every skill that acts on the blocks."""
    if recipe.defines("find_blocks") or _pending(edits, "find_blocks"):
        return
    edits.add_import("torch")
    insert_definitions(recipe, edits, FIND_BLOCKS, near)


def _pending(edits: Edits, name: str) -> bool:
    for statements in list(edits.before.values()) + list(edits.after.values()):
        for statement in statements:
            if isinstance(statement, (cst.FunctionDef, cst.ClassDef)) and statement.name.value == name:
                return True
    return False
