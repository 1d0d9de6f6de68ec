"""The server's own messages as MCP log notifications: at or above the level the client asked for
(logging/setLevel at 2025-11-25, the request's opt-in at 2026-07-28), redacted."""

from __future__ import annotations

import anyio
import pytest
from mcp import Client
from mcp_types import LoggingMessageNotificationParams

from engine import run_dir as rd
from mcp_server.server import build_server
from tests.sandbox.helpers import fake_run, make_workspace

# logging is of the 2025-11-25 era, which the SDK marks deprecated.
pytestmark = pytest.mark.filterwarnings("ignore::mcp.shared.exceptions.MCPDeprecationWarning")
TOKEN = "ghp_0123456789abcdefghijABCDEFGHIJ"


@pytest.fixture()
def workspace(tmp_path):
    root = make_workspace(tmp_path / "ws")
    fake_run(root, "done", status=rd.COMPLETED)
    fake_run(root, "broken", status=rd.FAILED, error=f"the hub refused {TOKEN}")
    return root


def logged(workspace, mode: str, level: str | None, *run_ids: str) -> list[tuple[str, str | None, str]]:
    """The log messages a client gets while it waits on each run (already ended)."""
    messages: list[LoggingMessageNotificationParams] = []

    async def on_log(params: LoggingMessageNotificationParams) -> None:
        messages.append(params)

    async def main() -> None:
        log_level = level if mode != "legacy" else None
        async with Client(build_server(workspace), mode=mode, logging_callback=on_log, log_level=log_level) as client:
            if mode == "legacy" and level is not None:
                await client.set_logging_level(level)
            for run_id in run_ids:
                result = await client.call_tool("wait_run", {"run_id": run_id, "timeout_s": 1})
                assert result.structured_content["reason"] == "ended"
            await anyio.sleep(0.2)

    anyio.run(main)
    return [(m.level, m.logger, m.data) for m in messages]


def test_a_2025_session_gets_the_runs_end_at_or_above_its_level_redacted(workspace):
    assert logged(workspace, "legacy", "error", "done", "broken") == [
        ("error", "trainwright", "run broken failed: the hub refused ***")]
    assert logged(workspace, "legacy", "info", "done") == [("info", "trainwright", "run done completed")]
    assert logged(workspace, "legacy", None, "done") == [("info", "trainwright", "run done completed")]  # info by default


def test_a_2026_request_gets_the_runs_end_only_when_it_opts_in(workspace):
    assert logged(workspace, "auto", "info", "done") == [("info", "trainwright", "run done completed")]
    assert logged(workspace, "auto", "error", "done") == []
    assert logged(workspace, "auto", None, "done") == []


def test_a_run_launched_and_ended_is_logged_to_the_session_that_launched_it(tmp_path):
    from tests.mcp.conftest import git

    workspace = make_workspace(tmp_path / "ws")
    (workspace / "train.py").write_text('import json\nprint(json.dumps({"step": 1, "loss": 1.0}))\n')
    git(workspace, "add", "train.py")
    git(workspace, "commit", "-q", "-m", "a one-step script")
    messages: list[tuple[str, str]] = []

    async def on_log(params: LoggingMessageNotificationParams) -> None:
        messages.append((params.level, params.data))

    async def main() -> str:
        async with Client(build_server(workspace), mode="legacy", logging_callback=on_log) as client:
            launched = await client.call_tool("launch_run", {"recipe": "train.py"})
            run_id = launched.structured_content["run_id"]
            for _ in range(6):
                waited = await client.call_tool("wait_run", {"run_id": run_id, "timeout_s": 20})
                if waited.structured_content["reason"] == "ended":
                    break
            await anyio.sleep(0.2)
            return run_id

    run_id = anyio.run(main)
    assert messages == [("info", f"run {run_id} launched (train.py)"), ("info", f"run {run_id} completed")]


def test_a_hub_downloads_progress_is_logged_by_tenths():
    from mcp_server.server import download_progress

    sent: list[tuple[str, str]] = []

    class Session:  # the SDK's ServerSession, as far as a log message needs it
        protocol_version = "2026-07-28"

        async def send_log_message(self, level, data, logger=None):
            sent.append((level, data))

    class Ctx:
        session = Session()

        async def report_progress(self, value, total, message):
            pass

    async def main() -> None:
        report = download_progress(Ctx())
        for done in range(0, 101, 5):
            await anyio.to_thread.run_sync(report, done * 1000, 100_000, "org/model: downloading")

    anyio.run(main)
    assert sent == [("info", f"org/model: downloading ({tenth}0%)") for tenth in range(1, 10)]
