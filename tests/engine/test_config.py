"""Configuration layering and the errors a bad key or value produces."""

from __future__ import annotations

import pytest

from engine.config import ConfigError, EngineConfig, build_config, parse_override
from engine.engine import Engine


def test_set_overrides_yaml_which_overrides_code_defaults(tmp_path):
    yaml_file = tmp_path / "config.yaml"
    yaml_file.write_text("train:\n  max_steps: 50\n  seed: 3\n")
    config = build_config(EngineConfig, yaml_file, ["train.max_steps=7"])
    assert config.train.max_steps == 7  # --set wins
    assert config.train.seed == 3  # YAML wins over the default
    assert config.train.log_every == 10  # code default


def test_values_are_coerced_to_the_field_type():
    config = build_config(
        EngineConfig, None, ["optim.lr=1e-3", "train.max_grad_norm=null", "checkpoint.at_end=false"]
    )
    assert config.optim.lr == 0.001
    assert config.train.max_grad_norm is None
    assert config.checkpoint.at_end is False


def test_unknown_key_names_the_key_and_the_valid_choices():
    with pytest.raises(ConfigError) as error:
        build_config(EngineConfig, None, ["train.max_stpes=3"])
    message = str(error.value)
    assert "unknown config key 'train.max_stpes'" in message
    assert "did you mean 'train.max_steps'" in message
    assert "max_steps" in message and "log_every" in message


def test_unknown_section_lists_the_sections():
    with pytest.raises(ConfigError, match=r"unknown config key 'trian'.*valid keys: checkpoint, data"):
        build_config(EngineConfig, None, ["trian.max_steps=3"])


def test_wrong_type_names_the_key_and_the_value():
    with pytest.raises(ConfigError, match=r"bad value for config key 'train.max_steps': 'abc'"):
        build_config(EngineConfig, None, ["train.max_steps=abc"])


def test_out_of_range_value_is_refused():
    with pytest.raises(ConfigError, match=r"'data.batch_size'.*greater than or equal to 1"):
        build_config(EngineConfig, None, ["data.batch_size=0"])


def test_a_literal_lists_its_choices():
    with pytest.raises(ConfigError, match=r"parallel.param_dtype.*'float32', 'bfloat16' or 'float16'"):
        build_config(EngineConfig, None, ["parallel.param_dtype=fp8"])


def test_a_section_cannot_be_set_to_a_scalar():
    with pytest.raises(ConfigError, match=r"'train' is a section; set one of its keys: .*max_steps"):
        build_config(EngineConfig, None, ["train=5"])


@pytest.mark.parametrize("text", ["novalue", "=5", "a..b=1"])
def test_malformed_overrides_are_refused(text):
    with pytest.raises(ConfigError):
        parse_override(text)


def test_bad_yaml_names_the_file(tmp_path):
    yaml_file = tmp_path / "config.yaml"
    yaml_file.write_text("train: [unclosed\n")
    with pytest.raises(ConfigError, match="config.yaml: not valid YAML"):
        build_config(EngineConfig, yaml_file, [])


def test_batch_must_split_evenly_over_ranks_and_micro_batches():
    config = build_config(EngineConfig, None, ["data.batch_size=6", "train.grad_accum=2"])
    Engine.validate_config(config, world_size=1)  # 6 = 1 rank × 2 micro-batches × 3
    with pytest.raises(ConfigError, match=r"data.batch_size=6 must be a multiple of .* 4 × 2"):
        Engine.validate_config(config, world_size=4)


def test_tensor_parallel_degree_must_divide_the_world():
    config = build_config(EngineConfig, None, ["parallel.tp=3"])
    with pytest.raises(ConfigError, match=r"parallel.tp=3 does not divide the number of processes \(2\)"):
        Engine.validate_config(config, world_size=2)
