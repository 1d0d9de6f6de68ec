"""A trained model as a Hugging Face folder: ``save_pretrained`` and the tokenizer, LoRA merged
or as a peft adapter.

The model comes from the recipe's ``Engine.hf_model()`` with the checkpoint's weights loaded
(``engine.model_io``); the tokenizer or processor from ``Engine.hf_processing()``. The folder
holds ``config.json``, ``generation_config.json``, the weights as safetensors (sharded, with
``model.safetensors.index.json``, above ``max_shard_size``) and the tokenizer's files, so
``AutoModelForCausalLM.from_pretrained`` and ``AutoTokenizer.from_pretrained`` load it, and a
recipe starts from it with ``model.pretrained_path``.

LoRA adapters (peft layers in the model, as the ``lora`` skill injects them) are either merged
into the base weights (``lora="merged"``: a plain model folder) or saved as a peft adapter folder
(``lora="adapter"``: ``adapter_config.json`` + ``adapter_model.safetensors``, loadable with
``peft.AutoPeftModelForCausalLM.from_pretrained``); the base model it adapts is the folder the
run started from (``name_or_path``) or, for a model trained from scratch, ``base/`` inside the
export. ``base_model_name_or_path`` names it relative to the export folder (``base``,
``../sft_model``), never by an absolute path of this machine; peft resolves it from the working
directory, so load from the export's folder or pass the base model yourself.
"""

from __future__ import annotations

import copy
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

from engine.config import ConfigError
from engine.seams import LORA_CHOICES

ADAPTER_BASE_DIRNAME = "base"
# The key prefix peft's own PeftModel.save_pretrained writes (its wrapper's attribute path).
PEFT_KEY_PREFIX = "base_model.model."


def lora_layers(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The peft adapter layers of ``model`` (empty when peft was never imported)."""
    if "peft" not in sys.modules:
        return []
    from peft.tuners.tuners_utils import BaseTunerLayer

    return [(name, module) for name, module in model.named_modules() if isinstance(module, BaseTunerLayer)]


def dequantized(layer: torch.nn.Module) -> torch.nn.Module:
    """A bitsandbytes 4-bit linear layer as a plain ``nn.Linear`` in the dtype its weight had
    before it was quantised (the base dtype); any other layer as it is."""
    quant_state = getattr(getattr(layer, "weight", None), "quant_state", None)
    if quant_state is None:
        return layer
    from bitsandbytes.functional import dequantize_4bit

    weight = dequantize_4bit(layer.weight.data, quant_state).to(quant_state.dtype)
    plain = torch.nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None,
                            device=weight.device, dtype=weight.dtype)
    plain.weight.data.copy_(weight)
    if layer.bias is not None:
        plain.bias.data.copy_(layer.bias.data)
    return plain


def dequantize_model(model: torch.nn.Module) -> int:
    """Every 4-bit linear layer of ``model`` (the ``qlora`` skill's) replaced by its
    :func:`dequantized` layer, adapters' base layers included; returns how many."""
    if "bitsandbytes" not in sys.modules:
        return 0
    count = 0
    for parent in list(model.modules()):
        for child_name, child in list(parent.named_children()):
            plain = dequantized(child)
            if plain is not child:
                setattr(parent, child_name, plain)
                count += 1
    return count


def unload_lora(model: torch.nn.Module, merge: bool) -> int:
    """Replace every adapter layer by its base layer, first merging the adapter's update into
    the base weight when ``merge``; returns how many layers were replaced. A 4-bit base layer
    comes back dequantised, the update added to it in the base dtype (peft's own merge would
    quantise the sum again)."""
    layers = lora_layers(model)
    for name, layer in layers:
        base = dequantized(layer.get_base_layer())
        if merge and base is not layer.get_base_layer():
            with torch.no_grad():
                for adapter in layer.active_adapters:
                    base.weight += layer.get_delta_weight(adapter).to(base.weight.dtype)
        elif merge:
            layer.merge()
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, base)
    if hasattr(model, "peft_config"):
        del model.peft_config
    return len(layers)


def text_tokenizer(processing: Any) -> Any:
    """The tokenizer of a processor (a multimodal recipe), or the tokenizer itself."""
    return getattr(processing, "tokenizer", processing)


def set_special_tokens(model: Any, processing: Any) -> None:
    """The model's config and generation config take the tokenizer's end and padding ids, so
    ``generate()`` stops where training ended documents."""
    if processing is None:
        return
    tokenizer = text_tokenizer(processing)
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = getattr(tokenizer, name, None)
        setattr(model.config, name, value)
        if getattr(model, "generation_config", None) is not None:
            setattr(model.generation_config, name, value)


def export(
    model: Any,
    processing: Any,
    out: Path,
    lora: str = "merged",
    max_shard_size: str | int = "2GB",
    final_dir: Path | None = None,
) -> dict[str, Any]:
    """Write ``model`` (with its adapters, if any, as ``lora`` says) and ``processing`` into the
    empty folder ``out``; ``final_dir``: where ``out`` will be renamed to (an adapter's base is
    referenced there). Returns what was written."""
    if lora not in LORA_CHOICES:
        raise ConfigError(f"lora must be one of {', '.join(LORA_CHOICES)}, got {lora!r}")
    out = Path(out)
    final_dir = Path(final_dir) if final_dir is not None else out
    quantized = any(getattr(p, "quant_state", None) is not None for p in model.parameters())
    if not quantized:  # adapters merge in float32, as the model is saved
        model = model.float() if model.dtype != torch.float32 else model
    layers = lora_layers(model)
    result: dict[str, Any] = {"lora": None, "lora_layers": len(layers)}
    if layers and lora == "merged":
        unload_lora(model, merge=True)
        result["lora"] = "merged"
    if not (layers and lora == "adapter"):
        dequantize_model(model)  # 4-bit layers (qlora) back in their base dtype
    model = model.float() if model.dtype != torch.float32 else model
    set_special_tokens(model, processing)
    if layers and lora == "adapter":
        result["lora"] = "adapter"
        result["base_model"] = _save_adapter(model, out, final_dir, max_shard_size)
        if processing is not None and (out / ADAPTER_BASE_DIRNAME).is_dir():
            save_processing(processing, out / ADAPTER_BASE_DIRNAME)  # the base folder loads on its own too
    else:
        model.save_pretrained(out, max_shard_size=max_shard_size)
    if processing is not None:
        save_processing(processing, out)
    result["tokenizer"] = type(processing).__name__ if processing is not None else None
    result["parameters"] = sum(p.numel() for p in model.parameters())
    return result


# What loading puts into a tokenizer's or processor's saved config: how it was loaded here, not
# what it is (``from_pretrained(..., local_files_only=True)`` writes them back out).
LOAD_TIME_KEYS = ("local_files_only", "is_local", "_commit_hash", "cache_dir", "force_download", "token")


def save_processing(processing: Any, out: Path) -> None:
    """``processing.save_pretrained(out)``, with the load-time keys left out of its config files."""
    processing.save_pretrained(out)
    for name in ("tokenizer_config.json", "processor_config.json", "preprocessor_config.json"):
        path = Path(out) / name
        if not path.is_file():
            continue
        config = json.loads(path.read_text())
        if isinstance(config, dict) and any(key in config for key in LOAD_TIME_KEYS):
            cleaned = {key: value for key, value in config.items() if key not in LOAD_TIME_KEYS}
            path.write_text(json.dumps(cleaned, indent=2, ensure_ascii=False) + "\n")


def adapter_base_reference(base: str, final_dir: Path) -> str:
    """What an adapter's ``base_model_name_or_path`` says: a local folder relative to the export
    (``../sft_model``: the export moves with it, and names no path of this machine), a Hub id as
    it is."""
    if not os.path.isdir(base):
        return base
    return Path(os.path.relpath(Path(base).resolve(), Path(final_dir).resolve())).as_posix()


def _save_adapter(model: Any, out: Path, final_dir: Path, max_shard_size: str | int) -> str:
    """A peft adapter folder in ``out``; returns the base model it names."""
    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file

    (adapter_name, config), *others = model.peft_config.items()
    if others:
        raise ConfigError(f"the model has {len(others) + 1} LoRA adapters; export one with lora='merged'")
    state = {PEFT_KEY_PREFIX + key: value.detach().contiguous() for key, value in
             get_peft_model_state_dict(model, adapter_name=adapter_name).items()}
    base = model.name_or_path
    if not (base and os.path.isdir(base)):
        # Trained from scratch: the adapter is worth nothing without the weights it adapts.
        unload_lora(model, merge=False)
        dequantize_model(model)
        model.save_pretrained(out / ADAPTER_BASE_DIRNAME, max_shard_size=max_shard_size)
        base = ADAPTER_BASE_DIRNAME
    else:
        base = adapter_base_reference(base, final_dir)
    config = copy.deepcopy(config)
    config.base_model_name_or_path, config.task_type, config.inference_mode = base, "CAUSAL_LM", True
    out.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(out)
    save_file(state, out / "adapter_model.safetensors", metadata={"format": "pt"})
    return base
