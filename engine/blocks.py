"""``find_blocks``: a model's repeated blocks, the one definition FSDP2 shards by
(``engine.fsdp.transformer_blocks``) and every skill that acts on blocks writes into a recipe.

The skills' codemods copy ``find_blocks`` into the recipe as text, once per file
(``skills/codemod_kit/definitions.py``: ``ensure_find_blocks``), so a recipe still holds all of
its code and the engine shards the blocks the recipe's own copy finds. Only ``torch`` is imported
here: what the copy needs in a recipe.
"""

import torch


def find_blocks(
    model: torch.nn.Module, skill: str, target: torch.nn.Module | None = None, warn=None
) -> tuple[str, list[torch.nn.Module]]:
    """The repeated blocks of a model and where they are (``"LlamaForCausalLM.model.layers"``):
    the children of ``target`` when it is an ``nn.ModuleList``/``nn.Sequential`` (``[target]``
    for another module); else the modules of the classes a Hugging Face model names in
    ``_no_split_modules`` that are items of an ``nn.ModuleList`` (its own layers, the outermost
    where they nest: a decoder's layers, both towers' layers of a vision-language model); else
    the children of the model's largest (by parameters) ``nn.ModuleList`` or ``nn.Sequential`` of
    modules of one class: nanoGPT's ``transformer.h``, a U-Net's down blocks. A model without
    blocks is an error (``warn`` instead, when given: the run goes on without the change), never
    a change that quietly does nothing.
    """
    names = {id(m): n for n, m in model.named_modules()}

    def place(module: torch.nn.Module) -> str:
        name = names.get(id(module), "")
        return f"{type(model).__name__}.{name}" if name else type(model).__name__

    if target is not None:
        if isinstance(target, (torch.nn.ModuleList, torch.nn.Sequential)):
            return place(target), list(target)
        return place(target), [target]
    declared = set(getattr(model, "_no_split_modules", None) or ())
    if declared:
        # Only listed ones: a class named there for another reason (an attention module kept
        # whole, a vision embedding) is no block.
        lists = {id(c): m for m in model.modules() if isinstance(m, torch.nn.ModuleList) for c in m}
        blocks: list[torch.nn.Module] = []
        places: list[str] = []
        inside: set[int] = set()
        for module in model.modules():  # parents come before their children
            if id(module) in inside or type(module).__name__ not in declared or id(module) not in lists:
                continue
            blocks.append(module)
            where = place(lists[id(module)])
            if where not in places:
                places.append(where)
            inside.update(id(m) for m in module.modules())
        if blocks:
            return " and ".join(places), blocks
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
