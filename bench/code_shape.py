"""The shape of the product code: its longest functions, and how much of skills/ is code in strings.

    python bench/code_shape.py [--top N] [--max-lines 80]

Two figures a reviewer can check (issue #22's goals: no function over 80 lines; under 3% of
``skills/`` code inside string constants):

- every function or method of the product packages longer than ``--max-lines`` lines (its
  ``def`` to its last line, decorators excluded), longest first, per package;
- the lines of ``skills/`` that sit inside string constants which are Python code: a string
  of two or more lines that parses as a module and holds a statement other than an expression
  (a docstring, prose in a string, does not count), counted over all lines of ``skills/*.py``.

Static: it reads the files, imports nothing.
"""

from __future__ import annotations

import argparse
import ast
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("engine", "sandbox", "workspace", "runner", "mcp_server", "skills", "trainwright")


def python_files(package: str) -> list[Path]:
    return sorted(p for p in (ROOT / package).rglob("*.py") if "__pycache__" not in p.parts)


def long_functions(max_lines: int) -> list[tuple[int, str, str]]:
    """(lines, package, file:function) for every function over ``max_lines`` lines."""
    found = []
    for package in PACKAGES:
        for path in python_files(package):
            tree = ast.parse(path.read_text(encoding="utf-8"))
            for node in ast.walk(tree):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    lines = (node.end_lineno or node.lineno) - node.lineno + 1
                    if lines > max_lines:
                        found.append((lines, package, f"{path.relative_to(ROOT)}:{node.name}"))
    return sorted(found, reverse=True)


def _is_code(text: str) -> bool:
    if text.count("\n") < 1:
        return False
    try:
        module = ast.parse(textwrap.dedent(text))
    except (SyntaxError, ValueError):
        return False
    return any(not isinstance(statement, ast.Expr) for statement in module.body)


def code_in_strings(package: str = "skills") -> tuple[int, int, dict[str, int]]:
    """(lines of code inside strings, all lines, per file) over ``package``."""
    inside, total, per_file = 0, 0, {}
    for path in python_files(package):
        source = path.read_text(encoding="utf-8")
        total += source.count("\n")
        counted: set[int] = set()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and _is_code(node.value):
                counted.update(range(node.lineno, (node.end_lineno or node.lineno) + 1))
        if counted:
            per_file[str(path.relative_to(ROOT))] = len(counted)
            inside += len(counted)
    return inside, total, per_file


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--top", type=int, default=10, help="files shown for code in strings (default 10)")
    parser.add_argument("--max-lines", type=int, default=80, help="a function over this is listed (default 80)")
    args = parser.parse_args()

    functions = long_functions(args.max_lines)
    counts = {package: sum(1 for _, p, _ in functions if p == package) for package in PACKAGES}
    print(f"functions over {args.max_lines} lines: {len(functions)} "
          f"({', '.join(f'{p} {n}' for p, n in counts.items())})")
    for lines, _, name in functions:
        print(f"  {lines:5d}  {name}")

    inside, total, per_file = code_in_strings()
    print(f"skills/: {inside:,} of {total:,} lines are code inside strings ({100 * inside / max(total, 1):.1f}%; "
          "goal < 3%)")
    for name, lines in sorted(per_file.items(), key=lambda item: -item[1])[:args.top]:
        print(f"  {lines:5d}  {name}")


if __name__ == "__main__":
    main()
