"""Bounds on what a tool takes and returns: agents' clients reject very large results (Claude
Code at about 25k tokens), so every text that can grow is cut, and the result says that it was.

``AGENT_BUDGET_CHARS`` (8 KB) is what a tool result stays under with its default arguments:
diffs and documents are cut at ``MAX_DIFF_CHARS`` / ``MAX_DOC_CHARS``, metrics tails, run
details and lists keep the newest that fit, and each says when it cut. Asking for more (a
larger ``n`` or ``limit``) is allowed up to ``MAX_RESULT_CHARS``; :meth:`mcp_server.server.Tools.call`
refuses, rather than sends, anything larger.

Each bound is defined once: the server's here (the arguments models of
:mod:`mcp_server.arguments` check a tool's arguments against them), the error family's
``MAX_ERROR_CHARS`` in :mod:`engine.errors` (the engine cannot import the server; it is
re-exported here), the seam's (prompts, tokens, data paths) in :mod:`engine.seams`.
"""

from __future__ import annotations

import json
import os
import secrets
import sys
from typing import Any

from engine.errors import MAX_ERROR_CHARS as MAX_ERROR_CHARS  # an error message, bounded with the error family

AGENT_BUDGET_CHARS = 8_000  # a default result, as JSON: ≈ 2k tokens
MAX_DIFF_CHARS = 5_000
MAX_DOC_CHARS = 6_000
MAX_RESULT_CHARS = 60_000  # ≈ 15–20k tokens of JSON, when the caller asks for more
MAX_RUN_ERROR_CHARS = 1_000  # a run's error as get_run shows it (its console tail says more)
MAX_ARGUMENTS_CHARS = 100_000  # the arguments of one tool call, as JSON
# One message a client sends over stdio (a line): a tool call's arguments with room for the rest.
# A longer line is never held whole: mcp_server.stdio answers it as too large.
MAX_MESSAGE_CHARS = 10 * MAX_ARGUMENTS_CHARS
MAX_CONCURRENT_CHECKS = 2  # describe_recipe's launch-check processes at once; more callers wait in turn
# describe_recipe calls holding a worker thread at once (waiting for a check blocks it); more wait
# on the event loop, so the other tools keep the rest of the server's threads.
MAX_DESCRIBE_THREADS = 8
HTTP_HEADER_TIMEOUT_S = 10  # serve --http: a request's headers must have arrived by then
MAX_HTTP_CONNECTIONS = 128  # serve --http: open connections; one more is closed at once
# MCP clients give up on a call after about 60 s (some even while progress arrives): by default
# a wait returns before that, with the run's status so far, and the agent calls again.
DEFAULT_WAIT_S = 45
# How often the server looks at a followed run's directory: wait_run, subscriptions, the A/B's waits.
POLL_S = 0.5
MAX_WAIT_S = 600
MAX_LIST_RUNS = 100  # list_runs' limit
# An export the recipe's code wrote (export_checkpoint, push, start-models): its files and folders,
# and how deep its folders nest. A Hugging Face folder holds tens of files two levels deep; more is
# refused before the server walks, copies or lists it all.
MAX_EXPORT_ENTRIES = 10_000
MAX_EXPORT_DEPTH = 32
MAX_LIST_STORES = 100  # `trainwright data-cache`: the largest stores listed (a run can write many)
MAX_NPROC = max(8, os.cpu_count() or 1)  # a run's processes per node
MAX_DEVICE_MEMORY_GIB = 1 << 20  # estimate_run's device_memory_gib
MAX_KEYS_ASKED = 50  # describe_recipe(keys=...)
MAX_KEY_CHARS = 200  # a dotted config key; a longer one is refused before it is compared with any
DEFAULT_TAIL_RECORDS = 10  # ≈ 4 KB as an agent reads it: a default result stays under 8 KB
MAX_TAIL_RECORDS = 200
# `trainwright ab`: an A/B is short (2 × rounds runs); the first logging window of each run is its
# warm-up, and a speed verdict needs two windows after it.
AB_DEFAULT_ROUNDS, AB_MAX_ROUNDS = 2, 10
AB_MIN_STEPS, AB_MAX_STEPS = 3, 1000


def bounded(text: str, limit: int) -> tuple[str, bool]:
    """``text`` cut to ``limit`` characters (with a marker), and whether it was cut."""
    if len(text) <= limit:
        return text, False
    return text[:limit] + f"\n… [cut: {len(text) - limit} more characters]\n", True


def text_bytes(value: Any) -> int:
    """The size of ``value`` as an agent reads it: the MCP SDK writes a result's text content
    as JSON indented by 2 (structuredContent carries the same object again)."""
    return len(json.dumps(value, indent=2, ensure_ascii=False, default=str).encode())


def compact_json(value: Any) -> str:
    """``value`` as compact JSON (what a client receives, near enough)."""
    return json.dumps(value, separators=(",", ":"), default=str)


def json_chars(value: Any) -> int:
    """The length of ``value`` as compact JSON."""
    return len(compact_json(value))


# What :mod:`mcp_server.stdio` puts in a message's place of an integer too long for Python to read
# (pydantic's JSON parser refuses it, and the SDK would drop the whole message unanswered). Random
# per server process, so that no text a client gives is taken for it.
OVERLONG_NUMBER = f"<a number of more than the digits Python reads {secrets.token_hex(16)}>"
# What it puts in the place of a tool call's arguments when the call's line is longer than
# MAX_MESSAGE_CHARS (random per process for the same reason).
OVERLONG_MESSAGE = f"<a message of more than the characters the server reads {secrets.token_hex(16)}>"


def arguments_size(arguments: Any) -> tuple[int | None, str | None]:
    """``(size, None)`` of a tool call's arguments within :data:`MAX_ARGUMENTS_CHARS`, or
    ``(size, refusal)``: too large, or (size None) holding an integer longer than Python writes
    as text (``sys.get_int_max_str_digits()``), which json.dumps cannot measure."""
    refusal = (f"bad_input: the arguments hold a number of more than {sys.get_int_max_str_digits():,} digits; "
               "give numbers within the bounds each argument states")
    try:
        text = compact_json(arguments)
    except ValueError:
        return None, refusal
    if OVERLONG_NUMBER in text:  # such a number as the stdio transport hands it on
        return None, refusal
    if OVERLONG_MESSAGE in text:  # a line the stdio transport did not read whole
        return None, (f"bad_input: the message is too large (more than {MAX_MESSAGE_CHARS:,} characters; a tool "
                      f"call's arguments take at most {MAX_ARGUMENTS_CHARS:,})")
    size = len(text)
    if size > MAX_ARGUMENTS_CHARS:
        return size, f"bad_input: the arguments are too large ({size:,} characters, at most {MAX_ARGUMENTS_CHARS:,})"
    return size, None


def bounded_mapping(values: dict[str, Any], limit: int) -> dict[str, Any]:
    """The first entries of ``values`` that fit in ``limit`` characters of JSON; when some are
    left out, a last entry ``"…"`` says how many."""
    if json_chars(values) <= limit:
        return values
    kept: dict[str, Any] = {}
    for key, value in values.items():
        if json_chars({**kept, key: value}) > limit - 40:
            break
        kept[key] = value
    kept["…"] = f"{len(values) - len(kept)} more not shown"
    return kept


def cut_strings(value: Any, limit: int, keep: frozenset[str] = frozenset()) -> Any:
    """``value`` with every string longer than ``limit`` cut (keys too), and every list to its
    first 20 items, at any depth; the top-level keys in ``keep`` are left as they are (fields
    their producer already bounded)."""
    if isinstance(value, str):
        return bounded(value, limit)[0]
    if isinstance(value, list):
        items = [cut_strings(v, limit) for v in value[:20]]
        return items + [f"… {len(value) - 20} more"] if len(value) > 20 else items
    if isinstance(value, dict):
        return {bounded(str(k), limit)[0]: (v if k in keep else cut_strings(v, limit)) for k, v in value.items()}
    return value
