"""New code, built in the recipe's own formatting (indentation and line endings).

Snippets are written with four-space indentation and ``\\n``; they are converted to the file's
``default_indent`` and ``default_newline`` and parsed with ``module.config_for_parsing``.
``{name}`` placeholders take libcst nodes (``parse_template_statement``); snippets without
placeholders may contain braces freely (f-strings, dicts).
"""

from __future__ import annotations

import json
import re
import textwrap
from functools import lru_cache
from typing import Any

import libcst as cst
from libcst.helpers import parse_template_expression, parse_template_statement

_LEADING_SPACES = re.compile(r"^((?:    )+)", re.MULTILINE)


def _in_file_style(code: str, module: cst.Module) -> str:
    code = textwrap.dedent(code).strip("\n") + "\n"
    indent = module.default_indent
    if indent != "    ":
        code = _LEADING_SPACES.sub(lambda m: indent * (len(m.group(1)) // 4), code)
    if module.default_newline != "\n":
        code = code.replace("\n", module.default_newline)
    return code


def statement(module: cst.Module, code: str, **replacements: cst.CSTNode) -> cst.BaseStatement:
    """One statement; ``{name}`` placeholders are replaced by the given nodes."""
    text = _in_file_style(code, module)
    if replacements:
        return parse_template_statement(text, config=module.config_for_parsing, **replacements)
    return cst.parse_statement(text, config=module.config_for_parsing)


def statements(module: cst.Module, code: str, blank_lines_before: int = 0) -> list[cst.BaseStatement]:
    """Several statements (no placeholders). The first gets ``blank_lines_before`` empty lines;
    top-level definitions after the first get two, as PEP 8 asks."""
    parsed = cst.parse_module(_in_file_style(code, module), config=module.config_for_parsing)
    body = list(parsed.body)
    if body:
        body[0] = body[0].with_changes(leading_lines=[cst.EmptyLine(indent=False)] * blank_lines_before + list(body[0].leading_lines))
    return body


@lru_cache(maxsize=64)
def _parse_definitions(code: str, indent: str, newline: str, config: cst.PartialParserConfig) -> cst.Module:
    # Parsed trees are immutable, so one parse serves every application with the same style.
    return cst.parse_module(code, config=config)


def definitions(module: cst.Module, code: str) -> list[cst.BaseStatement]:
    """Top-level functions/classes, each preceded by two blank lines."""
    parsed = _parse_definitions(
        _in_file_style(code, module), module.default_indent, module.default_newline, module.config_for_parsing
    )
    out = []
    for node in parsed.body:
        comments = [line for line in node.leading_lines if line.comment is not None]
        out.append(node.with_changes(leading_lines=[cst.EmptyLine(indent=False), cst.EmptyLine(indent=False), *comments]))
    return out


def expression(module: cst.Module, code: str, **replacements: cst.CSTNode) -> cst.BaseExpression:
    if replacements:
        return parse_template_expression(code, config=module.config_for_parsing, **replacements)
    return cst.parse_expression(code, config=module.config_for_parsing)


def literal(value: Any) -> str:
    """Python source for a parameter value, with double quotes like the usual formatters."""
    if value is None or isinstance(value, bool):
        return repr(value)
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, (list, tuple)):
        inner = ", ".join(literal(v) for v in value)
        return f"[{inner}]" if isinstance(value, list) else f"({inner}{',' if len(value) == 1 else ''})"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{literal(k)}: {literal(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"no literal for {type(value).__name__}")
