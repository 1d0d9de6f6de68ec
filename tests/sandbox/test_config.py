"""Run limits come from ``.trainwright/config.yaml`` (``runs:``); a bad file refuses the launch."""

from __future__ import annotations

import pytest

from workspace.settings import ConfigRefused, RunLimits, load_run_limits


def write(tmp_path, text):
    (tmp_path / "config.yaml").write_text(text)
    return tmp_path


def test_without_a_file_the_defaults_apply(tmp_path):
    assert load_run_limits(tmp_path) == RunLimits()
    assert RunLimits().network == "isolated" and RunLimits().max_open_files == 4096


def test_every_setting_is_read(tmp_path):
    limits = load_run_limits(write(tmp_path, """
runs:
  wall_time_s: 3600
  max_open_files: 1024
  max_processes: 512
  max_memory: 16GiB
  stop_grace_s: 2.5
  network: shared
  threads_per_process: 3
  pass_env: [WANDB_API_KEY, HF_TOKEN]
"""))
    assert limits == RunLimits(wall_time_s=3600.0, max_open_files=1024, max_processes=512,
                               max_memory_bytes=16 * 2**30, stop_grace_s=2.5, network="shared",
                               threads_per_process=3, pass_env=("WANDB_API_KEY", "HF_TOKEN"))


@pytest.mark.parametrize("size, expected", [("500M", 500 * 10**6), ("2GiB", 2 * 2**30), (4096, 4096), ("1.5 GB", 1_500_000_000)])
def test_memory_sizes_take_units(tmp_path, size, expected):
    assert load_run_limits(write(tmp_path, f"runs:\n  max_memory: {size}\n")).max_memory_bytes == expected


@pytest.mark.parametrize("text, message", [
    ("runs:\n  wall_time: 5\n", "unknown setting runs.wall_time; valid:"),
    ("runs:\n  wall_time_s: -5\n", "must be positive"),
    ("runs:\n  max_open_files: lots\n", "must be a positive int"),
    ("runs:\n  max_open_files: 1.5\n", "must be a positive int"),
    ("runs:\n  network: off\n", "runs.network must be one of isolated, shared"),
    ("runs:\n  max_memory: a lot\n", "size like '16GiB'"),
    ("runs:\n  pass_env: 5\n", "list of environment variable names"),
    ("runs: [1, 2]\n", "mapping of settings"),
    ("- just a list\n", "must be a mapping"),
    ("runs: {\n", "cannot be read"),
])
def test_a_bad_setting_is_refused_naming_the_key(tmp_path, text, message):
    with pytest.raises(ConfigRefused, match=message.replace("(", r"\(").replace(".", r"\.")):
        load_run_limits(write(tmp_path, text))
