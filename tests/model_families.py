"""Tiny random-weight models of real transformers families, built offline: a byte-level BPE
tokenizer trained here with ``tokenizers`` and the family's chat format, saved as a Hugging Face
folder a recipe's ``model.pretrained_path`` can name."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

# ChatML as Qwen2.5 ships it (no tools): a default system prompt, no {% generation %} markers.
CHATML = (
    "{%- if messages[0]['role'] != 'system' %}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# The same ChatML with the assistant's content and end of turn marked for training.
CHATML_MARKED = (
    "{%- if messages[0]['role'] != 'system' %}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}{% generation %}{{- message['content'] + '<|im_end|>\\n' }}{% endgeneration %}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Llama 3's header format (no markers either).
LLAMA3 = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)

# Gemma's turns (the assistant is "model"; a system prompt goes into the first user turn there,
# kept as its own turn here).
GEMMA = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{- '<start_of_turn>' + role + '\\n' + message['content'] + '<end_of_turn>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<start_of_turn>model\\n' }}{%- endif %}"
)

# Templates as the families ship them (byte for byte, as TRL stores them to recognise them):
# Qwen3's, with <think> and tools, that rewrites earlier turns; Qwen2.5's and Llama 3.1's with tools.
TEMPLATES_DIR = Path(__file__).parent / "fixtures" / "chat_templates"
QWEN3 = (TEMPLATES_DIR / "qwen3.jinja").read_text()
QWEN2_5 = (TEMPLATES_DIR / "qwen2_5.jinja").read_text()
LLAMA3_1 = (TEMPLATES_DIR / "llama3_1.jinja").read_text()
GPT_OSS = (TEMPLATES_DIR / "gpt_oss.jinja").read_text()  # the harmony format: channels, earlier analysis dropped
QWEN_TOOL_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]

CORPUS = [
    "What is 3 + 4? It is 7. Which letter comes after b? The letter c.",
    "You are a helpful assistant. Tell me a short story about a cat and a dog.",
    "The quick brown fox jumps over the lazy dog; the five boxing wizards jump quickly.",
    "Is 12 even or odd? 12 is even. Summarise the text in one sentence, please.",
] * 50

FAMILIES = {
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", CHATML, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], "<|im_end|>"),
    "llama": ("LlamaConfig", "LlamaForCausalLM", LLAMA3,
              ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"], "<|eot_id|>"),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", GEMMA, ["<pad>", "<bos>", "<start_of_turn>", "<end_of_turn>"],
               "<end_of_turn>"),
    "mistral": ("MistralConfig", "MistralForCausalLM", CHATML, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                "<|im_end|>"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", QWEN3,
              ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", *QWEN_TOOL_TOKENS], "<|im_end|>"),
    "qwen2.5": ("Qwen2Config", "Qwen2ForCausalLM", QWEN2_5,
                ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *QWEN_TOOL_TOKENS], "<|im_end|>"),
    "llama3.1": ("LlamaConfig", "LlamaForCausalLM", LLAMA3_1,
                 ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>",
                  "<|python_tag|>"], "<|eot_id|>"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", CHATML, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], "<|im_end|>"),
    "gpt-oss": ("GptOssConfig", "GptOssForCausalLM", GPT_OSS,
                ["<|endoftext|>", "<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|return|>", "<|call|>",
                 "<|constrain|>"], "<|return|>"),
}


def bpe_tokenizer(special: list[str], eos: str, chat_template: str, vocab_size: int = 400):
    """A byte-level BPE trained on a small corpus, with the family's special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=special, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    bos = next((t for t in special if "bos" in t or "begin" in t), None)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token=eos, pad_token=special[0], bos_token=bos, chat_template=chat_template
    )


def tiny_model_folder(folder: Path, family: str = "qwen2", chat_template: str | None = None, seed: int = 0,
                      **config: Any) -> Path:
    """A random-weight model of ``family`` with its tokenizer, saved to ``folder``; ``config``
    replaces sizes (``hidden_size=256``, ``num_hidden_layers=4``...)."""
    import transformers

    config_name, model_name, template, special, eos = FAMILIES[family]
    tokenizer = bpe_tokenizer(special, eos, chat_template or template)
    sizes = dict(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    if family == "gemma2":
        sizes.update(head_dim=8, sliding_window=64)
    if family == "qwen3":
        sizes.update(head_dim=8)
    if family == "gpt-oss":
        sizes.update(head_dim=8, num_local_experts=2, num_experts_per_tok=1, sliding_window=64)
    sizes.update(config)
    config = getattr(transformers, config_name)(**sizes)
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
