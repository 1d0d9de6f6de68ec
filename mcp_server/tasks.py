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

The 2025-11-25 revision is not served tasks: SEP-2663 says the extension is not defined there
("requests proceed as if the client had declared no task capability"), and that revision's own
experimental tasks (``params.task``, ``tasks/result``, ``tasks/list``) are left out of the SDK's
2025-11-25 surface (its ``tools/call`` result is sieved to a ``CallToolResult``). A 2025-11-25
client gets the blocking calls, whose ``wait_run`` returns before clients time out.

Bounds: at most :data:`MAX_LIVE_TASKS` tasks working at once (beyond: ``-32602``); a task and its
result are kept :data:`TTL_MS` from its creation, then forgotten; task ids are 128 random bits
(``secrets``), so a task id is the handle to it. A 2026-07-28 client has no session: tasks are
the server's (one client over stdio), found only by their unguessable id. Cancelling a
``wait_run`` task only stops the waiting: the run goes on (``stop_run`` stops a run). A
cancelled ``export_checkpoint`` or ``evaluate`` lets its sandboxed process end (the worker thread
is not interrupted) but drops its result.

A task's call runs with no client to report to: its progress messages become the task's
``statusMessage``, and the server's log messages of the call are not sent.
"""

from __future__ import annotations

import contextlib
import dataclasses
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
from mcp_types import INTERNAL_ERROR, INVALID_PARAMS, CallToolRequestParams, Request, RequestParams
from mcp_types.methods import serialize_server_result
from mcp_types.version import MODERN_PROTOCOL_VERSIONS
from pydantic import BaseModel, Field

IDENTIFIER = "io.modelcontextprotocol/tasks"
TASK_TOOLS = frozenset({"wait_run", "export_checkpoint", "evaluate"})
MAX_LIVE_TASKS = 8
TTL_MS = 3_600_000  # an hour from creation
POLL_INTERVAL_MS = 2_000
TaskStatus = Literal["working", "completed", "failed", "cancelled"]


# -- the extension's requests (the wire shapes; the tests send them through an SDK client) -----


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


# -- the tasks -----------------------------------------------------------------------------------


def _iso(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


@dataclass(eq=False)
class Task:
    """One task: the call it runs, its status, and its outcome."""

    task_id: str
    tool: str
    created: float = field(default_factory=time.time)
    updated: float = 0.0
    status: TaskStatus = "working"
    message: str | None = None
    result: dict[str, Any] | None = None  # the CallToolResult, once completed
    error: dict[str, Any] | None = None  # the JSON-RPC error, once failed
    scope: anyio.CancelScope = field(default_factory=anyio.CancelScope)

    def __post_init__(self) -> None:
        self.updated = self.created

    def expired(self, now: float) -> bool:
        return now > self.created + TTL_MS / 1000

    def settle(self, status: TaskStatus, message: str | None = None, **outcome: Any) -> None:
        if self.status != "working":  # terminal states never change
            return
        self.status, self.updated = status, time.time()
        if message is not None:
            self.message = message
        self.result, self.error = outcome.get("result"), outcome.get("error")

    def note(self, message: str) -> None:
        if self.status == "working":
            self.message, self.updated = message[:500], time.time()

    def wire(self) -> dict[str, Any]:
        """The task as ``tasks/get`` and ``CreateTaskResult`` show it (a ``DetailedTask``)."""
        shown: dict[str, Any] = {
            "taskId": self.task_id, "status": self.status,
            "createdAt": _iso(self.created), "lastUpdatedAt": _iso(self.updated),
            "ttlMs": TTL_MS, "pollIntervalMs": POLL_INTERVAL_MS,
        }
        if self.message is not None:
            shown["statusMessage"] = self.message
        if self.status == "completed":
            shown["result"] = self.result
        if self.status == "failed":
            shown["error"] = self.error
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
    """The tasks of one server, and the extension that serves them."""

    identifier = IDENTIFIER

    def __init__(self, has_tool: Callable[[str], bool] = lambda name: True):
        self.has_tool = has_tool  # a --read-only server serves no export_checkpoint: not a task
        self.tasks: dict[str, Task] = {}
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

    # -- tools/call ------------------------------------------------------------------------------

    def declared(self, ctx: ServerRequestContext[Any, Any]) -> bool:
        """Whether this request's client declared the extension (2026-07-28 only, SEP-2663)."""
        if ctx.protocol_version not in MODERN_PROTOCOL_VERSIONS:
            return False
        capabilities = ctx.session.client_capabilities
        return bool(capabilities and capabilities.extensions and IDENTIFIER in capabilities.extensions)

    async def intercept_tool_call(
        self, params: CallToolRequestParams, ctx: ServerRequestContext[Any, Any], call_next: CallNext
    ) -> HandlerResult:
        if params.name not in TASK_TOOLS or not self.has_tool(params.name) or not self.declared(ctx):
            return await call_next(ctx)
        if self._group is None:  # outside the server's lifespan: nowhere to run it
            return await call_next(ctx)
        self._forget_expired()
        working = sum(1 for task in self.tasks.values() if task.status == "working")
        if working >= MAX_LIVE_TASKS:
            raise MCPError(INVALID_PARAMS, f"limits: at most {MAX_LIVE_TASKS} tasks working at once; wait for "
                           "one to end (tasks/get) or tasks/cancel one")
        task = Task(secrets.token_urlsafe(16), params.name)
        self.tasks[task.task_id] = task
        quiet = dataclasses.replace(ctx, session=cast(ServerSession, _TaskSession(ctx.session, task)))
        self._group.start_soon(self._run, task, quiet, call_next)
        return {"resultType": "task", **task.wire()}

    async def _run(self, task: Task, ctx: ServerRequestContext[Any, Any], call_next: CallNext) -> None:
        with task.scope:
            try:
                result = await call_next(ctx)
                dumped = result.model_dump(by_alias=True, mode="json", exclude_none=True) \
                    if isinstance(result, BaseModel) else dict(cast(dict[str, Any], result))
                dumped = serialize_server_result("tools/call", ctx.protocol_version, dumped)
                failed = bool(dumped.get("isError"))
                task.settle("completed", f"{task.tool} {'returned a tool error' if failed else 'done'}", result=dumped)
            except MCPError as e:
                task.settle("failed", e.error.message, error=e.error.model_dump(by_alias=True, exclude_none=True))
            except Exception as e:  # a bug: the task says so, the server log has the traceback
                import logging

                logging.getLogger(__name__).exception("task %s (%s) failed", task.task_id, task.tool)
                task.settle("failed", "internal error",
                            error={"code": INTERNAL_ERROR, "message": f"internal: {type(e).__name__}"})

    # -- tasks/get, tasks/cancel, tasks/update ---------------------------------------------------

    def methods(self) -> Sequence[MethodBinding]:
        modern = frozenset(MODERN_PROTOCOL_VERSIONS)
        return (
            MethodBinding("tasks/get", TaskParams, self.get, protocol_versions=modern),
            MethodBinding("tasks/cancel", TaskParams, self.cancel, protocol_versions=modern),
            MethodBinding("tasks/update", UpdateTaskParams, self.update, protocol_versions=modern),
        )

    def find(self, ctx: ServerRequestContext[Any, Any], task_id: str) -> Task:
        require_client_extension(ctx, IDENTIFIER)  # -32021 for a client that did not declare it
        self._forget_expired()
        task = self.tasks.get(task_id)
        if task is None:
            shown = task_id if len(task_id) <= 40 and task_id.isprintable() else task_id[:40].encode("unicode_escape").decode() + "…"
            raise MCPError(INVALID_PARAMS, f"not_found: no task {shown!r} (unknown, or forgotten "
                           f"{TTL_MS // 60_000} minutes after it was created)")
        return task

    async def get(self, ctx: ServerRequestContext[Any, Any], params: TaskParams) -> dict[str, Any]:
        return self.find(ctx, params.task_id).wire()

    async def cancel(self, ctx: ServerRequestContext[Any, Any], params: TaskParams) -> dict[str, Any]:
        task = self.find(ctx, params.task_id)
        if task.status == "working":
            task.settle("cancelled", "cancelled: the wait stopped, the run goes on" if task.tool == "wait_run"
                        else "cancelled")
            task.scope.cancel()
        return {}

    async def update(self, ctx: ServerRequestContext[Any, Any], params: UpdateTaskParams) -> dict[str, Any]:
        self.find(ctx, params.task_id)  # no task here asks for input: responses are ignored (SEP-2663)
        return {}

    def _forget_expired(self) -> None:
        now = time.time()
        for task_id in [i for i, task in self.tasks.items() if task.expired(now)]:
            task = self.tasks.pop(task_id)
            task.settle("failed", "expired", error={"code": INTERNAL_ERROR, "message": "task expired"})
            task.scope.cancel()

