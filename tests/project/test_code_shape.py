"""The product code keeps the shape issue #22 set (``bench/code_shape.py`` prints the figures):
no function over 80 lines, none in ``mcp_server/`` over 60 (the binding layers stay thin), and
under 3% of ``skills/`` Python code kept inside strings (a skill's helpers are real modules)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _code_shape():
    spec = importlib.util.spec_from_file_location("code_shape", ROOT / "bench" / "code_shape.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


shape = _code_shape()


def test_no_product_function_is_over_80_lines():
    assert shape.long_functions(80) == []


def test_no_function_of_the_mcp_and_cli_bindings_is_over_60_lines():
    assert [f for f in shape.long_functions(60) if f[1] == "mcp_server"] == []


def test_no_file_of_the_run_side_is_over_500_lines():
    """Issue 35: the MCP and CLI bindings, the runner and the run directory's modules stay files a
    reader takes in whole."""
    files = [*ROOT.glob("mcp_server/**/*.py"), *ROOT.glob("runner/*.py"),
             *(ROOT / "engine" / name for name in ("run_dir.py", "run_checkpoints.py", "run_metrics.py", "run_files.py"))]
    long = {str(f.relative_to(ROOT)): n for f in files if (n := len(f.read_text(encoding="utf-8").splitlines())) > 500}
    assert long == {}


def test_under_3_percent_of_skills_is_code_inside_strings():
    inside, total, per_file = shape.code_in_strings()
    assert inside / total < 0.03, per_file


def test_the_measure_sees_a_long_function_and_code_in_a_string(tmp_path, monkeypatch):
    package = tmp_path / "skills"
    package.mkdir()
    body = "\n".join(f"    x{i} = {i}" for i in range(81))
    (package / "a.py").write_text(f'def long():\n{body}\n\nCODE = """\nimport os\nos.getcwd()\n"""\n')
    monkeypatch.setattr(shape, "ROOT", tmp_path)
    monkeypatch.setattr(shape, "PACKAGES", ("skills",))
    assert [(lines, name) for lines, _, name in shape.long_functions(80)] == [(82, "skills/a.py:long")]
    assert shape.code_in_strings()[0] == 4
