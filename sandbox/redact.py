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

import math
import os
import re
from collections import Counter
from typing import Any, Mapping

from sandbox.environment import looks_secret

MASK = "***"
MIN_SECRET_CHARS = 8
# A value this long, without spaces or path separators and with this much entropy per
# character, is treated as a key whatever its variable is called.
HIGH_ENTROPY_CHARS = 24
HIGH_ENTROPY_BITS = 3.5

CREDENTIAL = re.compile(
    r"\b(gh[pousr]_[A-Za-z0-9]{20,}|github_pat_[A-Za-z0-9_]{20,}|sk-[A-Za-z0-9_-]{20,}|"
    r"hf_[A-Za-z0-9]{20,}|(?:AKIA|ASIA)[0-9A-Z]{16}|xox[abprs]-[A-Za-z0-9-]{10,}|"
    r"[sr]k_(?:live|test)_[A-Za-z0-9]{10,}|glpat-[A-Za-z0-9_-]{20,}|npm_[A-Za-z0-9]{30,}|"
    r"AIza[0-9A-Za-z_-]{35}|eyJ[A-Za-z0-9_-]{10,}\.[A-Za-z0-9_-]{10,}\.[A-Za-z0-9_-]{10,})"
)
# scheme://user:password@host → the password is replaced (the user and host stay readable).
URL_CREDENTIALS = re.compile(r"(?P<head>\b[A-Za-z][A-Za-z0-9+.-]*://[^\s:/@]*:)(?P<password>[^\s/@]+)(?=@)")


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


class Redactor:
    """Replaces secret values and credential-shaped strings by ``***``; compiled once."""

    def __init__(self, environ: Mapping[str, str] | None = None):
        values = secret_values(os.environ if environ is None else environ)
        ordered = sorted(values, key=len, reverse=True)  # a value that contains another goes first
        self._values = re.compile("|".join(map(re.escape, ordered))) if ordered else None

    def text(self, text: str) -> str:
        if self._values is not None:
            text = self._values.sub(MASK, text)
        text = URL_CREDENTIALS.sub(lambda m: m.group("head") + MASK, text)
        return CREDENTIAL.sub(MASK, text)

    def value(self, value: Any, depth: int = 0) -> Any:
        """``value`` with every string in it (keys included, any nesting) redacted."""
        if isinstance(value, str):
            return self.text(value)
        if depth > 64:
            return value
        if isinstance(value, dict):
            return {self.value(k, depth + 1): self.value(v, depth + 1) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(self.value(v, depth + 1) for v in value)
        return value


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


def redact_value(value: Any) -> Any:
    return current().value(value)


def redact_model(model: Any) -> Any:
    """A pydantic result with every string inside it redacted (the same model class)."""
    dumped = model.model_dump()
    cleaned = current().value(dumped)
    return model if cleaned == dumped else type(model).model_validate(cleaned)
