"""Chat messages as data files hold them, checked and put in the one form the chat templates read.

A message is ``{"role", "content"}`` and, where it has them:

- an assistant's reasoning: ``reasoning_content`` (read from ``reasoning_content``, ``thinking``
  or ``reasoning``, or from a ``<think>…</think>`` that opens its content, as Qwen3's template
  splits it);
- an assistant's tool calls: ``tool_calls``, each ``{"type": "function", "function": {"name",
  "arguments"}}`` (OpenAI's form; a bare ``{"name", "arguments"}`` is wrapped), the arguments a
  JSON object (a JSON string is parsed: templates write ``arguments | tojson``);
- a tool result: role ``tool`` with ``tool_call_id`` and ``name`` (the call's name when missing).

A conversation may carry ``tools``: a list of JSON schemas (OpenAI's ``{"type": "function",
"function": {...}}``, a bare ``{"name", "parameters"}`` wrapped so), or that list as a JSON string
(as LLaMA-Factory writes it). ShareGPT's ``function_call`` and ``observation`` turns (LLaMA-Factory)
become an assistant's tool calls and their tool results.

A field that is ``None`` is left out (Llama 3.1's template fails on ``"tool_calls": null``).
Every error names the record and the message, and says what to change. Torch-free.
"""

from __future__ import annotations

import json
from typing import Any

from engine.config import ConfigError

Message = dict[str, Any]

REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
CALL_FORM = '{"type": "function", "function": {"name": ..., "arguments": {...}}}'

SHAREGPT_ROLES = {
    "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "bot": "assistant",
    "model": "assistant", "system": "system", "function_call": "assistant", "observation": "tool",
    "tool": "tool",
}


# json.loads raises RecursionError on text nested deeper than the interpreter's recursion limit.
NESTED_TOO_DEEPLY = "nested too deeply"


def _arguments(value: Any, where: str) -> dict[str, Any]:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{where}: 'arguments' is not JSON ({e.msg} at character {e.pos}): {value[:80]!r}") from None
        except RecursionError:
            raise ConfigError(f"{where}: 'arguments' is not JSON ({NESTED_TOO_DEEPLY})") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: 'arguments' must be a JSON object (the call's named arguments), got {type(value).__name__}")
    return value


def tool_call(call: Any, where: str) -> dict[str, Any]:
    """One call in OpenAI's form, its arguments a JSON object."""
    function = call.get("function", call) if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
        raise ConfigError(f"{where}: a tool call must be {CALL_FORM}, got {json.dumps(call, default=str)[:120]}")
    checked: dict[str, Any] = {
        "type": "function",
        "function": {"name": function["name"], "arguments": _arguments(function.get("arguments", {}), f"{where} ({function['name']})")},
    }
    if isinstance(call.get("id"), str):
        checked["id"] = call["id"]
    return checked


def tool_schemas(value: Any, where: str) -> list[dict[str, Any]] | None:
    """The ``tools`` column: a list of function schemas (or that list as JSON); None when empty."""
    if value is None or value == "" or value == []:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{where}: 'tools' is a string but not JSON ({e.msg} at character {e.pos})") from None
        except RecursionError:
            raise ConfigError(f"{where}: 'tools' is a string but not JSON ({NESTED_TOO_DEEPLY})") from None
    if not isinstance(value, list):
        raise ConfigError(f"{where}: 'tools' must be a list of function schemas, got {type(value).__name__}")
    schemas = []
    for index, schema in enumerate(value, 1):
        function = schema.get("function", schema) if isinstance(schema, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ConfigError(
                f"{where}: tools[{index}] is not a function schema: give {{\"type\": \"function\", \"function\": "
                f"{{\"name\": ..., \"description\": ..., \"parameters\": {{...}}}}}}, got {json.dumps(schema, default=str)[:120]}"
            )
        schemas.append({"type": "function", "function": function})
    return schemas


def _split_think(content: str) -> tuple[str | None, str]:
    """``(reasoning, answer)`` of a content that opens with ``<think>…</think>`` (Qwen3's split)."""
    if not content.lstrip().startswith("<think>") or "</think>" not in content:
        return None, content
    reasoning, answer = content.split("</think>", 1)
    return reasoning.split("<think>", 1)[1].strip("\n"), answer.lstrip("\n")


def _message(raw: Any, where: str) -> Message:
    if not isinstance(raw, dict) or not isinstance(raw.get("role"), str):
        raise ConfigError(f"{where}: a message must be an object with a string 'role', got {json.dumps(raw, default=str)[:80]}")
    role, content = raw["role"], raw.get("content")
    calls = raw.get("tool_calls")
    if calls is not None and not isinstance(calls, list):
        raise ConfigError(f"{where}: 'tool_calls' must be a list of {CALL_FORM}, got {type(calls).__name__}")
    if content is None and (calls or role == "assistant"):
        content = ""
    if not isinstance(content, str):
        raise ConfigError(f"{where}: 'content' must be a string, got {type(content).__name__}")
    message: Message = {"role": role, "content": content}
    if role == "assistant":
        reasoning = next((raw[k] for k in REASONING_FIELDS if raw.get(k) is not None), None)
        if reasoning is not None and not isinstance(reasoning, str):
            raise ConfigError(f"{where}: the reasoning must be a string, got {type(reasoning).__name__}")
        if reasoning is None:
            reasoning, message["content"] = _split_think(content)
        if reasoning is not None:
            message["reasoning_content"] = reasoning
        if calls:
            message["tool_calls"] = [tool_call(c, f"{where}: tool call {i}") for i, c in enumerate(calls, 1)]
    elif calls:
        raise ConfigError(f"{where}: only an assistant message may carry 'tool_calls' (this one is {role!r})")
    if role == "tool":
        for key in ("tool_call_id", "name"):
            if isinstance(raw.get(key), str):
                message[key] = raw[key]
    return message


def conversation(value: Any, where: str, key: str = "messages") -> list[Message]:
    """A list of messages, checked and in the one form; a tool result must follow a call."""
    if not isinstance(value, list):
        raise ConfigError(
            f"{where}: {key!r} must be a list of {{\"role\": ..., \"content\": ...}} messages, got {type(value).__name__} "
            "(map another column to it with data.columns)"
        )
    messages: list[Message] = []
    calls: list[dict[str, Any]] = []  # the calls not yet answered, latest assistant's
    for index, raw in enumerate(value, 1):
        message = _message(raw, f"{where}: {key}[{index}]")
        if message["role"] == "assistant":
            calls = [c["function"] for c in message.get("tool_calls", [])]
        elif message["role"] == "tool":
            if not any(m.get("tool_calls") for m in messages):
                raise ConfigError(
                    f"{where}: {key}[{index}] is a tool result with no call before it: a 'tool' message must follow "
                    "an assistant message with 'tool_calls'"
                )
            if "name" not in message and calls:
                message["name"] = calls[0]["name"]
            calls = calls[1:]
        else:
            calls = []
        messages.append(message)
    return messages


def _sharegpt_call(text: str, where: str) -> list[dict[str, Any]]:
    """A ``function_call`` turn's value: one call or a list of them, as JSON."""
    try:
        value = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as e:
        why = e.msg if isinstance(e, json.JSONDecodeError) else NESTED_TOO_DEEPLY
        raise ConfigError(f"{where}: a function_call turn must hold a JSON call {{\"name\", \"arguments\"}} ({why})") from None
    return value if isinstance(value, list) else [value]


def sharegpt_conversation(value: Any, where: str) -> list[Message]:
    """ShareGPT turns (``from``/``value``) as messages; ``function_call`` and ``observation``
    turns as an assistant's tool calls and their results."""
    if not isinstance(value, list) or not all(isinstance(m, dict) for m in value):
        raise ConfigError(f"{where}: 'conversations' must be a list of {{\"from\": ..., \"value\": ...}} turns")
    raw = []
    for index, turn in enumerate(value, 1):
        speaker, text = turn.get("from", turn.get("role")), turn.get("value", turn.get("content"))
        if speaker not in SHAREGPT_ROLES or not isinstance(text, str):
            raise ConfigError(
                f"{where}: conversations[{index}]: a ShareGPT turn needs 'from' (one of {sorted(SHAREGPT_ROLES)}) and a "
                f"string 'value', got from={str(speaker)[:40]!r}"
            )
        if speaker == "function_call":
            raw.append({"role": "assistant", "content": "",
                        "tool_calls": _sharegpt_call(text, f"{where}: conversations[{index}]")})
        else:
            raw.append({"role": SHAREGPT_ROLES[speaker], "content": text})
    return conversation(raw, where, "conversations")
