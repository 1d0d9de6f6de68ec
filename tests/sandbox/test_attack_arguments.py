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
