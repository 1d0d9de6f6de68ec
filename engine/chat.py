"""Chat templates as they are: a conversation's tokens, and which of them the model learns.

Three ways to find the tokens the loss covers (the data summary names the one in force, as
``mask``):

- ``generation_markers``: the template marks the assistant's text with ``{% generation %}`` ...
  ``{% endgeneration %}`` (transformers' ``return_assistant_tokens_mask``).
- ``turn_render``: the template has no markers (ChatML as Qwen2.5 ships it, Llama 3, Gemma,
  Mistral): the conversation is rendered one message at a time, and each assistant turn's span
  is the text its message adds after the generation prompt (its content and end of turn). This
  needs a template whose rendering of the first messages is the start of the rendering of all
  of them (prefix-stable); one that rewrites earlier turns (drops past reasoning, say) is
  refused, naming the turn.
- ``completion``: a prompt and its completion (or a preference pair's answer): everything the
  template adds after the prompt and its generation prompt.

Tokens are the rendered text tokenized as ``apply_chat_template`` tokenizes it (no special
tokens added); a token belongs to a span when its characters overlap it.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

from engine.config import ConfigError
from engine.data_files import confined_path

MaskMethod = Literal["generation_markers", "turn_render", "completion"]
Message = dict[str, Any]

# The built-in templates' chat format: the assistant's content and its end-of-turn token lie
# inside {% generation %}, so both mask methods find the same tokens.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "<|assistant|>\n{% generation %}{{ message['content'] }}{{ eos_token }}{% endgeneration %}"
    "{% else %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

_GENERATION_MARKER = re.compile(r"\{%-?\s*generation\s*-?%\}")


def byte_chat_tokenizer():
    """Bytes are tokens 0-255, end-of-turn is 256 and padding 257: the ids of the ``causal_lm``
    template's byte tokenizer, so a model pretrained there (and exported) fine-tunes here."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_to_char = bytes_to_unicode()
    vocab = {byte_to_char[b]: b for b in range(256)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token="</s>", pad_token="<pad>", chat_template=CHAT_TEMPLATE
    )


def load_chat_tokenizer(model_path: str | None, chat_template: str | None = None):
    """The tokenizer beside the weights (the byte tokenizer when there is none) with its own chat
    template, ``chat_template`` when given, or the built-in one when it has none."""
    from transformers import AutoTokenizer

    folder = Path(confined_path(model_path)) if model_path else None
    if folder is not None and any((folder / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
        tokenizer = AutoTokenizer.from_pretrained(folder)
    else:
        tokenizer = byte_chat_tokenizer()
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    elif isinstance(tokenizer.chat_template, dict) and isinstance(tokenizer.chat_template.get("default"), str):
        tokenizer.chat_template = tokenizer.chat_template["default"]  # named templates: the default one
    elif not isinstance(tokenizer.chat_template, str):
        tokenizer.chat_template = CHAT_TEMPLATE
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def has_generation_markers(template: str | None) -> bool:
    return bool(template) and _GENERATION_MARKER.search(template) is not None


def conversation_mask_method(tokenizer) -> MaskMethod:
    """How the assistant's tokens of a conversation are found with this tokenizer's template."""
    return "generation_markers" if has_generation_markers(tokenizer.chat_template) else "turn_render"


def render(tokenizer, messages: list[Message], generation_prompt: bool = False) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def _not_prefix_stable(where: str, index: int, role: str) -> ConfigError:
    return ConfigError(
        f"{where}: the chat template is not prefix-stable: rendering message {index + 1} ({role}) changes "
        "the text of the messages before it (the template rewrites earlier turns), so the assistant's "
        "tokens cannot be found turn by turn; set data.chat_template to a template that renders each "
        "turn the same whatever follows, or to one with {% generation %} markers"
    )


def assistant_spans(tokenizer, messages: list[Message], where: str = "a conversation") -> tuple[str, list[tuple[int, int]]]:
    """``(text, spans)``: the rendered conversation and, for each assistant message, the
    characters it adds after the generation prompt (the whole of what it adds when the template
    has no generation prompt). Raises :class:`ConfigError` when the template is not
    prefix-stable, naming the message."""
    before, spans = "", []
    for index, message in enumerate(messages):
        text = render(tokenizer, messages[: index + 1])
        if not text.startswith(before):
            raise _not_prefix_stable(where, index, str(message.get("role")))
        if message.get("role") == "assistant":
            start = len(before)
            if index:
                opened = render(tokenizer, messages[:index], generation_prompt=True)
                if opened.startswith(before) and text.startswith(opened):
                    start = len(opened)
            spans.append((start, len(text)))
        before = text
    return before, spans


def completion_span(tokenizer, prompt: list[Message], completion: list[Message], where: str = "a record") -> tuple[str, tuple[int, int]]:
    """``(text, span)``: prompt + completion rendered, and the characters after the prompt and
    its generation prompt."""
    opened = render(tokenizer, prompt, generation_prompt=True)
    text = render(tokenizer, prompt + completion)
    if not text.startswith(opened):
        closed = render(tokenizer, prompt)
        if not text.startswith(closed):
            raise _not_prefix_stable(where, len(prompt), str(completion[0].get("role") if completion else "?"))
        opened = closed
    return text, (len(opened), len(text))


def tokens_and_mask(tokenizer, text: str, spans: list[tuple[int, int]]) -> tuple[list[int], list[bool]]:
    """The text's tokens (as ``apply_chat_template`` tokenizes a rendering) and, per token,
    whether its characters overlap one of ``spans``."""
    encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    mask = [
        end > start and any(begin < end and start < stop for begin, stop in spans)
        for start, end in encoding["offset_mapping"]
    ]
    return list(encoding["input_ids"]), mask


def encode_conversation(tokenizer, messages: list[Message], where: str = "a conversation") -> tuple[list[int], list[bool]]:
    """``(tokens, assistant_mask)`` of a conversation as its chat template renders it."""
    if conversation_mask_method(tokenizer) == "generation_markers":
        encoded = tokenizer.apply_chat_template(
            messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        return list(encoded["input_ids"]), [bool(m) for m in encoded["assistant_masks"]]
    text, spans = assistant_spans(tokenizer, messages, where)
    return tokens_and_mask(tokenizer, text, spans)


def encode_completion(tokenizer, prompt: list[Message], completion: list[Message], where: str = "a record") -> tuple[list[int], list[bool]]:
    """``(tokens, completion_mask)`` of a prompt and its completion."""
    text, span = completion_span(tokenizer, prompt, completion, where)
    return tokens_and_mask(tokenizer, text, [span])
