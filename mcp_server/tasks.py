"""Long calls as MCP tasks: ``wait_run``, ``export_checkpoint`` and ``evaluate`` answered with a
task handle at once, the result fetched later, for a client that declares the tasks extension.

This is the ``io.modelcontextprotocol/tasks`` extension (SEP-2663, the ext-tasks repository's
specification) of the 2026-07-28 revision: a client lists the extension in the per-request
capabilities of its ``tools/call`` (``_meta["io.modelcontextprotocol/clientCapabilities"]``);
the server answers a call of one of :data:`TASK_TOOLS` with a ``CreateTaskResult``
(``resultType: "task"``) and runs the call in the background; ``tasks/get`` shows the task, with
the call's ``CallToolResult`` inline once it is ``completed`` (a tool error is a completed task
whose result has ``isError``); ``tasks/cancel`` stops the call; ``tasks/update`` is acknowledged
(no task here ever asks for input). The extension has no ``tasks/result`` and no ``tasks/list``
(``-32601``). A client that does not declare it gets every call answered as before.

The 2025-11-25 revision has tasks of its own, experimental, in the core protocol (SEP-1686),
and SEP-2663 says the extension does not apply there: a 2025-11-25 session gets those instead.
The server advertises ``capabilities.tasks`` (``list``, ``cancel``, ``requests.tools.call``) and
``execution.taskSupport: "optional"`` on the three tools; a ``tools/call`` with ``params.task``
answers ``CreateTaskResult`` (``{"task": ...}``); ``tasks/get`` shows the task, ``tasks/result``
waits for its end and answers the call's result (with ``_meta["io.modelcontextprotocol/related-task"]``),
``tasks/list`` lists the session's tasks, ``tasks/cancel`` cancels one that is working (a finished
one: ``-32602``) and answers the cancelled task. The SDK serves none of this (its 2025-11-25
surface sieves a ``tools/call`` result to a ``CallToolResult``), so :meth:`TasksExtension.legacy`,
a middleware, answers those requests itself, before the SDK validates and sieves them. A call
with ``params.task`` of any other tool is ``-32601`` (its ``taskSupport`` is forbidden).

Bounds: at most :data:`MAX_LIVE_TASKS` tasks working at once per 2025-11-25 session (beyond:
``-32602``), and of :data:`MAX_KEPT_TASKS` the oldest finished one is forgotten; a task and its
result are kept :data:`TTL_MS` from its creation (or the shorter ``ttl``, at least
:data:`MIN_TTL_MS`, a 2025-11-25 request asks for), then forgotten once it has ended (a task that
is still working is not: each tool bounds its own time); task ids are 128 random bits (``secrets``). A session sees only its own
tasks, and tasks end with it. A 2026-07-28 client has no session: its tasks are the server's (one
client over stdio), held to the same bounds together, found only by their unguessable id (the
extension has no ``tasks/list``); the two eras never see each other's tasks. Cancelling a
``wait_run`` task only stops the waiting: the run goes on (``stop_run`` stops a run). A
cancelled ``export_checkpoint`` or ``evaluate`` lets its sandboxed process end (the worker thread
is not interrupted) but drops its result.

A task's call runs with no client to report to: its progress messages become the task's
``statusMessage``, and the server's log messages of the call are not sent.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, AsyncIterator, Callable, ClassVar, Literal, cast

import anyio
from mcp.server.context import CallNext, HandlerResult, ServerRequestContext
from mcp.server.extension import Extension, MethodBinding
from mcp.server.mcpserver.server import require_client_extension
from mcp.server.session import ServerSession
from mcp.shared.exceptions import MCPError
from mcp_types import (INTERNAL_ERROR, INVALID_PARAMS, METHOD_NOT_FOUND, CallToolRequestParams, PaginatedRequestParams,
                       Request, RequestParams)
from mcp_types.methods import serialize_server_result
from mcp_types.version import MODERN_PROTOCOL_VERSIONS
from pydantic import BaseModel, Field

from mcp_server import clients
from mcp_server.declarations import TASK_TOOLS  # the tools declared with task=True

IDENTIFIER = "io.modelcontextprotocol/tasks"
LEGACY_VERSION = "2025-11-25"  # the one handshake revision with (experimental) tasks
RELATED_TASK = "io.modelcontextprotocol/related-task"
MAX_LIVE_TASKS = 8
MAX_KEPT_TASKS = 64
TTL_MS = 3_600_000  # an hour from creation
MIN_TTL_MS = 60_000  # the least a 2025-11-25 request's ttl gets
POLL_INTERVAL_MS = 2_000
LEGACY_CAPABILITY: dict[str, Any] = {"list": {}, "cancel": {}, "requests": {"tools": {"call": {}}}}
TaskStatus = Literal["working", "completed", "failed", "cancelled"]

logger = logging.getLogger(__name__)


# -- the requests (the wire shapes; the tests send them through an SDK client) -------------------


class TaskParams(RequestParams):
    task_id: str = Field(alias="taskId", max_length=200)


class UpdateTaskParams(TaskParams):
    input_responses: dict[str, Any] = Field(alias="inputResponses", default_factory=dict)


class GetTaskRequest(Request[TaskParams, Literal["tasks/get"]]):
    method: Literal["tasks/get"] = "tasks/get"
    params: TaskParams
    name_param: ClassVar[str | None] = "taskId"  # SEP-2663: Mcp-Name carries the task id


class CancelTaskRequest(Request[TaskParams, Literal["tasks/cancel"]]):
    method: Literal["tasks/cancel"] = "tasks/cancel"
    params: TaskParams
    name_param: ClassVar[str | None] = "taskId"


class UpdateTaskRequest(Request[UpdateTaskParams, Literal["tasks/update"]]):
    method: Literal["tasks/update"] = "tasks/update"
    params: UpdateTaskParams
    name_param: ClassVar[str | None] = "taskId"


class TaskResultRequest(Request[TaskParams, Literal["tasks/result"]]):
    """2025-11-25 only."""

    method: Literal["tasks/result"] = "tasks/result"
    params: TaskParams


class ListTasksRequest(Request[PaginatedRequestParams, Literal["tasks/list"]]):
    """2025-11-25 only."""

    method: Literal["tasks/list"] = "tasks/list"
    params: PaginatedRequestParams = Field(default_factory=PaginatedRequestParams)


# -- the tasks -----------------------------------------------------------------------------------


def _iso(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


@dataclass(eq=False)
class Task:
    """One task: whose it is, the call it runs, its status, and its outcome."""

    task_id: str
    tool: str
    owner: object | None  # a 2025-11-25 session's state; None: the 2026-07-28 clients'
    ttl_ms: int = TTL_MS
    created: float = field(default_factory=time.time)
    updated: float = 0.0
    status: TaskStatus = "working"
    message: str | None = None
    result: dict[str, Any] | None = None  # the CallToolResult, once completed
    error: dict[str, Any] | None = None  # the JSON-RPC error, once failed
    scope: anyio.CancelScope = field(default_factory=anyio.CancelScope)
    ended: anyio.Event = field(default_factory=anyio.Event)

    def __post_init__(self) -> None:
        self.updated = self.created

    def expired(self, now: float) -> bool:
        return self.status != "working" and now > self.created + self.ttl_ms / 1000

    def settle(self, status: TaskStatus, message: str | None = None, **outcome: Any) -> None:
        if self.status != "working":  # terminal states never change
            return
        self.status, self.updated = status, time.time()
        if message is not None:
            self.message = message
        self.result, self.error = outcome.get("result"), outcome.get("error")
        self.ended.set()

    def note(self, message: str) -> None:
        if self.status == "working":
            self.message, self.updated = message[:500], time.time()

    def wire(self) -> dict[str, Any]:
        """The task as ``tasks/get`` and ``CreateTaskResult`` show it (SEP-2663: a ``DetailedTask``)."""
        shown: dict[str, Any] = {
            "taskId": self.task_id, "status": self.status,
            "createdAt": _iso(self.created), "lastUpdatedAt": _iso(self.updated),
            "ttlMs": self.ttl_ms, "pollIntervalMs": POLL_INTERVAL_MS,
        }
        if self.message is not None:
            shown["statusMessage"] = self.message
        if self.status == "completed":
            shown["result"] = self.result
        if self.status == "failed":
            shown["error"] = self.error
        return shown

    def legacy_wire(self) -> dict[str, Any]:
        """The task as 2025-11-25 shows it (its ``Task``: no outcome inline)."""
        shown: dict[str, Any] = {
            "taskId": self.task_id, "status": self.status,
            "createdAt": _iso(self.created), "lastUpdatedAt": _iso(self.updated),
            "ttl": self.ttl_ms, "pollInterval": POLL_INTERVAL_MS,
        }
        if self.message is not None:
            shown["statusMessage"] = self.message
        return shown


class _TaskSession:
    """The session a task's call sees: the request's, except that nobody is listening any more.
    Progress becomes the task's status message; log messages are dropped."""

    def __init__(self, session: ServerSession, task: Task):
        self._session = session
        self._task = task

    def __getattr__(self, name: str) -> Any:
        return getattr(self._session, name)

    async def report_progress(self, progress: float, total: float | None = None, message: str | None = None) -> None:
        if message:
            self._task.note(message)

    async def send_log_message(self, *args: Any, **kwargs: Any) -> None:
        return None


class TasksExtension(Extension):
    """The tasks of one server: the 2026-07-28 extension, and the 2025-11-25 tasks as middleware."""

    identifier = IDENTIFIER

    def __init__(self, has_tool: Callable[[str], bool] = lambda name: True):
        self.has_tool = has_tool  # a --read-only server serves no export_checkpoint: not a task
        self.tasks: dict[str, Task] = {}
        self._sessions: set[object] = set()  # the 2025-11-25 sessions with tasks
        self._group: anyio.abc.TaskGroup | None = None

    # -- the server's lifespan: the task group the calls run in ---------------------------------

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        if self._group is not None:  # entered already (one group, however entered)
            yield
            return
        async with anyio.create_task_group() as group:
            self._group = group
            try:
                yield
            finally:
                self._group = None
                group.cancel_scope.cancel()

    # -- creating a task -------------------------------------------------------------------------

    def declared(self, ctx: ServerRequestContext[Any, Any]) -> bool:
        """Whether this request's client declared the extension (2026-07-28 only, SEP-2663)."""
        if ctx.protocol_version not in MODERN_PROTOCOL_VERSIONS:
            return False
        capabilities = ctx.session.client_capabilities
        return bool(capabilities and capabilities.extensions and IDENTIFIER in capabilities.extensions)

    def create(self, tool: str, owner: object | None, ttl_ms: int, ctx: ServerRequestContext[Any, Any],
               call: CallNext) -> Task:
        """A new task running ``call`` (the rest of the tools/call chain) in the background."""
        assert self._group is not None
        self._forget_expired()
        mine = [task for task in self.tasks.values() if task.owner is owner]
        if sum(1 for task in mine if task.status == "working") >= MAX_LIVE_TASKS:
            raise MCPError(INVALID_PARAMS, f"limits: at most {MAX_LIVE_TASKS} tasks working at once; wait for "
                           "one to end (tasks/get) or tasks/cancel one")
        finished = [task for task in mine if task.status != "working"]
        for task in finished[:max(0, len(mine) + 1 - MAX_KEPT_TASKS)]:  # the oldest first
            del self.tasks[task.task_id]
        task = Task(secrets.token_urlsafe(16), tool, owner, ttl_ms)
        self.tasks[task.task_id] = task
        quiet = dataclasses.replace(ctx, session=cast(ServerSession, _TaskSession(ctx.session, task)))
        self._group.start_soon(self._run, task, quiet, call)
        return task

    async def _run(self, task: Task, ctx: ServerRequestContext[Any, Any], call: CallNext) -> None:
        with task.scope:
            try:
                result = await call(ctx)
                dumped = result.model_dump(by_alias=True, mode="json", exclude_none=True) \
                    if isinstance(result, BaseModel) else dict(cast(dict[str, Any], result))
                dumped = serialize_server_result("tools/call", ctx.protocol_version, dumped)
                failed = bool(dumped.get("isError"))
                task.settle("completed", f"{task.tool} {'returned a tool error' if failed else 'done'}", result=dumped)
            except MCPError as e:
                task.settle("failed", e.error.message, error=e.error.model_dump(by_alias=True, exclude_none=True))
            except Exception as e:  # a bug: the task says so, the server log has the traceback
                logger.exception("task %s (%s) failed", task.task_id, task.tool)
                task.settle("failed", "internal error",
                            error={"code": INTERNAL_ERROR, "message": f"internal: {type(e).__name__}"})

    # -- 2026-07-28: tools/call through the extension's interceptor ------------------------------

    async def intercept_tool_call(
        self, params: CallToolRequestParams, ctx: ServerRequestContext[Any, Any], call_next: CallNext
    ) -> HandlerResult:
        if (params.name not in TASK_TOOLS or not self.has_tool(params.name) or not self.declared(ctx)
                or self._group is None):
            return await call_next(ctx)
        return {"resultType": "task", **self.create(params.name, None, TTL_MS, ctx, call_next).wire()}

    # -- 2025-11-25: initialize, tools/list and tools/call, before the SDK sieves them -----------

    async def legacy(self, ctx: ServerRequestContext[Any, Any], call_next: CallNext) -> HandlerResult:
        """Middleware: the 2025-11-25 tasks (capability, taskSupport, task-augmented tools/call)."""
        if ctx.method == "initialize":
            answer = cast(dict[str, Any], await call_next(ctx))
            if answer.get("protocolVersion") == LEGACY_VERSION and isinstance(answer.get("capabilities"), dict):
                answer["capabilities"]["tasks"] = LEGACY_CAPABILITY
            return answer
        if ctx.protocol_version != LEGACY_VERSION:
            return await call_next(ctx)
        if ctx.method == "tools/list":
            answer = cast(dict[str, Any], await call_next(ctx))
            for tool in answer.get("tools", []):
                if tool.get("name") in TASK_TOOLS:
                    tool["execution"] = {"taskSupport": "optional"}
            return answer
        params = ctx.params or {}
        if ctx.method != "tools/call" or params.get("task") is None:
            return await call_next(ctx)
        name, asked = params.get("name"), params.get("task")
        if not (isinstance(name, str) and name in TASK_TOOLS and self.has_tool(name)):
            shown = repr(name)[:80] if isinstance(name, str) else "this tool"
            raise MCPError(METHOD_NOT_FOUND, f"{shown} does not run as a task (its execution.taskSupport is "
                           "forbidden); call it without params.task")
        ttl = asked.get("ttl") if isinstance(asked, dict) else None
        ttl_ms = min(max(ttl, MIN_TTL_MS), TTL_MS) if isinstance(ttl, int) and not isinstance(ttl, bool) else TTL_MS
        state = clients.client_state(ctx.session)
        if state not in self._sessions:  # its tasks end with it
            self._sessions.add(state)
            state.on_close.append(lambda: self._forget_session(state))
        plain = dataclasses.replace(ctx, params={k: v for k, v in params.items() if k != "task"})
        if self._group is None:
            return await call_next(plain)
        return {"task": self.create(name, state, ttl_ms, plain, call_next).legacy_wire()}

    def _forget_session(self, state: object) -> None:
        self._sessions.discard(state)
        for task_id in [i for i, task in self.tasks.items() if task.owner is state]:
            self.tasks.pop(task_id).scope.cancel()

    # -- tasks/get, tasks/cancel, tasks/update (2026-07-28); tasks/result, tasks/list (2025-11-25)

    def methods(self) -> Sequence[MethodBinding]:
        modern, legacy = frozenset(MODERN_PROTOCOL_VERSIONS), frozenset({LEGACY_VERSION})
        return (
            MethodBinding("tasks/get", TaskParams, self.get, protocol_versions=modern | legacy),
            MethodBinding("tasks/cancel", TaskParams, self.cancel, protocol_versions=modern | legacy),
            MethodBinding("tasks/update", UpdateTaskParams, self.update, protocol_versions=modern),
            MethodBinding("tasks/result", TaskParams, self.result, protocol_versions=legacy),
            MethodBinding("tasks/list", PaginatedRequestParams, self.list_tasks, protocol_versions=legacy),
        )

    def owner(self, ctx: ServerRequestContext[Any, Any]) -> object | None:
        if ctx.protocol_version in MODERN_PROTOCOL_VERSIONS:
            require_client_extension(ctx, IDENTIFIER)  # -32021 for a client that did not declare it
            return None
        return clients.client_state(ctx.session)

    def find(self, ctx: ServerRequestContext[Any, Any], task_id: str) -> Task:
        owner = self.owner(ctx)
        self._forget_expired()
        task = self.tasks.get(task_id)
        if task is None or task.owner is not owner:
            shown = task_id if len(task_id) <= 40 and task_id.isprintable() else \
                task_id[:40].encode("unicode_escape").decode() + "…"
            raise MCPError(INVALID_PARAMS, f"not_found: no task {shown!r} (unknown, or forgotten: a "
                           f"task is kept {TTL_MS // 60_000} minutes at most)")
        return task

    async def get(self, ctx: ServerRequestContext[Any, Any], params: TaskParams) -> dict[str, Any]:
        task = self.find(ctx, params.task_id)
        return task.wire() if task.owner is None else task.legacy_wire()

    async def cancel(self, ctx: ServerRequestContext[Any, Any], params: TaskParams) -> dict[str, Any]:
        task = self.find(ctx, params.task_id)
        if task.owner is not None and task.status != "working":  # 2025-11-25: a finished task is not cancelled
            raise MCPError(INVALID_PARAMS, f"bad_input: task {task.task_id!r} is {task.status} already")
        if task.status == "working":
            task.settle("cancelled", "cancelled: the wait stopped, the run goes on" if task.tool == "wait_run"
                        else "cancelled")
            task.scope.cancel()
        return {} if task.owner is None else task.legacy_wire()

    async def update(self, ctx: ServerRequestContext[Any, Any], params: UpdateTaskParams) -> dict[str, Any]:
        self.find(ctx, params.task_id)  # no task here asks for input: responses are ignored (SEP-2663)
        return {}

    async def result(self, ctx: ServerRequestContext[Any, Any], params: TaskParams) -> dict[str, Any]:
        """2025-11-25 ``tasks/result``: once the task has ended, what the call answered."""
        task = self.find(ctx, params.task_id)
        await task.ended.wait()
        if task.status == "failed" and task.error is not None:
            raise MCPError(int(task.error.get("code", INTERNAL_ERROR)), str(task.error.get("message", "failed")))
        if task.status != "completed" or task.result is None:
            raise MCPError(INVALID_PARAMS, f"bad_input: task {task.task_id!r} was {task.status}: it has no result")
        related = {RELATED_TASK: {"taskId": task.task_id}}
        return {**task.result, "_meta": {**(task.result.get("_meta") or {}), **related}}

    async def list_tasks(self, ctx: ServerRequestContext[Any, Any], params: PaginatedRequestParams) -> dict[str, Any]:
        """2025-11-25 ``tasks/list``: this session's tasks, newest first (at most MAX_KEPT_TASKS)."""
        owner = self.owner(ctx)
        self._forget_expired()
        mine = [task for task in self.tasks.values() if task.owner is owner]
        return {"tasks": [task.legacy_wire() for task in reversed(mine)]}

    def _forget_expired(self) -> None:
        now = time.time()
        for task_id in [i for i, task in self.tasks.items() if task.expired(now)]:
            del self.tasks[task_id]
