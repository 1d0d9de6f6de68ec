"""HTTP with a token: ``trainwright serve --http PORT`` answers only requests that carry
``Authorization: Bearer <token>``.

A server on 127.0.0.1 is reachable by every local user and every process on the machine, and
a root server's tools act as root. So each start generates a new random token, writes it with
mode 0600 to the user's state folder (``$XDG_STATE_HOME/trainwright/http-token``, default
``~/.local/state/trainwright/http-token``) and prints it once on stderr with the URL. The SDK's
own Host and Origin checks (DNS rebinding) still apply; ``--no-auth`` turns the token off, for
a client that cannot send headers, and says so.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import os
import secrets
import sys
import time
from pathlib import Path
from typing import Any, Awaitable, Callable, Mapping

from mcp_server.limits import HTTP_HEADER_TIMEOUT_S, MAX_HTTP_CONNECTIONS

TOKEN_FILENAME = "http-token"
HOST = "127.0.0.1"
MCP_PATH = "/mcp"

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


def token_path(environ: Mapping[str, str] | None = None) -> Path:
    source: Mapping[str, str] = os.environ if environ is None else environ
    base = source.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "trainwright" / TOKEN_FILENAME


def write_new_token(path: Path | None = None) -> tuple[str, Path]:
    """A fresh token, written (replacing the last one) readable by this user only."""
    path = token_path() if path is None else Path(path)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    token = secrets.token_urlsafe(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.fchmod(fd, 0o600)  # an older file may have had other modes
        os.write(fd, (token + "\n").encode())
    finally:
        os.close(fd)
    return token, path


class BearerToken:
    """ASGI middleware: HTTP requests without the right bearer token get 401, nothing else."""

    def __init__(self, app: Callable, token: str):
        self.app = app
        self.expected = token.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and not self._authorized(scope):
            body = json.dumps({"error": "unauthorized: send the header 'Authorization: Bearer <token>' "
                               "with the token trainwright serve printed"}).encode()
            await send({"type": "http.response.start", "status": 401, "headers": [
                (b"content-type", b"application/json"), (b"www-authenticate", b'Bearer realm="trainwright"'),
                (b"content-length", str(len(body)).encode()),
            ]})
            await send({"type": "http.response.body", "body": body})
            return
        await self.app(scope, receive, send)

    def _authorized(self, scope: Scope) -> bool:
        given = [value for name, value in scope.get("headers", []) if name.lower() == b"authorization"]
        if len(given) != 1:
            return False
        # RFC 9110: the scheme is case-insensitive ("bearer" is "Bearer"); the token is not.
        scheme, _, token = given[0].strip().partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(b" "), self.expected)


def serve_http(server, port: int, auth: bool = True) -> None:
    """Serve ``server`` (an MCPServer) over streamable HTTP on 127.0.0.1:``port``."""
    import uvicorn

    app = server.streamable_http_app(streamable_http_path=MCP_PATH, host=HOST)
    url = f"http://{HOST}:{port}{MCP_PATH}"
    if auth:
        token, path = write_new_token()
        app = BearerToken(app, token)
        print(f"trainwright: serving MCP at {url}\n"
              f"  send 'Authorization: Bearer {token}' (also in {path}, mode 0600; new at each start)",
              file=sys.stderr, flush=True)
    else:
        print(f"trainwright: serving MCP at {url} WITHOUT authentication (--no-auth): "
              "every local user and process can call its tools", file=sys.stderr, flush=True)
    uvicorn.Server(uvicorn.Config(app, host=HOST, port=port, log_level="warning", http=bounded_protocol())).run()


def bounded_protocol() -> type:
    """uvicorn's h11 protocol, with a connection closed when its request's headers have not all
    arrived :data:`HTTP_HEADER_TIMEOUT_S` after it opened (or after its last response), and
    beyond :data:`MAX_HTTP_CONNECTIONS` the oldest connection still waiting for its headers closed
    (the new one, when every other is serving a request): half-sent requests cannot hold the
    server's file descriptors, nor can anyone without the token keep its holder out by holding
    connections open (uvicorn times out only idle keep-alive connections)."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class BoundedH11Protocol(H11Protocol):
        header_timer: asyncio.TimerHandle | None = None
        opened = 0.0

        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self.opened = time.monotonic()
            self.arm()
            if len(self.connections) > MAX_HTTP_CONNECTIONS:
                idle = [c for c in self.connections if c is not self and isinstance(c, BoundedH11Protocol)
                        and c.waiting_for_headers() and not c.transport.is_closing()]
                (min(idle, key=lambda c: c.opened).transport if idle else transport).close()

        def data_received(self, data: bytes) -> None:
            if self.waiting_for_headers() and self.header_timer is None:
                self.arm()
            super().data_received(data)
            if not self.waiting_for_headers():
                self.disarm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self.arm()  # the next request's headers are timed from here (and keep-alive as uvicorn does)

        def connection_lost(self, exc: Exception | None) -> None:
            self.disarm()
            super().connection_lost(exc)

        def waiting_for_headers(self) -> bool:
            return self.cycle is None or self.cycle.response_complete

        def arm(self) -> None:
            self.disarm()
            self.header_timer = self.loop.call_later(HTTP_HEADER_TIMEOUT_S, self.headers_too_slow)

        def disarm(self) -> None:
            if self.header_timer is not None:
                self.header_timer.cancel()
                self.header_timer = None

        def headers_too_slow(self) -> None:
            self.header_timer = None
            if self.waiting_for_headers() and not self.transport.is_closing():
                self.transport.close()

    return BoundedH11Protocol
