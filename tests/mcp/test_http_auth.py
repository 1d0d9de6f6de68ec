"""HTTP with a token: ``trainwright serve --http PORT`` answers 401 without the bearer token it
printed (and wrote 0600 to the user's state folder), and serves the tools with it."""

from __future__ import annotations

import socket
import stat
import subprocess
import sys
import time

import httpx2 as httpx
import pytest
from anyio.from_thread import start_blocking_portal
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import create_mcp_http_client

from tests.sandbox.helpers import make_workspace
from tests.support import wait_for

INITIALIZE = {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
    "protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "t", "version": "0"}}}
HEADERS = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    base = tmp_path_factory.mktemp("http")
    root = make_workspace(base / "ws")
    port = _free_port()
    env = {"PATH": "/usr/bin:/bin", "XDG_STATE_HOME": str(base / "state"), "HOME": str(base)}
    process = subprocess.Popen(
        [sys.executable, "-m", "mcp_server.cli", "serve", "--http", str(port), "--workspace", str(root)],
        env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
    )
    token_file = base / "state" / "trainwright" / "http-token"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            httpx.get(f"http://127.0.0.1:{port}/mcp", timeout=1)
            break
        except httpx.TransportError:
            time.sleep(0.2)
    try:
        yield f"http://127.0.0.1:{port}/mcp", token_file, process
    finally:
        process.terminate()
        process.wait(timeout=10)


def test_the_token_is_written_for_this_user_only_and_printed_once_with_the_url(served):
    url, token_file, process = served
    token = token_file.read_text().strip()
    assert len(token) >= 32
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
    assert stat.S_IMODE(token_file.parent.stat().st_mode) == 0o700
    first = process.stderr.readline() + process.stderr.readline()
    assert url in first and f"Bearer {token}" in first


@pytest.mark.parametrize("authorization", [None, "Bearer wrong", "Basic abc", "bearer {token}x", "{token}"])
def test_a_request_without_the_right_token_gets_401(served, authorization):
    url, token_file, _ = served
    headers = dict(HEADERS)
    if authorization is not None:
        headers["Authorization"] = authorization.format(token=token_file.read_text().strip())
    response = httpx.post(url, json=INITIALIZE, headers=headers, timeout=10)
    assert response.status_code == 401
    assert "Bearer" in response.headers["www-authenticate"]


def test_with_the_token_the_tools_are_served(served):
    url, token_file, _ = served
    token = token_file.read_text().strip()
    http_client = create_mcp_http_client(headers={"Authorization": f"Bearer {token}"})
    with start_blocking_portal() as portal:
        with portal.wrap_async_context_manager(Client(streamable_http_client(url, http_client=http_client))) as client:
            tools = portal.call(client.list_tools).tools
    assert "launch_run" in {t.name for t in tools}


def test_half_sent_requests_are_closed_after_the_header_timeout_and_never_starve_the_server(served):
    """Connections that send part of a request's headers and wait held a file descriptor each
    for ever (520 of them starved a server limited to 512 files)."""
    from mcp_server.limits import HTTP_HEADER_TIMEOUT_S, MAX_HTTP_CONNECTIONS

    url, _, _ = served
    port = int(url.split(":")[2].split("/")[0])
    half_sent = []
    for _ in range(MAX_HTTP_CONNECTIONS + 20):
        connection = socket.create_connection(("127.0.0.1", port), timeout=5)
        connection.sendall(b"POST /mcp HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")  # the headers never end
        half_sent.append(connection)
    try:
        # Beyond the bound, connections are closed at once (well inside the header timeout); the
        # others when the timeout passes; a client still gets its answer.
        wait_for(lambda: sum(_closed(c) for c in half_sent) >= 20, timeout=HTTP_HEADER_TIMEOUT_S / 2, interval=0.2)
        started = time.monotonic()
        while time.monotonic() - started < HTTP_HEADER_TIMEOUT_S + 10 and not all(_closed(c) for c in half_sent):
            time.sleep(0.5)
        assert all(_closed(c) for c in half_sent), "half-sent requests are still open"
        assert httpx.post(url, json=INITIALIZE, headers=HEADERS, timeout=10).status_code == 401  # answered
    finally:
        for connection in half_sent:
            connection.close()


def _closed(connection: socket.socket) -> bool:
    """Whether the server has closed ``connection``: an end of file or a reset is there to read.
    It does not wait (a wait per open connection cost seconds over the hundred of them)."""
    connection.setblocking(False)
    try:
        return connection.recv(1) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def test_connections_held_open_by_someone_without_the_token_never_keep_its_holder_out(served):
    """Anyone on the machine can open MAX_HTTP_CONNECTIONS sockets and send nothing: the new
    connection was the one closed, so the token's holder was refused for as long as they were
    held. Now the oldest one still waiting for its headers makes room."""
    from mcp_server.limits import MAX_HTTP_CONNECTIONS

    url, token_file, _ = served
    port = int(url.split(":")[2].split("/")[0])
    held = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(MAX_HTTP_CONNECTIONS + 5)]
    try:
        time.sleep(0.5)
        token = token_file.read_text().strip()
        answer = httpx.post(url, json=INITIALIZE, headers={**HEADERS, "Authorization": f"Bearer {token}"}, timeout=10)
        assert answer.status_code == 200
        wait_for(lambda: sum(_closed(c) for c in held) >= 6, timeout=10)  # the oldest made room, new ones included
    finally:
        for connection in held:
            connection.close()
