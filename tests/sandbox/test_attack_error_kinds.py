"""Every tool error starts with its kind (README, "Errors and exit codes"), also those refused
before a tool runs: an unknown tool, arguments that fail the schema or are too large."""

from __future__ import annotations

import pytest

from mcp_server.server import build_server
from tests.sandbox.helpers import error_text, live_client, make_workspace


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    with live_client(build_server(make_workspace(tmp_path_factory.mktemp("kinds") / "ws"))) as c:
        yield c


@pytest.mark.parametrize("tool, arguments, kind", [
    ("no_such_tool", {}, "not_found"),
    ("get_run", {}, "bad_input"),
    ("get_run", {"run_id": 5}, "bad_input"),
    ("list_runs", {"limit": "many"}, "bad_input"),
    ("get_skill", {"skill": "x" * 200_000}, "bad_input"),
    ("get_run", {"run_id": "20260101-000000-lm-none"}, "not_found"),
])
def test_every_refusal_names_its_kind(client, tool, arguments, kind):
    result = client.call(tool, arguments)
    message = error_text(result)
    assert result.is_error
    prefix = f"Error executing tool {tool}: "
    text = message[len(prefix):] if message.startswith(prefix) else message
    assert text.startswith(f"{kind}:"), message[:300]
