"""The layout a newcomer reads is the layout on disk: AGENTS.md's line for each package and the
package's own docstring name every module it holds, and name no module it does not."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("engine", "workspace", "runner", "sandbox", "mcp_server", "mcp_server/operations", "engine/metrics")
TOP_LEVEL = ("engine", "workspace", "runner", "sandbox", "mcp_server")


def modules(package: str) -> set[str]:
    return {p.stem for p in (ROOT / package).glob("*.py") if p.stem != "__init__"}


def agents_entry(package: str) -> str:
    """The bullet of AGENTS.md's layout that starts with ``package/``."""
    text = (ROOT / "AGENTS.md").read_text(encoding="utf-8")
    match = re.search(rf"^- `{re.escape(package)}/`.*?(?=^- |^#|\Z)", text, re.M | re.S)
    assert match, f"AGENTS.md has no layout line for {package}/"
    return match.group(0)


@pytest.mark.parametrize("package", TOP_LEVEL)
def test_agents_md_names_every_module_of_a_package_and_no_other(package):
    entry = agents_entry(package)
    named = set(re.findall(r"`([a-z_]+)\.py`", entry))
    subpackages = {p.name for p in (ROOT / package).iterdir() if (p / "__init__.py").is_file()}
    inside = modules(package) | {m for sub in subpackages for m in modules(f"{package}/{sub}")}
    assert modules(package) - named == set(), f"AGENTS.md's {package}/ line leaves out these modules"
    assert named - inside == set(), f"AGENTS.md's {package}/ line names modules that are not there"


@pytest.mark.parametrize("package", PACKAGES)
def test_a_package_docstring_lists_its_modules(package):
    doc = importlib.import_module(package.replace("/", ".")).__doc__ or ""
    listed = set(re.findall(r"^- ``([a-z_]+)(?:/)?``", doc, re.M))
    subpackages = {p.name for p in (ROOT / package).iterdir() if (p / "__init__.py").is_file()}
    assert listed == modules(package) | subpackages, f"{package}/__init__.py's list of modules is not its modules"
