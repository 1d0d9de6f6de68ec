"""Every CLI command follows the one exit-code table (README, "Errors and exit codes"):
0 ok, 1 the run failed, 2 bad input, 3 not found, 70 internal error (a bug), 130 stopped.

Each command is called in-process with a request that is bad input and, where the command
takes a name, one that names nothing; the exit code and the error kind must match the table,
and nothing may be written to the workspace.
"""

from __future__ import annotations

import json

import pytest

from engine.errors import EXIT_BAD_INPUT, EXIT_INTERNAL, EXIT_NOT_FOUND
from mcp_server import cli
from tests.sandbox.helpers import make_workspace, tree_hash

NO_RUN = "20990101-000000-lm-0000"

CASES = [
    # (command line, exit code, words the error must contain)
    (["runs", "--workspace", "/nonexistent/folder"], EXIT_NOT_FOUND, "is not a folder"),
    (["skills", "show", "no-such-skill"], EXIT_NOT_FOUND, "no skill named"),
    (["skills", "show", "../etc"], EXIT_BAD_INPUT, "not a plain name"),
    (["scaffold", "no_such_template", "x"], EXIT_NOT_FOUND, "unknown template"),
    (["scaffold", "causal_lm", "../x"], EXIT_BAD_INPUT, "not a plain name"),
    (["scaffold", "causal_lm", "x", "--config", "train.max_stpes=3"], EXIT_BAD_INPUT, "unknown config key"),
    (["apply", "no-such-skill", "recipes/lm"], EXIT_NOT_FOUND, "no skill named"),
    (["apply", "loss-guard", "recipes/nope"], EXIT_NOT_FOUND, "no recipe"),
    (["apply", "loss-guard", "/etc/passwd"], EXIT_BAD_INPUT, "outside the workspace"),
    (["apply", "freeze", "recipes/lm", "--param", "bogus=1"], EXIT_BAD_INPUT, "bogus"),
    (["run", "recipes/nope"], EXIT_NOT_FOUND, "no recipe"),
    (["run", "recipes/lm", "--nproc", "0"], EXIT_BAD_INPUT, "nproc must be between"),
    (["run", "recipes/lm", "--set", "novalue"], EXIT_BAD_INPUT, "key=value"),
    (["run", "recipes/lm", "--nnodes", "2"], EXIT_BAD_INPUT, "needs rdzv endpoint 'host:port'"),
    (["run", "recipes/lm", "--nnodes", "2", "--rdzv-endpoint", "node0:29400"], EXIT_BAD_INPUT, "runs.multi_node: true"),
    (["run", "recipes/lm", "--nnodes", "2", "--rdzv-endpoint", "node0:x"], EXIT_BAD_INPUT, "the port must be a number"),
    (["run", "recipes/lm", "--rdzv-id", "x"], EXIT_BAD_INPUT, "pass nnodes > 1 too"),
    (["run", "recipes/lm", "--partition", "gpu"], EXIT_BAD_INPUT, "pass target='slurm' too"),
    (["run", "recipes/lm", "--target", "slurm", "--time", "soon"], EXIT_BAD_INPUT, "slurm time must be"),
    (["run", "recipes/lm", "--target", "slurm", "--rdzv-endpoint", "h:1"], EXIT_BAD_INPUT, "the job's first node"),
    (["resume", NO_RUN], EXIT_NOT_FOUND, "no run"),
    (["resume", "../x"], EXIT_BAD_INPUT, "not a plain name"),
    (["runs", "--limit", "0"], EXIT_BAD_INPUT, "limit must be"),
    (["status", NO_RUN], EXIT_NOT_FOUND, "no run"),
    (["status", "../x"], EXIT_BAD_INPUT, "not a plain name"),
    (["tail", NO_RUN], EXIT_NOT_FOUND, "no run"),
    (["tail", NO_RUN, "-n", "0"], EXIT_BAD_INPUT, "n must be"),
    (["stop", NO_RUN], EXIT_NOT_FOUND, "no run"),
    (["checkpoints", NO_RUN], EXIT_NOT_FOUND, "no run"),
    (["review", "no-such-base"], EXIT_BAD_INPUT, "cannot read the history"),
    (["audit", "-n", "0"], EXIT_BAD_INPUT, "-n must be at least 1"),
    (["plot", NO_RUN], EXIT_NOT_FOUND, "no run"),
    (["wait", NO_RUN], EXIT_NOT_FOUND, "no run"),
    (["wait", NO_RUN, "--timeout", "0"], EXIT_BAD_INPUT, "timeout_s must be"),
    (["describe", "recipes/nope"], EXIT_NOT_FOUND, "no recipe"),
    (["describe", "../outside"], EXIT_BAD_INPUT, "outside the workspace"),
    (["recipes", "--workspace", "/nonexistent/folder"], EXIT_NOT_FOUND, "is not a folder"),
    (["data-cache", "--remove", "no-such-store"], EXIT_NOT_FOUND, "no cached data 'no-such-store'"),
    (["export", NO_RUN, "--to", "exports/x"], EXIT_NOT_FOUND, "no run"),
    (["export", NO_RUN, "--to", "../x"], EXIT_BAD_INPUT, "outside the workspace"),
    (["export", NO_RUN, "--to", "recipes/lm"], EXIT_BAD_INPUT, "is inside recipes/, which holds recipe code"),
    (["sample", NO_RUN, "--prompt", "a"], EXIT_NOT_FOUND, "no run"),
    (["sample", NO_RUN, "--prompt", "a", "--max-new-tokens", "0"], EXIT_BAD_INPUT, "max_new_tokens must be"),
    (["evaluate", NO_RUN], EXIT_NOT_FOUND, "no run"),
    (["compare", NO_RUN, NO_RUN], EXIT_NOT_FOUND, "no run"),
    (["compare", "../x", NO_RUN], EXIT_BAD_INPUT, "not a plain name"),
    (["estimate", "recipes/nope"], EXIT_NOT_FOUND, "no recipe"),
    (["estimate", "recipes/lm", "--device-memory-gib", "0"], EXIT_BAD_INPUT, "device_memory_gib must be"),
    (["estimate", "recipes/lm", "--nproc", "0"], EXIT_BAD_INPUT, "nproc must be"),
    (["evaluate", NO_RUN, "--data", "/etc/passwd"], EXIT_BAD_INPUT, "outside the workspace"),
    (["ab", "loss-guard", "recipes/nope", "--steps", "5"], EXIT_NOT_FOUND, "no recipe"),
    (["ab", "no-such-skill", "recipes/lm", "--steps", "5"], EXIT_NOT_FOUND, "no skill named"),
    (["ab", "loss-guard", "recipes/lm", "--steps", "1"], EXIT_BAD_INPUT, "steps must be between 3 and 1000"),
    (["ab", "loss-guard", "recipes/lm", "--steps", "5"], EXIT_BAD_INPUT, "is not applied to recipes/lm"),
]


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    from workspace.workspace import Workspace

    root = make_workspace(tmp_path_factory.mktemp("exit-codes") / "ws")
    Workspace.open(root).prepare_state()  # as a server leaves it: .trainwright/ and its lock
    return root


def run_cli(workspace, args, capsys) -> tuple[int, dict]:
    if "--workspace" not in args:
        args = [*args, "--workspace", str(workspace)]
    code = cli.main([*args, "--json"])
    out = capsys.readouterr().out.strip().splitlines()
    return code, json.loads(out[-1]) if out else {}


@pytest.mark.parametrize("args, expected_code, words", CASES, ids=[" ".join(c[0][:3]) for c in CASES])
def test_each_command_exits_with_the_code_of_its_error_kind(workspace, capsys, args, expected_code, words):
    before = tree_hash(workspace)
    code, out = run_cli(workspace, args, capsys)
    assert (code, out.get("exit_code")) == (expected_code, expected_code), out
    assert words in out["error"]
    assert tree_hash(workspace) == before, "a refused command changed the workspace"


def test_a_bug_is_an_internal_error_not_bad_input(workspace, capsys, monkeypatch):
    from mcp_server.operations import runs

    def broken(*args, **kwargs):
        raise KeyError("a bug")

    monkeypatch.setattr(runs, "list_runs", broken)
    code, out = run_cli(workspace, ["runs"], capsys)
    assert code == EXIT_INTERNAL and out["error"].startswith("internal error (a trainwright bug): KeyError")


def test_every_command_has_a_case_in_the_table():
    parser = cli.build_parser()
    commands = set(parser._subparsers._group_actions[0].choices)  # noqa: SLF001 — argparse keeps them here
    covered = {args[0] for args, _, _ in CASES}
    # `templates` takes no input that could be wrong; `serve` is the server itself.
    assert commands - covered <= {"serve", "templates"}, f"commands without an exit-code case: {commands - covered}"


def test_the_readme_table_and_the_cli_help_list_every_exit_code_of_the_one_table():
    from pathlib import Path

    from engine.errors import EXIT_MEANINGS

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")
    section = readme.split("## Errors and exit codes", 1)[1].split("\n## ", 1)[0]
    rows = {int(line.split("|")[1]) for line in section.splitlines() if line.startswith("| ") and
            line.split("|")[1].strip().isdigit()}
    assert rows == set(EXIT_MEANINGS)
    epilog = cli.build_parser().epilog or ""
    assert all(f"{code} {meaning}" in epilog for code, meaning in EXIT_MEANINGS.items())
