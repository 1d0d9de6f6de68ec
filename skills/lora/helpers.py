"""What the lora skill writes into a recipe: skills/lora/codemod.py copies these definitions
with libcst (skills/codemod_kit/copied.py). A real module, so that ruff lints it and tests import it.
"""

import torch
from peft import LoraConfig, inject_adapter_in_model

from engine.blocks import find_blocks  # written by ensure_find_blocks


def apply_lora(
    model: torch.nn.Module,
    rank: int = 8,
    alpha: float = 16,
    dropout: float = 0.0,
    target_modules: list[str] | None = None,
    within: torch.nn.Module | None = None,
) -> int:
    """LoRA (Hu et al., 2021) with peft: freeze the model and learn a low-rank update
    ``(alpha / rank) * B @ A`` next to each targeted linear layer. ``B`` starts at zero, so
    training starts from the model as it is; only the adapters are trainable, which cuts
    gradient and optimizer memory to a small fraction. The adapters are injected in place: the
    model keeps its class and attributes. Without ``target_modules``, every ``nn.Linear`` inside
    the repeated blocks of ``within`` (a part of the model: a vision-language model's language
    model), or else of the whole model, is adapted; a part's layers are named by their paths,
    since the other parts have layers of the same names (a vision tower's ``q_proj``) that peft
    would adapt too. Returns the number of trainable (adapter) values. (Written by the lora skill.)
    """
    linears = sorted(name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear))
    shown = list(target_modules or [])
    if target_modules is None:
        where, blocks = find_blocks(model if within is None else within, "lora", warn=lambda message: None)
        inside = {id(m) for block in blocks for m in block.modules() if isinstance(m, torch.nn.Linear)}
        paths = [name for name, module in model.named_modules() if id(module) in inside]
        shown = sorted({path.rsplit(".", 1)[-1] for path in paths})
        target_modules = shown if within is None else paths
    if not target_modules:
        raise ValueError(
            f"lora: no nn.Linear layer to adapt in {type(model).__name__}; its linear layers are "
            f"{linears or 'none'}: name them with target_modules"
        )
    config = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=target_modules)
    inject_adapter_in_model(config, model)
    adapted = [name for name, module in model.named_modules() if hasattr(module, "lora_A")]
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    part = next((f"`{name}` of " for name, module in model.named_modules() if module is within), "")
    print(
        f"lora: adapted {len(adapted)} linear layers ({', '.join(shown)}) of "
        f"{part}{type(model).__name__}; {trainable:,} trainable values",
        flush=True,
    )
    return trainable
