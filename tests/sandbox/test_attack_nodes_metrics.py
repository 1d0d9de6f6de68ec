"""Attacker's pass over nnodes/rdzv, target="slurm" and its options, the metric backends'
settings and apply_skill's target: hostile values are refused before anything is written, and
nothing a tool call passes can add a line to the generated sbatch script."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from engine import run_dir as rd
from engine import run_checkpoints
from engine.config import MetricsConfig
from engine.errors import BadInput
from mcp_server.arguments import ApplySkillArgs
from mcp_server.operations.skills import with_target
from runner import slurm
from runner.nodes import check_endpoint, check_nodes

SHELLY = ["gpu\n#SBATCH --account=other", "gpu;id", "$(id)", "`id`", "gpu'x", 'gpu"x', "gpu x", "", "a" * 100]


@pytest.mark.parametrize("value", SHELLY + ["gpu\n", "gpu\r"])
def test_partition_refused(value):
    with pytest.raises(BadInput):
        slurm.check_options({"partition": value})


@pytest.mark.parametrize("value", ["90\n", "90\n#SBATCH --nodes=99", "$(id)", "1:00 ", "`id`", 90, None])
def test_time_refused(value):
    with pytest.raises(BadInput):
        slurm.check_options({"time": value})


@pytest.mark.parametrize("value", ["8", 8.0, True, -1, 65, "8\n"])
def test_gpus_per_node_refused(value):
    with pytest.raises(BadInput):
        slurm.check_options({"gpus_per_node": value})


@pytest.mark.parametrize("value", ["29400", 0, 70000, True, "29400;id"])
def test_rdzv_port_refused(value):
    with pytest.raises(BadInput):
        slurm.check_options({"rdzv_port": value})


def test_unknown_slurm_key_refused():
    with pytest.raises(BadInput):
        slurm.check_options({"account": "x"})
    with pytest.raises(BadInput):
        slurm.check_options({"partition\n": "x"})


@pytest.mark.parametrize("endpoint", ["node0\n:29400", "$(id):29400", "`id`:1",
                                      "a b:1", "node0:29400/../x", "[::1\n]:1", "file:///etc", "x" * 300 + ":1",
                                      "node0:-1", "node0:99999"])
def test_rdzv_endpoint_refused(endpoint):
    with pytest.raises(BadInput):
        check_endpoint(endpoint)


def test_rdzv_endpoint_surrounding_space_stripped():
    assert check_endpoint(" node0:29400\n") == "node0:29400"
    assert check_endpoint("node0\n") == "node0:29400"


@pytest.mark.parametrize("rdzv_id", ["..", "../x", "a/b", "a\n", "a\r", ".hidden", "-x", "$(id)", "a" * 129, 7])
def test_rdzv_id_refused(rdzv_id):
    with pytest.raises(BadInput):
        check_nodes(2, {"endpoint": "127.0.0.1:29400", "id": rdzv_id})


@pytest.mark.parametrize("nnodes", [0, -1, 1025, True, "2", 2.0])
def test_nnodes_refused(nnodes):
    with pytest.raises(BadInput):
        check_nodes(nnodes, {"endpoint": "127.0.0.1:29400"})


def _script(recipe: str, rdzv_id: str, tmp_path: Path, **options) -> str:
    record = rd.RunRecord(id=rd.new_run_id(recipe), recipe=recipe, nproc=2, nnodes=2, rdzv_id=rdzv_id,
                          workspace=str(tmp_path / "w s$(id)"))
    return slurm.job_script(record, tmp_path, slurm.check_options(options), "/usr/bin/python3",
                            ["--config", "x';id;'"], {"TRAINWRIGHT_WORKSPACE": record.workspace, "OMP_NUM_THREADS": "1"})


def test_script_has_no_injected_lines(tmp_path):
    """A recipe folder's name is whatever the workspace holds (a newline included): the comment
    that names it must stay one line, or it adds #SBATCH directives or commands to the job."""
    recipe = "recipes/r\n#SBATCH --account=stolen\nid\r\n`id`"
    text = _script(recipe, "run-1", tmp_path, partition="gpu", time="04:00:00", gpus_per_node=2)
    lines = text.splitlines()
    assert not any(line.startswith("#SBATCH") and "--account" in line for line in lines)
    assert sum(line.startswith("# trainwright run") for line in lines) == 1
    assert not any(line.strip() in ("id", "`id`") for line in lines)
    sbatch = [line for line in lines if line.startswith("#SBATCH")]
    assert len(sbatch) == 9  # job-name nodes ntasks gpus time partition output open-mode no-requeue
    assert text.count("\n") == len(lines)
    assert "\r" not in text


def test_workspace_with_shell_chars_quoted(tmp_path):
    text = _script("recipes/r", "run-1", tmp_path)
    assert "cd '" in text and "$(id)'" in text  # single-quoted
    assert f"export OMP_NUM_THREADS=1 TRAINWRIGHT_WORKSPACE='{tmp_path}/w s$(id)'" in text.splitlines()
    assert "'--config' 'x'\"'\"';id;'\"'\"''" in text or "x'\"'\"';id;'\"'\"'" in text


def test_metrics_settings_hold_no_paths_or_credentials():
    for section in ("wandb", "trackio", "mlflow"):
        with pytest.raises(ValidationError):
            MetricsConfig.model_validate({section: {"dir": "/etc"}})
    with pytest.raises(ValidationError):
        MetricsConfig.model_validate({"mlflow": {"tracking_uri": "http://u:secret@host/"}})
    with pytest.raises(ValidationError):
        MetricsConfig.model_validate({"backends": ["wandb", "/etc/passwd"]})
    with pytest.raises(ValidationError):
        MetricsConfig.model_validate({"backends": ["tensorboard"]})


def test_apply_skill_target_twice_refused():
    with pytest.raises(BadInput):
        with_target({"target": "a"}, "b")
    with pytest.raises(BadInput):  # params that are not a mapping: refused where the argument is declared
        ApplySkillArgs.checked(skill="lora", recipe="recipes/lm", params=["x"], target="a")
    assert with_target(None, "x" * 10) == {"target": "x" * 10}


@pytest.mark.parametrize("name", ["run\n", "run\n\n", "a\r"])
def test_check_name_refuses_trailing_newline(name):
    from workspace.paths import PathRefused, check_name
    with pytest.raises(PathRefused):
        check_name(name, "run_id")


def test_names_with_a_trailing_newline_are_not_runs_or_checkpoints():
    assert not rd.RUN_ID_PATTERN.fullmatch("run\n")
    assert run_checkpoints.checkpoint_step(Path("step-00000001\n")) is None
    assert run_checkpoints.checkpoint_step(Path("step-00000001")) == 1
