"""A model built by a template can take the shape of the models people train: a vocabulary larger
than the tokenizer's (a Llama 3 shape has 128,256 rows) and an output layer tied to the
embeddings; a pretrained model keeps its own shape, and a key that would not act is refused."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from engine.config import ConfigError
from mcp_server.operations import estimate
from mcp_server.operations import recipes as recipe_ops
from recipes_template.causal_lm import recipe as causal_lm
from recipes_template.sft import recipe as sft
from workspace.workspace import Workspace

TEMPLATES = [causal_lm, sft]  # dpo starts from an SFT model: its shape is that model's
# Llama 3.2 1B, as its config.json has it.
LLAMA_1B = {"model.hidden_size": 2048, "model.intermediate_size": 8192, "model.num_layers": 16,
            "model.num_heads": 32, "model.num_kv_heads": 8, "model.rope_theta": 500000.0,
            "model.vocab_size": 128256, "model.tie_word_embeddings": True}


@pytest.mark.parametrize("template", TEMPLATES, ids=lambda m: m.__name__.split(".")[1])
def test_a_larger_vocabulary_and_tied_embeddings_build_the_model_asked_for(template):
    cfg = template.ModelConfig(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1,
                               vocab_size=300, tie_word_embeddings=True)
    model = template.build_model(cfg, 258, 16)
    assert model.config.vocab_size == 300 and model.get_input_embeddings().weight.shape[0] == 300
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    untied = template.build_model(cfg.model_copy(update={"tie_word_embeddings": False, "vocab_size": None}), 258, 16)
    assert untied.config.vocab_size == 258
    assert untied.get_output_embeddings().weight is not untied.get_input_embeddings().weight


@pytest.mark.parametrize("template", TEMPLATES, ids=lambda m: m.__name__.split(".")[1])
def test_a_vocabulary_below_the_tokenizers_is_refused(template):
    cfg = template.ModelConfig(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1,
                               vocab_size=100)
    with pytest.raises(ConfigError, match="model.vocab_size=100 is below the tokenizer's 258 tokens"):
        template.build_model(cfg, 258, 16)


@pytest.mark.parametrize("template", TEMPLATES, ids=lambda m: m.__name__.split(".")[1])
@pytest.mark.parametrize("key", [{"vocab_size": 1000}, {"tie_word_embeddings": True}])
def test_a_pretrained_model_keeps_its_own_shape(template, key):
    with pytest.raises(ValidationError, match="describe a model built here"):
        template.ModelConfig(pretrained_path="models/any", **key)


def test_a_llama_1b_shape_is_estimated_from_the_template_keys(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    ws = Workspace.open(tmp_path)
    recipe_ops.scaffold_recipe(ws, "causal_lm", "llama1b")
    result = estimate.estimate_run(ws, "recipes/llama1b", {**LLAMA_1B, "data.seq_len": 4096, "data.batch_size": 1},
                                   device="cuda", device_memory_gib=24)
    with torch.device("meta"):
        reference = LlamaForCausalLM(LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                                                 num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                                                 tie_word_embeddings=True))
    assert result.estimate["params"] == reference.num_parameters() == 1_235_814_400
    # Full fine-tuning in fp32 with AdamW: 16 bytes a parameter is 18.4 GiB before any activation,
    # and the 128k-wide logits of 4,096 tokens are 2 GiB more: it does not fit in 24 GiB.
    memory = result.estimate["memory_gib"]
    assert memory["peak_gib"] > 1_235_814_400 * 16 / 2**30
    assert result.fits is False and result.changes
