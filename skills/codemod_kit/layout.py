"""Keep new code within the line length that the file uses (black's and ruff's default: 88-100)."""

from __future__ import annotations

import libcst as cst

from skills.codemod_kit.recipe import Recipe

MAX_LINE = 99


def column_of(recipe: Recipe, node: cst.CSTNode) -> int:
    """Where ``node`` starts on its line: the statement's indentation plus what comes before it."""
    statement = recipe.statement_of(node)
    depth = sum(1 for a in recipe.ancestors(node) if isinstance(a, cst.IndentedBlock))
    first_line = recipe.module.code_for_node(statement.with_changes(leading_lines=[])).split("\n")[0]
    node_code = recipe.module.code_for_node(node).split("\n")[0]
    offset = first_line.find(node_code)
    indent = len(recipe.module.default_indent) * depth
    return indent + (offset if offset >= 0 else len(first_line.lstrip()))


def one_argument_per_line(call: cst.Call) -> cst.Call:
    """``f(a, b=1)`` → ``f(\\n    a,\\n    b=1,\\n)`` (the continuation indent follows the block)."""
    if not call.args:
        return call
    continuation = cst.ParenthesizedWhitespace(
        first_line=cst.TrailingWhitespace(), indent=True, last_line=cst.SimpleWhitespace("    ")
    )
    closing = cst.ParenthesizedWhitespace(first_line=cst.TrailingWhitespace(), indent=True, last_line=cst.SimpleWhitespace(""))
    args = []
    for index, arg in enumerate(call.args):
        last = index == len(call.args) - 1
        comma = cst.Comma(whitespace_after=closing if last else continuation)
        args.append(arg.with_changes(comma=comma))
    return call.with_changes(whitespace_before_args=continuation, args=args)


def fit_call(recipe: Recipe, original: cst.Call, updated: cst.Call) -> cst.Call:
    """``updated`` as it is when its first line fits, else one argument per line."""
    code = recipe.module.code_for_node(updated)
    if "\n" in code or column_of(recipe, original) + len(code) + 1 <= MAX_LINE:
        return updated
    return one_argument_per_line(updated)


def with_keyword(call: cst.Call, name: str, value: cst.BaseExpression) -> cst.Call:
    """``f(a, b)`` → ``f(a, b, name=value)``, following the call's layout (one argument per
    line with a trailing comma stays that way)."""
    new = cst.Arg(
        keyword=cst.Name(name),
        value=value,
        equal=cst.AssignEqual(whitespace_before=cst.SimpleWhitespace(""), whitespace_after=cst.SimpleWhitespace("")),
    )
    if not call.args:
        return call.with_changes(args=[new])
    *rest, last = call.args
    if isinstance(last.comma, cst.Comma):  # a trailing comma: the new argument takes it (the line
        # before the closing parenthesis), the last one the comma between arguments
        between = rest[-1].comma if rest and isinstance(rest[-1].comma, cst.Comma) else last.comma
        return call.with_changes(args=[*rest, last.with_changes(comma=between), new.with_changes(comma=last.comma)])
    comma = next((a.comma for a in rest if isinstance(a.comma, cst.Comma)), None)
    if comma is None or not isinstance(comma.whitespace_after, cst.SimpleWhitespace):
        comma = cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))
    return call.with_changes(args=[*rest, last.with_changes(comma=comma), new])
