"""Every MCP tool has a CLI twin that takes the same parameters with the same defaults.

Both are generated from one declaration per tool (``mcp_server/declarations.py``); when they
were written apart they drifted (``tail`` showed 20 records and ``tail_metrics`` 10, ``resume``
took ``--set`` and ``resume_checkpoint`` no overrides). This test reads both surfaces as a user
sees them — the server's ``tools/list`` and the CLI's argparse tree — and fails on any
parameter that one has and the other lacks, or a default they disagree on. :data:`TWINS` names
each tool's command and where the CLI spells a parameter otherwise (an object as several
options, a script's command line after ``--``); :data:`CLI_ONLY` what only a terminal needs.
Both are the whole list: a new tool or option fails here until it is placed.
"""

from __future__ import annotations

import argparse
import tempfile
from typing import Any

import pytest

from mcp_server.cli import build_parser, split_script_args
from mcp_server.server import build_server, tool_schemas

AFTER_DASHES = "the command line after --"  # a script's own arguments: trainwright run S -- ARGS
# tool -> (command path, {tool parameter: the CLI's dest, or a tuple of dests for an object the
# CLI spells as several options})
TWINS: dict[str, tuple[tuple[str, ...], dict[str, str | tuple[str, ...]]]] = {
    "list_skills": (("skills", "list"), {}),
    "get_skill": (("skills", "show"), {}),
    "list_templates": (("templates",), {}),
    "scaffold_recipe": (("scaffold",), {}),
    "list_recipes": (("recipes",), {}),
    "describe_recipe": (("describe",), {}),
    "apply_skill": (("apply",), {}),
    "launch_run": (("run",), {
        "rdzv": ("rdzv_endpoint", "rdzv_id", "node_rank"),
        "slurm": ("partition", "time", "gpus_per_node", "rdzv_port"),
        "args": AFTER_DASHES,
    }),
    "resume_checkpoint": (("resume",), {"args": AFTER_DASHES}),
    "list_runs": (("runs",), {}),
    "get_run": (("status",), {}),
    "tail_metrics": (("tail",), {}),
    "wait_run": (("wait",), {}),
    "estimate_run": (("estimate",), {}),
    "compare_runs": (("compare",), {}),
    "stop_run": (("stop",), {}),
    "list_checkpoints": (("checkpoints",), {}),
    "export_checkpoint": (("export",), {}),
    "sample": (("sample",), {}),
    "evaluate": (("evaluate",), {}),
}
COMMON = {"help", "workspace", "json", "func", "command", "action"}
# Options only a terminal needs: --detach (a tool call always returns at once), --config (the
# server's settings are the server's), --follow (a client subscribes to run://<id>/metrics).
CLI_ONLY: dict[tuple[str, ...], set[str]] = {
    ("run",): {"detach", "settings"},
    ("resume",): {"detach", "settings"},
    ("tail",): {"follow"},
}
EMPTY = (None, [], {}, "")


def _tools() -> dict[str, dict[str, Any]]:
    with tempfile.TemporaryDirectory(prefix="trainwright-parity-") as workspace:
        return {tool["name"]: tool for tool in tool_schemas(build_server(workspace))}


def _command(path: tuple[str, ...]) -> argparse.ArgumentParser:
    parser = build_parser()
    for name in path:
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = sub.choices[name]
    return parser


def _options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {a.dest: a for a in parser._actions if a.dest not in COMMON and a.dest != argparse.SUPPRESS}


TOOLS = _tools()


def test_every_tool_has_a_twin_and_every_twin_a_tool():
    assert set(TOOLS) == set(TWINS)


@pytest.mark.parametrize("tool", sorted(TWINS))
def test_a_tool_and_its_cli_twin_take_the_same_parameters_with_the_same_defaults(tool):
    path, renamed = TWINS[tool]
    schema = TOOLS[tool]["inputSchema"]
    required = set(schema.get("required", []))
    options = _options(_command(path))
    covered: set[str] = set()
    for name, prop in schema.get("properties", {}).items():
        dest = renamed.get(name, name)
        if dest == AFTER_DASHES:
            command = [*path, "x", "--nproc", "2"]
            assert split_script_args([*command, "--", "--epochs", "3"]) == (command, ["--epochs", "3"])
            continue
        dests = dest if isinstance(dest, tuple) else (dest,)
        missing = [d for d in dests if d not in options]
        assert not missing, f"{tool}({name}) has no twin in `trainwright {' '.join(path)}` (looked for {missing})"
        covered.update(dests)
        if isinstance(dest, tuple):
            continue  # an object the CLI spells as options: its keys' defaults are the server's
        action = options[dest]
        cli_required = action.required or not action.option_strings and action.nargs not in ("?", "*")
        assert (name in required) == bool(cli_required), f"{tool}({name}): required differs from the CLI's"
        if name not in required:
            tool_default, cli_default = prop.get("default"), action.default
            same = tool_default == cli_default or (tool_default in EMPTY and cli_default in EMPTY)
            assert same, f"{tool}({name}) defaults to {tool_default!r}, `trainwright {' '.join(path)}` to {cli_default!r}"
    extra = set(options) - covered - CLI_ONLY.get(path, set())
    assert not extra, f"`trainwright {' '.join(path)}` has options {sorted(extra)} that {tool} does not take"


def test_every_tool_command_prints_its_result_or_follows_it():
    from mcp_server import following, terminal
    from mcp_server.declarations import TOOLS

    for spec in TOOLS:
        assert (spec.name in terminal.TEXT) != (spec.name in following.AFTER), spec.name
