"""Attack on the stdio transport's marking of numbers too long for Python (mcp_server.stdio): a
line that makes the marking itself misbehave must still be answered, the server going on, and a
request whose text merely holds the marker must not be taken for one with such a number."""

from __future__ import annotations

import json
import select
import subprocess

import pytest

from mcp_server.limits import OVERLONG_NUMBER
from tests.mcp.conftest import trainwright_command
from tests.sandbox.helpers import make_workspace
from tests.sandbox.test_attack_arguments import call

pytestmark = pytest.mark.filterwarnings("ignore::mcp.shared.exceptions.MCPDeprecationWarning")

LONG = "1" + "0" * 5000


def _call_line(request_id: int, arguments: str) -> str:
    return ('{"jsonrpc": "2.0", "id": %d, "method": "tools/call", "params": {"name": "list_runs", "arguments": %s}}'
            % (request_id, arguments))


def test_lines_that_made_the_marking_misbehave_are_answered_and_the_server_goes_on(tmp_path):
    root = make_workspace(tmp_path / "ws")
    server = subprocess.Popen([*trainwright_command(), "serve", "--workspace", str(root)], cwd=root,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)

    def ask(text: str) -> dict:
        """The answer to ``text`` (a request with an id), past any other message the server writes."""
        server.stdin.write(text.encode() + b"\n")
        server.stdin.flush()
        while True:
            assert select.select([server.stdout], [], [], 30)[0], f"no answer to {text[:80]}"
            answer = json.loads(server.stdout.readline())
            if answer.get("id") == json.loads(text)["id"]:
                return answer

    try:
        ask(json.dumps({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
            "protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "attack", "version": "1"}}}))
        server.stdin.write(b'{"jsonrpc": "2.0", "method": "notifications/initialized"}\n')
        # Deeper than Python's json module recurses (it raised RecursionError, not ValueError, and
        # the transport's reader died with it: the server exited and every later call went unanswered).
        nested = "[" * 100_000 + LONG + "]" * 100_000
        server.stdin.write((_call_line(2, '{"limit": %s}' % nested) + "\n").encode())
        # A fraction or an exponent after such a number: pydantic refuses it too ("number out of
        # range"), and it was not marked, so the call went unanswered.
        for request_id, number in ((3, LONG + ".5"), (4, LONG + "e1"), (5, "-" + LONG + "E-1")):
            answer = ask(_call_line(request_id, '{"limit": %s}' % number))
            assert answer["result"]["isError"] and "more than 4,300 digits" in answer["result"]["content"][0]["text"]
        answer = ask(_call_line(6, '{"limit": 1}'))
        assert answer["id"] == 6 and not answer["result"]["isError"], answer
        assert server.poll() is None
    finally:
        server.kill()
        server.wait()


def test_a_string_that_holds_the_marker_is_not_taken_for_a_long_number(tmp_path):
    # The marker's words as a client can read them here; the marker itself holds a token of the
    # server process's own, which no client is told.
    words = "<a number of more than the digits Python reads>"
    assert OVERLONG_NUMBER.startswith(words[:-1]) and len(OVERLONG_NUMBER) > len(words) + 16
    root = make_workspace(tmp_path / "ws")
    is_error, text = call(root, "get_run", run_id=f"x{words}")
    assert is_error and "4,300 digits" not in text and "is not a plain name" in text, text
