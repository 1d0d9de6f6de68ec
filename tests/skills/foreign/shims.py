"""What the foreign scripts need offline: a tiny Llama with a byte-level tokenizer saved as a
model folder (for ``from_pretrained``), and a text data set folder (for ``load_dataset``)."""

from __future__ import annotations

import json
from pathlib import Path


def tiny_model(folder: Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    import torch

    torch.manual_seed(0)  # the same tiny model in every run
    folder.mkdir(parents=True, exist_ok=True)
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab.update({"<eos>": len(vocab), "<pad>": len(vocab) + 1})
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>", pad_token="<pad>").save_pretrained(folder)
    config = LlamaConfig(
        vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=64, eos_token_id=vocab["<eos>"], pad_token_id=vocab["<pad>"],
        bos_token_id=None,
    )
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def text_dataset(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps({"text": f"sample {i}: the quick brown fox jumps over the lazy dog"}) for i in range(16)]
    (folder / "train.jsonl").write_text("\n".join(lines) + "\n")
    return folder
