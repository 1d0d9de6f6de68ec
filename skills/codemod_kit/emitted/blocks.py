"""``find_blocks``: the repeated blocks of a model, as every skill that acts on them finds them.
Copied into a recipe by skills/codemod_kit/definitions.py (ensure_find_blocks), once per file.
"""

import torch


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
