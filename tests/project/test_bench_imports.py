"""Every name a benchmark or an example imports from the project exists. A benchmark imports inside the
functions that need it (a worker process, a peer), so a renamed helper surfaces only when that
function runs: in the middle of a 20-minute measurement."""

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
