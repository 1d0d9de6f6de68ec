"""What the server keeps per connected client, and the server's own log messages to it.

A 2025-11-25 client has a session (one connection): the level it set with ``logging/setLevel``
and the ``run://`` resources it subscribed to (``mcp_server.live``) last as long as that
connection. A 2026-07-28 client has no session: it opts in to log messages per request (the SDK
sends only those at or above the level the request names) and subscribes with
``subscriptions/listen``.

The server's own messages (a run launched, a run ended, a Hub download's progress) are sent as
``notifications/message`` with the logger name ``trainwright``, through the one sanitiser
(``sandbox.redact.shown``), like every other text the server shows.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, get_args

import anyio
from mcp.server.context import ServerRequestContext
from mcp.server.session import ServerSession
from mcp_types import EmptyResult, LoggingLevel, SetLevelRequestParams
from mcp_types.version import MODERN_PROTOCOL_VERSIONS

from sandbox.redact import shown

LEVELS: tuple[LoggingLevel, ...] = get_args(LoggingLevel)  # severity ascending (RFC 5424)
DEFAULT_LEVEL: LoggingLevel = "info"  # until the client sets one
LOGGER = "trainwright"
_STATE_KEY = "trainwright"

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class ClientState:
    """One 2025-11-25 session: its log level and subscriptions, and how to reach the client."""

    session: ServerSession  # the latest request's: its connection's channel reaches the client
    log_level: LoggingLevel = DEFAULT_LEVEL
    uris: set[str] = field(default_factory=set)  # the resources it subscribed to
    on_close: list[Callable[[], None]] = field(default_factory=list)

    def close(self) -> None:
        for callback in self.on_close:
            callback()

    async def updated(self, uris: set[str]) -> None:
        for uri in sorted(uris):
            try:
                await self.session.send_resource_updated(uri)
            except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                return  # the session is ending: its connection's teardown calls close()

    async def ended(self, run_id: str, status: str) -> None:
        await log(self.session, ENDED_LEVELS.get(status, "info"), f"run {run_id} {status}")


ENDED_LEVELS: dict[str, LoggingLevel] = {"completed": "info", "stopped": "notice", "failed": "error"}


def client_state(session: ServerSession) -> ClientState:
    """The state of the session ``session`` belongs to, made on its first request.

    The SDK hands a request handler a per-request ``ServerSession``; the connection behind it,
    whose ``state`` and ``exit_stack`` the SDK provides for a handler's per-connection data and
    teardown, it keeps as a private attribute. This is the one place that reads it.
    """
    connection = session._connection
    state = connection.state.get(_STATE_KEY)
    if state is None:
        state = connection.state[_STATE_KEY] = ClientState(session)
        connection.exit_stack.callback(state.close)
    else:
        state.session = session
    return state


async def set_level(ctx: ServerRequestContext[Any, Any], params: SetLevelRequestParams) -> EmptyResult:
    """``logging/setLevel`` (2025-11-25): the server's messages below ``level`` are not sent."""
    client_state(ctx.session).log_level = params.level
    return EmptyResult()


async def log(session: ServerSession | None, level: LoggingLevel, text: str) -> None:
    """Send one of the server's own messages to the client, if it wants ``level``; redacted."""
    if session is None:
        return
    modern = session.protocol_version in MODERN_PROTOCOL_VERSIONS  # the SDK filters by the request
    if not modern and LEVELS.index(level) < LEVELS.index(client_state(session).log_level):
        return
    try:
        await session.send_log_message(level, shown(text), logger=LOGGER)
    except (anyio.BrokenResourceError, anyio.ClosedResourceError):
        logger.debug("log message to a client gone away: dropped")
