"""Tiny random-weight vision-language models of real transformers families, built offline: a
byte-level BPE tokenizer trained here with the family's special tokens, the family's own image
processor (its PIL version: no torchvision here) and chat template, saved as a Hugging Face
folder (``processor_config.json`` or ``preprocessor_config.json``, tokenizer, weights) that
``model.pretrained_path`` of the ``vlm_chat`` template names, or that a fake Hub serves."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.model_families import bpe_tokenizer

# llava-hf/llava-1.5-7b-hf's template: "USER: <image>\n... ASSISTANT: ..." (no end of turn).
LLAVA_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] != 'system' %}{{ message['role'].upper() + ': '}}{% endif %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}{{ '<image>\n' }}{% endfor %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}{{ content['text'] + ' '}}"
    "{% endfor %}{% endfor %}{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)

# Qwen/Qwen2-VL-2B-Instruct's template (ChatML, an image as <|vision_start|><|image_pad|><|vision_end|>).
QWEN2_VL_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# HuggingFaceTB/SmolVLM-256M-Instruct's template (Idefics3).
IDEFICS3_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}"
    "{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}<end_of_utterance>\n{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)

QWEN_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                "<|image_pad|>", "<|video_pad|>"]
IDEFICS3_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<end_of_utterance>", "<fake_token_around_image>", "<image>",
                    "<global-img>"] + [f"<row_{r}_col_{c}>" for r in range(1, 5) for c in range(1, 5)]

# google/gemma-3-4b-it's template, without its system-prompt folding and tool turns.
GEMMA3_TEMPLATE = (
    "{{ bos_token }}{%- for message in messages -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\n' }}"
    "{%- if message['content'] is string -%}{{ message['content'] | trim }}{%- else -%}"
    "{%- for item in message['content'] -%}{%- if item['type'] == 'image' -%}{{ '<start_of_image>' }}"
    "{%- elif item['type'] == 'text' -%}{{ item['text'] | trim }}{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{{ '<end_of_turn>\n' }}{%- endfor -%}{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)
GEMMA3_SPECIAL = ["<pad>", "<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>", "<start_of_image>", "<end_of_image>",
                  "<image_soft_token>"]

# llava-hf/llava-onevision-qwen2-0.5b-ov-hf's template (ChatML, <image> before the text).
ONEVISION_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}{{ '<image>\n' }}{% endfor %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}{{ content['text'] }}{% endfor %}"
    "{{ '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

FAMILIES = ("llava", "qwen2_vl", "qwen2_5_vl", "idefics3", "gemma3", "llava_onevision", "qwen3_vl")
# Families the installed transformers may lack: the class each needs and the release that added it.
NEEDS = {"qwen3_vl": ("Qwen3VLForConditionalGeneration", "4.57")}
# Families with no chat by design: the user's text is a prefix, the answer a suffix.
PREFIX_SUFFIX_FAMILIES = ("paligemma",)

TEXT = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=1024)


def missing(family: str) -> str | None:
    """Why the installed transformers cannot build ``family``, or None."""
    import transformers

    if family in NEEDS and not hasattr(transformers, NEEDS[family][0]):
        name, release = NEEDS[family]
        return f"transformers {transformers.__version__} has no {name} (added in {release})"
    return None


def available(families=FAMILIES) -> tuple[str, ...]:
    """The ``families`` the installed transformers builds."""
    return tuple(family for family in families if missing(family) is None)


def each(families=FAMILIES) -> list:
    """``families`` as pytest parameters, one the installed transformers lacks skipped with the reason."""
    import pytest

    return [pytest.param(family, marks=pytest.mark.skipif(missing(family) is not None, reason=missing(family) or ""))
            for family in families]


def _llava(tokenizer, sizes, vision: dict | None = None):
    from transformers import (CLIPImageProcessorPil, CLIPVisionConfig, LlamaConfig, LlavaConfig,
                              LlavaForConditionalGeneration, LlavaProcessor)

    # A CLIP tower as LLaVA 1.5's: shortest edge, centre crop, a class token it drops ("default").
    image_processor = CLIPImageProcessorPil(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28})
    processor = LlavaProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=7,
                               vision_feature_select_strategy="default", num_additional_image_tokens=1,
                               chat_template=LLAVA_TEMPLATE)
    vision = CLIPVisionConfig(**{**dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                        image_size=28, patch_size=7, projection_dim=32), **(vision or {})})
    text = LlamaConfig(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                       eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id, **sizes)
    config = LlavaConfig(vision_config=vision, text_config=text, image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
                         image_seq_length=16, vision_feature_select_strategy="default", vision_feature_layer=-2)
    return LlavaForConditionalGeneration(config), processor


def mrope_sections(sizes: dict) -> list[int]:
    """Qwen's 3-D rotary sections (time, height, width) over half a head: [1, 1, 2] of 4."""
    half = sizes["hidden_size"] // sizes["num_attention_heads"] // 2
    return [half // 4, (half - half // 4) // 2, half - half // 4 - (half - half // 4) // 2]


def _qwen_processor(processor_class, tokenizer, patch_size: int):
    """A Qwen-VL processor (its video processor left out where torchvision is missing: images do
    not need it) whose images are 2 × 2 merged patches of ``patch_size``, from 1 to 4 merged
    units; and the config's ids of its image, video and vision-span tokens."""
    from transformers import Qwen2VLImageProcessorPil

    from recipes_template.vlm_chat.recipe import torchvision_available, without_video

    if not torchvision_available():
        processor_class = without_video(processor_class)
    unit = 2 * patch_size
    image_processor = Qwen2VLImageProcessorPil(min_pixels=unit * unit, max_pixels=4 * unit * unit,
                                               patch_size=patch_size, merge_size=2, temporal_patch_size=2)
    processor = processor_class(image_processor=image_processor, tokenizer=tokenizer, chat_template=QWEN2_VL_TEMPLATE)
    ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in (
        ("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
        ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>"))}
    return processor, ids


def _qwen2_vl(tokenizer, version: str, sizes: dict, vision: dict | None = None):
    import transformers
    from transformers import Qwen2VLProcessor

    # Dynamic resolution: 28-pixel units (14-pixel patches merged 2 × 2); 56 × 56 images give 4 tokens.
    # (The vision config's hidden_size is what its merger gives the language model.)
    processor, ids = _qwen_processor(Qwen2VLProcessor, tokenizer, patch_size=14)
    text = dict(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                bos_token_id=None, rope_scaling={"type": "mrope", "mrope_section": mrope_sections(sizes)}, **sizes)
    if version == "qwen2_5_vl":
        vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=sizes["hidden_size"],
                      patch_size=14, spatial_merge_size=2, temporal_patch_size=2, fullatt_block_indexes=[1],
                      window_size=56)
        config = transformers.Qwen2_5_VLConfig(text_config=text, vision_config=vision, **ids)
        return transformers.Qwen2_5_VLForConditionalGeneration(config), processor
    vision = dict(depth=2, embed_dim=32, hidden_size=sizes["hidden_size"], mlp_ratio=2, num_heads=2, patch_size=14, spatial_merge_size=2,
                  temporal_patch_size=2) | (vision or {})
    config = transformers.Qwen2VLConfig(text_config=text, vision_config=vision, **ids)
    return transformers.Qwen2VLForConditionalGeneration(config), processor


def _idefics3(tokenizer, sizes):
    from transformers import (Idefics3Config, Idefics3ForConditionalGeneration, Idefics3ImageProcessorPil,
                              Idefics3Processor, LlamaConfig)

    # SmolVLM's image splitting: an image is cut into tiles of 32 pixels plus a global view;
    # 8-pixel patches, pixel-shuffled by 2: 4 tokens a tile.
    image_processor = Idefics3ImageProcessorPil(size={"longest_edge": 64}, max_image_size={"longest_edge": 32},
                                                do_image_splitting=True)
    processor = Idefics3Processor(image_processor=image_processor, tokenizer=tokenizer, image_seq_len=4,
                                  chat_template=IDEFICS3_TEMPLATE)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=32,
                  patch_size=8)
    text = LlamaConfig(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                       eos_token_id=tokenizer.eos_token_id, **sizes)
    config = Idefics3Config(vision_config=vision, text_config=text.to_dict(), scale_factor=2,
                            image_token_id=tokenizer.convert_tokens_to_ids("<image>"))
    return Idefics3ForConditionalGeneration(config), processor


def _gemma3(tokenizer, sizes):
    from transformers import (Gemma3Config, Gemma3ForConditionalGeneration, Gemma3ImageProcessorPil, Gemma3Processor,
                              Gemma3TextConfig, SiglipVisionConfig)

    # A SigLIP tower on 28-pixel images in 7-pixel patches, pooled to 4 soft tokens an image.
    processor = Gemma3Processor(image_processor=Gemma3ImageProcessorPil(size={"height": 28, "width": 28}),
                                tokenizer=tokenizer, image_seq_length=4, chat_template=GEMMA3_TEMPLATE)
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                image_size=28, patch_size=7, vision_use_head=False)
    text = Gemma3TextConfig(vocab_size=len(tokenizer), head_dim=8, sliding_window=64, pad_token_id=tokenizer.pad_token_id,
                            eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id, **sizes)
    ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in (
        ("boi_token_id", "<start_of_image>"), ("eoi_token_id", "<end_of_image>"), ("image_token_id", "<image_soft_token>"))}
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4, **ids)
    return Gemma3ForConditionalGeneration(config), processor


def _llava_onevision(tokenizer, sizes):
    import transformers
    from transformers import (LlavaOnevisionConfig, LlavaOnevisionForConditionalGeneration,
                              LlavaOnevisionImageProcessorPil, LlavaOnevisionProcessor, Qwen2Config, SiglipVisionConfig)

    from recipes_template.vlm_chat.recipe import torchvision_available, without_video

    processor_class = LlavaOnevisionProcessor if torchvision_available() else without_video(LlavaOnevisionProcessor)
    # AnyRes: the image at 28 pixels plus its tiles on the best of these grids, 4 × 4 patches each.
    grid = [[28, 28], [28, 56], [56, 28], [56, 56]]
    image_processor = LlavaOnevisionImageProcessorPil(size={"height": 28, "width": 28}, image_grid_pinpoints=grid)
    processor = processor_class(image_processor=image_processor, tokenizer=tokenizer, num_image_tokens=16,
                                vision_feature_select_strategy="full", vision_aspect_ratio="anyres_max_9",
                                chat_template=ONEVISION_TEMPLATE)
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                image_size=28, patch_size=7, vision_use_head=False)
    text = Qwen2Config(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                       **sizes)
    config = LlavaOnevisionConfig(vision_config=vision, text_config=text, image_grid_pinpoints=grid,
                                  vision_feature_select_strategy="full", vision_feature_layer=-1,
                                  image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
                                  video_token_id=tokenizer.convert_tokens_to_ids("<video>"))
    assert transformers  # the family's classes are transformers' own
    return LlavaOnevisionForConditionalGeneration(config), processor


def _paligemma(tokenizer, sizes):
    from transformers import (GemmaConfig, PaliGemmaConfig, PaliGemmaForConditionalGeneration, PaliGemmaProcessor,
                              SiglipImageProcessorPil, SiglipVisionConfig)

    # A SigLIP tower on 28-pixel images in 7-pixel patches: 16 image tokens, each its own patch.
    # The processor adds PaliGemma's <loc>/<seg> tokens to the tokenizer: the vocabulary is its length after.
    image_processor = SiglipImageProcessorPil(size={"height": 28, "width": 28})
    image_processor.image_seq_length = 16
    processor = PaliGemmaProcessor(image_processor=image_processor, tokenizer=tokenizer)
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                image_size=28, patch_size=7, projection_dim=sizes["hidden_size"])
    text = GemmaConfig(vocab_size=len(tokenizer), head_dim=8, pad_token_id=tokenizer.pad_token_id,
                       eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id, **sizes)
    config = PaliGemmaConfig(vision_config=vision, text_config=text, image_token_id=processor.image_token_id,
                             projection_dim=sizes["hidden_size"])
    return PaliGemmaForConditionalGeneration(config), processor


def _qwen3_vl(tokenizer, sizes: dict):
    """Qwen3-VL: Qwen2-VL's processing with 16-pixel patches (32-pixel units: a 56 × 56 image gives
    4 tokens), interleaved 3-D rotary sections, deep-stacked vision features."""
    import transformers

    processor, ids = _qwen_processor(transformers.Qwen3VLProcessor, tokenizer, patch_size=16)
    text = dict(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                bos_token_id=None, head_dim=sizes["hidden_size"] // sizes["num_attention_heads"],
                rope_scaling={"rope_type": "default", "mrope_section": mrope_sections(sizes), "mrope_interleaved": True},
                **sizes)
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=sizes["hidden_size"],
                  patch_size=16, spatial_merge_size=2, temporal_patch_size=2, deepstack_visual_indexes=[1],
                  num_position_embeddings=16)
    config = transformers.Qwen3VLConfig(text_config=text, vision_config=vision, **ids)
    return transformers.Qwen3VLForConditionalGeneration(config), processor


def tiny_vlm_folder(folder: Path, family: str = "qwen2_vl", seed: int = 0, text: dict | None = None,
                    vision: dict | None = None) -> Path:
    """A random-weight ``family`` model (one of :data:`FAMILIES`, with its processor and chat
    template, or of :data:`PREFIX_SUFFIX_FAMILIES`, with none), saved to ``folder``; ``text``
    overrides the language model's sizes (:data:`TEXT`), ``vision`` LLaVA's or Qwen2-VL's vision
    config (its own keys)."""
    sizes = {**TEXT, **(text or {})}
    if vision and family not in ("llava", "qwen2_vl"):
        raise KeyError(f"vision sizes are taken for llava and qwen2_vl, not {family}")
    if family == "llava":
        tokenizer = bpe_tokenizer(["<unk>", "<s>", "</s>", "<image>"], "</s>", LLAVA_TEMPLATE)
        tokenizer.pad_token = "<unk>"
        build = lambda t, sizes: _llava(t, sizes, vision)  # noqa: E731
    elif family in ("qwen2_vl", "qwen2_5_vl"):
        tokenizer = bpe_tokenizer(QWEN_SPECIAL, "<|im_end|>", QWEN2_VL_TEMPLATE)
        build = lambda t, sizes: _qwen2_vl(t, family, sizes, vision)  # noqa: E731
    elif family == "qwen3_vl":
        tokenizer = bpe_tokenizer(QWEN_SPECIAL, "<|im_end|>", QWEN2_VL_TEMPLATE)
        build = _qwen3_vl
    elif family == "idefics3":
        tokenizer = bpe_tokenizer(IDEFICS3_SPECIAL, "<end_of_utterance>", IDEFICS3_TEMPLATE)
        build = _idefics3
    elif family == "gemma3":
        from transformers import PreTrainedTokenizerFast

        trained = bpe_tokenizer(GEMMA3_SPECIAL, "<end_of_turn>", GEMMA3_TEMPLATE)
        tokenizer = PreTrainedTokenizerFast(  # Gemma 3's named tokens, which its processor reads
            tokenizer_object=trained.backend_tokenizer, eos_token="<end_of_turn>", pad_token="<pad>", bos_token="<bos>",
            chat_template=GEMMA3_TEMPLATE, extra_special_tokens={
                "boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"})
        build = _gemma3
    elif family == "paligemma":
        tokenizer = bpe_tokenizer(["<pad>", "<bos>", "<eos>", "<image>"], "<eos>", None)
        build = _paligemma
    elif family == "llava_onevision":
        tokenizer = bpe_tokenizer(QWEN_SPECIAL + ["<image>", "<video>"], "<|im_end|>", ONEVISION_TEMPLATE)
        build = _llava_onevision
    else:
        raise KeyError(family)
    torch.manual_seed(seed)
    model, processor = build(tokenizer, sizes)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    if family in ("qwen2_vl", "qwen2_5_vl", "qwen3_vl"):
        save_video_settings(folder, processor.image_processor, family)
    return folder


def save_video_settings(folder: Path, image_processor, family: str) -> None:
    """The Qwen families' video processor settings in ``processor_config.json``, as a model folder
    saved where torchvision is holds them (without it transformers cannot build one to save): a
    frame's pixel bounds, patches and normalization are the image processor's, so a 56 × 56 frame
    makes 4 tokens a temporal patch as a 56 × 56 image does."""
    import json

    path = folder / "processor_config.json"
    config = json.loads(path.read_text())
    size = image_processor.size
    config.setdefault("video_processor", {
        "video_processor_type": "Qwen3VLVideoProcessor" if family == "qwen3_vl" else "Qwen2VLVideoProcessor",
        "size": {"shortest_edge": size.shortest_edge, "longest_edge": size.longest_edge},
        "patch_size": image_processor.patch_size, "temporal_patch_size": image_processor.temporal_patch_size,
        "merge_size": image_processor.merge_size, "image_mean": list(image_processor.image_mean),
        "image_std": list(image_processor.image_std), "do_sample_frames": False})
    path.write_text(json.dumps(config, indent=2) + "\n")
