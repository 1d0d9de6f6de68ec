"""A parsed recipe and an index of what codemods look for in it.

One visitor pass records every node's parent and collects calls, assignments, definitions and
imports. Names are qualified through the file's imports (``nn.Linear`` → ``torch.nn.Linear`` after
``import torch.nn as nn``), which is what anchors are matched on: not text, and without libcst's
full scope analysis, which costs more than a whole skill application may take.

A source is parsed, indexed and (when a message needs a line) positioned once: libcst trees are
immutable, so the recipes of several skill applications to the same text share one ``_Parsed``
(parsing and positions were two thirds of an application's time on large scripts).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

import libcst as cst
from libcst.metadata import CodeRange, MetadataWrapper, PositionProvider

from skills.errors import SkillRefused

Suite = cst.Module | cst.IndentedBlock


@dataclass
class _Index:
    parents: dict[cst.CSTNode, cst.CSTNode] = field(default_factory=dict)
    calls: list[cst.Call] = field(default_factory=list)
    assigns: list[cst.Assign] = field(default_factory=list)
    functions: list[cst.FunctionDef] = field(default_factory=list)
    classes: list[cst.ClassDef] = field(default_factory=list)
    returns: list[cst.Return] = field(default_factory=list)
    imports: dict[str, str] = field(default_factory=dict)  # local name → qualified name


# Formatting nodes hold no code that anchors care about; skipping them halves the walk.
_SKIP = (
    cst.BaseParenthesizableWhitespace,
    cst.TrailingWhitespace,
    cst.EmptyLine,
    cst.Newline,
    cst.Comma,
    cst.LeftParen,
    cst.RightParen,
    cst.Colon,
    cst.Dot,
    cst.AssignEqual,
    cst.Semicolon,
)
_FIELDS: dict[type, tuple[str, ...] | None] = {}  # node class → its field names; None: skip it
_NOT_NODES: set[type] = set()


def _fields(cls: type) -> tuple[str, ...] | None:
    try:
        return _FIELDS[cls]
    except KeyError:
        fields = None if issubclass(cls, _SKIP) else tuple(f.name for f in dataclasses.fields(cls))
        _FIELDS[cls] = fields
        return fields


def _is_node(cls: type) -> bool:
    if cls in _FIELDS:
        return True
    if cls in _NOT_NODES:
        return False
    if issubclass(cls, cst.CSTNode):
        return True
    _NOT_NODES.add(cls)
    return False


def _index(module: cst.Module) -> _Index:
    """One pass over the tree, reading the nodes' fields directly (libcst's visitors rebuild
    every node they pass, which costs more than a whole skill application may take). Nodes are
    recorded in pre-order, so statements come in source order."""
    index = _Index()
    parents = index.parents
    collect = {
        cst.Call: index.calls,
        cst.Assign: index.assigns,
        cst.FunctionDef: index.functions,
        cst.ClassDef: index.classes,
        cst.Return: index.returns,
    }
    stack: list[cst.CSTNode] = [module]
    while stack:
        node = stack.pop()
        cls = type(node)
        bucket = collect.get(cls)
        if bucket is not None:
            bucket.append(node)
        elif cls is cst.Import or cls is cst.ImportFrom:
            _record_import(node, index.imports)  # type: ignore[arg-type]
        children: list[cst.CSTNode] = []
        for name in _fields(cls) or ():
            value = getattr(node, name)
            if isinstance(value, (list, tuple)):
                for item in value:
                    item_cls = type(item)
                    if _is_node(item_cls) and _fields(item_cls) is not None:
                        children.append(item)
            elif _is_node(type(value)) and _fields(type(value)) is not None:
                children.append(value)
        for child in children:
            parents[child] = node
        stack.extend(reversed(children))
    return index


def _record_import(node: cst.Import | cst.ImportFrom, imports: dict[str, str]) -> None:
    if isinstance(node, cst.Import):
        for alias in node.names:
            dotted = dotted_name(alias.name)
            if alias.asname is not None:
                imports[alias.asname.name.value] = dotted  # type: ignore[union-attr]
            else:
                head = dotted.split(".")[0]
                imports[head] = head
    elif not node.relative and node.module is not None and not isinstance(node.names, cst.ImportStar):
        base = dotted_name(node.module)
        for alias in node.names:
            name = dotted_name(alias.name)
            local = alias.asname.name.value if alias.asname else name  # type: ignore[union-attr]
            imports[local] = f"{base}.{name}"


def dotted_name(node: cst.BaseExpression | cst.Attribute | cst.Name) -> str:
    """``a.b.c`` for a Name/Attribute chain; "" for anything else."""
    if isinstance(node, cst.Name):
        return node.value
    if isinstance(node, cst.Attribute):
        head = dotted_name(node.value)
        return f"{head}.{node.attr.value}" if head else ""
    return ""


class _Parsed:
    """One source's tree, its index and (computed when first asked) its nodes' positions."""

    def __init__(self, source: str):
        self.module = cst.parse_module(source)
        self.index = _index(self.module)
        self.positions: Mapping[cst.CSTNode, CodeRange] | None = None


@functools.lru_cache(maxsize=8)  # the skills applied in turn to one file, and the files it imports
def _parsed(source: str) -> _Parsed:
    return _Parsed(source)  # a syntax error is raised, and not cached


class Recipe:
    """The recipe file a codemod works on: its tree, an index, and helpers to query them."""

    def __init__(self, path: Path, source: str):
        self.path = Path(path)
        self.source = source
        try:
            self._parsed = _parsed(source)
        except cst.ParserSyntaxError as e:
            raise SkillRefused(
                f"{self.path.name} does not parse (line {e.raw_line}: {e.message}); fix it first"
            ) from None
        self.module = self._parsed.module
        self._index = self._parsed.index

    # --- basic queries -------------------------------------------------------------------------

    @property
    def name(self) -> str:
        return self.path.name

    def parent(self, node: cst.CSTNode) -> cst.CSTNode | None:
        return self._index.parents.get(node)

    def ancestors(self, node: cst.CSTNode):
        parent = self._index.parents.get(node)
        while parent is not None:
            yield parent
            parent = self._index.parents.get(parent)

    def is_inside(self, node: cst.CSTNode, container: cst.CSTNode) -> bool:
        return node is container or any(a is container for a in self.ancestors(node))

    def enclosing(self, node: cst.CSTNode, kind: type | tuple[type, ...]):
        for ancestor in self.ancestors(node):
            if isinstance(ancestor, kind):
                return ancestor
        return None

    def enclosing_function(self, node: cst.CSTNode) -> cst.FunctionDef | None:
        return self.enclosing(node, cst.FunctionDef)

    def enclosing_class(self, node: cst.CSTNode) -> cst.ClassDef | None:
        return self.enclosing(node, cst.ClassDef)

    def statement_of(self, node: cst.CSTNode) -> cst.BaseStatement:
        """The statement (simple line or compound) that directly holds ``node`` in a suite."""
        current = node
        for ancestor in self.ancestors(node):
            if isinstance(ancestor, (cst.Module, cst.IndentedBlock)) and isinstance(current, cst.BaseStatement):
                return current
            current = ancestor
        raise SkillRefused(f"{self.name}: {self.code(node)!r} is not inside a statement block")

    def suite_of(self, statement: cst.BaseStatement) -> Suite:
        parent = self.parent(statement)
        if not isinstance(parent, (cst.Module, cst.IndentedBlock)):
            raise SkillRefused(f"{self.name}: line {self.line(statement)} is not in an indented block")
        return parent

    def top_level_statement(self, node: cst.CSTNode) -> cst.BaseStatement:
        current = node
        for ancestor in self.ancestors(node):
            if isinstance(ancestor, cst.Module):
                return current  # type: ignore[return-value]
            current = ancestor
        return current  # type: ignore[return-value]

    def code(self, node: cst.CSTNode) -> str:
        return self.module.code_for_node(node).strip()

    def short(self, node: cst.CSTNode, limit: int = 60) -> str:
        text = " ".join(self.code(node).split())
        return text if len(text) <= limit else text[: limit - 3] + "..."

    def line(self, node: cst.CSTNode) -> int:
        """1-based line of ``node`` (computed on demand: positions are only needed for messages)."""
        position = self._positions().get(node)
        return position.start.line if position is not None else 0

    def span(self, node: cst.CSTNode) -> tuple[int, int]:
        """First and last 1-based lines of ``node``."""
        position = self._positions().get(node)
        return (position.start.line, position.end.line) if position is not None else (0, 0)

    def _positions(self) -> Mapping[cst.CSTNode, CodeRange]:
        parsed = self._parsed
        if parsed.positions is None:
            parsed.positions = MetadataWrapper(self.module, unsafe_skip_copy=True).resolve(PositionProvider)
        return parsed.positions

    def where(self, node: cst.CSTNode) -> str:
        return f"{self.name}:{self.line(node)}"

    # --- names ---------------------------------------------------------------------------------

    @property
    def imports(self) -> dict[str, str]:
        return self._index.imports

    def qualify(self, node: cst.BaseExpression) -> str:
        """The qualified name of a Name/Attribute chain through the file's imports ("" if none)."""
        dotted = dotted_name(node)
        if not dotted:
            return ""
        head, _, rest = dotted.partition(".")
        base = self._index.imports.get(head, head)
        return f"{base}.{rest}" if rest else base

    def call_name(self, call: cst.Call) -> str:
        return self.qualify(call.func)

    def calls(self) -> list[cst.Call]:
        return self._index.calls

    def calls_to(self, *qualified: str, within: cst.CSTNode | None = None) -> list[cst.Call]:
        """Calls whose qualified name equals one of ``qualified`` or ends with ``.<one of them>``
        when that one starts with a dot (``".fully_shard"`` matches any module's fully_shard)."""
        found = []
        for call in self._index.calls:
            name = self.call_name(call)
            if not name:
                continue
            if any(name == q or (q.startswith(".") and name.endswith(q)) for q in qualified):
                if within is None or self.is_inside(call, within):
                    found.append(call)
        return found

    def method_calls(self, method: str, within: cst.CSTNode | None = None) -> list[cst.Call]:
        """Calls of the form ``<anything>.method(...)``."""
        return [
            c
            for c in self._index.calls
            if isinstance(c.func, cst.Attribute)
            and c.func.attr.value == method
            and (within is None or self.is_inside(c, within))
        ]

    def assigns(self) -> list[cst.Assign]:
        return self._index.assigns

    def returns_of(self, function: cst.FunctionDef) -> list[cst.Return]:
        """The ``return`` statements of ``function`` itself (not of functions nested in it)."""
        return [r for r in self._index.returns if self.enclosing_function(r) is function]

    # --- definitions ---------------------------------------------------------------------------

    def top_level_functions(self) -> dict[str, cst.FunctionDef]:
        return {f.name.value: f for f in self.module.body if isinstance(f, cst.FunctionDef)}

    def top_level_classes(self) -> dict[str, cst.ClassDef]:
        return {c.name.value: c for c in self.module.body if isinstance(c, cst.ClassDef)}

    def defines(self, name: str) -> bool:
        """Is ``name`` bound at module level (a def, a class, an import or an assignment)?"""
        if name in self._index.imports:
            return True
        for statement in self.module.body:
            if isinstance(statement, (cst.FunctionDef, cst.ClassDef)) and statement.name.value == name:
                return True
            if isinstance(statement, cst.SimpleStatementLine):
                for small in statement.body:
                    if isinstance(small, cst.Assign) and any(
                        isinstance(t.target, cst.Name) and t.target.value == name for t in small.targets
                    ):
                        return True
        return False

    def methods(self, cls: cst.ClassDef) -> dict[str, cst.FunctionDef]:
        body = cls.body.body if isinstance(cls.body, cst.IndentedBlock) else ()
        return {f.name.value: f for f in body if isinstance(f, cst.FunctionDef)}

    def base_names(self, cls: cst.ClassDef) -> list[str]:
        return [self.qualify(base.value) for base in cls.bases]

    def subclasses(self, *qualified: str) -> list[cst.ClassDef]:
        """Classes in the file that derive (directly or through classes of the file) from one of
        ``qualified`` (matched like ``calls_to``)."""
        local = {c.name.value: c for c in self._index.classes}
        memo: dict[str, bool] = {}

        def derives(cls: cst.ClassDef, seen: frozenset[str]) -> bool:
            if cls.name.value in memo:
                return memo[cls.name.value]
            result = False
            for base in cls.bases:
                name = self.qualify(base.value)
                if any(name == q or (q.startswith(".") and name.endswith(q)) for q in qualified):
                    result = True
                elif name in local and name not in seen:
                    result = derives(local[name], seen | {name})
                if result:
                    break
            memo[cls.name.value] = result
            return result

        return [c for c in self._index.classes if derives(c, frozenset({c.name.value}))]

    def references(self, name: str, within: cst.CSTNode | None = None) -> bool:
        """Is the bare name ``name`` used (as a Name node) anywhere, or inside ``within``?"""
        root = within if within is not None else self.module
        finder = _NameFinder(name)
        root.visit(finder)
        return finder.found


class _NameFinder(cst.CSTVisitor):
    def __init__(self, name: str):
        self.name = name
        self.found = False

    def on_visit(self, node: cst.CSTNode) -> bool:
        if self.found:
            return False
        if isinstance(node, cst.Name) and node.value == self.name:
            self.found = True
        return True
