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

import hmac
import json
import os
import secrets
import sys
from pathlib import Path
from typing import Any, Awaitable, Callable, Mapping

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
    uvicorn.Server(uvicorn.Config(app, host=HOST, port=port, log_level="warning")).run()
