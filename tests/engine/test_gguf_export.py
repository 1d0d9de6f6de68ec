"""A Hugging Face folder as one GGUF file (engine/gguf_export.py), checked by loading it back
with transformers' GGUF reader — an independent implementation of the format, its tensor names,
Llama's rotary permutation and Gemma's norm offset — from a folder holding nothing but the file,
as llama.cpp or Ollama would get it."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from engine.config import ConfigError
from engine.gguf_export import gguf_file_name, write_gguf
from tests.model_families import tiny_model_folder

PROMPT = "The quick brown fox is even"
# Worst logit difference allowed, as a share of the largest logit: float32 is the same numbers.
TOLERANCE = {"f32": 1e-6, "f16": 2e-3, "bf16": 1e-2, "q8_0": 3e-2, "q4_0": 0.5}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf")
    folders = {family: tiny_model_folder(root / family, family) for family in ("llama", "qwen2", "mistral", "gemma2")}
    folders["qwen3"] = qwen3_folder(folders["qwen2"], root / "qwen3")
    return folders


def qwen3_folder(qwen2, folder):
    """A random Qwen3 (Qwen2 with per-head q/k norms) with the Qwen2 fixture's tokenizer."""
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(qwen2)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                         # transformers' GGUF reader takes a Qwen3's head_dim as the family's 128
                                         head_dim=128, max_position_embeddings=512, tie_word_embeddings=False))
    with torch.no_grad():  # norms away from 1, so a lost or misread one shows
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.uniform_(0.5, 1.5)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


# The file's general.name is the folder it is written to. transformers' reader takes a Llama-architecture
# file whose name says "mistral" for Mistral (llama.cpp writes Mistral as Llama) and then finds no
# tensor map of that name in gguf: the folders here are named for the test, not the family.
OUT = "exported"


def load_back(folder, out_dir, quantization):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out_dir = out_dir / OUT
    out_dir.mkdir(parents=True)
    info = write_gguf(folder, out_dir / gguf_file_name(quantization), quantization)
    name = gguf_file_name(quantization)
    model = AutoModelForCausalLM.from_pretrained(out_dir, gguf_file=name, dtype=torch.float32).eval()
    return info, model, AutoTokenizer.from_pretrained(out_dir, gguf_file=name)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral", "gemma2"])
@pytest.mark.parametrize("quantization", ["f32", "f16", "q8_0", "q4_0"])
def test_the_file_loads_back_with_the_models_logits_and_tokens(folders, tmp_path, family, quantization):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = folders[family]
    reference = AutoModelForCausalLM.from_pretrained(folder).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    info, loaded, loaded_tokenizer = load_back(folder, tmp_path / "out", quantization)
    assert info["quantization"] == quantization and info["vocabulary"] == reference.config.vocab_size
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    assert loaded_tokenizer(PROMPT).input_ids == ids[0].tolist()
    with torch.no_grad():
        expected, got = reference(ids).logits, loaded(ids).logits
    scale = expected.abs().max().item()
    assert (got - expected).abs().max().item() <= TOLERANCE[quantization] * scale
    if quantization == "f32":  # the same greedy continuation
        with torch.no_grad():
            a = reference.generate(ids, max_new_tokens=8, do_sample=False)
            b = loaded.generate(ids, max_new_tokens=8, do_sample=False)
        assert a.tolist() == b.tolist()


def test_the_metadata_carries_the_chat_template_and_special_tokens(folders, tmp_path):
    import gguf

    folder = folders["llama"]
    out = tmp_path / "m.gguf"
    write_gguf(folder, out, "f16")
    fields = gguf.GGUFReader(out).fields

    def text(key):
        field = fields[key]
        return bytes(field.parts[field.data[0]]).decode()

    from transformers import AutoTokenizer

    assert text("tokenizer.chat_template") == AutoTokenizer.from_pretrained(folder).chat_template
    assert text("general.architecture") == "llama" and text("tokenizer.ggml.model") == "gpt2"
    eos = fields["tokenizer.ggml.eos_token_id"]
    assert int(eos.parts[eos.data[0]][0]) == json.loads((folder / "config.json").read_text())["eos_token_id"]


def test_a_tied_output_layer_is_written_once_and_read_back_tied(tmp_path):
    from transformers import AutoModelForCausalLM

    folder = tiny_model_folder(tmp_path / "tied", "qwen2", tie_word_embeddings=True)
    info, loaded, _ = load_back(folder, tmp_path / "out", "f32")
    reference = AutoModelForCausalLM.from_pretrained(folder)
    assert info["tensors"] == len(reference.state_dict()) - 1  # no output.weight
    assert loaded.config.tie_word_embeddings
    assert torch.equal(loaded.lm_head.weight, reference.lm_head.weight)


def test_what_gguf_cannot_hold_is_refused_naming_it(folders, tmp_path):
    phi = tiny_model_folder(tmp_path / "phi3", "phi3")
    with pytest.raises(ConfigError, match="GGUF export knows the families gemma2, llama, mistral, qwen2, qwen3; "
                                          "this model is 'phi3'"):
        write_gguf(phi, tmp_path / "phi.gguf")
    no_tokenizer = tmp_path / "bare"
    shutil.copytree(folders["qwen2"], no_tokenizer)
    (no_tokenizer / "tokenizer.json").unlink()
    with pytest.raises(ConfigError, match="needs the model's tokenizer.json"):
        write_gguf(no_tokenizer, tmp_path / "bare.gguf")
    with pytest.raises(ConfigError, match="quantization must be one of"):
        write_gguf(folders["qwen2"], tmp_path / "x.gguf", "q3_k")
