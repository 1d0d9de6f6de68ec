"""Each tool argument is checked once, where it is declared (``mcp_server/arguments.py``): the
MCP binding, the CLI and a Python caller all get the same refusal, naming the field, and the
operations keep no checks of their own (issue 35)."""

from __future__ import annotations

import json
import typing

import pytest
from pydantic import create_model

from engine.errors import BadInput
from mcp_server import cli
from mcp_server.arguments import (
    DescribeArgs,
    EvaluateArgs,
    LaunchRunArgs,
    ListRunsArgs,
    ResumeArgs,
    SampleArgs,
    TailArgs,
    WaitRunArgs,
    invalid,
    refusal,
)
from mcp_server.limits import MAX_NPROC

REFUSED = [
    (ListRunsArgs, {"limit": 0}, "limit must be an integer between 1 and 100, got 0"),
    (ListRunsArgs, {"limit": 101}, "limit must be an integer between 1 and 100, got 101"),
    (TailArgs, {"run_id": "r", "n": 201}, "n must be an integer between 1 and 200, got 201"),
    (WaitRunArgs, {"run_id": "r", "until_step": -1}, "until_step must be a step number (0 or more) or null, got -1"),
    (WaitRunArgs, {"run_id": "r", "timeout_s": 0.0},
     "timeout_s must be a number of seconds above 0 and at most 600, got 0.0; call wait_run again to wait longer"),
    (LaunchRunArgs, {"recipe": "r", "nproc": MAX_NPROC + 1}, f"nproc must be between 1 and {MAX_NPROC}, got {MAX_NPROC + 1}"),
    (ResumeArgs, {"run_id": "r", "nproc": 0}, f"nproc must be between 1 and {MAX_NPROC}, got 0"),
    (SampleArgs, {"run_id": "r", "prompts": ["a"] * 9}, "at most 8 prompts at a time, got 9"),
    (SampleArgs, {"run_id": "r", "prompts": ["a"], "temperature": 9.0}, "temperature must be 0 (greedy) or a number"),
    (EvaluateArgs, {"run_id": "r", "data": ["d"] * 21}, "data must be a path or a list of 1 to 20 paths"),
    (DescribeArgs, {"recipe": "r", "keys": ["train", " . "]}, "keys: an empty key"),
]


@pytest.mark.parametrize("model, values, message", REFUSED)
def test_a_value_out_of_bounds_is_bad_input_that_names_the_field(model, values, message):
    with pytest.raises(BadInput) as refused:
        model.checked(**values)
    assert str(refused.value).startswith(message)


@pytest.mark.parametrize("model, values, message", REFUSED)
def test_the_check_holds_in_a_model_rebuilt_from_the_annotations(model, values, message):
    """The MCP SDK builds its own model of a tool's parameters from the arguments model's
    annotations, evaluated again in another module: the bounds travel with them."""
    rebuilt = create_model(f"{model.__name__}Rebuilt", **{
        name: (hint, model.model_fields[name].default if not model.model_fields[name].is_required() else ...)
        for name, hint in typing.get_type_hints(model, include_extras=True).items()})
    with pytest.raises(ValueError) as refused:
        rebuilt.model_validate(values)
    own = refusal(refused.value)
    assert own is not None and str(own).startswith(message)


def test_a_type_error_is_named_by_field_and_the_bounds_add_nothing_to_the_schema():
    with pytest.raises(BadInput, match="^n: Input should be a valid integer"):
        TailArgs.checked(run_id="r", n="many")
    assert refusal(None) is None
    schema = json.dumps(TailArgs.model_json_schema())
    assert "minimum" not in schema and "maximum" not in schema  # tools/list keeps its bytes
    with pytest.raises(ValueError) as refused:
        TailArgs.model_validate({"run_id": "r", "n": 0})
    assert str(invalid(refused.value)) == "n must be an integer between 1 and 200, got 0"


def test_the_cli_refuses_with_the_same_message(tmp_path, capsys):
    code = cli.main(["runs", "--limit", "101", "--workspace", str(tmp_path), "--json"])
    assert code == 2
    assert json.loads(capsys.readouterr().out)["error"] == "limit must be an integer between 1 and 100, got 101"
