"""One definition of a model's repeated blocks: the blocks FSDP2 shards one by one
(``engine.fsdp.transformer_blocks``) are the blocks every skill acts on (``find_blocks``, as the
codemods copy it into a recipe), for Hugging Face models, the templates' models and hand-written
scripts alike."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
import transformers
from torch import nn

from engine.fsdp import transformer_blocks
from skills.codemod_kit import definitions
from tests.model_families import FAMILIES

RECIPES = Path(__file__).parents[1] / "skills" / "recipes"


def copied_find_blocks():
    """``find_blocks`` as a recipe holds it: the text the codemods write, run on its own."""
    namespace: dict = {"torch": torch}
    exec(compile(definitions.FIND_BLOCKS, "<recipe>", "exec"), namespace)
    return namespace["find_blocks"]


def script_classes(name: str) -> dict:
    """The classes of a hand-written training script (its imports, settings and class definitions,
    not the training it runs at import)."""
    tree = ast.parse((RECIPES / name).read_text())
    tree.body = [s for s in tree.body if isinstance(s, (ast.Import, ast.ImportFrom, ast.ClassDef))
                 or (isinstance(s, ast.Assign) and isinstance(s.value, ast.Constant))]
    namespace: dict = {}
    exec(compile(tree, name, "exec"), namespace)
    return namespace


def hf_family(family: str) -> nn.Module:
    config_name, model_name, *_ = FAMILIES[family]
    sizes = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, bos_token_id=1,
                 eos_token_id=2)
    if family == "gemma2":
        sizes.update(head_dim=8, sliding_window=64)
    return getattr(transformers, model_name)(getattr(transformers, config_name)(**sizes))


def llava(text_layers: int) -> nn.Module:
    """The vlm template's model (LLaVA: a SigLIP tower of 2 layers and a Llama)."""
    vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=128, num_hidden_layers=2,
                                             num_attention_heads=1, image_size=32, patch_size=8, vision_use_head=False)
    text = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=text_layers,
                                    num_attention_heads=2, num_key_value_heads=1)
    config = transformers.LlavaConfig(vision_config=vision, text_config=text, image_token_id=63,
                                      vision_feature_select_strategy="full", vision_feature_layer=-1)
    return transformers.LlavaForConditionalGeneration(config)


def causal_lm_template() -> nn.Module:
    from recipes_template.causal_lm import recipe

    return recipe.build_model(recipe.ModelConfig(hidden_size=32, intermediate_size=64, num_layers=3), 64, 16)


def nanogpt() -> nn.Module:
    classes = script_classes("nanogpt_style.py")
    return classes["GPT"](classes["GPTConfig"](16, 64, 3, 2, 32))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)


class SequentialOfBlocks(nn.Module):
    """A U-Net/GAN-style stack: blocks of one class in an nn.Sequential, beside a small ModuleList."""

    def __init__(self) -> None:
        super().__init__()
        self.heads = nn.ModuleList([nn.Linear(8, 2)])
        self.blocks = nn.Sequential(Block(), Block(), Block())


def gan_generator() -> nn.Module:
    return script_classes("gan.py")["Generator"]()


def unet() -> nn.Module:
    return script_classes("unet_diffusion.py")["UNet"]()


# model -> (the class of each block, how many)
MODELS = {
    **{family: (lambda family=family: hf_family(family), f"{FAMILIES[family][1].removesuffix('ForCausalLM')}DecoderLayer",
                2) for family in sorted(FAMILIES)},
    "causal_lm template": (causal_lm_template, "LlamaDecoderLayer", 3),
    # Both towers, whichever is larger: the model names SigLIP's and Llama's layers in _no_split_modules.
    "vlm template, 1 text layer": (lambda: llava(1), "LlamaDecoderLayer SiglipEncoderLayer", 3),
    "vlm template, 4 text layers": (lambda: llava(4), "LlamaDecoderLayer SiglipEncoderLayer", 6),
    "nanoGPT script": (nanogpt, "Block", 3),
    "Sequential of blocks": (SequentialOfBlocks, "Block", 3),
    "GAN script": (gan_generator, "GenBlock", 3),
    "U-Net script": (unet, "ResBlock", 2),
}


@pytest.mark.parametrize("name", list(MODELS))
def test_fsdp_shards_the_blocks_every_skill_acts_on(name: str):
    build, classes, count = MODELS[name]
    torch.manual_seed(0)
    model = build()
    where, found = copied_find_blocks()(model, "probe")
    sharded = transformer_blocks(model)
    assert [id(b) for b in sharded] == [id(b) for b in found], where
    assert (" ".join(sorted({type(b).__name__ for b in found})), len(found)) == (classes, count)


def test_a_model_without_blocks_is_sharded_at_the_root_and_refused_by_the_skills():
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    assert transformer_blocks(model) == []
    with pytest.raises(ValueError, match="probe: Sequential has no repeated blocks"):
        copied_find_blocks()(model, "probe")
