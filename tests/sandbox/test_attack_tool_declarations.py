"""The one declaration per tool (mcp_server/declarations.py, Tools.run): what a run writes into
its run directory reaches a client's log line only escaped and redacted."""

from __future__ import annotations

import anyio
import pytest
from mcp import Client
from mcp_types import LoggingMessageNotificationParams

from engine import run_dir as rd
from mcp_server.server import build_server
from tests.sandbox.helpers import fake_run, make_workspace
from tests.sandbox.test_attack_forged_run_record import forge

pytestmark = pytest.mark.filterwarnings("ignore::mcp.shared.exceptions.MCPDeprecationWarning")
TOKEN = "ghp_0123456789abcdefghijABCDEFGHIJ"


def test_a_forged_run_error_reaches_the_wait_run_log_line_escaped_and_redacted(tmp_path):
    root = make_workspace(tmp_path / "ws")
    # The server's record says why (as the supervisor wrote it, from the run's own output);
    # run.json, which the run can rewrite, says something else.
    run_dir = fake_run(root, "broken", status=rd.FAILED, error=f"oops\x1b]0;owned\x07\x1b[2J\r{TOKEN}\x00")
    forge(run_dir, error="FORGED by the run")
    messages: list[LoggingMessageNotificationParams] = []

    async def on_log(params: LoggingMessageNotificationParams) -> None:
        messages.append(params)

    async def main() -> None:
        async with Client(build_server(root), mode="legacy", logging_callback=on_log) as client:
            await client.set_logging_level("info")
            result = await client.call_tool("wait_run", {"run_id": "broken", "timeout_s": 1})
            assert result.structured_content["reason"] == "ended"
            assert TOKEN not in str(result.structured_content)
            await anyio.sleep(0.2)

    anyio.run(main)
    lines = [m.data for m in messages]
    assert len(lines) == 1, lines
    line = lines[0]
    assert line.startswith("run broken failed: oops")
    assert TOKEN not in line and "***" in line
    assert not any(ord(c) < 32 and c not in "\n\t" for c in line), repr(line)
    assert "\\x1b" in line
    assert "FORGED" not in line


def test_an_argument_a_tool_does_not_take_is_refused_naming_it_and_the_tools_parameters(tmp_path):
    """``sample(..., image=...)`` (a name it does not take) was answered as if no image had been given."""
    root = make_workspace(tmp_path / "ws")
    fake_run(root, "r1")

    async def main() -> list[str]:
        async with Client(build_server(root), mode="legacy") as client:
            texts = []
            for name, arguments in (("sample", {"run_id": "r1", "prompts": ["hi"], "image": "cat.png"}),
                                    ("list_runs", {"limit": 5, "statuss": "running"})):
                result = await client.call_tool(name, arguments)
                assert result.is_error
                texts.append(result.content[0].text)
            assert not (await client.call_tool("list_runs", {})).is_error
            return texts

    sample, list_runs = anyio.run(main)
    assert sample == ("bad_input: sample takes no argument 'image'; its parameters: "
                      "run_id, prompts, step, max_new_tokens, temperature, think, images")
    assert list_runs == "bad_input: list_runs takes no argument 'statuss'; its parameters: limit"
