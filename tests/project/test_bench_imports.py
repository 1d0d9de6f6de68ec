"""Every name a benchmark or an example imports from the project exists, and every attribute it
reads of a project module it imported (``rd.read_all_metrics``). A benchmark imports inside the
functions that need it (a worker process, a peer), so a renamed or moved helper surfaces only
when that function runs: in the middle of a 20-minute measurement."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PROJECT_PACKAGES = {"engine", "mcp_server", "runner", "sandbox", "skills", "workspace", "tests"}


def project_imports(path: Path) -> list[tuple[int, str, str]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 \
                and node.module.split(".")[0] in PROJECT_PACKAGES:
            found += [(node.lineno, node.module, alias.name) for alias in node.names]
    return found


SCRIPTS = sorted(str(p.relative_to(REPO)) for folder in ("bench", "examples") for p in (REPO / folder).glob("*.py"))


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_project_name_a_benchmark_or_example_imports_exists(script):
    missing = []
    for line, module, name in project_imports(REPO / script):
        imported = importlib.import_module(module)
        if not hasattr(imported, name):
            try:
                importlib.import_module(f"{module}.{name}")  # a submodule
            except ImportError:
                missing.append(f"{script}:{line}: from {module} import {name}")
    assert not missing, missing


def module_attributes(path: Path) -> list[tuple[int, str, str]]:
    """``(line, module, attribute)`` for each ``alias.attribute`` read where ``alias`` names a
    project module the file imported (``from engine import run_dir as rd``)."""
    tree = ast.parse(path.read_text(), str(path))
    aliases: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 \
                and node.module.split(".")[0] in PROJECT_PACKAGES:
            for alias in node.names:
                try:
                    importlib.import_module(f"{node.module}.{alias.name}")
                except ImportError:
                    continue
                aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return [(node.lineno, aliases[node.value.id], node.attr) for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases]


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_attribute_a_benchmark_reads_of_a_project_module_exists(script):
    missing = [f"{script}:{line}: {module}.{name}" for line, module, name in module_attributes(REPO / script)
               if not hasattr(importlib.import_module(module), name)]
    assert not missing, missing

