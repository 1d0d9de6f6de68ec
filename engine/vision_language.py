"""``vision_language_parts`` and ``vision_language_parameters``: the parts of a vision-language
model, as the skills that act on them find them. Copied into a recipe by
skills/codemod_kit/vlm.py (ensure_helper), once per file; ``engine.estimate`` finds the language
model the lora skill adapts with the same function.
"""

import torch


def vision_language_parts(
    model: torch.nn.Module, skill: str, parts: list[str], every: bool = False
) -> dict[str, torch.nn.Module]:
    """The parts of a vision-language model, found by module name (the shallowest match): the
    ``vision_tower`` (or ``visual``, ``vision_model``, ``vision_encoder``, ``image_encoder``), the
    ``projector`` (``multi_modal_projector``, ``mm_projector``, ``merger``, ``connector``,
    ``aligner``) and the ``language_model`` (``llm``, ``text_model``). Returns ``parts`` (with
    ``every``, all parts found); one of ``parts`` that the model lacks is an error listing the
    modules it has. (Written by a trainwright skill.)
    """
    names = {
        "vision_tower": ("vision_tower", "visual", "vision_model", "vision_encoder", "image_encoder"),
        "projector": ("multi_modal_projector", "mm_projector", "projector", "merger", "connector", "aligner"),
        "language_model": ("language_model", "llm", "text_model"),
    }
    found = {}
    for part, candidates in names.items():
        matches = [(n.count("."), n, m) for n, m in model.named_modules() if n.rsplit(".", 1)[-1] in candidates]
        if matches:
            found[part] = min(matches, key=lambda match: match[:2])[2]
    missing = [part for part in parts if part not in found]
    if missing:
        seen = [n for n, _ in model.named_modules() if n and n.count(".") < 2]
        raise ValueError(
            f"{skill}: {type(model).__name__} has no {' or '.join(missing)} (a module named one of "
            f"{[n for part in missing for n in names[part]]}); its modules: {seen[:16]}"
        )
    return found if every else {part: found[part] for part in parts}


def vision_language_parameters(model: torch.nn.Module, skill: str, parts: list[str]) -> list[torch.nn.Parameter]:
    """The parameters of the chosen parts of a vision-language model. The language model has its
    output head too (``lm_head``, outside ``language_model`` in transformers' classes); a part
    nested in another (Qwen2-VL's ``visual.merger``) keeps its parameters out of the outer one.
    (Written by a trainwright skill.)
    """
    found = vision_language_parts(model, skill, parts, every=True)
    depth = {id(m): n.count(".") for n, m in model.named_modules()}
    owner = {}
    for part, module in sorted(found.items(), key=lambda item: depth[id(item[1])]):  # inner parts last
        owner.update((id(p), part) for p in module.parameters())
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    for parameter in head.parameters() if head is not None else ():
        owner.setdefault(id(parameter), "language_model")
    return [p for p in model.parameters() if owner.get(id(p)) in parts]
