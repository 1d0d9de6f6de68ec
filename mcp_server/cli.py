"""The ``trainwright`` command line: the CLI twin of every MCP tool, for people and CI agents.

Each tool's subcommand is generated from its declaration (:data:`mcp_server.declarations.TOOLS`):
the same arguments, defaults, limits and help, one :func:`run_tool` for all of them; how a
result reads in a terminal is :mod:`mcp_server.terminal`'s. Only what a terminal needs beyond
the tool is written here: following a run's console (``run``, ``resume`` without ``--detach``),
``tail --follow``, the exit code of a run's outcome, and the commands with no tool (``serve``,
``review``, ``audit``, ``plot``, ``ab``).

Every command takes ``--workspace DIR`` (default: the current directory) and ``--json`` (one
JSON object on stdout, the same object the MCP tool returns). Exit codes: the one table,
:data:`engine.errors.EXIT_MEANINGS`.
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
import types
import typing
from pathlib import Path
from typing import Any, Callable, Literal

from pydantic import ValidationError
from pydantic.fields import FieldInfo

from engine.errors import (EXIT_INTERNAL, EXIT_MEANINGS, EXIT_OK, EXIT_RUN_FAILED, EXIT_STOPPED, BadInput, TrainwrightError)
from mcp_server import terminal
from mcp_server.following import AFTER, DownloadBar, WaitLines, emit, said_once
from mcp_server.arguments import Cli, invalid, refusal
from mcp_server.declarations import TOOLS, Report, ToolSpec

EPILOG = ("exit codes: " + ", ".join(f"{code} {meaning}" for code, meaning in EXIT_MEANINGS.items())
          + ". Every command accepts --workspace DIR and --json.")
GROUPS = {"skills": "list or show skills"}  # commands with actions (trainwright skills list)


def _workspace(args: argparse.Namespace):
    from workspace.workspace import Workspace

    return Workspace.open(args.workspace, getattr(args, "settings", None))


# ---------------------------------------------------------------------------------------------
# A tool's command
# ---------------------------------------------------------------------------------------------


def run_tool(args: argparse.Namespace) -> int:
    """Any tool's command: the command line read into the tool's arguments model, the operation
    run with a progress bar, the result printed (or followed, :data:`AFTER`)."""
    spec: ToolSpec = args.spec
    ws = _workspace(args) if spec.workspace else None
    inputs = tool_arguments(spec, args)
    if spec.stages is not None and not args.json:
        print(f"{spec.stages.start}…", file=sys.stderr, flush=True)
    bar = DownloadBar()
    try:
        result = spec.run(ws, inputs, Report(download=bar, observe=WaitLines(args.json), waiting=said_once()))
        if inspect.iscoroutine(result):
            import anyio

            result = anyio.run(lambda: result)
    finally:
        bar.close()
    after = AFTER.get(spec.name)
    if after is not None:
        return after(args, ws, result)
    emit(args, result, terminal.TEXT[spec.name])
    return EXIT_OK


def tool_arguments(spec: ToolSpec, args: argparse.Namespace) -> Any:
    """The parsed command line as the tool's arguments model (a value the model refuses is bad
    input, as over MCP)."""
    given: dict[str, Any] = {}
    for name, field in spec.args.model_fields.items():
        cli = cli_of(field)
        if cli.after_dashes:
            value: Any = getattr(args, "script_args", None) or field.default  # resume: None, the run's own
        elif cli.keys is not None:
            given_keys = {key: getattr(args, _dest(option.flag)) for key, option in cli.keys.items()}
            value = {key: v for key, v in given_keys.items() if v is not None}
        else:
            value = getattr(args, name)
            if cli.key_values and value is not None:
                from engine.config import overrides_to_dict

                value = overrides_to_dict(value)
        if value is not None or field.is_required():
            given[name] = value
    try:
        return spec.args.model_validate(given)
    except ValidationError as e:
        raise refusal(e) or BadInput(f"{' '.join(spec.command)}: {invalid(e)}") from None


def cli_of(field: FieldInfo) -> Cli:
    return next((m for m in field.metadata if isinstance(m, Cli)), Cli())


def _dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


# ---------------------------------------------------------------------------------------------
# Commands with no tool: serve, review, audit, plot, ab
# ---------------------------------------------------------------------------------------------


def cmd_serve(args: argparse.Namespace) -> int:
    from mcp_server.server import serve

    if args.no_auth and args.http is None:
        raise BadInput("--no-auth applies to --http only")
    serve(args.workspace, http_port=args.http, read_only=args.read_only, auth=not args.no_auth,
          settings=args.settings)
    return EXIT_OK


def cmd_review(args: argparse.Namespace) -> int:
    from mcp_server.operations import review

    emit(args, review.review(_workspace(args), args.base), review.format_review)
    return EXIT_OK


def cmd_audit(args: argparse.Namespace) -> int:
    """The latest entries of ``.trainwright/audit.jsonl``: every tool call, oldest first."""
    from workspace.audit import AuditLog

    if args.n < 1:
        raise BadInput("-n must be at least 1")
    entries = AuditLog(_workspace(args).state_dir).tail(args.n)
    if args.json:
        print(json.dumps({"entries": entries}))
        return EXIT_OK
    if not entries:
        print("no tool calls recorded yet (.trainwright/audit.jsonl is empty)")
    for entry in entries:
        arguments = json.dumps(entry.get("arguments", {}), separators=(",", ":"))
        outcome = entry.get("outcome", "?")
        line = f"{entry.get('time', '?')}  {entry.get('tool', '?'):<18} {outcome:<5} {arguments[:100]}"
        produced = entry.get("commit", "")[:10] or entry.get("run_id", "")
        if produced:
            line += f"  → {produced}"
        print(line)
        if entry.get("error"):
            print(f"    {str(entry['error']).splitlines()[0][:200]}")
    return EXIT_OK


def cmd_plot(args: argparse.Namespace) -> int:
    from mcp_server.plot import history_png

    ws = _workspace(args)
    output = Path(args.output or f"{args.run_id}-loss.png")
    output.write_bytes(history_png(ws, args.run_id))
    if args.json:
        print(json.dumps({"run_id": args.run_id, "path": str(output)}))
    else:
        print(f"wrote {output}")
    return EXIT_OK


def cmd_ab(args: argparse.Namespace) -> int:
    from mcp_server.operations import ab

    def progress(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    result = ab.ab(_workspace(args), args.skill, args.recipe, args.steps, args.rounds, args.overrides,
                   nproc=args.nproc, note=args.note, progress=progress, args=args.script_args or None,
                   revisions=(args.commit_a, args.commit_b))
    emit(args, result, terminal.ab_text)
    return {"completed": EXIT_OK, "stopped": EXIT_STOPPED}.get(result.outcome, EXIT_RUN_FAILED)


# ---------------------------------------------------------------------------------------------
# Parser
# ---------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--workspace", default=".", metavar="DIR",
                        help="the workspace folder (default: the current directory)")
    common.add_argument("--json", action="store_true", help="print one JSON object")
    parser = argparse.ArgumentParser(
        prog="trainwright",
        description="Train models with skills as reviewable commits, real FSDP2 runs and "
        "resumable checkpoints. Every command is the twin of an MCP tool.",
        epilog=EPILOG,
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_serve(sub, common)
    groups: dict[str, Any] = {}
    for spec in TOOLS:
        add_tool_command(_group(sub, groups, spec), spec, common)
    _add_terminal_commands(sub, common)
    return parser


def _group(sub: Any, groups: dict[str, Any], spec: ToolSpec) -> Any:
    """The subparsers a tool's command goes in: the top level, or its group's (``skills``)."""
    if len(spec.command) == 1:
        return sub
    name = spec.command[0]
    if name not in groups:
        twins = ", ".join(s.name for s in TOOLS if s.command[0] == name)
        group = sub.add_parser(name, help=f"{GROUPS[name]} ({twins})")
        groups[name] = group.add_subparsers(dest=f"{name}_command", required=True, metavar="ACTION")
    return groups[name]


def add_tool_command(sub: Any, spec: ToolSpec, common: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``spec``'s subcommand: one argument per field of its arguments model (:func:`add_field`),
    and the options only a terminal needs (:data:`TERMINAL_OPTIONS`)."""
    help_line = f"{spec.help} ({spec.name})"
    same = spec.description.rstrip(".").lower() == spec.help.lower()
    p = sub.add_parser(spec.command[-1], parents=[common], help=help_line,
                       description=help_line if same else f"{help_line}. {spec.description}", epilog=EPILOG)
    p.set_defaults(func=run_tool, spec=spec)
    hints = typing.get_type_hints(spec.args)
    groups: dict[str, argparse._ArgumentGroup] = {}
    for name, field in spec.args.model_fields.items():
        group_name = cli_of(field).group
        if group_name is not None and group_name not in groups:
            groups[group_name] = p.add_argument_group(group_name)
        add_field(groups.get(group_name or "", p), name, field, hints[name])
    for add_option in TERMINAL_OPTIONS.get(spec.name, ()):
        add_option(p)
    if any(cli_of(field).after_dashes for field in spec.args.model_fields.values()):
        first = next(name for name, field in spec.args.model_fields.items() if field.is_required())
        p.usage = f"%(prog)s {first.upper()} [options] [-- SCRIPT_ARG ...]"
    return p


def add_field(p: Any, name: str, field: FieldInfo, hint: Any) -> None:
    """One field of a tool's arguments as a command-line argument: a required one positional
    (unless it has a ``flag``), an optional one ``--its-name`` with the tool's default."""
    cli = cli_of(field)
    if cli.after_dashes:
        return  # trainwright run SCRIPT [OPTIONS] -- ARGS (split_script_args)
    if cli.keys is not None:
        for option in cli.keys.values():
            p.add_argument(option.flag, type=option.type, metavar=option.metavar, help=_escaped(option.help))
        return
    kwargs: dict[str, Any] = {"help": _help(field, cli)}
    if cli.metavar or _base(hint) in (int, float):
        kwargs["metavar"] = cli.metavar or {int: "N", float: "X"}[_base(hint)]
    choices = _choices(hint)
    if choices:
        kwargs["choices"] = choices
    if field.is_required() and cli.flag is None:
        p.add_argument(name, **kwargs)
        return
    kwargs.update(_value_kwargs(field, cli, hint))
    flags = [cli.flag] if cli.flag else ["--" + name.replace("_", "-")]
    p.add_argument(*flags, dest=name, **kwargs)


def _value_kwargs(field: FieldInfo, cli: Cli, hint: Any) -> dict[str, Any]:
    """How an option takes its value: a flag, once per item, or one value of the field's type."""
    if field.is_required():
        kind: dict[str, Any] = {"required": True}
    else:
        kind = {"default": None if cli.repeat else field.default}
    if cli.repeat:
        return {**kind, "action": "append"}
    if _base(hint) is bool and field.default is None:  # three ways: --x, --no-x, or neither (the default)
        return {"action": argparse.BooleanOptionalAction, "default": None}
    if _base(hint) is bool:
        return {"action": "store_true", "default": field.default}
    return {**kind, "type": _base(hint)}


def _base(hint: Any) -> Any:
    """The type argparse reads a field's value as: ``int | None`` → ``int``; a Literal → ``str``
    (its values are the choices)."""
    if typing.get_origin(hint) is Literal:
        return str
    options = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and len(options) == 1:
        return _base(options[0])
    return hint if hint in (int, float, str, bool) else str


def _choices(hint: Any) -> tuple[Any, ...] | None:
    return typing.get_args(hint) if typing.get_origin(hint) is Literal else None


def _help(field: FieldInfo, cli: Cli) -> str:
    text = " ".join(part for part in (field.description or "", cli.more) if part)
    default = field.default if not field.is_required() else None
    if default is not None and not isinstance(default, bool) and default not in ("", [], {}):
        text += f" (default {default})"
    return _escaped(text)


def _escaped(text: str) -> str:
    return text.replace("%", "%%")  # argparse formats help with %


# Options only a terminal needs: --detach (a tool call always returns at once), --config (the
# server's settings are the server's), --follow (a client subscribes to run://<id>/metrics).
def _detach_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--detach", action="store_true", help="start it and return at once")


def _settings_option(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--config", dest="settings", metavar="FILE",
        help="trusted settings (runs: limits); default $XDG_CONFIG_HOME/trainwright/config.yaml "
        "(~/.config/trainwright/config.yaml). The workspace's .trainwright/config.yaml may only tighten them",
    )


def _follow_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--follow", action="store_true", help="keep printing new records until the run ends")


TERMINAL_OPTIONS: dict[str, tuple[Callable[[argparse.ArgumentParser], None], ...]] = {
    "launch_run": (_detach_option, _settings_option),
    "resume_checkpoint": (_detach_option, _settings_option),
    "tail_metrics": (_follow_option,),
}


def _add_serve(sub: Any, common: argparse.ArgumentParser) -> None:
    p = _add_command(sub, common, "serve", cmd_serve, "serve the MCP tools (stdio by default)")
    p.add_argument("--http", type=int, metavar="PORT",
                   help="serve streamable HTTP on http://127.0.0.1:PORT/mcp; requests need the bearer token "
                   "printed at start (also in $XDG_STATE_HOME/trainwright/http-token, default "
                   "~/.local/state/trainwright/http-token)")
    p.add_argument("--no-auth", action="store_true",
                   help="with --http: accept requests without the token (any local user can then call the tools)")
    p.add_argument("--read-only", action="store_true", help="serve only tools that change nothing")
    _settings_option(p)


def _add_command(sub: Any, common: argparse.ArgumentParser, name: str, func: Callable[[argparse.Namespace], int],
                 help: str) -> argparse.ArgumentParser:
    p = sub.add_parser(name, parents=[common], help=help, description=help, epilog=EPILOG)
    p.set_defaults(func=func)
    return p


def _add_terminal_commands(sub: Any, common: argparse.ArgumentParser) -> None:
    p = _add_command(sub, common, "review", cmd_review, "each agent commit since BASE: skill, diff stat, runs and "
                     "outcomes")
    p.add_argument("base", nargs="?", help="a commit or ref (default: the whole history)")
    p = _add_command(sub, common, "audit", cmd_audit, "the latest tool calls from .trainwright/audit.jsonl, "
                     "oldest first")
    p.add_argument("-n", type=int, default=20, help="entries to show (default 20)")
    p = _add_command(sub, common, "plot", cmd_plot, "write a PNG of a run's loss curve, across resumes (each one "
                     "marked)")
    p.add_argument("run_id")
    p.add_argument("-o", "--output", help="output file (default: RUN_ID-loss.png)")
    _add_ab(sub, common)


def _add_ab(sub: Any, common: argparse.ArgumentParser) -> None:
    from mcp_server.limits import AB_DEFAULT_ROUNDS, AB_MAX_ROUNDS, AB_MAX_STEPS, AB_MIN_STEPS

    p = _add_command(sub, common, "ab", cmd_ab, "a skill's effect, measured: the recipe or script at the skill's "
                     "commit (b) against the commit before it (a), or at two revisions (--b, --a), same config or "
                     "script args (after --), runs interleaved a b b a ..., then compare_runs over the rounds")
    p.add_argument("skill", nargs="?", help="a skill applied to the code (its newest commit with Skill-Applied: "
                   "SKILL is b); leave it out with --b")
    p.add_argument("recipe", help="recipe folder, relative to the workspace, or its name; or a training script "
                   "(a .py file, or a folder with a train.py), whose args follow --")
    p.add_argument("--b", dest="commit_b", metavar="REV", help="instead of a skill: the revision b runs (sha, HEAD)")
    p.add_argument("--a", dest="commit_a", metavar="REV", help="with --b: the revision a runs (default: b's parent)")
    p.add_argument("--steps", type=int, metavar="N",
                   help=f"a recipe's train.max_steps for every run (required for a recipe; {AB_MIN_STEPS}-"
                   f"{AB_MAX_STEPS}; train.log_every defaults to N/10, and no checkpoints are saved)")
    p.add_argument("--rounds", type=int, default=AB_DEFAULT_ROUNDS, metavar="R",
                   help=f"rounds of one a and one b run (default {AB_DEFAULT_ROUNDS}; 1-{AB_MAX_ROUNDS})")
    p.add_argument("--nproc", type=int, default=1, help="processes (FSDP2 ranks) of each run")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value of every run (repeatable)")
    p.add_argument("--note", action="store_true", help="append the verdict and the command to the skill commit's "
                   "git note (git log --notes=trainwright)")
    _settings_option(p)


# ---------------------------------------------------------------------------------------------
# Entry
# ---------------------------------------------------------------------------------------------


class RedactedStream:
    """A text stream that redacts what passes through it and escapes control characters
    (``sandbox.redact.shown``): the CLI prints run output, errors and results, which may hold a
    server secret or a terminal escape sequence the run wrote."""

    def __init__(self, stream):
        self._stream = stream

    def write(self, text: str) -> int:
        from sandbox.redact import shown

        self._stream.write(shown(text))
        return len(text)

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv, script_args = split_script_args(sys.argv[1:] if argv is None else list(argv))
    args = parser.parse_args(argv)
    args.script_args = script_args
    if args.func is cmd_serve:  # serve speaks MCP on stdout: its tools redact what they return
        return _run(args)
    streams = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = RedactedStream(sys.stdout), RedactedStream(sys.stderr)
    try:
        return _run(args)
    finally:
        sys.stdout, sys.stderr = streams


def split_script_args(argv: list[str]) -> tuple[list[str], list[str]]:
    """``trainwright run SCRIPT [OPTIONS] -- ARGS`` (``resume RUN_ID ... -- ARGS``, ``ab ... SCRIPT
    -- ARGS``): the command line before the first ``--``,
    and the script's own after it (argparse would take the script's options for its own)."""
    if argv[:1] in (["run"], ["resume"], ["ab"]) and "--" in argv:
        at = argv.index("--")
        return argv[:at], argv[at + 1:]
    return argv, []


def _run(args: argparse.Namespace) -> int:
    try:
        return args.func(args)
    except KeyboardInterrupt:
        return EXIT_STOPPED
    except BrokenPipeError:  # the reader went away (`trainwright describe ... | head`)
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK
    except TrainwrightError as e:
        return _fail(args, str(e), e.exit_code)
    except Exception as e:  # a bug: say so, with the traceback, and never call it bad input
        import traceback

        traceback.print_exc()
        return _fail(args, f"internal error (a trainwright bug): {type(e).__name__}: {e}", EXIT_INTERNAL)


def _fail(args: argparse.Namespace, message: str, code: int) -> int:
    if getattr(args, "json", False):
        print(json.dumps({"error": message, "exit_code": code}))
    else:
        print(f"error: {message}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
