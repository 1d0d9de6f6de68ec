"""The MCP binding: ``trainwright serve`` serves :data:`mcp_server.declarations.TOOLS` as MCP
tools, and the workspace's resources and prompts.

Each tool is generated from its declaration (:mod:`mcp_server.tool_schemas`): the arguments
model's fields are its parameters, the spec's description is what the agent reads; the work is done by
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
from pathlib import Path
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable

import anyio
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ResourceError, ToolError, UnexpectedToolError
from mcp.server.mcpserver.resources import FunctionResource
from mcp.server.mcpserver.tools import Tool
from mcp.server.session import ServerSession
from mcp.server.subscriptions import InMemorySubscriptionBus
from mcp.shared.exceptions import MCPError
from mcp_types import (INVALID_PARAMS, SetLevelRequestParams, SubscribeRequestParams, UnsubscribeRequestParams)
from mcp_types import Resource as MCPResource
from mcp_types import Tool as MCPTool

from engine import run_dir as rd
from engine.errors import TrainwrightError
from mcp_server import clients, run_view, workflows
from mcp_server.arguments import refusal
from mcp_server.declarations import TOOLS, Report, ToolSpec
from mcp_server.limits import MAX_ERROR_CHARS, MAX_RESULT_CHARS, MAX_TAIL_RECORDS, arguments_size, bounded, json_chars
from mcp_server.live import LiveRuns
from mcp_server.tool_schemas import ToolFunction, ToolSchemas, compacted, served_schemas, tool_fields
from mcp_server.tasks import TasksExtension
from sandbox import redact as redaction
from workspace.audit import AuditLog
from workspace.settings import trusted_limits
from workspace.git import ensure_workspace_repo
from sandbox.redact import printable, redact_model, shown
from workspace.workspace import Workspace

if TYPE_CHECKING:
    from mcp_server.operations import waiting

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


class AuditedServer(MCPServer):
    """The MCP server, with every call audited, also those refused before a tool runs."""

    def __init__(self, tools: Tools, served: list[ToolSpec], schemas: dict[str, ToolSchemas], **settings: Any):
        super().__init__(**settings)  # no tools yet: each is built at its first call (built_tool)
        self.tools = tools
        self.served = {spec.name: spec for spec in served}
        self.schemas = schemas
        self.tool_names = frozenset(self.served)
        self.parameters = {spec.name: tuple(spec.args.model_fields) for spec in served}
        self.skill_resources_added = False

    async def list_resources(self) -> list[MCPResource]:
        self.add_skill_resources()
        return await super().list_resources()

    async def read_resource(self, uri: Any, context: Context | None = None) -> Any:
        self.add_skill_resources()
        return await super().read_resource(uri, context)

    def add_skill_resources(self) -> None:
        """Each skill's SKILL.md as ``skill://<name>``, added when resources are first listed or
        read: the skill cards' front matter (and YAML) are not needed to start."""
        if self.skill_resources_added:
            return
        import skills as skill_library

        for info in skill_library.list_skill_cards():
            # The constructor, not from_function: a function of no arguments needs no validate_call
            # (~1 ms of pydantic per skill).
            self.add_resource(FunctionResource(
                fn=functools.partial(_skill_md, info.name), uri=f"skill://{info.name}", name=info.name,
                description=info.description, mime_type="text/markdown"))
        self.skill_resources_added = True

    async def list_tools(self) -> list[MCPTool]:
        """The served tools as the SDK lists a built one, from their schemas: no tool is built
        to answer tools/list."""
        listed = []
        for name, spec in self.served.items():
            fields, schemas = tool_fields(spec), self.schemas[name]
            listed.append(MCPTool(name=name, description=fields["description"], annotations=fields["annotations"],
                                  input_schema=schemas["inputSchema"], output_schema=schemas["outputSchema"],
                                  _meta=fields["meta"]))
        return listed

    def built_tool(self, name: str) -> Tool | None:
        """The served tool ``name``, built and registered at its first use (None: not served).
        The one place that reaches MCPServer's tool manager: it offers no public way to register
        a tool built elsewhere (and compacted)."""
        tool = self._tool_manager.get_tool(name)
        if tool is None and name in self.served:
            spec = self.served[name]
            tool = compacted(self._tool_manager.add_tool(ToolFunction(spec, self.tools), **tool_fields(spec)))
        return tool

    def _tool_input_schema(self, name: str) -> dict[str, Any] | None:
        """The SDK's hook for a call's Mcp-Param headers over HTTP (before the call is dispatched)."""
        tool = self.built_tool(name)
        return None if tool is None else tool.parameters

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
        self.built_tool(name)
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


def build_server(workspace: Path | str, read_only: bool = False, settings: Path | str | None = None,
                 cached_schemas: bool = True) -> MCPServer:
    """The server of one workspace; ``settings``: the trusted settings file (``serve --config``);
    ``read_only``: only the tools that change nothing (their annotations say so);
    ``cached_schemas=False``: the tool schemas built, not read from the cache (:func:`served_schemas`)."""
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
    mcp = AuditedServer(Tools(ws), served, served_schemas(cached_schemas), name="trainwright", instructions=INSTRUCTIONS, version=package_version(),
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
    """A run's metrics, log, status and loss curve (``run://<id>/...``); each skill's SKILL.md is
    :meth:`AuditedServer.add_skill_resources`'."""

    def __init__(self, ws: Workspace):
        self.ws = ws

    def register(self, mcp: MCPServer) -> None:
        mcp.resource("run://{run_id}/metrics", mime_type="application/json", description="The latest metrics "
                     "records (at most 200) of a run's history across resumes, as JSON.")(self.run_metrics)
        mcp.resource("run://{run_id}/log", mime_type="text/plain",
                     description="The end of a run's console log (at most 20 kB).")(self.run_log)
        mcp.resource("run://{run_id}/status", mime_type="application/json", description="A run's status, "
                     "latest metrics, ETA and checkpoints (get_run), as JSON.")(self.run_status)
        mcp.resource("run://{run_id}/loss.png", mime_type="image/png", description="The loss curve (and "
                     "learning rate) of a run's history, each resume marked.")(self.run_loss_png)

    def run_metrics(self, run_id: str) -> str:
        from mcp_server.operations import runs as run_ops

        tail = _resource(lambda: run_ops.tail_metrics(self.ws, run_id, MAX_TAIL_RECORDS, follow_resumes=True))
        return redact_model(tail).model_dump_json()

    def run_log(self, run_id: str) -> str:
        from mcp_server.operations import runs as run_ops

        run_dir = _resource(lambda: self.ws.run_dir(run_id))
        return shown(run_ops.tail_text(run_dir / rd.CONSOLE_LOG, 20_000) or "")  # escapes escaped: raw in console.log

    def run_status(self, run_id: str) -> str:
        from mcp_server.operations import runs as run_ops

        return redact_model(_resource(lambda: run_ops.get_run(self.ws, run_id))).model_dump_json()

    def run_loss_png(self, run_id: str) -> bytes:
        from mcp_server.plot import history_png

        return _resource(lambda: history_png(self.ws, run_id))


def _skill_md(name: str) -> str:
    import skills as skill_library

    return skill_library.get_skill(name).skill_md


def package_version() -> str:
    """The installed trainwright's version (serverInfo.version)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("trainwright")
    except PackageNotFoundError:
        return "0+unknown"


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
        from mcp_server.stdio import serve_stdio

        anyio.run(serve_stdio, server._lowlevel_server)
    else:
        from mcp_server.http_auth import serve_http

        serve_http(server, http_port, auth=auth)
