"""Trusted settings outside the workspace: ``serve --config FILE`` (default: the user's config
folder) sets the run limits; the workspace's ``.trainwright/config.yaml`` may only tighten them,
and a loosening attempt is ignored with a warning the run records."""

from __future__ import annotations

import subprocess
import sys

import pytest

from engine import run_dir as rd
from mcp_server.operations import launch as launching
from mcp_server.operations import runs as run_ops
from mcp_server.server import build_server
from workspace.settings import ConfigRefused, RunLimits, effective_limits, tighten, user_config_path
from workspace.workspace import Workspace
from tests.sandbox.helpers import make_workspace, run_overrides, wait_final


def _files(tmp_path, trusted: str | None, workspace: str):
    state = tmp_path / ".trainwright"
    state.mkdir(exist_ok=True)
    (state / "config.yaml").write_text(workspace)
    path = None
    if trusted is not None:
        path = tmp_path / "trusted.yaml"
        path.write_text(trusted)
    return path, state


def test_the_default_file_is_in_the_users_config_folder(tmp_path):
    assert user_config_path({"XDG_CONFIG_HOME": str(tmp_path)}) == tmp_path / "trainwright" / "config.yaml"
    assert str(user_config_path({})).endswith(".config/trainwright/config.yaml")


def test_the_workspace_may_tighten_every_limit(tmp_path):
    trusted, state = _files(tmp_path, "runs:\n  network: shared\n  pass_env: [A_TOKEN, B_TOKEN]\n  wall_time_s: 100\n",
                            "runs:\n  network: isolated\n  pass_env: [A_TOKEN]\n  wall_time_s: 50\n"
                            "  max_open_files: 100\n  max_memory: 1GiB\n  stop_grace_s: 1\n  threads_per_process: 1\n")
    limits, warnings = effective_limits(trusted, state)
    assert warnings == []
    assert limits == RunLimits(network="isolated", pass_env=("A_TOKEN",), wall_time_s=50.0, max_open_files=100,
                               max_memory_bytes=2**30, stop_grace_s=1.0, threads_per_process=1)


@pytest.mark.parametrize("setting, kept", [
    ("network: shared", {"network": "isolated"}),
    ("pass_env: [AWS_SECRET_ACCESS_KEY]", {"pass_env": ()}),
    ("max_open_files: 100000", {"max_open_files": 4096}),
    ("max_open_files: null", {"max_open_files": 4096}),
    ("wall_time_s: 200", {"wall_time_s": 100.0}),
    ("wall_time_s: null", {"wall_time_s": 100.0}),
    ("stop_grace_s: 60", {"stop_grace_s": 10.0}),
])
def test_a_loosening_setting_is_ignored_with_a_warning(tmp_path, setting, kept):
    trusted, state = _files(tmp_path, "runs:\n  wall_time_s: 100\n", f"runs:\n  {setting}\n")
    limits, warnings = effective_limits(trusted, state)
    for name, value in kept.items():
        assert getattr(limits, name) == value
    assert len(warnings) == 1 and "would loosen" in warnings[0] and "ignored" in warnings[0]
    assert setting.split(":")[0] in warnings[0]


def test_pass_env_keeps_only_the_allowed_names():
    limits, warnings = tighten(RunLimits(pass_env=("A",)), RunLimits(pass_env=("A", "B")), {"pass_env"})
    assert limits.pass_env == ("A",) and "would loosen" in warnings[0]


def test_a_given_settings_file_must_exist(tmp_path):
    with pytest.raises(ConfigRefused, match="does not exist"):
        build_server(make_workspace(tmp_path / "ws"), settings=tmp_path / "missing.yaml")
    result = subprocess.run(
        [sys.executable, "-m", "mcp_server.cli", "run", "recipes/lm", "--workspace", str(tmp_path / "ws"),
         "--config", str(tmp_path / "missing.yaml")], capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 2 and "does not exist" in result.stderr


def test_a_run_gets_the_trusted_limits_and_records_the_ignored_setting(tmp_path):
    root = make_workspace(tmp_path / "ws", config_yaml="runs:\n  threads_per_process: 1\n  network: shared\n"
                          "  max_open_files: 2048\n")
    trusted = tmp_path / "trusted.yaml"
    trusted.write_text("runs:\n  network: isolated\n")
    ws = Workspace.open(root, trusted)
    result = launching.launch_run(ws, "recipes/lm", 1, run_overrides("train.max_steps=1"))
    record = wait_final(root / rd.RUNS_DIRNAME / result.run_id)
    assert record.limits["network"] == "isolated" and record.limits["max_open_files"] == 2048
    info = run_ops.get_run(ws, result.run_id)
    assert any("runs.network = 'shared'" in w and "ignored" in w for w in info.warnings), info.warnings


def test_the_readme_and_the_module_show_the_real_defaults():
    import re
    from pathlib import Path

    import yaml

    import workspace.settings
    from workspace.settings import limits_from_mapping

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    block = re.search(r"```yaml\n(runs:\n.*?)```", readme, re.S).group(1)
    assert limits_from_mapping(yaml.safe_load(block)["runs"]) == RunLimits()
    doc = re.search(r"\n(    runs:\n.*?)\n\"\"\"", workspace.settings.__doc__ + '\n"""', re.S).group(1)
    assert limits_from_mapping(yaml.safe_load(doc.replace("\n    ", "\n").strip())["runs"]) == RunLimits()
