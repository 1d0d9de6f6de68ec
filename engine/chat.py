"""Chat templates as they are: a conversation's tokens, and which of them the model learns.

A conversation is rendered once, as the model will see it whole (:func:`render`): its messages
as :mod:`engine.chat_messages` reads them, with their tool calls and tool results and the
``tools`` of the conversation, and each assistant's reasoning where the template reads it
(``reasoning_content``, or ``thinking``; a template that reads neither gets it in the content as
``<think>…</think>``). The loss covers each assistant turn as that rendering writes it: from
after the generation prompt (``<|im_start|>assistant\n``: the model never writes it) through its
end of turn and the text the template writes after it (ChatML's newline after ``<|im_end|>``,
which TRL's training templates cover too); never a user's, a system's or a tool result's text.
Four ways to find those tokens (the data summary names the one in force, as ``mask``):

- ``generation_markers``: the template marks the assistant's text with ``{% generation %}`` ...
  ``{% endgeneration %}`` (transformers' ``return_assistant_tokens_mask``; TRL's training chat
  templates are such, a template's training form given as ``data.chat_template``).
- ``turn_render``: the template has no markers and renders each turn the same whatever follows
  (ChatML as Qwen2.5 ships it, Llama 3, Gemma, Mistral): the conversation is rendered one message
  at a time, and each assistant turn's span is the text its message adds after the generation
  prompt.
- ``final_render``: the template rewrites earlier turns (Qwen3 drops the reasoning of every
  assistant turn before the last user message): each assistant turn is found in the rendering
  of the whole conversation, after the n-th generation prompt through the end-of-turn token its
  template writes, and checked to hold the message's text and calls. gpt-oss's harmony format
  writes one assistant message as several (``analysis``, then a call or ``final``, each opened by
  the generation prompt ``<|start|>assistant``): there each part runs to the next message's start
  token, and parts that follow each other directly are one turn. A template where neither works
  is refused, naming the tokenizer and what was tried.
- ``completion``: a prompt and its completion (or a preference pair's answer): everything the
  template adds after the prompt and its generation prompt.

``reasoning=False`` takes each ``<think>…</think>`` block (gpt-oss: each ``analysis`` message)
out of the loss (the rest of the turn stays in it). Tokens are the rendered text tokenized as ``apply_chat_template`` tokenizes it (no
special tokens added); a token belongs to a span when its characters overlap it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Iterator, Literal

from engine.config import ConfigError
from engine.data_files import confined_path

MaskMethod = Literal["generation_markers", "turn_render", "final_render", "completion"]
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


def conversation_mask_method(tokenizer, messages: list[Message] | None = None, tools: list | None = None) -> MaskMethod:
    """How the assistant's tokens of a conversation are found with this tokenizer's template
    (``turn_render`` for a template without markers when no conversation is given)."""
    if has_generation_markers(tokenizer.chat_template):
        return "generation_markers"
    if messages is None or _turn_spans(tokenizer, messages, tools)[2] is None:
        return "turn_render"
    return "final_render"


def template_messages(tokenizer, messages: list[Message]) -> list[Message]:
    """The messages as this template reads an assistant's reasoning: ``reasoning_content`` or
    ``thinking`` where it reads that field, else in the content as ``<think>…</think>``."""
    template = tokenizer.chat_template or ""
    field = "reasoning_content" if "reasoning_content" in template else (
        "thinking" if re.search(r"\.thinking\b|\[.thinking.\]", template) else None)
    adapted = []
    for message in messages:
        reasoning = message.get("reasoning_content")
        if reasoning is None or field == "reasoning_content":
            adapted.append(message)
            continue
        message = {k: v for k, v in message.items() if k != "reasoning_content"}
        if field:
            message[field] = reasoning
        else:
            answer = message["content"].lstrip()
            message["content"] = f"<think>\n{reasoning.strip()}\n</think>" + (f"\n\n{answer}" if answer else "")
        adapted.append(message)
    return adapted


def render(tokenizer, messages: list[Message], generation_prompt: bool = False, tools: list | None = None) -> str:
    return tokenizer.apply_chat_template(
        template_messages(tokenizer, messages), tools=tools, tokenize=False, add_generation_prompt=generation_prompt
    )


def render_whole(tokenizer, messages: list[Message], where: str, generation_prompt: bool = False, tools=None) -> str:
    """:func:`render`, a template's refusal (``raise_exception``: Llama 3.1 takes one tool call a
    turn) a :class:`ConfigError` naming the record."""
    from jinja2 import TemplateError

    try:
        return render(tokenizer, messages, generation_prompt, tools)
    except TemplateError as e:
        raise ConfigError(f"{where}: the chat template of {tokenizer.name_or_path or 'the tokenizer'} refuses this "
                          f"conversation: {e}") from None


def _refused(tokenizer, where: str, tried: list[str]) -> ConfigError:
    return ConfigError(
        f"{where}: the chat template of {tokenizer.name_or_path or 'the tokenizer'} cannot mark the assistant's "
        f"tokens: {'; '.join(tried)}. Set data.chat_template to the family's training form (a template with "
        "{% generation %} markers, e.g. TRL's training chat templates) or to one that renders each turn the same "
        "whatever follows"
    )


def _turn_spans(tokenizer, messages: list[Message], tools) -> tuple[str, list[tuple[int, int]], str | None]:
    """``(text, spans, None)`` rendering turn by turn, or ``(.., .., why)`` when a message
    changes the text of those before it."""
    from jinja2 import TemplateError

    before, spans = "", []
    for index, message in enumerate(messages):
        try:
            text = render(tokenizer, messages[: index + 1], tools=tools)
        except TemplateError as e:  # a template that needs what follows (Llama 3.1: tools and a first user message)
            return before, spans, f"turn by turn, the first {index + 1} messages do not render alone ({e})"
        if not text.startswith(before):
            return before, spans, (f"turn by turn, message {index + 1} ({message.get('role')}) changes the text of "
                                   "the messages before it (the template rewrites earlier turns)")
        if message.get("role") == "assistant":
            start = len(before)
            if index:
                opened = render(tokenizer, messages[:index], generation_prompt=True, tools=tools)
                if opened.startswith(before) and text.startswith(opened):
                    start = len(opened)
            spans.append((start, len(text)))
        before = text
    return before, spans, None


def _special_tokens(tokenizer) -> list[str]:
    added = [t.content for t in tokenizer.added_tokens_decoder.values() if t.special]
    return sorted(set(added) | set(tokenizer.all_special_tokens), key=len, reverse=True)


def _final_spans(tokenizer, messages: list[Message], tools, where: str) -> tuple[str, list[tuple[int, int]], str | None]:
    """``(text, spans, None)`` found in the whole conversation's rendering, or why not."""
    text = render_whole(tokenizer, messages, where, tools=tools)
    first = next(i for i, m in enumerate(messages) if m.get("role") == "assistant")
    closed = render(tokenizer, messages[:first], tools=tools) if first else ""
    opened = render(tokenizer, messages[:first], generation_prompt=True, tools=tools) if first else ""
    header = opened[len(closed):] if opened.startswith(closed) else ""
    if not header.strip():
        return text, [], "in the whole rendering, the template writes no generation prompt to find the turns by"
    held = next((n for n, m in enumerate(messages, 1) if any(header.strip() in s for s in _strings(m))), None)
    if held is not None:  # a turn is found by the generation prompt: text that writes it would be one
        return text, [], (f"in the whole rendering, message {held} ({messages[held - 1].get('role')}) holds the "
                          f"generation prompt {header.strip()!r}: its text would be taken for the assistant's")
    assistants = [m for m in messages if m.get("role") == "assistant"]
    turns = _turns_by_end_token(tokenizer, text, header, render(tokenizer, messages[: first + 1], tools=tools)[len(opened):])
    if isinstance(turns, str) or len(turns) != len(assistants):
        grouped = _turns_by_message_start(tokenizer, text, header)
        if isinstance(grouped, str) or len(grouped) != len(assistants):
            why = turns if isinstance(turns, str) else (
                f"in the whole rendering, the generation prompt {header!r} occurs {len(turns)} times for "
                f"{len(assistants)} assistant messages")
            return text, [], why
        turns = grouped
    for number, ((start, stop), message) in enumerate(zip(turns, assistants), 1):
        held = text[start:stop]
        missing = [part for part in [message["content"].strip()] + [c["function"]["name"] for c in message.get("tool_calls", [])]
                   if part not in held]
        if missing:
            return text, [], f"in the whole rendering, assistant message {number} does not hold {missing[0][:40]!r}"
    return text, turns, None


def _strings(value: Any) -> Iterator[str]:
    """Every string in a message: its text, reasoning, calls and their arguments."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _strings(item)
    elif isinstance(value, list):
        for item in value:
            yield from _strings(item)


def _turns_by_end_token(tokenizer, text: str, header: str, turn: str) -> list[tuple[int, int]] | str:
    """Each turn after an occurrence of the generation prompt, through the end-of-turn token the
    template writes after an assistant message (``turn``) and the blank after it; or why not."""
    end_of_turn = max(((turn.rfind(t), t) for t in _special_tokens(tokenizer) if t in turn), default=(-1, ""))[1]
    if not end_of_turn:
        return "in the whole rendering, an assistant turn ends in no special token"
    spans = []
    starts = _occurrences(text, header)
    for number, (at, following) in enumerate(zip(starts, starts[1:] + [len(text)]), 1):
        start = at + len(header)
        stop = text.find(end_of_turn, start, following)
        if stop < 0:  # gpt-oss ends an earlier answer in <|end|>, the last in <|return|>
            return f"in the whole rendering, assistant turn {number} has no {end_of_turn!r} before the next one"
        stop += len(end_of_turn)
        spans.append((start, stop + len(text[stop:]) - len(text[stop:].lstrip())))
    return spans


def _turns_by_message_start(tokenizer, text: str, header: str) -> list[tuple[int, int]] | str:
    """Templates that write one assistant message as several messages of their own (gpt-oss's
    harmony format: an ``analysis`` message, then tool calls or the ``final`` one, each opened by
    ``<|start|>assistant`` and closed by ``<|end|>``, ``<|call|>`` or ``<|return|>``): each part runs
    from after the generation prompt to the next message's start token (the special token the
    generation prompt opens with); parts that follow each other directly are one turn, from after
    the first part's generation prompt through the last part's closing special token."""
    opener = next((t for t in _special_tokens(tokenizer) if header.startswith(t)), None)
    if opener is None:
        return "by the start of each message, the generation prompt opens with no special token"
    specials = re.compile("|".join(re.escape(t) for t in _special_tokens(tokenizer)))
    turns: list[tuple[int, int]] = []
    for at in _occurrences(text, header):
        start = at + len(header)
        following = text.find(opener, start)
        part = text[start: len(text) if following < 0 else following]
        closing = [m.end() for m in specials.finditer(part)]
        if not closing:
            return f"by the start of each message, an assistant part at character {start} ends in no special token"
        stop = start + closing[-1]
        stop += len(text[stop:]) - len(text[stop:].lstrip())
        if turns and turns[-1][1] == at:
            turns[-1] = (turns[-1][0], stop)  # the same assistant message goes on
        else:
            turns.append((start, stop))
    return turns


def _occurrences(text: str, part: str) -> list[int]:
    found, at = [], text.find(part)
    while at >= 0:
        found.append(at)
        at = text.find(part, at + len(part))
    return found


# A reasoning block: <think>…</think> and the blank after it, or gpt-oss's analysis message.
_THINK_BLOCK = re.compile(r"<think>.*?</think>\s*|<\|channel\|>analysis<\|message\|>.*?<\|end\|>", re.S)


def without_reasoning(text: str, spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``spans`` less every reasoning block in ``text``: ``<think>…</think>`` (and the blank after
    it), or an ``analysis`` message of gpt-oss's harmony format."""
    for block in _THINK_BLOCK.finditer(text):
        cut = []
        for start, stop in spans:
            if block.end() <= start or stop <= block.start():
                cut.append((start, stop))
                continue
            cut += [(a, b) for a, b in ((start, block.start()), (block.end(), stop)) if b > a]
        spans = cut
    return spans


def assistant_spans(
    tokenizer, messages: list[Message], where: str = "a conversation", tools: list | None = None
) -> tuple[str, list[tuple[int, int]]]:
    """``(text, spans)``: the conversation rendered whole and, for each assistant message, the
    characters of its turn after the generation prompt, turn by turn where the template renders
    each turn the same whatever follows, else found in the whole rendering. Raises
    :class:`ConfigError` when neither works, naming what was tried."""
    text, spans, why = _turn_spans(tokenizer, messages, tools)
    if why is None:
        return text, spans
    text, spans, also = _final_spans(tokenizer, messages, tools, where)
    if also is None:
        return text, spans
    raise _refused(tokenizer, where, [why, also])


def completion_span(
    tokenizer, prompt: list[Message], completion: list[Message], where: str = "a record", tools: list | None = None
) -> tuple[str, tuple[int, int]]:
    """``(text, span)``: prompt + completion rendered, and the characters after the prompt and
    its generation prompt."""
    opened = render_whole(tokenizer, prompt, where, generation_prompt=True, tools=tools)
    text = render_whole(tokenizer, prompt + completion, where, tools=tools)
    if not text.startswith(opened):
        closed = render(tokenizer, prompt, tools=tools)
        if not text.startswith(closed):
            raise _refused(tokenizer, where, [
                f"the prompt renders differently once its completion ({completion[0].get('role') if completion else '?'}) "
                "follows (the template rewrites earlier turns)"
            ])
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


def encode_conversation(
    tokenizer, messages: list[Message], where: str = "a conversation", tools: list | None = None, reasoning: bool = True
) -> tuple[list[int], list[bool]]:
    """``(tokens, assistant_mask)`` of a conversation as its chat template renders it whole;
    ``reasoning=False`` leaves the ``<think>`` blocks out of the mask."""
    if conversation_mask_method(tokenizer) == "generation_markers":
        render_whole(tokenizer, messages, where, tools=tools)  # a template's refusal named
        encoded = tokenizer.apply_chat_template(
            template_messages(tokenizer, messages), tools=tools, tokenize=True, return_dict=True,
            return_assistant_tokens_mask=True,
        )
        tokens, mask = list(encoded["input_ids"]), [bool(m) for m in encoded["assistant_masks"]]
        if not reasoning:
            text = render(tokenizer, messages, tools=tools)
            kept = tokens_and_mask(tokenizer, text, without_reasoning(text, [(0, len(text))]))[1]
            mask = [m and k for m, k in zip(mask, kept)]
        return tokens, mask
    text, spans = assistant_spans(tokenizer, messages, where, tools)
    return tokens_and_mask(tokenizer, text, spans if reasoning else without_reasoning(text, spans))


def encode_completion(
    tokenizer, prompt: list[Message], completion: list[Message], where: str = "a record", tools: list | None = None,
    reasoning: bool = True,
) -> tuple[list[int], list[bool]]:
    """``(tokens, completion_mask)`` of a prompt and its completion."""
    text, span = completion_span(tokenizer, prompt, completion, where, tools)
    return tokens_and_mask(tokenizer, text, [span] if reasoning else without_reasoning(text, [span]))


_TOOL_CALL_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


def parse_completion(raw: str, end_of_turn: str | None = None) -> dict[str, Any]:
    """A completion as the model wrote it, parsed: ``reasoning`` (its ``<think>`` block, None
    without one), ``content`` (the answer, less the reasoning, the calls and the end of turn) and
    ``tool_calls`` (each ``<tool_call>`` block, Qwen's and Hermes' form, as ``{"name",
    "arguments"}``; a block that is not a JSON call is left in the content). gpt-oss's harmony
    messages are read by their channels."""
    text = raw.split(end_of_turn, 1)[0] if end_of_turn else raw
    if "<|channel|>" in text and "<|message|>" in text:
        return _parse_harmony(text)
    reasoning = None
    if "</think>" in text:
        thought, text = text.split("</think>", 1)
        reasoning = thought.split("<think>", 1)[-1].strip()
    calls = []
    for block in list(_TOOL_CALL_BLOCK.finditer(text)):
        try:
            call = json.loads(block.group(1))
        except (json.JSONDecodeError, RecursionError):  # RecursionError: nested past what json decodes
            continue
        if isinstance(call, dict) and isinstance(call.get("name"), str):
            calls.append({"name": call["name"], "arguments": call.get("arguments", call.get("parameters", {}))})
            text = text.replace(block.group(0), "", 1)
    return {"reasoning": reasoning, "content": text.strip(), "tool_calls": calls or None}


_HARMONY_END = re.compile(r"<\|(?:end|call|return)\|>")


def _parse_harmony(text: str) -> dict[str, Any]:
    """gpt-oss's harmony format: each ``<|start|>``-opened message's channel decides what it is
    (``analysis``: reasoning; addressed ``to=functions.NAME``: a call, its JSON arguments; else
    the answer)."""
    reasoning, content, calls = [], [], []
    for part in text.split("<|start|>"):
        if "<|message|>" not in part:
            continue
        head, body = part.split("<|message|>", 1)
        body = _HARMONY_END.split(body, maxsplit=1)[0]
        to = re.search(r"to=functions\.([\w.-]+)", head)
        if to:
            try:
                arguments = json.loads(body)
            except (json.JSONDecodeError, RecursionError):  # RecursionError: nested past what json decodes
                arguments = body
            calls.append({"name": to.group(1), "arguments": arguments})
        elif re.search(r"<\|channel\|>\s*analysis\b", head):
            reasoning.append(body.strip())
        else:
            content.append(body.strip())
    return {"reasoning": "\n".join(reasoning) if reasoning else None, "content": "\n".join(content),
            "tool_calls": calls or None}
