"""Secrets by value: every text trainwright hands back (tool results, errors, resources, the
audit log, the CLI's output) passes :func:`redact`.

Run code is arbitrary Python: whatever it can read, it can print, and its console log and
metrics come back to the agent. So the redactor does not look at names alone. When the server
starts it collects the *values* of its environment that are secret:

- variables named like a secret (``looks_secret``: ``*_TOKEN``, ``*_PASSWORD``, ``MYSQL_PWD``,
  ``STRIPE_SK``, ``AWS_*``, ...);
- values that carry credentials whatever the name: URLs with ``user:password@``
  (``REDIS_URL=redis://:pw@host``), known token formats, and long high-entropy strings;

and compiles them, longest first, into one pattern. Values shorter than
:data:`MIN_SECRET_CHARS` are not collected (they would match everywhere). Independently of the
environment, credential-shaped strings (GitHub, OpenAI/Anthropic, Hugging Face, AWS, Slack,
Stripe, GitLab, Google keys, JWTs) and the password part of URLs are replaced wherever they
appear.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections import Counter
from typing import Any, Callable, Mapping

from sandbox.environment import looks_secret

MASK = "***"
MIN_SECRET_CHARS = 8
# A value this long, without spaces or path separators and with this much entropy per
# character, is treated as a key whatever its variable is called.
HIGH_ENTROPY_CHARS = 24
HIGH_ENTROPY_BITS = 3.5

# Each format as (literal prefix, pattern): a text is searched only for the prefixes it holds,
# which keeps a 20 kB text at a few tens of microseconds. The word boundary before a token is
# checked per match.
CREDENTIAL_FORMATS = (
    ("ghp_", r"ghp_[A-Za-z0-9]{20,}"), ("gho_", r"gho_[A-Za-z0-9]{20,}"), ("ghu_", r"ghu_[A-Za-z0-9]{20,}"),
    ("ghs_", r"ghs_[A-Za-z0-9]{20,}"), ("ghr_", r"ghr_[A-Za-z0-9]{20,}"),
    ("github_pat_", r"github_pat_[A-Za-z0-9_]{20,}"), ("sk-", r"sk-[A-Za-z0-9_-]{20,}"),
    ("hf_", r"hf_[A-Za-z0-9]{20,}"), ("AKIA", r"AKIA[0-9A-Z]{16}"), ("ASIA", r"ASIA[0-9A-Z]{16}"),
    ("xox", r"xox[abprs]-[A-Za-z0-9-]{10,}"), ("sk_live_", r"sk_live_[A-Za-z0-9]{10,}"),
    ("sk_test_", r"sk_test_[A-Za-z0-9]{10,}"), ("rk_live_", r"rk_live_[A-Za-z0-9]{10,}"),
    ("glpat-", r"glpat-[A-Za-z0-9_-]{20,}"), ("npm_", r"npm_[A-Za-z0-9]{30,}"),
    ("AIza", r"AIza[0-9A-Za-z_-]{35}"), ("eyJ", r"eyJ[A-Za-z0-9_-]{10,}\.[A-Za-z0-9_-]{10,}\.[A-Za-z0-9_-]{10,}"),
)
_FORMATS = tuple((prefix, re.compile(pattern)) for prefix, pattern in CREDENTIAL_FORMATS)
CREDENTIAL = re.compile("|".join(pattern for _, pattern in CREDENTIAL_FORMATS))


def _credentials(text: str) -> str:
    for prefix, pattern in _FORMATS:
        if prefix in text:
            text = pattern.sub(_credential, text)
    return text


def _has_credential(text: str) -> bool:
    return any(prefix in text and pattern.search(text) for prefix, pattern in _FORMATS)


# scheme://user:password@host → the password is replaced (the user and host stay readable).
URL_CREDENTIALS = re.compile(r"(?P<head>://[^\s:/@]*:)(?P<password>[^\s/@]+)(?=@)")
_WORD = re.compile(r"\w")


def _entropy_bits(value: str) -> float:
    counts = Counter(value)
    return -sum(n / len(value) * math.log2(n / len(value)) for n in counts.values())


def looks_high_entropy(value: str) -> bool:
    """A long random-looking string: an API key or token, whatever its variable is called."""
    return (
        len(value) >= HIGH_ENTROPY_CHARS
        and not any(c.isspace() for c in value)
        and "/" not in value and os.pathsep not in value
        and _entropy_bits(value) >= HIGH_ENTROPY_BITS
    )


def secret_values(environ: Mapping[str, str]) -> set[str]:
    """The values of ``environ`` that must never be shown (see the module docstring)."""
    found = set()
    for name, value in environ.items():
        if not isinstance(value, str) or len(value) < MIN_SECRET_CHARS:
            continue
        if looks_secret(name) or CREDENTIAL.search(value) or looks_high_entropy(value):
            found.add(value)
        for match in URL_CREDENTIALS.finditer(value):
            found.add(value)
            if len(match.group("password")) >= MIN_SECRET_CHARS:
                found.add(match.group("password"))
    return found


def _credential(match: re.Match) -> str:
    start = match.start()
    return match.group(0) if start and _WORD.match(match.string, start - 1) else MASK


def _alternation(values: set[str]) -> re.Pattern | None:
    ordered = sorted(values, key=len, reverse=True)  # a value that contains another goes first
    return re.compile("|".join(map(re.escape, ordered))) if ordered else None


class Redactor:
    """Replaces secret values and credential-shaped strings by ``***``; compiled once."""

    def __init__(self, environ: Mapping[str, str] | None = None):
        values = secret_values(os.environ if environ is None else environ)
        self._values = _alternation(values)
        # The same values as they appear inside JSON text (quotes, backslashes escaped).
        self._values_in_json = _alternation(values | {json.dumps(v, ensure_ascii=False)[1:-1] for v in values})

    def text(self, text: str) -> str:
        if self._values is not None:
            text = self._values.sub(MASK, text)
        if "://" in text:
            text = URL_CREDENTIALS.sub(lambda m: m.group("head") + MASK, text)
        return _credentials(text)

    def may_hold_secrets(self, json_text: str) -> bool:
        """A fast check of a serialized result: False when there is certainly nothing to redact."""
        return bool(
            (self._values_in_json is not None and self._values_in_json.search(json_text))
            or URL_CREDENTIALS.search(json_text) or _has_credential(json_text)
        )

    def value(self, value: Any) -> Any:
        """``value`` with every string in it (keys included, any nesting) redacted."""
        return map_strings(value, self.text)


_current: Redactor | None = None


def current() -> Redactor:
    """The process's redactor (built from its environment on first use)."""
    global _current
    if _current is None:
        _current = Redactor()
    return _current


def reload(environ: Mapping[str, str] | None = None) -> Redactor:
    """Rebuild the process's redactor, e.g. when a server starts (and in tests)."""
    global _current
    _current = Redactor(environ)
    return _current


def redact(text: str) -> str:
    """``text`` with every secret value and credential-shaped string replaced by ``***``."""
    return current().text(text)


# What never reaches a reader as it is. C0 and C1 control characters but newline and tab, and
# DEL: a run's output, metric names, file names and run.json reach a person's terminal, where
# ``ESC [2J`` clears the screen, OSC 0 sets the window title, OSC 52 writes the clipboard and
# OSC 8 makes a link, and a carriage return hides what is printed. And every invisible
# character: Unicode's format characters (category Cf: the bidirectional controls and marks
# that reorder or hide text, zero-width spaces and joiners, the tag block U+E0000-E007F that
# spells words no one sees), the line and paragraph separators, the variation selectors (which
# can carry a byte each after a visible character), the Hangul fillers, and every other code
# point Unicode calls default-ignorable (DerivedCoreProperties: U+034F, U+17B4-17B5, the
# Mongolian selectors, U+FFF0-FFF8, all of U+E0000-E0FFF). And lone surrogates (category Cs),
# which JSON can carry and no UTF-8 encoder writes. An agent reads what a person cannot: text
# that says nothing on screen can still instruct it.
INVISIBLE_RANGES = (
    "\x00-\x08\x0b-\x1f\x7f-\x9f\u00ad\u0600-\u0605\u061c\u06dd\u070f\u0890-\u0891\u08e2"
    "\u115f\u1160\u180e\u200b-\u200f\u2028-\u202e\u2060-\u2064\u2066-\u206f\u3164\ufe00-\ufe0f"
    "\ufeff\uffa0\ufff9-\ufffb\U000110bd\U000110cd\U00013430-\U0001343f\U0001bca0-\U0001bca3"
    "\U0001d173-\U0001d17a\u034f\u17b4\u17b5\u180b-\u180f\u2065\ufff0-\ufff8\ud800-\udfff"
    "\U000e0000-\U000e0fff"
)
_CONTROLS = re.compile(f"[{INVISIBLE_RANGES}]")
# In JSON text (a result serialized), the C0 controls but newline and tab appear escaped.
_CONTROLS_IN_JSON = re.compile(rf"[{INVISIBLE_RANGES}]|\\u00[01][0-9a-fA-F]|\\[rbf]")


def _escaped(match: re.Match) -> str:
    code = ord(match.group(0))
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def printable(text: str) -> str:
    """``text`` as shown to a person or an agent (the CLI's output, tool results and errors,
    resources, log messages): every control and invisible character but newline and tab written
    as its escape (``\\x1b``, ``\\u200e``, ``\\U000e0041``), so none acts on a terminal or hides
    in the text. The one sanitiser of shown text."""
    return _CONTROLS.sub(_escaped, text) if _CONTROLS.search(text) else text


def shown(text: str) -> str:
    """``text`` redacted (:func:`redact`), then :func:`printable`."""
    return printable(redact(text))


def redact_value(value: Any) -> Any:
    return current().value(value)


def map_strings(value: Any, change: Callable[[str], str], depth: int = 0) -> Any:
    """``value`` with ``change`` applied to every string in it: keys included, any nesting, inside
    pydantic models too. A model is copied with its changed fields, not validated again (an
    escape may make a string longer than its field allows)."""
    if isinstance(value, str):
        return change(value)
    if depth > 64:
        return value
    if hasattr(type(value), "model_fields") and hasattr(value, "model_copy"):  # a pydantic model
        fields = type(value).model_fields
        return value.model_copy(update={name: map_strings(getattr(value, name), change, depth + 1) for name in fields})
    if isinstance(value, dict):
        return {map_strings(k, change, depth + 1): map_strings(v, change, depth + 1) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(map_strings(v, change, depth + 1) for v in value)
    return value


def redact_model(model: Any) -> Any:
    """A pydantic result with every string inside it redacted and made printable (:func:`shown`;
    the same model class). Most results hold neither a secret nor a control character: one search
    over their JSON says so, and they are returned as they are."""
    try:
        json_text = model.model_dump_json()
    except ValueError:  # a lone surrogate a run wrote (JSON allows "\ud800"; UTF-8 does not)
        return map_strings(model, shown)
    if not current().may_hold_secrets(json_text) and not _CONTROLS_IN_JSON.search(json_text):
        return model
    return map_strings(model, shown)
