"""Live runs as resources: ``run://<id>/metrics``, ``run://<id>/log`` and ``run://<id>/status``
tell their subscribers when the run logs a step, changes status or writes a checkpoint.

A run writes its directory, not to the server (it may have started before the server did), so
the runs someone subscribed to are polled: every :data:`POLL_S`, once for all subscribers of a
run, the sizes and mtimes of its files, and its status. Whatever changed within one poll is one
update per URI, so a URI is updated at most ``1 / POLL_S`` times a second. A client subscribes
in the way of its protocol era:

- 2025-11-25: ``resources/subscribe`` / ``resources/unsubscribe``; updates are
  ``notifications/resources/updated`` on its session, until it unsubscribes or the session ends
  (the session's state is ``mcp_server.clients.ClientState``).
- 2026-07-28: ``subscriptions/listen`` naming the URIs in ``resourceSubscriptions``; updates are
  ``ResourceUpdated`` events on the server's ``SubscriptionBus``, which the SDK's listen handler
  delivers, until the stream ends.

Either way at most :data:`MAX_SUBSCRIPTIONS` URIs per session (or listen stream). A ``run://``
URI must name a live resource of a run in the workspace; other URIs (``skill://``) never change:
accepted, never updated.
"""

from __future__ import annotations

import stat

import contextlib
import re
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator, Protocol

import anyio
from mcp.server.context import CallNext, HandlerResult, ServerRequestContext
from mcp.server.subscriptions import ResourceUpdated, SubscriptionBus
from mcp.shared.exceptions import MCPError
from mcp_types import INVALID_PARAMS, EmptyResult, SubscribeRequestParams, UnsubscribeRequestParams

from engine import run_dir as rd
from runner import server_record as sr
from workspace.workspace import RECORD_JSON
from engine.errors import TrainwrightError
from mcp_server import clients
from mcp_server.limits import POLL_S
from sandbox.redact import shown
from workspace.workspace import Workspace

STATUS_RECHECK_S = 2.0  # a supervisor that dies changes no file: its run's status is read this often
MAX_SUBSCRIPTIONS = 32
DELIVERY_S = 2.0  # the longest one subscriber's updates of one poll may take to send
LIVE_URI = re.compile(r"^run://(?P<run_id>[^/]+)/(?P<kind>metrics|log|status)$")
# What each live resource shows, as the parts of a run whose change updates it.
SHOWS = {
    "metrics": {"metrics", "checkpoints", "status"},
    "status": {"metrics", "checkpoints", "status"},
    "log": {"log", "status"},
}


class Subscriber(Protocol):
    uris: Any  # the URIs it follows (a set, or a Counter of listen streams per URI)

    async def updated(self, uris: set[str]) -> None: ...

    async def ended(self, run_id: str, status: str) -> None: ...


@dataclass(frozen=True)
class Observed:
    """What one poll saw of a run."""

    files: dict[str, tuple[int, int] | None]  # part → (size, mtime_ns), None when absent
    status: str
    status_files: tuple[tuple[int, int] | None, ...]  # run.json and the server's record, when status was read
    status_read_at: float


class ListenStreams:
    """The 2026-07-28 subscribers: every open listen stream's URIs, published on the bus."""

    def __init__(self, bus: SubscriptionBus):
        self.bus = bus
        self.uris: Counter[str] = Counter()  # URI → open streams that follow it

    async def updated(self, uris: set[str]) -> None:
        for uri in sorted(uris):
            await self.bus.publish(ResourceUpdated(uri=uri))

    async def ended(self, run_id: str, status: str) -> None:
        """Nothing: at 2026-07-28 log messages answer a request, not a subscription."""


class LiveRuns:
    """The subscriptions of one server and the poll that serves them."""

    def __init__(self, workspace: Workspace, bus: SubscriptionBus):
        self.ws = workspace
        self.listen_streams = ListenStreams(bus)
        self.subscribers: dict[int, Subscriber] = {id(self.listen_streams): self.listen_streams}
        self.observed: dict[str, Observed] = {}
        self._polling = False

    # -- subscribing ---------------------------------------------------------------------------

    async def follow(self, uri: str) -> str | None:
        """Check ``uri``; the run it watches (None: it never changes), observed from now on."""
        match = LIVE_URI.match(uri)
        if match is None:
            if uri.startswith("run://"):
                raise MCPError(INVALID_PARAMS, shown(
                    f"bad_input: {uri[:200]!r} is not a live resource; run://<id>/metrics, "
                    "run://<id>/log and run://<id>/status change as a run goes"))
            return None
        run_id = match["run_id"]
        try:
            self.ws.run_dir(run_id)
        except TrainwrightError as e:
            raise MCPError(INVALID_PARAMS, shown(f"{e.kind}: {e}")) from None
        if run_id not in self.observed:
            observed = await anyio.to_thread.run_sync(self._observe, run_id, None)
            if observed is not None:
                self.observed[run_id] = observed
        return run_id

    async def subscribe(self, ctx: ServerRequestContext[Any, Any], params: SubscribeRequestParams) -> EmptyResult:
        """``resources/subscribe`` (2025-11-25)."""
        state = clients.client_state(ctx.session)
        if params.uri not in state.uris and len(state.uris) >= MAX_SUBSCRIPTIONS:
            raise MCPError(INVALID_PARAMS, f"at most {MAX_SUBSCRIPTIONS} subscriptions per session; "
                           "resources/unsubscribe one first")
        await self.follow(params.uri)
        if id(state) not in self.subscribers:
            self.subscribers[id(state)] = state
            state.on_close.append(lambda: self._drop(id(state)))
        state.uris.add(params.uri)
        return EmptyResult()

    def _drop(self, key: int) -> None:
        self.subscribers.pop(key, None)

    async def unsubscribe(self, ctx: ServerRequestContext[Any, Any], params: UnsubscribeRequestParams) -> EmptyResult:
        """``resources/unsubscribe`` (2025-11-25): no more updates of ``uri`` to this session."""
        clients.client_state(ctx.session).uris.discard(params.uri)
        return EmptyResult()

    async def listen_middleware(self, ctx: ServerRequestContext[Any, Any], call_next: CallNext) -> HandlerResult:
        """Around ``subscriptions/listen`` (2026-07-28): its run URIs are watched while it is open."""
        if ctx.method != "subscriptions/listen":
            return await call_next(ctx)
        notifications = (ctx.params or {}).get("notifications")
        requested = notifications.get("resourceSubscriptions") if isinstance(notifications, dict) else None
        uris = {uri for uri in requested if isinstance(uri, str)} if isinstance(requested, list) else set()
        if len(uris) > MAX_SUBSCRIPTIONS:
            raise MCPError(INVALID_PARAMS, f"at most {MAX_SUBSCRIPTIONS} resource subscriptions per stream "
                           f"({len(uris)} asked); listen to fewer")
        watched = [uri for uri in uris if await self.follow(uri) is not None]
        self.listen_streams.uris.update(watched)
        try:
            return await call_next(ctx)
        finally:
            self.listen_streams.uris.subtract(watched)
            self.listen_streams.uris += Counter()  # drops the URIs no stream follows

    # -- polling -------------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def running(self, _server: Any) -> AsyncIterator[dict[str, Any]]:
        """The server's lifespan: the poll runs while the server does (once, however entered)."""
        if self._polling:
            yield {}
            return
        async with anyio.create_task_group() as tasks:
            self._polling = True
            tasks.start_soon(self._poll_forever)
            try:
                yield {}
            finally:
                self._polling = False
                tasks.cancel_scope.cancel()

    async def _poll_forever(self) -> None:
        while True:
            await anyio.sleep(POLL_S)
            await self.poll()

    async def poll(self) -> None:
        """Look at every watched run once; tell each subscriber what changed."""
        runs = {run_id for s in list(self.subscribers.values()) for _, run_id, _ in _live(s.uris)}
        before = {run_id: self.observed.get(run_id) for run_id in runs}
        now = await anyio.to_thread.run_sync(lambda: {r: self._observe(r, before[r]) for r in runs})
        self.observed = {run_id: seen for run_id, seen in now.items() if seen is not None}
        changed = {run_id: _changes(before[run_id], seen) for run_id, seen in self.observed.items()}
        ended = {run_id: seen.status for run_id, seen in self.observed.items()
                 if "status" in changed[run_id] and seen.status in rd.FINAL_STATUSES}
        for subscriber in list(self.subscribers.values()):
            following = _live(subscriber.uris)
            due = {uri for uri, run_id, kind in following if SHOWS[kind] & changed.get(run_id, set())}
            # A client that reads slowly delays its own updates, not the others' (it misses one).
            with anyio.move_on_after(DELIVERY_S):
                if due:
                    await subscriber.updated(due)
                for run_id in sorted({run_id for _, run_id, _ in following} & set(ended)):
                    await subscriber.ended(run_id, ended[run_id])

    def _observe(self, run_id: str, before: Observed | None) -> Observed | None:
        """A run's files and status (the status read again only when its records changed, or
        after STATUS_RECHECK_S); None when the run is gone."""
        try:
            run_dir = self.ws.run_dir(run_id)
        except TrainwrightError:
            return None
        files = {"metrics": _stat(run_dir / rd.METRICS_JSONL), "log": _stat(run_dir / rd.CONSOLE_LOG),
                 "checkpoints": _stat(run_dir / rd.CHECKPOINTS_DIRNAME)}
        status_files = (_stat(run_dir / rd.RUN_JSON), _stat(self.ws.record_dir(run_id) / RECORD_JSON))
        now = time.monotonic()
        if before is not None and before.status_files == status_files and now - before.status_read_at < STATUS_RECHECK_S:
            return Observed(files, before.status, status_files, before.status_read_at)
        try:
            status: str = sr.known_run(self.ws.root, run_dir).effective_status()
        except (OSError, ValueError):
            status = before.status if before is not None else "unknown"
        return Observed(files, status, status_files, now)


def _live(uris: Any) -> list[tuple[str, str, str]]:
    """(uri, run id, kind) of each live resource among ``uris``."""
    return [(uri, match["run_id"], match["kind"]) for uri in list(uris) if (match := LIVE_URI.match(uri))]


def _stat(path: Path) -> tuple[int, int] | None:
    """Size and time of a run's file or folder; a link (the run may plant one to watch a host
    file) counts as absent."""
    try:
        info = path.stat(follow_symlinks=False)
    except OSError:
        return None
    if stat.S_ISLNK(info.st_mode):
        return None
    return info.st_size, info.st_mtime_ns


def _changes(before: Observed | None, now: Observed) -> set[str]:
    """The parts of a run that changed between two polls (none for a run first seen: that is its baseline)."""
    if before is None:
        return set()
    changed = {part for part, value in now.files.items() if before.files.get(part) != value}
    return changed | ({"status"} if before.status != now.status else set())
