"""Attack on the JSON a record holds as text (a call's arguments, a tools column, a ShareGPT
function_call turn, all read by sft, dpo and now grpo prompts): nested deeper than json decodes,
it is bad input naming the record, not an internal error."""

from __future__ import annotations

import json

import pytest

from engine.chat_messages import conversation, sharegpt_conversation, tool_schemas
from engine.config import ConfigError

DEEP = "[" * 2000 + "]" * 2000


def test_a_calls_arguments_nested_too_deeply_are_refused_naming_the_record():
    messages = [{"role": "user", "content": "add"},
                {"role": "assistant", "content": None,
                 "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": DEEP}}]}]
    with pytest.raises(ConfigError) as refused:
        conversation(messages, "chat.jsonl:7")
    assert str(refused.value) == "chat.jsonl:7: messages[2]: tool call 1 (add): 'arguments' is not JSON (nested too deeply)"


def test_a_tools_column_nested_too_deeply_is_refused_naming_the_record():
    with pytest.raises(ConfigError) as refused:
        tool_schemas(DEEP, "chat.jsonl:7")
    assert str(refused.value) == "chat.jsonl:7: 'tools' is a string but not JSON (nested too deeply)"


def test_a_function_call_turn_nested_too_deeply_is_refused_naming_the_record():
    turns = [{"from": "human", "value": "add"}, {"from": "function_call", "value": DEEP}]
    with pytest.raises(ConfigError) as refused:
        sharegpt_conversation(turns, "chat.jsonl:7")
    assert str(refused.value).startswith("chat.jsonl:7")
    assert str(refused.value).endswith("must hold a JSON call {\"name\", \"arguments\"} (nested too deeply)")


def test_arguments_nested_as_deep_as_json_decodes_are_read():
    shallow = json.dumps({"a": [[[1]]]})
    messages = [{"role": "user", "content": "add"},
                {"role": "assistant", "content": None,
                 "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": shallow}}]}]
    assert conversation(messages, "chat.jsonl:7")[1]["tool_calls"][0]["function"]["arguments"] == {"a": [[[1]]]}
