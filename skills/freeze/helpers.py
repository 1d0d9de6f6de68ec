"""What the freeze skill writes into a recipe: skills/freeze/codemod.py copies these definitions
with libcst (skills/codemod_kit/copied.py). A real module, so that ruff lints it and tests import it.
"""

import fnmatch

import torch


def freeze_parameters(
    model: torch.nn.Module,
    embeddings: bool = True,
    first_blocks: int = 0,
    patterns: list[str] = (),
    found_blocks: tuple[str, list[torch.nn.Module]] = ("", []),
    parameters=(),
) -> int:
    """Freeze part of a model: with ``requires_grad=False`` no gradient is computed or stored for
    a parameter, and the optimizer, which is handed only trainable parameters, never changes it.
    Freezes every ``nn.Embedding`` (with ``embeddings``), the first ``first_blocks`` of
    ``found_blocks`` (what ``find_blocks`` returns: where the blocks are, and the blocks), the
    parameters whose names match one of the fnmatch ``patterns``, and the given ``parameters``.
    Returns the number of values it froze (those the recipe had frozen already are not counted).
    (Written by the freeze skill.)
    """
    chosen: dict[int, torch.nn.Parameter] = {id(p): p for p in parameters}
    if embeddings:
        for module in model.modules():
            if isinstance(module, torch.nn.Embedding):
                chosen.update((id(p), p) for p in module.parameters())
    where, blocks = found_blocks
    for block in blocks[:first_blocks]:
        chosen.update((id(p), p) for p in block.parameters())
    for name, parameter in model.named_parameters():
        if any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns):
            chosen[id(parameter)] = parameter
    if not chosen:
        raise ValueError(
            f"freeze_parameters: nothing matched (embeddings={embeddings}, "
            f"first_blocks={first_blocks}, patterns={list(patterns)})"
        )
    already = sum(p.numel() for p in chosen.values() if not p.requires_grad)
    for parameter in chosen.values():
        parameter.requires_grad_(False)
    frozen = sum(p.numel() for p in chosen.values()) - already
    total = sum(p.numel() for p in model.parameters())
    blocks_part = f", the first {min(first_blocks, len(blocks))} of {len(blocks)} blocks of {where}" if blocks else ""
    if frozen == 0:
        print(f"freeze: nothing new frozen: the {already:,} parameter values chosen ({len(chosen)} tensors"
              f"{blocks_part}) were frozen already, by the recipe", flush=True)
        return 0
    before = f"; {already:,} of those chosen were frozen already" if already else ""
    print(f"freeze: froze {frozen:,} of {total:,} parameter values ({len(chosen)} tensors{blocks_part}{before})",
          flush=True)
    return frozen
