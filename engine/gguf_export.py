"""A Hugging Face causal-LM folder as one GGUF file, for llama.cpp, Ollama and LM Studio.

The ``gguf`` package (llama.cpp's own Python writer) gives the file format, the tensor names
(``gguf.get_tensor_name_map``) and the quantisation of blocks; this module says what each family
needs beyond renaming, as llama.cpp's converter does:

- Llama (and Mistral, which llama.cpp runs as Llama): the rows of ``q_proj`` and ``k_proj``
  permuted from Hugging Face's rotary layout (the two halves of each head) to GGML's (pairs).
- Gemma 2: RMSNorm weights stored as ``1 + w`` (Hugging Face's norm multiplies by ``1 + w``).
- A tied output layer is left out: the runtime reads ``token_embd`` for both.

The tokenizer goes into the metadata as llama.cpp's ``gpt2`` model (a byte-level BPE from
``tokenizer.json``: every token, its type, the merges, the special token ids) with the chat
template. Norms and other vectors stay float32, as llama.cpp keeps them; a matrix whose rows do
not divide into the quantisation's blocks is written as float16.

Runs in the model process (:mod:`engine.model_io`), in the sandbox, after the folder was written.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from engine.config import ConfigError
from engine.seams import GGUF_QUANTIZATIONS

# The model types of the Hugging Face config, and the GGUF architecture each is written as.
ARCHITECTURES = {"llama": "LLAMA", "mistral": "LLAMA", "qwen2": "QWEN2", "qwen3": "QWEN3", "gemma2": "GEMMA2"}
PERMUTED = ("LLAMA",)  # families whose q/k rows llama.cpp stores in its own rotary order
NORM_PLUS_ONE = ("GEMMA2",)


def gguf_file_name(quantization: str) -> str:
    return f"model-{quantization}.gguf"


def write_gguf(folder: Path, out: Path, quantization: str = "f16", name: str | None = None) -> dict[str, Any]:
    """Write the model in ``folder`` (a ``save_pretrained`` folder with its tokenizer) to the new
    file ``out`` at ``quantization``, named ``name`` (``general.name``; default: the folder of
    ``out``); returns what was written."""
    import gguf

    if quantization not in GGUF_QUANTIZATIONS:
        raise ConfigError(f"quantization must be one of {', '.join(GGUF_QUANTIZATIONS)}, got {quantization!r}")
    config = json.loads((folder / "config.json").read_text())
    model_type = config.get("model_type")
    if model_type not in ARCHITECTURES:
        raise ConfigError(f"GGUF export knows the families {', '.join(sorted(ARCHITECTURES))}; this model is "
                          f"{model_type!r}: export it as a Hugging Face folder (format hf)")
    arch = getattr(gguf.MODEL_ARCH, ARCHITECTURES[model_type])
    writer = gguf.GGUFWriter(out, gguf.MODEL_ARCH_NAMES[arch])
    qtype = getattr(gguf.GGMLQuantizationType, quantization.upper())
    writer.add_name((name or out.parent.name or config["model_type"])[:200])
    _write_hyperparameters(writer, config, quantization)
    vocab = _write_tokenizer(writer, folder, config)
    names = gguf.get_tensor_name_map(arch, config["num_hidden_layers"])
    written = 0
    for name, tensor in _tensors(folder):
        if name == "lm_head.weight" and config.get("tie_word_embeddings"):
            continue
        mapped = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if mapped is None:
            raise ConfigError(f"the GGUF tensor map of {model_type} has no name for {name}: this model has "
                              "parts llama.cpp does not read; export it as a Hugging Face folder")
        data = _family_layout(ARCHITECTURES[model_type], mapped, tensor, config)
        _add_tensor(writer, mapped, data, qtype)
        written += 1
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return {"architecture": gguf.MODEL_ARCH_NAMES[arch], "tensors": written, "vocabulary": vocab,
            "quantization": quantization}


def _write_hyperparameters(writer: Any, config: dict[str, Any], quantization: str) -> None:
    import gguf

    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    writer.add_context_length(config.get("max_position_embeddings", 2048))
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(config.get("num_key_value_heads") or heads)
    writer.add_rope_dimension_count(head_dim)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_freq_base(float(_rope_theta(config)))
    writer.add_layer_norm_rms_eps(float(config.get("rms_norm_eps", 1e-6)))
    writer.add_vocab_size(config["vocab_size"])
    if config.get("sliding_window") and config["model_type"] == "gemma2":
        writer.add_sliding_window(config["sliding_window"])
    for key, add in (("attn_logit_softcapping", writer.add_attn_logit_softcapping),
                     ("final_logit_softcapping", writer.add_final_logit_softcapping)):
        if config.get(key) is not None:
            add(float(config[key]))
    file_type = "ALL_F32" if quantization == "f32" else f"MOSTLY_{quantization.upper()}"
    writer.add_file_type(getattr(gguf.LlamaFileType, file_type))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


def _rope_theta(config: dict[str, Any]) -> float:
    """The rotary base, where transformers 5 keeps it (``rope_parameters``) or 4 did."""
    parameters = config.get("rope_parameters") or {}
    if isinstance(parameters, dict) and "rope_theta" in parameters:
        return parameters["rope_theta"]
    return config.get("rope_theta", 10000.0)


def _write_tokenizer(writer: Any, folder: Path, config: dict[str, Any]) -> int:
    """The tokenizer as llama.cpp's ``gpt2`` model: every id's token and type, padded to the
    model's vocabulary; the merges, special ids and chat template (``gguf.SpecialVocab``)."""
    import gguf

    path = folder / "tokenizer.json"
    if not path.is_file():
        raise ConfigError("GGUF export needs the model's tokenizer.json (a byte-level BPE tokenizer); this export has "
                          "none: export it as a Hugging Face folder")
    spec = json.loads(path.read_text())
    model = spec.get("model") or {}
    if model.get("type") != "BPE":
        raise ConfigError(f"GGUF export writes byte-level BPE tokenizers; this one is {model.get('type')!r}: "
                          "export it as a Hugging Face folder")
    by_id: dict[int, str] = {int(i): t for t, i in model.get("vocab", {}).items()}
    special = set()
    for added in spec.get("added_tokens") or []:
        by_id[int(added["id"])] = added["content"]
        if added.get("special"):
            special.add(int(added["id"]))
    size = max(config["vocab_size"], max(by_id, default=-1) + 1)
    tokens, types = [], []
    for i in range(size):
        if i not in by_id:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        else:
            tokens.append(by_id[i])
            types.append(gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    gguf.SpecialVocab(folder, load_merges=True, n_vocab=size).add_to_gguf(writer, quiet=True)
    return size


def _tensors(folder: Path):
    """Every tensor of the folder's safetensors files, as float32 numpy arrays, in file order."""
    from safetensors import safe_open

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ConfigError("GGUF export reads safetensors weights, and the export has none")
    for file in files:
        with safe_open(file, framework="pt") as handle:
            for name in handle.keys():
                yield name, handle.get_tensor(name).float().numpy()


def _family_layout(arch: str, name: str, data: np.ndarray, config: dict[str, Any]) -> np.ndarray:
    """``data`` as the family's GGUF tensor ``name`` holds it (see the module's docstring)."""
    if arch in PERMUTED and name.endswith((".attn_q.weight", ".attn_k.weight")):
        heads = config["num_attention_heads"]
        if name.endswith(".attn_k.weight"):
            heads = config.get("num_key_value_heads") or heads
        return _rotary_pairs(data, heads)
    if arch in NORM_PLUS_ONE and name.endswith("norm.weight"):
        return data + 1
    return data


def _rotary_pairs(weight: np.ndarray, heads: int) -> np.ndarray:
    """Each head's rows reordered from (first half, second half) to interleaved pairs."""
    return (weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def _add_tensor(writer: Any, name: str, data: np.ndarray, qtype: Any) -> None:
    import gguf
    from gguf import quants

    if data.ndim < 2 or qtype == gguf.GGMLQuantizationType.F32:
        writer.add_tensor(name, np.ascontiguousarray(data, dtype=np.float32))
        return
    if qtype == gguf.GGMLQuantizationType.F16:
        writer.add_tensor(name, data.astype(np.float16))
        return
    block, _ = gguf.GGML_QUANT_SIZES[qtype]
    if data.shape[-1] % block:
        writer.add_tensor(name, data.astype(np.float16))  # as llama.cpp falls back
        return
    writer.add_tensor(name, quants.quantize(data, qtype), raw_dtype=qtype)
