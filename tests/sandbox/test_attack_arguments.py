"""Attack on this round's tool arguments through a real MCP client: sample's images (paths that
lead out, into reserved folders, through links, at a FIFO or a folder) and numbers given as
other types. Each is refused as bad input naming the argument, before any process starts."""

from __future__ import annotations

import os

import anyio
import pytest
from mcp import Client

from mcp_server.server import build_server
from tests.sandbox.helpers import fake_run, make_workspace

pytestmark = pytest.mark.filterwarnings("ignore::mcp.shared.exceptions.MCPDeprecationWarning")


def call(root, tool: str, **arguments) -> tuple[bool, str]:
    """``(is_error, text)`` of one call of ``tool`` over a real MCP client."""
    answer: list = []

    async def main() -> None:
        async with Client(build_server(root), mode="legacy") as client:
            result = await client.call_tool(tool, arguments)
            answer.append((result.is_error, result.content[0].text if result.content else ""))

    anyio.run(main)
    return answer[0]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = make_workspace(tmp_path_factory.mktemp("attack") / "ws")
    fake_run(root, "done")
    outside = root.parent / "outside.png"
    outside.write_bytes(b"\x89PNG")
    (root / "data").mkdir()
    (root / "data" / "leads-out.png").symlink_to(outside)
    os.mkfifo(root / "data" / "fifo.png")
    (root / "data" / "folder.png").mkdir()
    return root


@pytest.mark.parametrize("image, said", [
    ("../outside.png", "resolves outside the workspace"),
    ("{parent}/outside.png", "resolves outside the workspace"),
    ("data/leads-out.png", "resolves outside the workspace"),
    (".trainwright/config.yaml", "inside .trainwright/"),
    (".git/config", "inside .git/"),
    ("data/fifo.png", "is not a regular file"),
    ("data/folder.png", "is not a regular file"),
])
def test_an_image_that_is_no_workspace_file_is_refused_before_the_model_process_starts(root, image, said):
    is_error, text = call(root, "sample", run_id="done", prompts=["what is it?"],
                          images=[image.format(parent=root.parent)])
    assert is_error
    assert text.startswith("Error executing tool sample: bad_input: images ") and said in text, text


def test_a_number_given_as_a_boolean_or_a_string_is_refused(root):
    for value in (True, "3"):
        is_error, text = call(root, "estimate_run", recipe="recipes/lm", device_memory_gib=value)
        assert is_error, (value, text)
        assert "device_memory_gib" in text, text


# Python converts an integer of more than 4,300 digits to text only when told to: json.dumps of
# such an argument raises ValueError where the server measures the arguments' size.
HUGE = 10 ** 5000


@pytest.mark.parametrize("tool, arguments", [
    ("list_runs", {"limit": HUGE}),
    ("export_checkpoint", {"run_id": "done", "step": HUGE, "to": "exported"}),
    ("wait_run", {"run_id": "done", "until_step": HUGE, "timeout_s": 1}),
])
def test_an_integer_too_long_to_write_as_text_is_bad_input(root, tool, arguments):
    is_error, text = call(root, tool, **arguments)
    assert is_error
    assert text == ("bad_input: the arguments hold a number of more than 4,300 "
                    "digits; give numbers within the bounds each argument states")


def test_over_stdio_the_call_is_answered_and_the_server_goes_on(root):
    """Over stdio such a call is answered with the same refusal (pydantic's JSON parser refuses the
    number and the SDK would drop the message unanswered: mcp_server.stdio marks it), and the server
    goes on."""
    import json
    import select
    import subprocess
    import sys

    from tests.mcp.conftest import trainwright_command

    server = subprocess.Popen([*trainwright_command(), "serve", "--workspace", str(root)], cwd=root,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)

    def ask(text: str) -> dict:
        server.stdin.write(text.encode() + b"\n")
        server.stdin.flush()
        assert select.select([server.stdout], [], [], 30)[0], f"no answer to {text[:80]}"
        return json.loads(server.stdout.readline())

    try:
        ask(json.dumps({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
            "protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "attack", "version": "1"}}}))
        server.stdin.write(b'{"jsonrpc": "2.0", "method": "notifications/initialized"}\n')
        answer = ask('{"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": {"name": "list_runs", '
                     '"arguments": {"limit": 1' + "0" * 5000 + "}}}")
        assert answer["id"] == 2 and answer["result"]["isError"]
        assert "more than 4,300 digits" in answer["result"]["content"][0]["text"]
        answer = ask(json.dumps({"jsonrpc": "2.0", "id": 3, "method": "tools/call",
                                 "params": {"name": "list_runs", "arguments": {"limit": 1}}}))
        assert answer["id"] == 3 and not answer["result"]["isError"]
    finally:
        server.kill()
        server.wait()
        assert sys.get_int_max_str_digits() == 4300  # this process left as it was
