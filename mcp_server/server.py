"""The MCP binding: ``trainwright serve`` serves :data:`mcp_server.declarations.TOOLS` as MCP
tools, and the workspace's resources and prompts.

Each tool is generated from its declaration (:func:`mcp_tool`): the arguments model's fields
are its parameters, the spec's description is what the agent reads; the work is done by
``mcp_server.operations``. Every call goes through :meth:`Tools.call`, which turns input
errors into tool errors with an actionable message (cut to a bounded length), refuses a result
too large for an agent's context, and appends the call to the audit log. Calls that the SDK
rejects before they reach a tool (unknown tool, arguments that fail the schema, arguments too
large) are audited by :class:`AuditedServer`. This module never imports torch: runs are
separate processes.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import json
import logging
import typing
from collections import Counter
from pathlib import Path
from typing import Any, AsyncIterator, Callable

import anyio
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ResourceError, ToolError, UnexpectedToolError
from mcp.server.mcpserver.resources import FunctionResource
from mcp.server.mcpserver.tools import Tool
from mcp.server.session import ServerSession
from mcp.server.subscriptions import InMemorySubscriptionBus
from mcp.shared.exceptions import MCPError
from mcp_types import (INVALID_PARAMS, SetLevelRequestParams, SubscribeRequestParams, ToolAnnotations,
                       UnsubscribeRequestParams)

import skills as skill_library
from engine import run_dir as rd
from engine.errors import TrainwrightError
from mcp_server import clients, run_view, workflows
from mcp_server.arguments import refusal
from mcp_server.declarations import TOOLS, Report, ToolSpec
from mcp_server.limits import MAX_ERROR_CHARS, MAX_RESULT_CHARS, MAX_TAIL_RECORDS, arguments_size, bounded, json_chars
from mcp_server.live import LiveRuns
from mcp_server.operations import runs as run_ops
from mcp_server.operations import waiting
from mcp_server.tasks import TasksExtension
from sandbox import redact as redaction
from workspace.audit import AuditLog
from workspace.settings import trusted_limits
from workspace.git import ensure_workspace_repo
from sandbox.redact import printable, redact_model, shown
from workspace.workspace import Workspace

INSTRUCTIONS = """\
trainwright trains models in this workspace. The loop: scaffold → apply → launch → wait → stop →
resume → wait.
1. scaffold_recipe(template, name, config, skills) creates recipes/<name>/ as a commit (config:
   dotted keys, {"train.max_steps": 500, "data.paths": [...]}); list_templates names templates,
   describe_recipe lists every config key, list_recipes the recipes.
2. apply_skill(skill, recipe) writes a training pattern (list_skills, get_skill) into the
   recipe's code as one reviewable commit; dry_run=true shows the diff first.
3. launch_run(recipe, nproc, overrides) returns a run_id at once; wait_run(run_id, until_step)
   returns at that step or when the run ends; get_run and tail_metrics show it; stop_run ends it.
   launch_run also runs a plain .py script as it is (args: its command line; its JSON lines
   with a step are its metrics; docs/script-to-recipe.md says what a recipe adds).
4. resume_checkpoint(run_id, step) continues a run as a new run (list_checkpoints has the steps);
   tail_metrics(follow_resumes=true) shows the history across resumes.
5. sample, evaluate and export_checkpoint (a Hugging Face folder) look at a checkpoint's model.
Runs outlive this server; list_runs shows them all. Errors say what to change.
"""

logger = logging.getLogger(__name__)


class AuditedToolError(ToolError):
    """A tool error that :meth:`Tools.call` has already written to the audit log."""


def session_of(ctx: Context | None) -> ServerSession | None:
    """The session a tool call came on (None when called outside a request)."""
    try:
        return ctx.session if ctx is not None else None
    except ValueError:
        return None


class DownloadProgress:
    """For work in a worker thread: a Hub model's download (bytes) as progress notifications
    between 0 and 1 (of the call's 2), each one higher than the last, as MCP requires; and as an
    info log message at each tenth."""

    def __init__(self, ctx: Context):
        self.ctx = ctx
        self.last = 0.0

    def __call__(self, done: float, total: float | None, message: str) -> None:
        value = round(min(0.99, done / total), 4) if total else self.last
        if value <= self.last:
            return
        tenth_reached = int(value * 10) > int(self.last * 10)
        self.last = value
        self._send(value, message, tenth_reached)

    def waiting(self, message: str) -> None:
        """A wait in line (no bytes to count): the same message with a progress value a step
        higher each time, as MCP requires, kept under a tenth of the call."""
        if self.last < WAITING_PROGRESS_CEILING:
            self.last = round(self.last + WAITING_PROGRESS_STEP, 4)
            self._send(self.last, message, log=False)

    def _send(self, value: float, message: str, log: bool) -> None:
        try:
            anyio.from_thread.run(self.ctx.report_progress, value, 2, message)
            if log:
                anyio.from_thread.run(clients.log, session_of(self.ctx), "info", f"{message} ({value:.0%})")
        except Exception:  # a client gone away: the work goes on
            logger.debug("progress notification failed", exc_info=True)


WAITING_PROGRESS_STEP, WAITING_PROGRESS_CEILING = 0.001, 0.1


def download_progress(ctx: Context | None) -> DownloadProgress | None:
    return DownloadProgress(ctx) if ctx is not None else None


class WaitProgress:
    """A run's progress while a tool waits on it, as the call's progress notifications."""

    def __init__(self, ctx: Context | None):
        self.ctx = ctx

    async def __call__(self, now: waiting.Observation) -> None:
        if self.ctx is not None:
            await self.ctx.report_progress(now.step or 0, now.max_steps, now.progress_message())


class Tools:
    """The tools of one server, bound to one workspace."""

    def __init__(self, workspace: Workspace):
        self.ws = workspace
        self.audit = AuditLog(workspace.state_dir, hold=True)
        self.limiters: dict[str, anyio.CapacityLimiter] = {}

    async def call(self, tool: str, arguments: dict[str, Any], work: Callable[[], Any],
                   threads: int | None = None) -> Any:
        """Run ``work`` (in a worker thread, at most ``threads`` of them for this tool; a coroutine
        function on the event loop); map errors to tool errors; audit the call."""
        try:
            if inspect.iscoroutinefunction(work):
                result = await work()
            else:
                result = await anyio.to_thread.run_sync(work, limiter=self._limiter(tool, threads))
            if hasattr(result, "model_dump"):  # run output (console, metrics) may print a server secret
                result = redact_model(result)
            size = json_chars(result.model_dump(mode="json")) if hasattr(result, "model_dump") else 0
        except TrainwrightError as e:
            self.refuse(tool, arguments, f"{e.kind}: {e}")
        except Exception as e:  # a bug: the agent still gets a message, the log the traceback
            logger.exception("tool %s failed", tool)
            self.refuse(tool, arguments, f"internal: a trainwright bug ({type(e).__name__}: {e}); "
                        "the server log has the traceback")
        if size > MAX_RESULT_CHARS:
            self.refuse(tool, arguments, f"bad_input: the result is too large ({size:,} characters, at most "
                        f"{MAX_RESULT_CHARS:,}); ask for less (a smaller n or limit)")
        self.audit.record(
            tool, arguments, "ok",
            commit=getattr(result, "commit", None),
            run_id=getattr(result, "run_id", None),
        )
        return result

    def _limiter(self, tool: str, threads: int | None) -> anyio.CapacityLimiter | None:
        """The tool's own limiter (its waiting calls hold no thread of the server's pool)."""
        if threads is None:
            return None
        if tool not in self.limiters:
            self.limiters[tool] = anyio.CapacityLimiter(threads)
        return self.limiters[tool]

    def refuse(self, tool: str, arguments: dict[str, Any], message: str) -> None:
        """Audit the failed call and raise its tool error (the message redacted and bounded)."""
        message = bounded(shown(message), MAX_ERROR_CHARS)[0]
        self.audit.record(tool, arguments, "error", error=message)
        raise AuditedToolError(message) from None

    async def run(self, spec: ToolSpec, arguments: dict[str, Any], ctx: Context | None) -> Any:
        """One MCP call of ``spec``: its arguments validated into its model, its stages sent as
        progress, its operation run through :meth:`call`, its announcement sent as a log message."""
        args = spec.args.model_validate(arguments)
        download = download_progress(ctx)
        report = Report(download=download, observe=WaitProgress(ctx),
                        waiting=download.waiting if download is not None else None)
        stages = spec.stages
        if ctx is not None and stages is not None:
            await ctx.report_progress(0, stages.total, stages.start)
        result = await self.call(spec.name, args.model_dump(), functools.partial(spec.run, self.ws, args, report),
                                 threads=spec.threads)
        if ctx is not None and stages is not None:
            await ctx.report_progress(stages.total, stages.total, stages.end.format(**dict(result)))
        announced = spec.announce(args, result) if spec.announce is not None else None
        if announced is not None:
            message, status = announced
            await clients.log(session_of(ctx), clients.ENDED_LEVELS.get(status or "", "info"), message)
        return result


def mcp_tool(spec: ToolSpec, tools: Tools) -> Tool:
    """``spec`` as an MCP tool: its arguments model's fields are the tool's parameters (the
    schema compacted, :func:`_compact_schema`), its result model the output schema."""
    hints = spec.hints
    # readOnlyHint false is the spec's default, left out as openWorldHint true is (bytes of tools/list).
    annotations = ToolAnnotations(readOnlyHint=hints.read_only or None, destructiveHint=hints.destructive,
                                  idempotentHint=hints.idempotent, openWorldHint=hints.open_world)
    tool = Tool.from_function(ToolFunction(spec, tools), name=spec.name, description=spec.description,
                              annotations=annotations, meta=spec.meta)
    for schema, output in ((tool.parameters, False), (tool.fn_metadata.output_schema, True)):
        _compact_schema(schema, output)
        _inline_single_use_definitions(schema)
    return tool


class ToolFunction:
    """What the SDK calls for one tool: a callable whose signature is the arguments model's
    fields (each annotated with its ``Field``, as the SDK reads parameters) and the request's
    context; a call goes to :meth:`Tools.run`."""

    def __init__(self, spec: ToolSpec, tools: Tools):
        self.spec, self.tools = spec, tools
        hints = typing.get_type_hints(spec.args, include_extras=True)
        parameters = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, annotation=hints[name],
                                        default=inspect.Parameter.empty if field.is_required() else field.default)
                      for name, field in spec.args.model_fields.items()]
        parameters.append(inspect.Parameter("ctx", inspect.Parameter.KEYWORD_ONLY, default=None,
                                            annotation=Context | None))
        self.__signature__ = inspect.Signature(parameters, return_annotation=spec.result)
        self.__annotations__ = {**{p.name: p.annotation for p in parameters}, "return": spec.result}
        self.__name__ = self.__qualname__ = spec.name

    async def __call__(self, ctx: Context | None = None, **arguments: Any) -> Any:
        return await self.tools.run(self.spec, arguments, ctx)


class AuditedServer(MCPServer):
    """The MCP server, with every call audited, also those refused before a tool runs."""

    def __init__(self, tools: Tools, served: list[ToolSpec], **settings: Any):
        super().__init__(tools=[mcp_tool(spec, tools) for spec in served], **settings)
        self.tools = tools
        self.tool_names = frozenset(spec.name for spec in served)
        self.parameters = {spec.name: tuple(spec.args.model_fields) for spec in served}

    async def call_tool(self, name: str, arguments: dict[str, Any], context: Context | None = None):
        size, message = arguments_size(arguments)
        if message is not None:
            self.tools.audit.record(str(name)[:100], {"size": size}, "error", error=message)
            raise ToolError(message)
        if name not in self.tool_names:
            cut = name if len(name) <= 80 else name[:80] + "…"
            message = printable(f"not_found: unknown tool {cut!r}; tools: "
                                f"{', '.join(sorted(t.name for t in await self.list_tools()))}")
            self.tools.audit.record(str(name)[:100], arguments, "error", error=message)
            raise ToolError(message)
        unknown = sorted(set(arguments) - set(self.parameters[name]))
        if unknown:  # never answered as if it were not given (sample's images, a misspelt option)
            shown_names = ", ".join(repr(k if len(k) <= 40 else k[:40] + "…") for k in unknown[:5])
            message = printable(f"bad_input: {name} takes no argument {shown_names}; its parameters: "
                                f"{', '.join(self.parameters[name])}")
            self.tools.audit.record(str(name)[:100], {"unknown": unknown[:5]}, "error", error=message)
            raise ToolError(message)
        try:
            return await super().call_tool(name, arguments, context)
        except ToolError as e:
            if isinstance(e.__cause__, AuditedToolError):
                raise
            if isinstance(e, UnexpectedToolError):  # a crash outside Tools.call: not the agent's input
                logger.error("tool %s failed", name, exc_info=e.__cause__ or e)
                message = printable(f"internal: a trainwright bug in {str(name)[:100]} "
                                    f"({type(e.__cause__ or e).__name__}); the server log has the traceback")
                self.tools.audit.record(str(name)[:100], arguments, "error", error=message)
                raise ToolError(message) from None
            own = refusal(e.__cause__)  # a field's own check (mcp_server.arguments): its message alone
            text = shown(str(own if own is not None else e))  # schema validation: it may echo the input
            prefix = printable(f"Error executing tool {name}: ")
            message = prefix + "bad_input: " + (text[len(prefix):] if text.startswith(prefix) else text)
            self.tools.audit.record(str(name)[:100], arguments, "error", error=message)
            raise ToolError(message) from None

    async def get_prompt(self, name: str, arguments: dict[str, Any] | None = None, context: Context | None = None):
        """An unknown prompt, or arguments it does not take, are invalid params (-32602)."""
        known = sorted(p.name for p in await self.list_prompts())
        if name not in known:
            cut = name if len(name) <= 80 else name[:80] + "…"
            raise MCPError(code=INVALID_PARAMS, message=printable(f"unknown prompt {cut!r}; prompts: {', '.join(known)}"))
        try:
            return await super().get_prompt(name, arguments, context)
        except ValueError as e:
            raise MCPError(code=INVALID_PARAMS, message=shown(str(e))[:MAX_ERROR_CHARS]) from None


def build_server(workspace: Path | str, read_only: bool = False, settings: Path | str | None = None) -> MCPServer:
    """The server of one workspace; ``settings``: the trusted settings file (``serve --config``);
    ``read_only``: only the tools that change nothing (their annotations say so)."""
    redaction.reload()  # the values of this server's secrets, compiled once per start
    ws = Workspace.open(workspace, settings)
    trusted_limits(ws.settings)  # a missing or broken settings file stops the start
    if not read_only:
        ensure_workspace_repo(ws.root)
        ws.prepare_state()
    served = [spec for spec in TOOLS if spec.mcp and (spec.hints.read_only or not read_only)]
    bus = InMemorySubscriptionBus()
    live = LiveRuns(ws, bus)
    tasks = TasksExtension(has_tool=frozenset(spec.name for spec in served).__contains__)
    mcp = AuditedServer(Tools(ws), served, name="trainwright", instructions=INSTRUCTIONS, version=package_version(),
                        log_level="WARNING", subscriptions=bus, lifespan=functools.partial(_lifespan, live, tasks),
                        middleware=[live.listen_middleware, tasks.legacy], extensions=[run_view.extension(), tasks])
    _serve_session_methods(mcp, live)
    Resources(ws).register(mcp)
    workflows.register_prompts(mcp)
    workflows.register_completions(mcp, ws)
    return mcp


@contextlib.asynccontextmanager
async def _lifespan(live: LiveRuns, tasks: TasksExtension, server: Any) -> AsyncIterator[dict[str, Any]]:
    async with live.running(server) as state, tasks.running():
        yield state


class Resources:
    """The workspace's resources: each skill's SKILL.md, and a run's metrics, log, status and
    loss curve (``run://<id>/...``)."""

    def __init__(self, ws: Workspace):
        self.ws = ws

    def register(self, mcp: MCPServer) -> None:
        for info in skill_library.list_skill_cards():
            # The constructor, not from_function: a function of no arguments needs no validate_call
            # (~1 ms of pydantic per skill at every start).
            mcp.add_resource(FunctionResource(
                fn=functools.partial(_skill_md, info.name), uri=f"skill://{info.name}", name=info.name,
                description=info.description, mime_type="text/markdown"))
        mcp.resource("run://{run_id}/metrics", mime_type="application/json", description="The latest metrics "
                     "records (at most 200) of a run's history across resumes, as JSON.")(self.run_metrics)
        mcp.resource("run://{run_id}/log", mime_type="text/plain",
                     description="The end of a run's console log (at most 20 kB).")(self.run_log)
        mcp.resource("run://{run_id}/status", mime_type="application/json", description="A run's status, "
                     "latest metrics, ETA and checkpoints (get_run), as JSON.")(self.run_status)
        mcp.resource("run://{run_id}/loss.png", mime_type="image/png", description="The loss curve (and "
                     "learning rate) of a run's history, each resume marked.")(self.run_loss_png)

    def run_metrics(self, run_id: str) -> str:
        tail = _resource(lambda: run_ops.tail_metrics(self.ws, run_id, MAX_TAIL_RECORDS, follow_resumes=True))
        return redact_model(tail).model_dump_json()

    def run_log(self, run_id: str) -> str:
        run_dir = _resource(lambda: self.ws.run_dir(run_id))
        return shown(run_ops.tail_text(run_dir / rd.CONSOLE_LOG, 20_000) or "")  # escapes escaped: raw in console.log

    def run_status(self, run_id: str) -> str:
        return redact_model(_resource(lambda: run_ops.get_run(self.ws, run_id))).model_dump_json()

    def run_loss_png(self, run_id: str) -> bytes:
        from mcp_server.plot import history_png

        return _resource(lambda: history_png(self.ws, run_id))


def _skill_md(name: str) -> str:
    return skill_library.get_skill(name).skill_md


def package_version() -> str:
    """The installed trainwright's version (serverInfo.version)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("trainwright")
    except PackageNotFoundError:
        return "0+unknown"


def _compact_schema(schema: Any, output: bool = False, names: bool = False) -> None:
    """Make a tool's JSON schema smaller without changing what it accepts, and portable: every
    tool's schemas are sent to the agent in each session, and some clients reject type arrays.

    Drops the ``title`` pydantic gives every schema (the key's name again, in Title Case) and
    ``additionalProperties: true`` (what JSON Schema assumes). An optional argument whose
    default is null (``anyOf: [{type: T}, {type: null}]``, default null) becomes plain
    ``{type: T}`` without the default: leaving it out means null. In output schemas
    (which describe what the server sends: every key, always) it also drops ``required`` lists and
    defaults, and keeps a nullable value's ``anyOf``, since null is sent. An empty default
    (``[]``, ``{}``, ``""``) is left out of input schemas too: leaving the argument out means it. A value of any type
    (``{}``) is said so with ``anyOf``, so that every property has a validation keyword.
    ``names`` marks a mapping of property names, which are kept as they are.
    """
    if isinstance(schema, dict):
        if not names:
            if isinstance(schema.get("title"), str):
                del schema["title"]
            if schema.get("additionalProperties") is True:  # what JSON Schema assumes
                del schema["additionalProperties"]
            if not output and schema.get("default", ...) in ([], {}, ""):  # nothing given means that
                del schema["default"]
            if output:
                schema.pop("default", None)
                if isinstance(schema.get("required"), list):  # the server sends every key, always
                    del schema["required"]
        for key, value in schema.items():  # children first: an option may become plain {type}
            _compact_schema(value, output, names=not names and key in ("properties", "$defs"))
        if names:
            for name, value in schema.items():
                if isinstance(value, dict) and not VALIDATION_KEYWORDS & set(value):
                    value["anyOf"] = [{"type": t} for t in JSON_TYPES]
            return
        options = schema.get("anyOf")
        if (not output and schema.get("default", ...) is None and isinstance(options, list) and len(options) == 2
                and {"type": "null"} in options and all(isinstance(o, dict) for o in options)):
            del schema["anyOf"], schema["default"]
            schema.update(next(o for o in options if o != {"type": "null"}))
    elif isinstance(schema, list):
        for item in schema:
            _compact_schema(item, output)


def _inline_single_use_definitions(schema: Any) -> None:
    """Write each ``$defs`` entry that one ``$ref`` uses in that place: the same schema, read
    top to bottom and shorter."""
    if not isinstance(schema, dict) or not isinstance(schema.get("$defs"), dict):
        return
    refs: list[dict[str, Any]] = []

    def collect(node: Any) -> None:
        if isinstance(node, dict):
            if isinstance(node.get("$ref"), str):
                refs.append(node)
            for value in node.values():
                collect(value)
        elif isinstance(node, list):
            for item in node:
                collect(item)

    collect(schema)
    definitions = schema["$defs"]
    uses = Counter(ref["$ref"] for ref in refs)
    for ref in refs:
        name = ref["$ref"].removeprefix("#/$defs/")
        if uses[ref["$ref"]] == 1 and name in definitions and f'"#/$defs/{name}"' not in json.dumps(definitions[name]):
            del ref["$ref"]
            ref.update(definitions.pop(name))
    if not definitions:
        del schema["$defs"]


VALIDATION_KEYWORDS = frozenset({"type", "enum", "const", "anyOf", "oneOf", "allOf", "not", "$ref"})
JSON_TYPES = ("string", "number", "boolean", "object", "array", "null")


def _serve_session_methods(mcp: MCPServer, live: LiveRuns) -> None:
    """The 2025-11-25 session methods MCPServer leaves unserved: resources/subscribe and
    resources/unsubscribe (for which the server then advertises ``resources.subscribe``) and
    logging/setLevel. MCPServer registers its handlers on its low-level server and offers no
    public way to add these; this is the one place that reaches that server."""
    lowlevel = mcp._lowlevel_server
    lowlevel.add_request_handler("resources/subscribe", SubscribeRequestParams, live.subscribe)
    lowlevel.add_request_handler("resources/unsubscribe", UnsubscribeRequestParams, live.unsubscribe)
    lowlevel.add_request_handler("logging/setLevel", SetLevelRequestParams, clients.set_level)


def _resource(work: Callable[[], Any]) -> Any:
    try:
        return work()
    except TrainwrightError as e:
        raise ResourceError(shown(f"{e.kind}: {e}")) from None


def tool_schemas(server: MCPServer) -> list[dict[str, Any]]:
    """The agent-facing surface, as snapshotted in tests/mcp/tool_schemas.json."""

    async def collect():
        tools = await server.list_tools()
        return [json.loads(t.model_dump_json(by_alias=True, exclude_none=True)) for t in tools]

    return sorted(anyio.run(collect), key=lambda t: t["name"])


def serve(workspace: Path | str, http_port: int | None = None, read_only: bool = False, auth: bool = True,
          settings: Path | str | None = None) -> None:
    server = build_server(workspace, read_only=read_only, settings=settings)
    if http_port is None:
        server.run("stdio")
    else:
        from mcp_server.http_auth import serve_http

        serve_http(server, http_port, auth=auth)
