"""Headless Chromium over the DevTools protocol, for tests of pages in a real browser.

:class:`Browser` starts Chromium with ``--headless --remote-debugging-port=0`` in a profile of
its own, reads the DevTools address it prints and speaks the protocol over a websocket
(``websockets``' synchronous client). :meth:`Browser.open` gives a :class:`Page` that evaluates
JavaScript in any of its frames, also a sandboxed iframe of an opaque origin that Chromium
runs in a process of its own (reached through an auto-attached session), and takes
screenshots. Chromium comes from the distribution (``make browser``: Debian's ``chromium``);
:func:`find_chromium` says where, or None.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Callable

CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
# Set to a browser's path to choose it; set empty to run as if there were none.
CHROMIUM_VARIABLE = "TRAINWRIGHT_CHROMIUM"
START_TIMEOUT_S = 30
LISTENING = re.compile(r"DevTools listening on (ws://\S+)")
ABSENT = "__absent__"


class DevToolsError(RuntimeError):
    """The browser answered a command with an error, or did not answer in time."""


def find_chromium() -> str | None:
    """The Chromium to drive: ``$TRAINWRIGHT_CHROMIUM`` if set, else the first on PATH."""
    chosen = os.environ.get(CHROMIUM_VARIABLE)
    if chosen is not None:
        return shutil.which(chosen) if chosen else None
    return next((path for path in map(shutil.which, CANDIDATES) if path), None)


class Browser:
    """One headless Chromium and its DevTools connection; a context manager."""

    def __init__(self, executable: str, profile: Path, width: int = 900, height: int = 720):
        self.executable = executable
        self.profile = profile
        self.size = (width, height)
        self.process: subprocess.Popen[str] | None = None
        self.stderr: list[str] = []
        self._socket: Any = None
        self._stack = ExitStack()
        self._next_id = 0
        self._answers: dict[int, dict[str, Any]] = {}
        self._attached: list[str] = []  # sessions of frames attached since the last command
        self.parents: dict[str, str | None] = {}  # session: the session it was attached from
        self.contexts: dict[tuple[str | None, int], dict[str, Any]] = {}

    def __enter__(self) -> Browser:
        self.start()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def start(self) -> None:
        from websockets.sync.client import connect

        width, height = self.size
        command = [
            self.executable, "--headless", "--disable-gpu", "--no-first-run", "--no-default-browser-check",
            "--disable-background-networking", "--disable-component-update", "--disable-sync",
            "--disable-dev-shm-usage", "--hide-scrollbars", "--mute-audio", f"--window-size={width},{height}",
            f"--user-data-dir={self.profile}", "--remote-debugging-port=0", "about:blank",
        ]
        if os.geteuid() == 0:  # Chromium's own sandbox refuses root
            command.insert(1, "--no-sandbox")
        self.process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.PIPE, text=True, start_new_session=True)
        address = self._devtools_address()
        self._socket = self._stack.enter_context(connect(address, max_size=None, open_timeout=START_TIMEOUT_S))

    def _devtools_address(self) -> str:
        """Read stderr (on a thread, to the end, so the pipe never fills) until the address."""
        assert self.process is not None and self.process.stderr is not None
        found = threading.Event()
        address: list[str] = []

        def read(stream) -> None:
            for line in stream:
                self.stderr.append(line.rstrip())
                match = LISTENING.search(line)
                if match and not address:
                    address.append(match.group(1))
                    found.set()
            found.set()

        threading.Thread(target=read, args=(self.process.stderr,), daemon=True).start()
        found.wait(START_TIMEOUT_S)
        if not address:
            self.close()
            raise DevToolsError("Chromium did not start:\n" + "\n".join(self.stderr[-20:]))
        return address[0]

    def close(self) -> None:
        if self._socket is not None:
            try:
                self.send("Browser.close", timeout=5)
            except Exception:  # already gone
                pass
            self._stack.close()
            self._socket = None
        if self.process is not None:
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)  # its own session: Chromium's helpers
                self.process.wait(timeout=10)
            self.process = None

    # -- the protocol ---------------------------------------------------------------------------

    def send(self, method: str, params: dict[str, Any] | None = None, session: str | None = None,
             timeout: float = 30) -> dict[str, Any]:
        """One command; its result. Events read meanwhile are kept (contexts, attached frames)."""
        self._next_id += 1
        number = self._next_id
        message: dict[str, Any] = {"id": number, "method": method, "params": params or {}}
        if session is not None:
            message["sessionId"] = session
        self._socket.send(json.dumps(message))
        deadline = time.monotonic() + timeout
        while number not in self._answers:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise DevToolsError(f"{method}: no answer within {timeout} s")
            try:
                raw = self._socket.recv(timeout=remaining)
            except TimeoutError:
                continue
            self._receive(json.loads(raw))
        answer = self._answers.pop(number)
        if "error" in answer:
            raise DevToolsError(f"{method}: {answer['error'].get('message')}")
        result: dict[str, Any] = answer.get("result", {})
        self._enable_attached()
        return result

    def _receive(self, message: dict[str, Any]) -> None:
        if "id" in message:
            self._answers[message["id"]] = message
            return
        method, params, session = message.get("method"), message.get("params", {}), message.get("sessionId")
        if method == "Runtime.executionContextCreated":
            context = params["context"]
            self.contexts[(session, context["id"])] = context
        elif method == "Runtime.executionContextDestroyed":
            self.contexts.pop((session, params.get("executionContextId")), None)
        elif method == "Runtime.executionContextsCleared":
            for key in [key for key in self.contexts if key[0] == session]:
                del self.contexts[key]
        elif method == "Target.attachedToTarget":
            self.parents[params["sessionId"]] = session
            self._attached.append(params["sessionId"])
        elif method == "Target.detachedFromTarget":
            for key in [key for key in self.contexts if key[0] == params.get("sessionId")]:
                del self.contexts[key]

    def _enable_attached(self) -> None:
        """A frame in a process of its own: follow its contexts, and its own child frames."""
        while self._attached:
            session = self._attached.pop(0)
            try:
                self.send("Runtime.enable", session=session)
                self.send("Target.setAutoAttach", {"autoAttach": True, "waitForDebuggerOnStart": False,
                                                   "flatten": True}, session=session)
            except DevToolsError:  # detached again meanwhile
                pass

    def open(self, url: str) -> Page:
        """A new tab at ``url``."""
        target = self.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = self.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        width, height = self.size
        self.send("Page.enable", session=session)
        self.send("Runtime.enable", session=session)
        self.send("Emulation.setDeviceMetricsOverride",
                  {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False}, session=session)
        self.send("Target.setAutoAttach", {"autoAttach": True, "waitForDebuggerOnStart": False, "flatten": True},
                  session=session)
        self.send("Page.navigate", {"url": url}, session=session)
        return Page(self, session, target)

    def within(self, session: str | None, root: str) -> bool:
        """Whether ``session`` is ``root`` or a frame attached under it."""
        while session is not None:
            if session == root:
                return True
            session = self.parents.get(session)
        return False


class Page:
    """A tab: JavaScript in its frames, and pictures of it."""

    def __init__(self, browser: Browser, session: str, target: str):
        self.browser = browser
        self.session = session
        self.target = target

    def close(self) -> None:
        self.browser.send("Target.closeTarget", {"targetId": self.target})

    def evaluate(self, expression: str, where: str = "true") -> Any:
        """``expression``'s value (JSON) in the first frame of this tab where ``where`` holds,
        or :data:`ABSENT` when no frame has it (yet)."""
        wrapped = f"(() => {{ if (!({where})) return {json.dumps(ABSENT)}; return ({expression}); }})()"
        for (session, context_id), context in list(self.browser.contexts.items()):
            if not context.get("auxData", {}).get("isDefault") or not self.browser.within(session, self.session):
                continue
            try:
                answer = self.browser.send("Runtime.evaluate", {
                    "expression": wrapped, "contextId": context_id, "returnByValue": True, "awaitPromise": True,
                }, session=session)
            except DevToolsError:  # the context went away meanwhile
                continue
            if "exceptionDetails" in answer:
                raise DevToolsError(f"{expression}: {answer['exceptionDetails'].get('text')} "
                                    f"{answer['result'].get('description', '')}")
            value = answer["result"].get("value")
            if value != ABSENT:
                return value
        return ABSENT

    def wait_for(self, expression: str, check: Callable[[Any], bool], where: str = "true",
                 timeout: float = 60, what: str = "") -> Any:
        """Evaluate ``expression`` until ``check`` accepts its value; that value."""
        deadline = time.monotonic() + timeout
        value: Any = ABSENT
        while time.monotonic() < deadline:
            value = self.evaluate(expression, where)
            if value != ABSENT and check(value):
                return value
            time.sleep(0.1)
            self.browser.send("Runtime.evaluate", {"expression": "0"}, session=self.session)  # read events
        raise AssertionError(f"{what or expression}: not so within {timeout} s; last value {value!r}")

    def screenshot(self, path: Path | str) -> int:
        """A PNG of the tab as shown (its frames composited); its size in bytes."""
        data = base64.b64decode(self.browser.send("Page.captureScreenshot", {"format": "png"},
                                                  session=self.session)["data"])
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_bytes(data)
        return len(data)
