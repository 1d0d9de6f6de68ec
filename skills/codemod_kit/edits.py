"""Edits on the original tree, applied in one pass, and imports merged into the file's own.

Codemods find their anchors on the tree they were given and record what to change there
(``replace``, ``insert_before``, ``insert_after``, ``add_import``); ``Edits.apply`` then rebuilds
only the branches that hold an edit. Anchors therefore never go stale between two edits.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Callable, Sequence

import libcst as cst

from skills.codemod_kit.recipe import Recipe

Replacement = cst.CSTNode | Callable[[cst.CSTNode], cst.CSTNode]


@dataclass(frozen=True)
class Import:
    module: str  # "torch" or "torch.distributed.tensor.parallel"
    name: str | None = None  # None: ``import module``; else ``from module import name``


@dataclass
class Edits:
    recipe: Recipe
    replacements: dict[cst.CSTNode, Replacement] = field(default_factory=dict)
    before: dict[cst.CSTNode, list[cst.BaseStatement]] = field(default_factory=dict)
    after: dict[cst.CSTNode, list[cst.BaseStatement]] = field(default_factory=dict)
    imports: list[Import] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # sentences for the result's message
    acts_on: str = ""  # what the change will act on ("wraps 4 blocks of `model.layers`")

    def __bool__(self) -> bool:
        return bool(self.replacements or self.before or self.after or self.imports)

    def replace(self, node: cst.CSTNode, new: Replacement) -> None:
        """Replace ``node``; ``new`` may be a function of the node as updated by nested edits."""
        if node in self.replacements:
            previous = self.replacements[node]
            self.replacements[node] = lambda n: _call(new, _call(previous, n))
        else:
            self.replacements[node] = new

    def insert_before(self, statement: cst.BaseStatement, new: Sequence[cst.BaseStatement]) -> None:
        self.before.setdefault(statement, []).extend(new)

    def insert_after(self, statement: cst.BaseStatement, new: Sequence[cst.BaseStatement]) -> None:
        self.after.setdefault(statement, []).extend(new)

    def add_import(self, module: str, name: str | None = None) -> None:
        item = Import(module, name)
        if item not in self.imports:
            self.imports.append(item)

    def apply(self) -> cst.Module:
        touched = set(self.replacements) | set(self.before) | set(self.after)
        ancestors: set[cst.CSTNode] = set()
        for node in touched:
            ancestors.add(node)
            ancestors.update(self.recipe.ancestors(node))
        module = self.recipe.module.visit(_Applier(self, ancestors))
        return merge_imports(module, self.imports, self.recipe)


def _call(replacement: Replacement, node: cst.CSTNode) -> cst.CSTNode:
    return replacement(node) if callable(replacement) else replacement


class _Applier(cst.CSTTransformer):
    def __init__(self, edits: Edits, ancestors: set[cst.CSTNode]):
        self.edits = edits
        self.ancestors = ancestors

    def on_visit(self, node: cst.CSTNode) -> bool:
        return node in self.ancestors

    def on_leave(self, original_node: cst.CSTNode, updated_node: cst.CSTNode):  # type: ignore[override]
        if isinstance(updated_node, (cst.Module, cst.IndentedBlock)):
            original_body = original_node.body  # type: ignore[attr-defined]
            if any(s in self.edits.before or s in self.edits.after for s in original_body):
                body: list[cst.BaseStatement] = []
                for old, new in zip(original_body, updated_node.body):
                    body.extend(self.edits.before.get(old, ()))
                    body.append(new)
                    body.extend(self.edits.after.get(old, ()))
                updated_node = updated_node.with_changes(body=body)
        if original_node in self.edits.replacements:
            return _call(self.edits.replacements[original_node], updated_node)
        return updated_node


# ---------------------------------------------------------------------------------------------
# Imports
# ---------------------------------------------------------------------------------------------


def _is_import(statement: cst.CSTNode) -> bool:
    return isinstance(statement, cst.SimpleStatementLine) and all(
        isinstance(s, (cst.Import, cst.ImportFrom)) for s in statement.body
    )


def _is_docstring(statement: cst.CSTNode) -> bool:
    return (
        isinstance(statement, cst.SimpleStatementLine)
        and len(statement.body) == 1
        and isinstance(statement.body[0], cst.Expr)
        and isinstance(statement.body[0].value, (cst.SimpleString, cst.ConcatenatedString))
    )


def merge_imports(module: cst.Module, needed: list[Import], recipe: Recipe) -> cst.Module:
    """Add what is missing: a name joins an existing ``from module import ...`` line (kept
    sorted); anything else becomes a new line where isort would put it."""
    missing = [i for i in needed if not _already_imported(i, recipe)]
    if not missing:
        return module
    body = list(module.body)
    for item in missing:
        if item.name is not None:
            index = _from_import_line(body, item.module)
            if index is not None:
                merged = _add_name(body[index], item.name, module)  # type: ignore[arg-type]
                if merged is not None:
                    body[index] = merged
                    continue
        code = f"import {item.module}" if item.name is None else f"from {item.module} import {item.name}"
        _insert_import(body, cst.parse_statement(code + module.default_newline, config=module.config_for_parsing))
    return module.with_changes(body=body)


def _already_imported(item: Import, recipe: Recipe) -> bool:
    if item.name is None:
        return recipe.imports.get(item.module) == item.module
    return recipe.imports.get(item.name) == f"{item.module}.{item.name}"


def _from_import_line(body: list[cst.BaseStatement], module_name: str) -> int | None:
    from skills.codemod_kit.recipe import dotted_name

    for index, statement in enumerate(body):
        if _is_import(statement):
            small = statement.body[0]  # type: ignore[attr-defined]
            if (
                isinstance(small, cst.ImportFrom)
                and not small.relative
                and small.module is not None
                and dotted_name(small.module) == module_name
                and not isinstance(small.names, cst.ImportStar)
            ):
                return index
    return None


def _add_name(statement: cst.SimpleStatementLine, name: str, module: cst.Module) -> cst.SimpleStatementLine | None:
    """``from m import a, c`` + ``b`` → ``from m import a, b, c`` (the order is kept when it was
    alphabetical). Returns None when the line holds a comment, which a rewrite could lose."""
    small: cst.ImportFrom = statement.body[0]  # type: ignore[assignment]
    if "#" in module.code_for_node(small):
        return None
    names = [module.code_for_node(a.with_changes(comma=cst.MaybeSentinel.DEFAULT)).strip() for a in small.names]  # type: ignore[union-attr]
    if name in names:
        return statement
    if names == sorted(names, key=_isort_key):
        names.append(name)
        names.sort(key=_isort_key)
    else:
        names.append(name)
    head = f"from {module.code_for_node(small.module).strip()} import "  # type: ignore[arg-type]
    one_line = head + ", ".join(names)
    if small.lpar is None and len(one_line) <= 99:
        code = one_line
    else:
        indent = module.default_indent
        code = head + "(" + module.default_newline + "".join(
            f"{indent}{n},{module.default_newline}" for n in names
        ) + ")"
    new = cst.parse_statement(code + module.default_newline, config=module.config_for_parsing)
    return new.with_changes(  # type: ignore[return-value]
        leading_lines=statement.leading_lines, trailing_whitespace=statement.trailing_whitespace
    )


def _isort_key(name: str) -> tuple[int, str]:
    """isort's default order of imported names: CONSTANTS, then Classes, then functions."""
    base = name.split(" as ")[0]
    kind = 0 if base.isupper() and len(base) > 1 else 1 if base[:1].isupper() else 2
    return kind, base


def _module_of(statement: cst.BaseStatement) -> str:
    from skills.codemod_kit.recipe import dotted_name

    small = statement.body[0]  # type: ignore[attr-defined]
    if isinstance(small, cst.ImportFrom):
        return "." if small.relative else dotted_name(small.module) if small.module else ""
    return dotted_name(small.names[0].name)


FIRST_PARTY = frozenset({"engine", "skills", "sandbox", "mcp_server", "recipes_template"})


def _section(module_name: str) -> int:
    """isort's sections: future, standard library, third party, first party."""
    root = module_name.split(".")[0]
    if root == "__future__":
        return 0
    if root in sys.stdlib_module_names:
        return 1
    return 3 if root in FIRST_PARTY or root == "." else 2


def _import_key(statement: cst.BaseStatement) -> tuple[int, int, str]:
    module_name = _module_of(statement)
    plain = isinstance(statement.body[0], cst.Import)  # type: ignore[attr-defined]
    return (_section(module_name), 0 if plain else 1, module_name)


def _insert_import(body: list[cst.BaseStatement], new: cst.BaseStatement) -> None:
    """Insert where isort would: in its section (future, stdlib, third party, first party),
    plain ``import x`` lines before ``from x import`` lines, alphabetically; sections are
    separated by one blank line."""
    key = _import_key(new)
    imports = [(index, _import_key(s)) for index, s in enumerate(body) if _is_import(s)]
    if not imports:
        index = _after_last_import(body)
        if index < len(body):
            first = body[index]
            new = new.with_changes(leading_lines=first.leading_lines)
            body[index] = first.with_changes(leading_lines=[cst.EmptyLine(indent=False)])
        body.insert(index, new)
        return
    for position, (index, other) in enumerate(imports):
        if other > key:
            following = body[index]
            previous = imports[position - 1] if position > 0 else None
            if other[0] != key[0] and previous is not None and previous[0] == index - 1 and previous[1][0] == key[0]:
                # The last of its own section, right before the next section: no blank line
                # above it, and the next section keeps the one above it.
                body.insert(index, new.with_changes(leading_lines=[]))
                return
            new = new.with_changes(leading_lines=following.leading_lines)
            separator = [] if other[0] == key[0] else [cst.EmptyLine(indent=False)]
            body[index] = following.with_changes(leading_lines=separator)
            body.insert(index, new)
            return
    last_index, last = imports[-1]
    if last[0] != key[0]:
        new = new.with_changes(leading_lines=[cst.EmptyLine(indent=False)])
    body.insert(last_index + 1, new)


def _after_last_import(body: list[cst.BaseStatement]) -> int:
    last = None
    for index, statement in enumerate(body):
        if _is_import(statement):
            last = index
        elif last is None and (_is_docstring(statement) or _is_future(statement)):
            continue
        elif last is not None:
            break
    if last is not None:
        return last + 1
    return 1 if body and _is_docstring(body[0]) else 0


def _is_future(statement: cst.CSTNode) -> bool:
    return (
        isinstance(statement, cst.SimpleStatementLine)
        and isinstance(statement.body[0], cst.ImportFrom)
        and dotted_name_safe(statement.body[0].module) == "__future__"
    )


def dotted_name_safe(node) -> str:
    from skills.codemod_kit.recipe import dotted_name

    return dotted_name(node) if node is not None else ""
