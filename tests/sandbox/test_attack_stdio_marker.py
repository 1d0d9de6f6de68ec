"""Attack on the stdio transport's marking of numbers too long for Python (mcp_server.stdio): a
line that makes the marking itself misbehave must still be answered, the server going on, and a
request whose text merely holds the marker must not be taken for one with such a number."""

from __future__ import annotations

import json
import select
import subprocess

import anyio
import pytest

from mcp_server.limits import MAX_MESSAGE_CHARS, OVERLONG_MESSAGE, OVERLONG_NUMBER
from mcp_server.stdio import BoundedLines
from tests.mcp.conftest import trainwright_command
from tests.sandbox.helpers import make_workspace
from tests.sandbox.test_attack_arguments import call

pytestmark = pytest.mark.filterwarnings("ignore::mcp.shared.exceptions.MCPDeprecationWarning")

LONG = "1" + "0" * 5000


def _call_line(request_id: int, arguments: str) -> str:
    return ('{"jsonrpc": "2.0", "id": %d, "method": "tools/call", "params": {"name": "list_runs", "arguments": %s}}'
            % (request_id, arguments))


class _Server:
    """``trainwright serve`` over stdio, initialized; ``ask`` sends a request and returns its answer."""

    def __init__(self, tmp_path):
        root = make_workspace(tmp_path / "ws")
        self.process = subprocess.Popen([*trainwright_command(), "serve", "--workspace", str(root)], cwd=root,
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        self.ask(json.dumps({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
            "protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "attack", "version": "1"}}}))
        self.send('{"jsonrpc": "2.0", "method": "notifications/initialized"}')

    def close(self) -> None:
        self.process.kill()
        self.process.wait()

    def send(self, text: str) -> None:
        self.process.stdin.write(text.encode() + b"\n")
        self.process.stdin.flush()

    def ask(self, text: str, request_id: int | str | None = None) -> dict:
        """The answer to ``text`` (a request with an id), past any other message the server writes."""
        self.send(text)
        request_id = json.loads(text)["id"] if request_id is None else request_id
        while True:
            assert select.select([self.process.stdout], [], [], 60)[0], f"no answer to {text[:80]}"
            answer = json.loads(self.process.stdout.readline())
            if answer.get("id") == request_id:
                return answer


def test_lines_that_made_the_marking_misbehave_are_answered_and_the_server_goes_on(tmp_path):
    server = _Server(tmp_path)
    ask = server.ask
    try:
        # Deeper than Python's json module recurses (it raised RecursionError, not ValueError, and
        # the transport's reader died with it: the server exited and every later call went unanswered).
        nested = "[" * 100_000 + LONG + "]" * 100_000
        server.send(_call_line(2, '{"limit": %s}' % nested))
        # A fraction or an exponent after such a number: pydantic refuses it too ("number out of
        # range"), and it was not marked, so the call went unanswered.
        for request_id, number in ((3, LONG + ".5"), (4, LONG + "e1"), (5, "-" + LONG + "E-1")):
            answer = ask(_call_line(request_id, '{"limit": %s}' % number))
            assert answer["result"]["isError"] and "more than 4,300 digits" in answer["result"]["content"][0]["text"]
        answer = ask(_call_line(6, '{"limit": 1}'))
        assert answer["id"] == 6 and not answer["result"]["isError"], answer
        assert server.process.poll() is None
    finally:
        server.close()


def test_a_string_that_holds_the_marker_is_not_taken_for_a_long_number(tmp_path):
    # The marker's words as a client can read them here; the marker itself holds a token of the
    # server process's own, which no client is told.
    words = "<a number of more than the digits Python reads>"
    assert OVERLONG_NUMBER.startswith(words[:-1]) and len(OVERLONG_NUMBER) > len(words) + 16
    root = make_workspace(tmp_path / "ws")
    is_error, text = call(root, "get_run", run_id=f"x{words}")
    assert is_error and "4,300 digits" not in text and "is not a plain name" in text, text


def test_a_line_longer_than_a_message_is_answered_as_too_large_without_being_held(tmp_path):
    """Over stdio the SDK read each line whole, however long; now a line past MAX_MESSAGE_CHARS is
    read in pieces and dropped, and its request answered as too large (the id at either end)."""
    server = _Server(tmp_path)
    filler = "x" * (MAX_MESSAGE_CHARS + 10)
    try:
        answer = server.ask(_call_line(2, '{"limit": 1, "pad": "%s"}' % filler))
        assert answer["result"]["isError"], answer
        assert "the message is too large (more than 1,000,000 characters" in answer["result"]["content"][0]["text"]
        # The id and method after the parameters (at the line's end); another method than a call.
        answer = server.ask('{"jsonrpc": "2.0", "params": {"name": "%s"}, "method": "prompts/get", "id": "p"}' % filler,
                            request_id="p")
        assert "error" in answer, answer
        # A notification of that size is dropped; the server reads on and answers the next call.
        server.send('{"jsonrpc": "2.0", "method": "notifications/progress", "params": {"x": "%s"}}' % filler)
        answer = server.ask(_call_line(3, '{"limit": 1}'))
        assert not answer["result"]["isError"], answer
        assert server.process.poll() is None
    finally:
        server.close()


class _Stdin:
    def __init__(self, text: str):
        self.text, self.asked = text, []

    def readline(self, limit: int) -> str:
        self.asked.append(limit)
        end = self.text.find("\n")
        end = len(self.text) if end < 0 else end + 1
        line, self.text = self.text[:min(end, limit)], self.text[min(end, limit):]
        return line


def test_the_reader_never_asks_for_more_than_a_message():
    stdin = _Stdin(_call_line(7, '{"pad": "%s"}' % ("y" * 3 * MAX_MESSAGE_CHARS)) + "\n" + _call_line(8, "{}") + "\n")

    async def lines() -> list[str]:
        return [line async for line in BoundedLines(stdin)]

    first, second = anyio.run(lines)
    assert json.loads(first)["id"] == 7 and OVERLONG_MESSAGE in first
    assert json.loads(second)["id"] == 8
    assert max(stdin.asked) == MAX_MESSAGE_CHARS + 1


def test_an_overlong_line_whose_id_holds_an_escape_json_has_not_leaves_the_reader_going():
    # The id's regex took any backslash pair and raw control characters; json.loads of "\q" or
    # of a raw tab or of 01 raised and ended the transport.
    pad = "y" * MAX_MESSAGE_CHARS
    bad = '{"jsonrpc": "2.0", "id": "a\\q", "method": "tools/call", "params": {"pad": "%s"}}' % pad
    good = '{"jsonrpc": "2.0", "id": "b\\u00e9\\n", "method": "tools/call", "params": {"pad": "%s"}}' % pad
    raw_tab = bad.replace("a\\q", "a\tb")  # a control character JSON wants escaped
    leading_zero = bad.replace('"a\\q"', "01")  # json.loads("01") is extra data
    stdin = _Stdin(bad + "\n" + raw_tab + "\n" + leading_zero + "\n" + good + "\n" + _call_line(9, "{}") + "\n")

    async def lines() -> list[str]:
        return [line async for line in BoundedLines(stdin)]

    *zero, escaped, after = anyio.run(lines)
    assert [json.loads(line)["id"] for line in zero] in ([], [0])  # not JSON: dropped, or answered
    assert json.loads(escaped)["id"] == "b\u00e9\n" and OVERLONG_MESSAGE in escaped
    assert json.loads(after)["id"] == 9
