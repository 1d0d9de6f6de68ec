"""Live runs as resources, through a real SDK client in both protocol eras: a subscriber to a run's
metrics hears of each logged step and of the run's end, and nothing after it unsubscribes; the
subscriptions of a session are bounded; the server's own messages arrive at the client's level.

The runs are fake run directories that the test appends to, as a run would."""

from __future__ import annotations

import json
import time
from pathlib import Path

import anyio
import pytest
from mcp import Client
from mcp.shared.exceptions import MCPError
from mcp_types import LoggingMessageNotificationParams, ResourceUpdatedNotification

from engine import run_dir as rd
from engine import run_checkpoints
from engine.checkpoint_manifest import write_manifest
from runner import server_record as sr
from workspace.workspace import record_dir
from mcp_server.live import MAX_SUBSCRIPTIONS, POLL_S
from mcp_server.server import build_server
from tests.sandbox.helpers import fake_run, make_workspace

# resources/subscribe and logging are of the 2025-11-25 era, which the SDK marks deprecated.
pytestmark = pytest.mark.filterwarnings("ignore::mcp.shared.exceptions.MCPDeprecationWarning")
QUIET_S = 3 * POLL_S + 0.5  # longer than a few polls: what has not arrived by then will not


@pytest.fixture()
def workspace(tmp_path) -> Path:
    root = make_workspace(tmp_path / "ws")
    fake_run(root, "live", status=rd.RUNNING, steps=1, checkpoints=())
    return root


def log_step(workspace: Path, run_id: str, step: int) -> None:
    with open(workspace / rd.RUNS_DIRNAME / run_id / rd.METRICS_JSONL, "a") as f:
        f.write(json.dumps({"step": step, "loss": 5.0 - 0.1 * step}) + "\n")


def end_run(workspace: Path, run_id: str, status: str = rd.COMPLETED) -> None:
    rd.update_run(workspace / rd.RUNS_DIRNAME / run_id, status=status)
    sr.update_record(record_dir(workspace, run_id), status=status)


class Updates:
    """The URIs of the resource updates a client received, in order."""

    def __init__(self):
        self.uris: list[str] = []

    async def next(self, timeout: float = 10) -> str:
        count = len(self.uris)
        with anyio.fail_after(timeout):
            while len(self.uris) == count:
                await anyio.sleep(0.02)
        return self.uris[count]

    async def none_for(self, seconds: float) -> None:
        count = len(self.uris)
        await anyio.sleep(seconds)
        assert self.uris[count:] == []


def test_a_2025_session_hears_of_each_step_coalesced_a_checkpoint_and_the_end_then_nothing_after_unsubscribing(workspace):
    updates = Updates()

    async def on_message(message) -> None:
        if isinstance(message, ResourceUpdatedNotification):
            updates.uris.append(message.params.uri)

    async def main() -> None:
        async with Client(build_server(workspace), mode="legacy", message_handler=on_message) as client:
            assert client.protocol_version == "2025-11-25"
            assert client.server_capabilities.resources.subscribe is True
            await client.subscribe_resource("run://live/metrics")
            await updates.none_for(QUIET_S)  # nothing changed yet: no update
            for step in (2, 3):
                log_step(workspace, "live", step)
                assert await updates.next() == "run://live/metrics"
                await updates.none_for(2 * POLL_S)  # one step, one update
            for step in range(4, 14):  # ten steps at once: one update, or two if a poll falls between
                log_step(workspace, "live", step)
            assert await updates.next() == "run://live/metrics"
            await anyio.sleep(QUIET_S)
            assert len(updates.uris) in (3, 4)
            checkpoint = workspace / rd.RUNS_DIRNAME / "live" / rd.CHECKPOINTS_DIRNAME / run_checkpoints.checkpoint_dir_name(13)
            checkpoint.mkdir(parents=True)
            (checkpoint / run_checkpoints.DCP_METADATA).write_bytes(b"")
            write_manifest(checkpoint)
            assert await updates.next() == "run://live/metrics"
            end_run(workspace, "live")
            assert await updates.next() == "run://live/metrics"
            assert json.loads((await client.read_resource("run://live/metrics")).contents[0].text)["status"] == "completed"
            await client.unsubscribe_resource("run://live/metrics")
            log_step(workspace, "live", 14)
            await updates.none_for(QUIET_S)

    anyio.run(main)


def test_a_2026_listen_stream_hears_of_each_step_and_the_end_and_of_nothing_it_did_not_ask_for(workspace):
    fake_run(workspace, "other", status=rd.RUNNING, steps=1, checkpoints=())

    async def main() -> None:
        async with Client(build_server(workspace)) as client:
            assert client.protocol_version == "2026-07-28"
            assert client.server_capabilities.resources.subscribe is True
            async with client.listen(resource_subscriptions=["run://live/metrics", "run://live/log"]) as events:
                received: list[str] = []

                async def collect() -> None:
                    async for event in events:
                        received.append(event.uri)

                async with anyio.create_task_group() as tasks:
                    tasks.start_soon(collect)
                    log_step(workspace, "other", 2)  # not asked for
                    log_step(workspace, "live", 2)
                    with anyio.fail_after(10):
                        while not received:
                            await anyio.sleep(0.02)
                    await anyio.sleep(QUIET_S)
                    assert received == ["run://live/metrics"]
                    end_run(workspace, "live", rd.FAILED)
                    await anyio.sleep(QUIET_S)
                    assert sorted(received[1:]) == ["run://live/log", "run://live/metrics"]
                    tasks.cancel_scope.cancel()

    anyio.run(main)


def test_a_session_subscribes_to_at_most_32_resources_and_only_to_runs_there_are(workspace):
    for n in range(MAX_SUBSCRIPTIONS // 3 + 1):
        fake_run(workspace, f"run{n}", steps=1, checkpoints=())
    uris = [f"run://run{n}/{kind}" for n in range(MAX_SUBSCRIPTIONS // 3 + 1) for kind in ("metrics", "log", "status")]

    async def main() -> None:
        async with Client(build_server(workspace), mode="legacy") as client:
            for uri in uris[:MAX_SUBSCRIPTIONS]:
                await client.subscribe_resource(uri)
            with pytest.raises(MCPError) as refused:
                await client.subscribe_resource(uris[MAX_SUBSCRIPTIONS])
            assert refused.value.error.code == -32602
            assert str(refused.value) == ("at most 32 subscriptions per session; resources/unsubscribe one first")
            await client.unsubscribe_resource(uris[0])
            await client.subscribe_resource(uris[MAX_SUBSCRIPTIONS])  # room again
            await client.unsubscribe_resource(uris[1])
            with pytest.raises(MCPError) as unknown:
                await client.subscribe_resource("run://nope/metrics")
            assert "not_found: no run 'nope'" in str(unknown.value)
            with pytest.raises(MCPError) as not_live:
                await client.subscribe_resource("run://run0/loss.jpg")
            assert "is not a live resource" in str(not_live.value)

        async with Client(build_server(workspace), mode="2026-07-28") as client:
            with pytest.raises(MCPError) as too_many:
                async with client.listen(resource_subscriptions=uris):
                    pass
            assert str(too_many.value).startswith("at most 32 resource subscriptions per stream (33 asked)")

    anyio.run(main)


def test_a_run_that_ends_is_logged_to_a_2025_session_at_or_above_its_level(workspace):
    fake_run(workspace, "quiet", status=rd.RUNNING, steps=1, checkpoints=())
    messages: list[LoggingMessageNotificationParams] = []

    async def on_log(params: LoggingMessageNotificationParams) -> None:
        messages.append(params)

    async def main() -> None:
        async with Client(build_server(workspace), mode="legacy", logging_callback=on_log) as client:
            assert client.server_capabilities.logging is not None
            await client.set_logging_level("warning")
            await client.subscribe_resource("run://live/status")
            await client.subscribe_resource("run://quiet/status")
            end_run(workspace, "quiet", rd.COMPLETED)  # info: below warning
            end_run(workspace, "live", rd.FAILED)  # error
            await anyio.sleep(QUIET_S)

    anyio.run(main)
    assert [(m.level, m.logger, m.data) for m in messages] == [("error", "trainwright", "run live failed")]


def test_the_status_resource_is_get_runs_answer(workspace):
    async def main() -> None:
        async with Client(build_server(workspace)) as client:
            templates = [t.uri_template for t in (await client.list_resource_templates()).resource_templates]
            assert "run://{run_id}/status" in templates
            status = json.loads((await client.read_resource("run://live/status")).contents[0].text)
            assert (status["run_id"], status["step"]) == ("live", 1)

    anyio.run(main)


def test_nothing_polls_once_the_session_ends(workspace):
    server = build_server(workspace)

    async def main() -> None:
        async with Client(server, mode="legacy") as client:
            await client.subscribe_resource("run://live/metrics")
            live = server._lowlevel_server.get_request_handler("resources/subscribe").handler.__self__
            assert len(live.subscribers) == 2  # the listen streams, and this session
        started = time.monotonic()
        while len(live.subscribers) != 1 and time.monotonic() - started < 5:
            await anyio.sleep(0.05)
        assert list(live.subscribers.values()) == [live.listen_streams]

    anyio.run(main)


@pytest.mark.parametrize("mode", ["legacy", "auto"])
def test_over_stdio_a_subscriber_hears_of_a_step_in_either_era(workspace, mode):
    from tests.mcp.conftest import stdio_parameters

    updates = Updates()

    async def on_message(message) -> None:
        if isinstance(message, ResourceUpdatedNotification):
            updates.uris.append(message.params.uri)

    async def main() -> None:
        async with Client(stdio_parameters(workspace), mode=mode, message_handler=on_message) as client:
            if mode == "legacy":
                assert client.protocol_version == "2025-11-25"
                await client.subscribe_resource("run://live/status")
                log_step(workspace, "live", 2)
                assert await updates.next() == "run://live/status"
                return
            assert client.protocol_version == "2026-07-28"
            async with client.listen(resource_subscriptions=["run://live/status"]) as events:
                log_step(workspace, "live", 2)
                with anyio.fail_after(10):
                    event = await events.__anext__()
                assert event.uri == "run://live/status"

    anyio.run(main)
