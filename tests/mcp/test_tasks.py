"""Long calls as MCP tasks (the ``io.modelcontextprotocol/tasks`` extension, 2026-07-28), through
a real SDK client that declares the extension, against the real server and real runs of the
template's tiny model: a ``wait_run`` task polled to completion answers what a plain call
answers; a cancelled wait leaves its run running; an ``export_checkpoint`` task writes the export;
bad task ids, clients that did not declare the extension, and one task too many are refused."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import anyio
import pytest
from mcp import Client
from mcp.client.extension import ClaimContext, ClientExtension, ResultClaim
from mcp.shared.exceptions import MCPError
from mcp_types import CallToolResult, Result
from pydantic import ConfigDict, TypeAdapter

from engine import run_dir as rd
from mcp_server.server import build_server
from mcp_server.tasks import (IDENTIFIER, MAX_KEPT_TASKS, MAX_LIVE_TASKS, POLL_INTERVAL_MS, TTL_MS, CancelTaskRequest,
                              GetTaskRequest, ListTasksRequest, TaskParams, TaskResultRequest, UpdateTaskParams,
                              UpdateTaskRequest)
from tests.mcp.conftest import ENDLESS_RUN, SHORT_RUN, connect, process_group_alive, stdio_parameters, tiny_config
from tests.sandbox.helpers import make_workspace

# The server logs a launched run to its client, which the SDK marks deprecated at 2026-07-28.
pytestmark = pytest.mark.filterwarnings("ignore::mcp.shared.exceptions.MCPDeprecationWarning")
ANY = TypeAdapter(dict[str, Any])


class CreatedTask(Result):
    """A ``CreateTaskResult``: the task's seed state."""

    model_config = ConfigDict(extra="allow")
    result_type: Literal["task"] = "task"
    task_id: str
    status: str
    ttl_ms: int | None = None
    poll_interval_ms: int | None = None


async def get_task(session, task_id: str) -> dict[str, Any]:
    return await session.send_request(GetTaskRequest(params=TaskParams(taskId=task_id)), ANY)


async def ack(session, request) -> dict[str, Any]:
    """The answer of tasks/cancel or tasks/update, without the serverInfo stamp."""
    answer = await session.send_request(request, ANY)
    answer.pop("_meta", None)
    return answer


async def poll(session, task_id: str, timeout: float = 240) -> dict[str, Any]:
    """tasks/get until the task is terminal (at the server's poll interval, faster here)."""
    with anyio.fail_after(timeout):
        while (task := await get_task(session, task_id))["status"] == "working":
            await anyio.sleep(0.2)
    return task


async def resolve(created: CreatedTask, ctx: ClaimContext) -> CallToolResult:
    task = await poll(ctx.session, created.task_id)
    assert task["status"] == "completed", task
    return CallToolResult.model_validate(task["result"])


class Tasks(ClientExtension):
    """The client side of the extension: declared on every request; a task is polled to its end."""

    identifier = IDENTIFIER

    def claims(self):
        return (ResultClaim(result_type="task", model=CreatedTask, resolve=resolve),)


async def legacy_call(client: Client, tool: str, arguments: dict[str, Any], ttl: int | None = None) -> dict[str, Any]:
    """A 2025-11-25 task-augmented tools/call (``params.task``). The SDK's client validates a
    2025-11-25 tools/call answer as a CallToolResult, so this one goes to its dispatcher as it is."""
    task = {} if ttl is None else {"ttl": ttl}
    return await client.session._dispatcher.send_raw_request(
        "tools/call", {"name": tool, "arguments": arguments, "task": task}, {})


def tasks_client(target: Any) -> Client:
    return Client(target, extensions=[Tasks()])


def tasks_client_mode(target: Any, mode: str) -> Client:
    return Client(target, mode=mode, extensions=[Tasks()])


async def start(client: Client, tool: str, **arguments: Any) -> CreatedTask:
    created = await client.session.call_tool(tool, arguments, allow_claimed=True)
    assert isinstance(created, CreatedTask), created
    return created


def plain(result: CallToolResult) -> dict[str, Any]:
    """A tool result as the wire carries it, without the serverInfo stamp of the answer."""
    dumped = result.model_dump(by_alias=True, mode="json", exclude_none=True)
    dumped.pop("_meta", None)
    return dumped


def without_wait_time(dumped: dict[str, Any]) -> dict[str, Any]:
    structured = {k: v for k, v in dumped["structuredContent"].items() if k != "waited_s"}
    text = {k: v for k, v in json.loads(dumped["content"][0]["text"]).items() if k != "waited_s"}
    return {**dumped, "structuredContent": structured, "content": [{**dumped["content"][0], "text": text}]}


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    return make_workspace(tmp_path_factory.mktemp("tasks") / "ws")  # recipes/lm: the template


def launch(workspace: Path, **config: Any) -> str:
    with connect("memory", workspace) as client:
        return client.ok("launch_run", recipe="lm", overrides=tiny_config(**config))["run_id"]


@pytest.mark.slow
def test_a_wait_run_task_polled_to_completion_answers_as_a_plain_call_and_export_and_evaluate_tasks_complete(workspace):
    run_id = launch(workspace, **SHORT_RUN)

    async def main() -> None:
        async with tasks_client(build_server(workspace)) as client:
            assert client.protocol_version == "2026-07-28"
            assert IDENTIFIER in client.server_capabilities.extensions
            created = await start(client, "wait_run", run_id=run_id, timeout_s=240.0)
            assert created.status == "working" and len(created.task_id) >= 22
            assert (created.ttl_ms, created.poll_interval_ms) == (TTL_MS, POLL_INTERVAL_MS)
            task = await poll(client.session, created.task_id)
            assert task["status"] == "completed" and task["result"]["structuredContent"]["reason"] == "ended"
            assert task["result"]["structuredContent"]["status"] == "completed"
            assert task == await get_task(client.session, created.task_id)  # a result is kept
            # The same call, plain: the same answer (but for the seconds it waited).
            async with Client(build_server(workspace)) as plain_client:
                answer = await plain_client.call_tool("wait_run", {"run_id": run_id, "timeout_s": 240.0})
            assert without_wait_time(task["result"]) == without_wait_time(plain(answer))
            # The SDK's claim resolution: call_tool polls the task and returns its result.
            resolved = await client.call_tool("wait_run", {"run_id": run_id})
            assert without_wait_time(plain(resolved)) == without_wait_time(plain(answer))

            exported = await start(client, "export_checkpoint", run_id=run_id, to="exports/lm", step=3)
            task = await poll(client.session, exported.task_id)
            assert task["status"] == "completed" and not task["result"].get("isError"), task
            export = task["result"]["structuredContent"]
            assert (export["step"], export["path"]) == (3, "exports/lm")
            for name, size in export["files"].items():
                assert (workspace / "exports" / "lm" / name).stat().st_size == size
            evaluated = await poll(client.session, (await start(client, "evaluate", run_id=run_id, step=3)).task_id)
            assert evaluated["status"] == "completed" and not evaluated["result"].get("isError"), evaluated
            assert evaluated["result"]["structuredContent"]["step"] == 3
            assert 0 < evaluated["result"]["structuredContent"]["eval_loss"] < 6.0
            # A tool error is a completed task whose result says so (the folder is not empty now).
            again = await poll(client.session, (await start(client, "export_checkpoint", run_id=run_id,
                                                                to="exports/lm")).task_id)
            assert again["status"] == "completed" and again["result"]["isError"] is True
            assert "bad_input:" in again["result"]["content"][0]["text"]

    anyio.run(main)


@pytest.mark.slow
def test_a_cancelled_wait_task_leaves_the_run_running_and_one_task_too_many_is_refused(workspace):
    run_id = launch(workspace, **ENDLESS_RUN)
    with connect("memory", workspace) as tools:
        try:
            cancel_and_overfill(tools, workspace, run_id)
        finally:
            assert tools.ok("stop_run", run_id=run_id)["status"] == "stopped"


def cancel_and_overfill(tools, workspace: Path, run_id: str) -> None:
    step_seen = tools.wait_for_step(run_id, 1)["step"]
    record = rd.read_run(workspace / rd.RUNS_DIRNAME / run_id)

    async def main() -> None:
        async with tasks_client(build_server(workspace)) as client:
            created = await start(client, "wait_run", run_id=run_id, timeout_s=600.0)
            cancel = CancelTaskRequest(params=TaskParams(taskId=created.task_id))
            assert await ack(client.session, cancel) == {"resultType": "complete"}
            task = await get_task(client.session, created.task_id)
            assert task["status"] == "cancelled" and "run goes on" in task["statusMessage"]
            assert "result" not in task
            await anyio.sleep(2)  # the run keeps logging
            running = [await start(client, "wait_run", run_id=run_id, timeout_s=600.0)
                       for _ in range(MAX_LIVE_TASKS)]
            with pytest.raises(MCPError) as refused:
                await start(client, "wait_run", run_id=run_id, timeout_s=600.0)
            assert refused.value.error.code == -32602
            assert str(refused.value) == (f"limits: at most {MAX_LIVE_TASKS} tasks working at once; wait "
                                          "for one to end (tasks/get) or tasks/cancel one")
            # tasks/update: nothing is asked of the client; acknowledged
            update = UpdateTaskRequest(params=UpdateTaskParams(taskId=running[0].task_id, inputResponses={}))
            assert await ack(client.session, update) == {"resultType": "complete"}
            for each in running:
                await client.session.send_request(CancelTaskRequest(params=TaskParams(taskId=each.task_id)), ANY)
            await start(client, "wait_run", run_id=run_id, timeout_s=1.0)  # room again

    anyio.run(main)
    info = tools.ok("get_run", run_id=run_id)
    assert info["status"] == "running" and info["step"] > step_seen
    assert rd.pid_alive(record.pid) and process_group_alive(record.child_pgid)


@pytest.mark.slow
def test_a_2025_session_gets_the_tasks_of_its_revision_and_sees_only_its_own(workspace):
    run_id = launch(workspace, **SHORT_RUN)

    async def main() -> None:
        async with Client(build_server(workspace), mode="legacy") as client, \
                Client(build_server(workspace), mode="legacy") as other:
            assert client.protocol_version == "2025-11-25"
            capability = client.server_capabilities.tasks
            assert capability.list is not None and capability.cancel is not None
            assert capability.requests.tools.call is not None
            executions = {tool.name: tool.execution for tool in (await client.list_tools()).tools}
            assert {name for name, e in executions.items() if e and e.task_support == "optional"} == {
                "wait_run", "export_checkpoint", "evaluate"}
            created = (await legacy_call(client, "wait_run", {"run_id": run_id, "timeout_s": 240.0}, ttl=60_000))["task"]
            assert created["status"] == "working" and created["ttl"] == 60_000
            assert created["pollInterval"] == POLL_INTERVAL_MS
            # A wait cancelled while the run goes on (it was launched a moment ago): the cancelled
            # task comes back; its result is refused.
            waiting = (await legacy_call(client, "wait_run", {"run_id": run_id, "until_step": 10**6}))["task"]
            cancelled = await client.session.send_request(
                CancelTaskRequest(params=TaskParams(taskId=waiting["taskId"])), ANY)
            assert cancelled["status"] == "cancelled" and cancelled["taskId"] == waiting["taskId"]
            with pytest.raises(MCPError) as no_result:
                await client.session.send_request(TaskResultRequest(params=TaskParams(taskId=waiting["taskId"])), ANY)
            assert str(no_result.value).endswith("was cancelled: it has no result")
            listed = await client.session.send_request(ListTasksRequest(), ANY)  # newest first
            assert [task["taskId"] for task in listed["tasks"]] == [waiting["taskId"], created["taskId"]]
            result_request = TaskResultRequest(params=TaskParams(taskId=created["taskId"]))
            with anyio.fail_after(240):
                answer = await client.session.send_request(result_request, ANY)  # waits for the end
            assert answer["_meta"]["io.modelcontextprotocol/related-task"] == {"taskId": created["taskId"]}
            assert answer["structuredContent"]["reason"] == "ended"
            task = await get_task(client.session, created["taskId"])
            assert task["status"] == "completed" and "result" not in task
            answer.pop("_meta")
            again = plain(await client.call_tool("wait_run", {"run_id": run_id, "timeout_s": 240.0}))
            assert again.pop("resultType") == "complete"  # the SDK's model says it; no 2025-11-25 wire does
            assert without_wait_time(answer) == without_wait_time(again)
            with pytest.raises(MCPError) as finished:
                await client.session.send_request(CancelTaskRequest(params=TaskParams(taskId=created["taskId"])), ANY)
            assert finished.value.error.code == -32602 and str(finished.value).endswith("is completed already")
            # Another session sees none of it.
            assert (await other.session.send_request(ListTasksRequest(), ANY))["tasks"] == []
            with pytest.raises(MCPError) as hidden:
                await get_task(other.session, created["taskId"])
            assert hidden.value.error.code == -32602

    anyio.run(main)


def test_bad_task_ids_and_clients_without_the_extension_are_refused(workspace):
    async def main() -> None:
        async with tasks_client(build_server(workspace)) as client:
            for task_id in ("nope", "x" * 200):
                for request in (GetTaskRequest, CancelTaskRequest):
                    with pytest.raises(MCPError) as unknown:
                        await client.session.send_request(request(params=TaskParams(taskId=task_id)), ANY)
                    assert unknown.value.error.code == -32602
                    assert str(unknown.value).startswith("not_found: no task '")
                    assert "forgotten: a task is kept 60 minutes at most" in str(unknown.value)
            with pytest.raises(MCPError) as too_long:  # the params' schema: at most 200 characters
                await client.session.send_request(
                    GetTaskRequest(params=TaskParams.model_construct(task_id="y" * 201)), ANY)
            assert too_long.value.error.code == -32602
            with pytest.raises(MCPError) as gone:
                await client.session.send_request(
                    GetTaskRequest.model_construct(method="tasks/result", params=TaskParams(taskId="nope")), ANY)
            assert gone.value.error.code == -32601  # the extension has no tasks/result
        # Without the extension: today's answers (no task), and the task methods are refused.
        async with Client(build_server(workspace)) as client:
            result = await client.call_tool("wait_run", {"run_id": "nope"})
            assert result.is_error and result.content[0].text.startswith("Error executing tool wait_run: not_found: no run 'nope'")
            with pytest.raises(MCPError) as undeclared:
                await client.session.send_request(GetTaskRequest(params=TaskParams(taskId="nope")), ANY)
            assert undeclared.value.error.code == -32021
        async with tasks_client(build_server(workspace)) as client:  # a tool that is not a task
            listing = await client.call_tool("list_runs", {})
            assert not listing.is_error
        async with Client(build_server(workspace), mode="legacy", extensions=[Tasks()]) as client:
            assert client.protocol_version == "2025-11-25"  # SEP-2663: no extension in this era
            result = await client.call_tool("wait_run", {"run_id": "nope"})  # no params.task: no task
            assert result.is_error and "not_found: no run 'nope'" in result.content[0].text
            with pytest.raises(MCPError) as legacy:
                await client.session.send_request(GetTaskRequest(params=TaskParams(taskId="nope")), ANY)
            assert legacy.value.error.code == -32602 and str(legacy.value).startswith("not_found: no task 'nope'")
            with pytest.raises(MCPError) as not_a_task:
                await legacy_call(client, "list_runs", {})
            assert not_a_task.value.error.code == -32601
            assert "does not run as a task" in str(not_a_task.value)
            with pytest.raises(MCPError) as removed:
                await client.session.send_request(
                    UpdateTaskRequest(params=UpdateTaskParams(taskId="nope", inputResponses={})), ANY)
            assert removed.value.error.code == -32601  # tasks/update is the extension's
    anyio.run(main)


@pytest.mark.parametrize("mode", ["legacy", "auto"])
def test_over_stdio_a_task_is_created_and_polled_in_either_era(workspace, mode):
    async def main() -> None:
        async with tasks_client_mode(stdio_parameters(workspace), mode) as client:
            if mode == "legacy":
                assert client.protocol_version == "2025-11-25"
                created = (await legacy_call(client, "wait_run", {"run_id": "nope"}))["task"]
                answer = await client.session.send_request(
                    TaskResultRequest(params=TaskParams(taskId=created["taskId"])), ANY)
                assert answer["isError"] is True and "not_found: no run 'nope'" in answer["content"][0]["text"]
                return
            assert client.protocol_version == "2026-07-28"
            created = await start(client, "wait_run", run_id="nope")
            task = await poll(client.session, created.task_id, timeout=30)
            assert task["status"] == "completed" and task["result"]["isError"] is True
            assert "not_found: no run 'nope'" in task["result"]["content"][0]["text"]

    anyio.run(main)


@pytest.mark.parametrize("mode", ["legacy", "auto"])
def test_the_tool_list_with_task_support_fits_the_agent_budget_in_either_era(workspace, mode):
    async def main() -> None:
        async with Client(build_server(workspace), mode=mode) as client:
            listing = await client.list_tools()
            assert len(listing.model_dump_json(by_alias=True, exclude_none=True).encode()) <= 20_000
            supported = {tool.name for tool in listing.tools if tool.execution is not None}
            assert supported == ({"wait_run", "export_checkpoint", "evaluate"} if mode == "legacy" else set())

    anyio.run(main)


def test_tasks_are_forgotten_after_their_ttl_the_oldest_beyond_the_bound_and_a_sessions_with_it(workspace):
    server = build_server(workspace)
    (extension,) = [e for e in server._extensions if e.identifier == IDENTIFIER]

    async def main() -> None:
        async with tasks_client(server) as client:
            first = await start(client, "wait_run", run_id="nope")
            await poll(client.session, first.task_id, timeout=30)
            extension.tasks[first.task_id].created -= TTL_MS / 1000 + 1  # an hour and a second ago
            with pytest.raises(MCPError) as expired:
                await get_task(client.session, first.task_id)
            assert expired.value.error.code == -32602 and "forgotten: a task is kept 60 minutes at most" in str(expired.value)
            created = [await start(client, "wait_run", run_id="nope") for _ in range(MAX_KEPT_TASKS + 1)]
            for each in created[1:]:
                await poll(client.session, each.task_id, timeout=30)
            with pytest.raises(MCPError):  # the oldest finished one made room
                await get_task(client.session, created[0].task_id)
            assert len(extension.tasks) == MAX_KEPT_TASKS
        extension.tasks.clear()
        async with Client(server, mode="legacy") as legacy:
            task = (await legacy_call(legacy, "wait_run", {"run_id": "nope"}, ttl=1))["task"]
            assert task["ttl"] == 60_000  # a minute at least
            assert list(extension.tasks) == [task["taskId"]]
        with anyio.fail_after(5):  # the session ended: its tasks with it
            while extension.tasks:
                await anyio.sleep(0.05)

    anyio.run(main)


def test_over_streamable_http_a_task_is_created_and_fetched_in_either_era(workspace, tmp_path):
    import socket
    import subprocess
    import sys
    import time

    import httpx2 as httpx
    from mcp.client.streamable_http import streamable_http_client

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"PATH": "/usr/bin:/bin", "XDG_STATE_HOME": str(tmp_path / "state"), "HOME": str(tmp_path)}
    process = subprocess.Popen([sys.executable, "-m", "mcp_server.cli", "serve", "--http", str(port), "--no-auth",
                                "--workspace", str(workspace)], env=env, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}/mcp"
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                httpx.get(url, timeout=1)
                break
            except httpx.TransportError:
                time.sleep(0.2)

        async def main() -> None:
            async with tasks_client_mode(streamable_http_client(url), "auto") as client:
                assert client.protocol_version == "2026-07-28"
                created = await start(client, "wait_run", run_id="nope")
                task = await poll(client.session, created.task_id, timeout=30)
                assert task["status"] == "completed" and "no run 'nope'" in task["result"]["content"][0]["text"]
            async with Client(streamable_http_client(url), mode="legacy") as client:
                assert client.server_capabilities.tasks is not None
                created = (await legacy_call(client, "wait_run", {"run_id": "nope"}))["task"]
                answer = await client.session.send_request(
                    TaskResultRequest(params=TaskParams(taskId=created["taskId"])), ANY)
                assert answer["isError"] is True and "no run 'nope'" in answer["content"][0]["text"]

        anyio.run(main)
    finally:
        process.terminate()
        process.wait(timeout=10)
