"""Emitted code as real code: definitions copied from a real module into the recipe, with libcst.

A skill's helpers (an optimizer, a kernel, the blocks finder) live in a module of their own
beside the skill's codemod, which ruff lints and the tests import and exercise like any module;
the codemod copies their top-level definitions into the recipe, so a recipe still holds all of
its code. The idea is the transformers "modular" converter's: the source of truth is code, the
copy is generated.

A module written to be copied holds a docstring, imports and top-level statements. Its imports
are not copied: those of third-party modules are returned by :func:`imports` for the codemod to
add (``Edits.add_import``); those of trainwright's own modules (``skills.…``, ``engine.…``) and
relative ones name definitions the codemod copies as well, or has already written
(``find_blocks``, from ``engine/blocks.py``). The
module is read as text and never imported here, so ``skills/`` still imports no torch.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import libcst as cst

FIRST_PARTY = ("skills", "engine")


@functools.lru_cache(maxsize=None)
def _module(path: Path) -> cst.Module:
    return cst.parse_module(Path(path).read_text(encoding="utf-8"))


def _is_import(statement: cst.CSTNode) -> bool:
    return isinstance(statement, cst.SimpleStatementLine) and any(
        isinstance(small, (cst.Import, cst.ImportFrom)) for small in statement.body
    )


def _is_docstring(statement: cst.CSTNode) -> bool:
    return (isinstance(statement, cst.SimpleStatementLine) and len(statement.body) == 1
            and isinstance(statement.body[0], cst.Expr) and isinstance(statement.body[0].value, cst.SimpleString))


def _bound(statement: cst.CSTNode) -> set[str]:
    """The names a top-level statement defines: a function's or class's, an assignment's targets,
    and those bound at the top of a ``try`` or ``if`` block (a guarded import, a kernel defined
    only where its library is)."""
    if isinstance(statement, (cst.FunctionDef, cst.ClassDef)):
        return {statement.name.value}
    names: set[str] = set()
    if isinstance(statement, cst.SimpleStatementLine):
        for small in statement.body:
            targets: Iterable[cst.BaseExpression] = ()
            if isinstance(small, cst.Assign):
                targets = (t.target for t in small.targets)
            elif isinstance(small, cst.AnnAssign):
                targets = (small.target,)
            names.update(t.value for t in targets if isinstance(t, cst.Name))
            if isinstance(small, (cst.Import, cst.ImportFrom)) and not isinstance(small.names, cst.ImportStar):
                for alias in small.names:
                    bound = alias.asname.name if alias.asname else alias.name
                    if isinstance(bound, cst.Name):
                        names.add(bound.value)
                    elif isinstance(bound, cst.Attribute):  # import a.b binds a
                        root: cst.BaseExpression = bound
                        while isinstance(root, cst.Attribute):
                            root = root.value
                        if isinstance(root, cst.Name):
                            names.add(root.value)
    elif isinstance(statement, (cst.Try, cst.If)):
        for inner in statement.body.body:
            names |= _bound(inner)
    return names


def _body(path: Path) -> list[cst.BaseStatement]:
    """The module's statements that are copied: all but its docstring and imports."""
    body = list(_module(path).body)
    if body and _is_docstring(body[0]):
        body = body[1:]
    return [statement for statement in body if not _is_import(statement)]


class _Renamed(cst.CSTTransformer):
    """Names replaced by the recipe's own (a parameter, a function, a constant by an expression):
    every Name node but an attribute's or a keyword argument's, never text in strings."""

    def __init__(self, renamed: Mapping[str, str]):
        self.renamed = {old: cst.parse_expression(new) for old, new in renamed.items()}

    def leave_Attribute(self, original: cst.Attribute, updated: cst.Attribute) -> cst.Attribute:
        return updated.with_changes(attr=original.attr)  # the object may be renamed, the attribute never

    def leave_Arg(self, original: cst.Arg, updated: cst.Arg) -> cst.Arg:
        return updated.with_changes(keyword=original.keyword)

    def leave_Name(self, original: cst.Name, updated: cst.Name) -> cst.BaseExpression:
        return self.renamed.get(original.value, updated)  # type: ignore[return-value]


def definitions(path: Path, names: Sequence[str] | None = None, renamed: Mapping[str, str] | None = None) -> str:
    """The code of the module's top-level statements that define ``names`` (all of them when
    None), in the module's order, as :func:`skills.codemod_kit.insert_definitions` takes it.
    ``renamed`` maps a name of the module to the recipe's code for it (an identifier, or an
    expression where the name is only read). Comments above a definition are the module's own
    and stay there."""
    chosen = []
    wanted = set(names) if names is not None else None
    found: set[str] = set()
    for statement in _body(path):
        bound = _bound(statement)
        if wanted is None or bound & wanted:
            chosen.append(statement.with_changes(leading_lines=[]))
            found |= bound
    missing = sorted((wanted or set()) - found)
    if missing:
        raise LookupError(f"{path.name} defines no {', '.join(missing)}")
    module = cst.Module(body=chosen)
    if renamed:
        module = module.visit(_Renamed(renamed))
    return module.code


def imports(path: Path) -> list[tuple[str, str | None]]:
    """The module's third-party imports as ``(module, name)`` pairs (``name`` None for ``import
    module``), in order: what the copied definitions need in the recipe."""
    found: list[tuple[str, str | None]] = []
    for statement in _module(path).body:
        if not _is_import(statement):
            continue
        assert isinstance(statement, cst.SimpleStatementLine)
        for small in statement.body:
            if isinstance(small, cst.Import):
                found += [(_dotted(alias.name), None) for alias in small.names]
            elif isinstance(small, cst.ImportFrom) and small.module is not None and not small.relative:
                module = _dotted(small.module)
                if module == "__future__" or module.split(".")[0] in FIRST_PARTY:
                    continue
                assert not isinstance(small.names, cst.ImportStar), f"{path.name}: no star imports"
                found += [(module, _dotted(alias.name)) for alias in small.names]
    return found


def _dotted(node: cst.BaseExpression) -> str:
    if isinstance(node, cst.Name):
        return node.value
    assert isinstance(node, cst.Attribute)
    return f"{_dotted(node.value)}.{node.attr.value}"
