"""No product module uses another module's private names: a leading underscore means "this
module's own", so a name another module needs is public where it is defined (issue 35)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("engine", "mcp_server", "runner", "sandbox", "skills", "workspace", "trainwright")


def project_modules() -> dict[str, Path]:
    modules = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def private_uses(path: Path, modules: set[str], root: Path = ROOT) -> list[str]:
    """``from project.module import _name`` and ``alias._name`` where ``alias`` is a project
    module this file imported."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found, aliases = [], {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for name in node.names:
                full = f"{node.module}.{name.name}"
                if full in modules:
                    aliases[name.asname or name.name] = full
                elif node.module in modules and name.name.startswith("_") and not name.name.startswith("__"):
                    found.append(f"{path.relative_to(root)}:{node.lineno}: from {node.module} import {name.name}")
        elif isinstance(node, ast.Import):
            for name in node.names:
                if name.name in modules and name.asname:
                    aliases[name.asname] = name.name
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                and node.attr.startswith("_") and not node.attr.startswith("__")):
            found.append(f"{path.relative_to(root)}:{node.lineno}: {aliases[node.value.id]}.{node.attr}")
    return found


def test_no_product_module_uses_a_private_name_of_another():
    modules = project_modules()
    found = [use for path in modules.values() for use in private_uses(path, set(modules))]
    assert found == []


def test_the_check_sees_both_forms(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("from engine.run_dir import _count\nfrom engine import run_dir as rd\nrd._count(1, 'x')\n")
    modules = set(project_modules())
    assert [use.split(": ", 1)[1] for use in private_uses(probe, modules, tmp_path)] == [
        "from engine.run_dir import _count", "engine.run_dir._count"]
