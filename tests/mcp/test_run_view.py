"""The MCP App view of a run (mcp_server/run_view.py), in a real browser.

Headless Chromium (tests/mcp/browser.py) opens a test host page (run_view_host.html) that
speaks the MCP Apps protocol to the view in a sandboxed iframe and relays the view's tool calls,
through a small HTTP bridge in this file, to an in-process MCP client session of the real
server on a real workspace, whose runs are real runs of a script (scripts/logged_steps.py):
the view draws a finished run, follows a live one until it ends, and shows a failed run's
error as text; one slow test views a run of the causal_lm template (steps of max_steps, speed). Set TRAINWRIGHT_RUN_VIEW_SCREENSHOT=PATH to keep a picture of a finished run's
view. The browser tests skip with the reason where Chromium is not installed (``make browser``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Iterator
from urllib.parse import urlencode, urlsplit

import pytest
from anyio.from_thread import start_blocking_portal
from mcp import Client
from mcp.client import advertise
from mcp.server.apps import APP_MIME_TYPE, EXTENSION_ID
from mcp.shared.exceptions import MCPError

from mcp_server import run_view
from mcp_server.limits import MAX_TAIL_RECORDS
from mcp_server.server import build_server
from tests.mcp.browser import Browser, Page, find_chromium
from tests.mcp.conftest import SHORT_RUN, ToolSession, closing_cleanly, git, tiny_config
from tests.support import untimed

# The server's log messages are of the 2025-11-25 era, which the SDK marks deprecated.
pytestmark = pytest.mark.filterwarnings("ignore::mcp.shared.exceptions.MCPDeprecationWarning")

HOST_PAGE = Path(__file__).with_name("run_view_host.html")
SCRIPT = Path(__file__).parent / "scripts" / "logged_steps.py"
SCREENSHOT_VARIABLE = "TRAINWRIGHT_RUN_VIEW_SCREENSHOT"
IN_VIEW = "document.body && document.body.dataset.app === 'trainwright-run'"
IN_HOST = "typeof window.hostLog !== 'undefined'"
VIEW_STATE = """({
  runId: document.getElementById('run-id').textContent,
  status: document.getElementById('status').textContent,
  statusKind: document.getElementById('status').dataset.status,
  step: document.getElementById('step').textContent,
  loss: document.getElementById('loss').textContent,
  tokensPerS: document.getElementById('tokens-per-s').textContent,
  speed: document.getElementById('speed').textContent,
  eta: document.getElementById('eta').textContent,
  points: Number(document.getElementById('chart').dataset.points),
  circles: [...document.querySelectorAll('#chart circle.point')].map(c => [Number(c.getAttribute('cx')), Number(c.getAttribute('cy'))]),
  curve: document.querySelector('#chart path.curve')?.getAttribute('d') ?? null,
  failureShown: !document.getElementById('failure').hidden,
  error: document.getElementById('error').textContent,
  console: document.getElementById('console').textContent,
  note: document.getElementById('note').textContent,
  elements: document.querySelectorAll('*').length,
  injected: document.body.dataset.injected ?? null,
})"""
# The view's own relayed calls, as the host saw them.
RELAYED = "window.relayed.map(r => r.params)"
FAIL_MESSAGE = 'boom <img src=x onerror="document.body.dataset.injected=1"><b id="injected">bold</b>'


# -- the server, its runs, and the bridge the host page reaches it by ------------------------------


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("run-view-workspace")


@pytest.fixture(scope="module")
def session(workspace) -> Iterator[ToolSession]:
    """A client of the real server that declares MCP Apps, as a host that renders them does."""
    client = Client(build_server(workspace), extensions=[advertise(EXTENSION_ID, {"mimeTypes": [APP_MIME_TYPE]})])
    with start_blocking_portal() as portal:
        with closing_cleanly(portal.wrap_async_context_manager(client)) as connected:
            shutil.copyfile(SCRIPT, workspace / "logged_steps.py")
            git(workspace, "add", "logged_steps.py")
            git(workspace, "commit", "-q", "-m", "a script that logs steps")
            yield ToolSession(portal, connected, "memory")


class Bridge:
    """HTTP for the host page: GET /host.html, and POST /mcp ``{method, params}`` answered by the
    MCP session (tools/list, tools/call, resources/read) as ``{result}`` or ``{error}``."""

    def __init__(self, session: ToolSession):
        self.session = session
        bridge = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if urlsplit(self.path).path != "/host.html":
                    self.send_error(404)
                    return
                self.reply(HOST_PAGE.read_bytes(), "text/html; charset=utf-8")

            def do_POST(self) -> None:
                request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                answer = bridge.answer(request["method"], request.get("params") or {})
                self.reply(json.dumps(answer).encode(), "application/json")

            def reply(self, body: bytes, content_type: str) -> None:
                self.send_response(200)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:  # quiet
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def answer(self, method: str, params: dict[str, Any]) -> dict[str, Any]:
        portal, client = self.session.portal, self.session.client
        try:
            if method == "tools/list":
                result = portal.call(client.list_tools)
            elif method == "tools/call":
                result = portal.call(lambda: client.call_tool(params["name"], params.get("arguments") or {}))
            elif method == "resources/read":
                result = portal.call(client.read_resource, params["uri"])
            else:
                return {"error": {"code": -32601, "message": f"the bridge does not relay {method}"}}
        except MCPError as e:
            return {"error": {"code": e.error.code, "message": e.error.message}}
        return {"result": result.model_dump(mode="json", by_alias=True, exclude_none=True)}

    def host_url(self, tool: str, **arguments: Any) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}/host.html?" + urlencode({"tool": tool, "args": json.dumps(arguments)})

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def bridge(session) -> Iterator[Bridge]:
    bridge = Bridge(session)
    yield bridge
    bridge.close()


@pytest.fixture(scope="module")
def browser(tmp_path_factory) -> Iterator[Browser]:
    executable = find_chromium()
    if executable is None:
        pytest.skip("Chromium is not installed (`make browser` installs Debian's chromium): "
                    "the run view is tested in a real browser")
    with Browser(executable, tmp_path_factory.mktemp("chromium-profile")) as browser:
        yield browser


@pytest.fixture()
def open_view(bridge, browser):
    """Open the test host in a new tab on a tool call (``open_view("get_run", run_id=...)``);
    the tabs close after the test."""
    pages: list[Page] = []

    def open_tab(tool: str, **arguments: Any) -> Page:
        pages.append(browser.open(bridge.host_url(tool, **arguments)))
        return pages[-1]

    yield open_tab
    for page in pages:
        page.close()


def launch(session: ToolSession, *args: str) -> str:
    return session.ok("launch_run", recipe="logged_steps.py", args=list(args))["run_id"]


def view(page: Page, check, what: str, timeout: float = 60) -> dict[str, Any]:
    """The view's state, once ``check`` accepts it."""
    return page.wait_for(VIEW_STATE, check, where=IN_VIEW, timeout=timeout, what=what)


def vertices(curve: str) -> list[tuple[float, float]]:
    return [(float(x), float(y)) for x, y in re.findall(r"[ML](-?[\d.]+) (-?[\d.]+)", curve)]


# -- without a browser: the binding ----------------------------------------------------------------


def test_get_run_and_wait_run_point_to_the_view_which_the_server_serves_as_an_mcp_app(session):
    tools = session.tools()
    bound = {name: tool.meta for name, tool in tools.items() if tool.meta}
    assert bound == {"get_run": {"ui": {"resourceUri": "ui://trainwright/run"}},
                     "wait_run": {"ui": {"resourceUri": "ui://trainwright/run"}}}
    assert session.client.server_capabilities.extensions == {EXTENSION_ID: {}, "io.modelcontextprotocol/tasks": {}}
    (contents,) = session.portal.call(session.client.read_resource, run_view.RESOURCE_URI).contents
    assert contents.mime_type == APP_MIME_TYPE
    assert contents.text == (Path(run_view.__file__).with_name("run_view.html")).read_text()
    assert contents.meta == {"ui": {"prefersBorder": True}}  # no origins asked for: the default CSP
    assert "ui://trainwright/run" in session.resources()
    # Self-contained, and run data never parsed as markup.
    assert re.findall(r"\b(?:src|href)\s*=|@import|url\(", contents.text) == []
    assert re.findall(r"innerHTML|outerHTML|insertAdjacentHTML|document\.write", contents.text) == []


def test_a_2025_11_25_client_sees_the_same_binding_where_that_era_has_no_extensions_capability(workspace):
    async def main() -> tuple[str, Any, dict[str, Any], str | None]:
        apps = advertise(EXTENSION_ID, {"mimeTypes": [APP_MIME_TYPE]})
        async with Client(build_server(workspace), mode="legacy", extensions=[apps]) as client:
            tools = (await client.list_tools()).tools
            (contents,) = (await client.read_resource(run_view.RESOURCE_URI)).contents
            return (client.protocol_version, client.server_capabilities.extensions,
                    {tool.name: tool.meta for tool in tools if tool.meta}, contents.mime_type)

    with start_blocking_portal() as portal:
        version, extensions, bound, mime_type = portal.call(main)
    assert version == "2025-11-25" and extensions is None  # not in that revision's capabilities
    assert bound == {name: run_view.TOOL_META for name in ("get_run", "wait_run")} and mime_type == APP_MIME_TYPE


def test_the_text_result_is_complete_for_a_client_without_apps(session, workspace):
    run_id = launch(session, "--steps", "2")
    with_apps = session.wait_for_run(run_id)
    with start_blocking_portal() as portal:
        with closing_cleanly(portal.wrap_async_context_manager(Client(build_server(workspace)))) as plain:
            result = portal.call(lambda: plain.call_tool("get_run", {"run_id": run_id}))
    assert json.loads(result.content[0].text) == result.structured_content
    assert {key: value for key, value in result.structured_content.items() if key != "eta_s"} == {
        key: value for key, value in with_apps.items() if key != "eta_s"}
    assert untimed(result.structured_content["latest"]) == {"step": 2, "loss": 2.4, "tokens_per_s": 1002.0}


# -- in the browser --------------------------------------------------------------------------------


def test_the_view_draws_a_finished_run_its_loss_points_tokens_per_s_and_status(session, open_view):
    run_id = launch(session, "--steps", "5")
    assert session.wait_for_run(run_id)["status"] == "completed"
    page = open_view("get_run", run_id=run_id)
    state = view(page, lambda s: s["status"] == "completed" and s["points"] == 5, "a completed run of 5 points")
    assert (state["runId"], state["statusKind"], state["step"]) == (run_id, "completed", "5")
    assert (state["loss"], state["tokensPerS"]) == ("1.5", "1,005")  # the last record: 3 - 0.3 * 5, 1000 + 5
    assert not state["failureShown"] and state["error"] == ""
    # Five points left to right, each lower than the last (the loss falls by 0.3 a step).
    assert len(state["circles"]) == 5 and vertices(state["curve"]) == [tuple(c) for c in state["circles"]]
    xs, ys = zip(*state["circles"])
    assert list(xs) == sorted(xs) and list(ys) == sorted(ys) and len(set(xs)) == 5
    steps_apart = [round(b - a, 1) for a, b in zip(ys, ys[1:])]
    assert max(steps_apart) - min(steps_apart) <= 0.2  # a straight line: equal drops

    host = page.evaluate("({log: window.hostLog, init: window.viewInitialize})", where=IN_HOST)
    methods = [(m["to"], m["method"]) for m in host["log"] if m["method"]]
    assert methods[0] == ("host", "ui/initialize")
    assert methods.index(("host", "ui/notifications/initialized")) < methods.index(("view", "ui/notifications/tool-input"))
    assert ("view", "ui/notifications/tool-result") in methods
    assert host["init"]["protocolVersion"] == "2026-01-26" and host["init"]["appInfo"]["name"] == "trainwright-run-view"
    time.sleep(2.5)  # longer than the view's poll: an ended run is read once, then no more
    assert page.evaluate(RELAYED, where=IN_HOST) == [
        {"name": "get_run", "arguments": {"run_id": run_id}},
        {"name": "tail_metrics", "arguments": {"run_id": run_id, "n": MAX_TAIL_RECORDS, "follow_resumes": True}},
    ]
    screenshot = os.environ.get(SCREENSHOT_VARIABLE)
    if screenshot:
        assert page.screenshot(screenshot) > 10_000


def test_the_view_follows_a_live_run_step_by_step_until_it_ends(session, open_view, workspace):
    run_id = launch(session, "--steps", "6", "--hold-after", "3")
    assert session.ok("wait_run", run_id=run_id, until_step=3, timeout_s=60)["reason"] == "reached_step"
    page = open_view("wait_run", run_id=run_id, until_step=3, timeout_s=30)
    live = view(page, lambda s: s["points"] == 3, "3 points of a live run")
    assert (live["status"], live["step"], live["loss"]) == ("running", "3", "2.1")
    assert not live["failureShown"]
    (workspace / "runs" / run_id / "go").touch()  # the script logs steps 4-6 and ends
    ended = view(page, lambda s: s["status"] == "completed", "the live run's end")
    assert (ended["points"], ended["step"], ended["loss"], ended["tokensPerS"]) == (6, "6", "1.2", "1,006")
    assert vertices(ended["curve"])[:3] != vertices(live["curve"])  # rescaled to the new steps
    relayed = page.evaluate(RELAYED, where=IN_HOST)
    tails = [call["arguments"].get("after_step") for call in relayed if call["name"] == "tail_metrics"]
    assert tails[0] is None and 3 in tails and tails == sorted(tails, key=lambda s: -1 if s is None else s)
    assert sum(call["name"] == "get_run" for call in relayed) >= 2
    time.sleep(2.5)  # the run has ended: no more polls
    assert page.evaluate(RELAYED, where=IN_HOST) == relayed


def test_the_view_shows_a_failed_runs_error_and_console_as_text(session, open_view):
    run_id = launch(session, "--steps", "2", "--fail", FAIL_MESSAGE)
    info = session.wait_for_run(run_id)
    assert info["status"] == "failed" and info["error"]
    page = open_view("get_run", run_id=run_id)
    state = view(page, lambda s: s["status"] == "failed" and s["points"] == 2, "a failed run")
    assert state["statusKind"] == "failed" and state["failureShown"]
    assert state["error"] == info["error"] == "the run's main process exited with status 1; see console.log"
    assert FAIL_MESSAGE in state["console"]  # the run's own words, shown as they are
    assert state["injected"] is None  # never parsed as markup: no handler ran ...
    assert page.evaluate("[document.querySelector('#console img, #injected'), document.images.length]",
                         where=IN_VIEW) == [None, 0]  # ... and no element was made


def test_a_tool_error_is_shown_in_the_view_as_its_text(open_view):
    page = open_view("get_run", run_id="no-such-run")
    state = view(page, lambda s: s["note"] != "", "the tool's error")
    assert state["note"] == ("Error executing tool get_run: not_found: no run 'no-such-run' in this workspace; "
                             "list_runs shows the runs")
    assert (state["status"], state["points"], state["failureShown"]) == ("–", 0, False)


def test_a_long_run_shows_its_latest_records_and_says_the_rest_are_left_out(session, open_view):
    run_id = launch(session, "--steps", "250")
    assert session.wait_for_run(run_id)["status"] == "completed"
    tail = session.ok("tail_metrics", run_id=run_id, n=MAX_TAIL_RECORDS, follow_resumes=True)
    assert tail["truncated"] and tail["records"][-1]["step"] == 250  # more than one read returns
    page = open_view("get_run", run_id=run_id)
    state = view(page, lambda s: s["status"] == "completed" and s["points"] > 0, "a long completed run")
    assert state["points"] == len(tail["records"]) and state["step"] == "250"
    assert state["note"] == f"records left out: the view reads at most {MAX_TAIL_RECORDS} at a time"
    assert len(vertices(state["curve"])) == len(tail["records"]) and state["circles"] == []  # a line only


@pytest.mark.slow
def test_the_view_of_a_recipe_run_shows_the_engines_steps_of_max_steps_tokens_per_s_and_speed(session, open_view):
    recipe = session.ok("scaffold_recipe", template="causal_lm", name="lm", config=tiny_config(**SHORT_RUN))["path"]
    run_id = session.ok("launch_run", recipe=recipe)["run_id"]
    info = session.wait_for_run(run_id)
    assert info["status"] == "completed" and info["step"] == info["max_steps"] == 6
    page = open_view("get_run", run_id=run_id)
    state = view(page, lambda s: s["status"] == "completed" and s["points"] == 6, "a completed recipe run")
    assert state["step"] == "6 / 6" and state["speed"] == info["speed"] and state["eta"] == "–"
    rate = info["latest"]["tokens_per_s"]
    assert state["tokensPerS"] == f"{rate:,.0f}" and state["loss"] == f"{info['latest']['loss']:.4g}"


def test_finite_extreme_losses_are_left_out_of_the_curve_and_said_so(open_view, workspace):
    """A run may log any finite float: ±1e308 made the curve's coordinates NaN. They are not drawn,
    the note says how many, and the rest of the curve is drawn as usual."""
    from tests.sandbox.helpers import fake_run

    run_dir = fake_run(workspace, "extreme", steps=0, checkpoints=())
    losses = [3.0, 1e308, 2.5, -1e308, 2.0, 1.5]
    with open(run_dir / "metrics.jsonl", "w") as f:
        f.writelines(json.dumps({"step": step, "loss": loss}) + "\n" for step, loss in enumerate(losses, 1))
    page = open_view("get_run", run_id="extreme")
    state = view(page, lambda s: s["points"] == 4 and s["note"] != "", "the finite losses drawn")
    assert state["note"] == "2 loss value(s) beyond ±1e15 not drawn"
    assert len(state["circles"]) == 4 and "NaN" not in state["curve"]
    ys = [y for _, y in state["circles"]]
    assert ys == sorted(ys)  # 3.0, 2.5, 2.0, 1.5: each lower on the page than the last
