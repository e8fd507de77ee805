"""Headless Chromium over the DevTools protocol, on a pipe: open a page, hear its console, ask its DOM.

``--remote-debugging-pipe`` (the transport Puppeteer and Playwright use) makes Chromium read
protocol commands from file descriptor 3 and write replies and events to 4, each message JSON
ended by a NUL byte; no port, no websocket library. :meth:`Chromium.open` navigates a fresh tab
to a page and returns, once its load event fires, every console error, uncaught exception and
error log entry (a resource that failed to load, say) the page produced on the way.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

from tests.services import unavailable

#: A guard against a wedged browser, not a wait: every reply normally comes in well under a second.
REPLY_DEADLINE_S = 60.0


def chromium_binary() -> str:
    """Debian's ``chromium`` (or ``chromium-browser``); skipped where absent, a failure under ``CI=true``."""
    for name in ("chromium", "chromium-browser"):
        path = shutil.which(name)
        if path is not None:
            return path
    unavailable("chromium is not installed (apt-get install chromium)")
    raise AssertionError("unreachable")


class Chromium:
    """One headless browser; use as a context manager."""

    def __init__(self, binary: str, profile: Path) -> None:
        commands_read, self._commands = os.pipe()
        self._replies, replies_write = os.pipe()

        def wire_fds() -> None:  # in the child: the protocol's fixed descriptors, inherited through exec
            # through fresh copies first: a pipe end that already is 3 or 4 would keep its close-on-exec flag
            commands, replies = os.dup(commands_read), os.dup(replies_write)
            os.dup2(commands, 3)
            os.dup2(replies, 4)

        args = ["--headless", "--disable-gpu", "--no-sandbox", "--no-first-run", "--remote-debugging-pipe"]
        self._process = subprocess.Popen(
            [binary, *args, f"--user-data-dir={profile}", "about:blank"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            close_fds=False,  # the pipes' own ends are close-on-exec; 3 and 4, dup2'ed, are inherited
            preexec_fn=wire_fds,
        )
        os.close(commands_read)
        os.close(replies_write)
        self._buffer = b""
        self._next_id = 0
        self.events: list[dict[str, Any]] = []

    def __enter__(self) -> Chromium:
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.send("Browser.close")
        except (OSError, RuntimeError):
            pass
        try:
            self._process.wait(timeout=REPLY_DEADLINE_S)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        os.close(self._commands)
        os.close(self._replies)

    def _message(self) -> dict[str, Any]:
        deadline = time.monotonic() + REPLY_DEADLINE_S
        while b"\0" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._replies], [], [], left)[0]:
                raise RuntimeError(f"chromium sent nothing for {REPLY_DEADLINE_S:g} s")
            chunk = os.read(self._replies, 1 << 16)
            if not chunk:
                raise RuntimeError("chromium closed its protocol pipe")
            self._buffer += chunk
        message, _, self._buffer = self._buffer.partition(b"\0")
        return dict(json.loads(message))

    def send(self, method: str, session: str | None = None, **params: Any) -> dict[str, Any]:
        """Send one command and return its result; the events before the reply go to :attr:`events`."""
        self._next_id += 1
        command: dict[str, Any] = {"id": self._next_id, "method": method, "params": params}
        if session is not None:
            command["sessionId"] = session
        os.write(self._commands, json.dumps(command).encode() + b"\0")
        while True:
            message = self._message()
            if message.get("id") == self._next_id:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return dict(message.get("result", {}))
            self.events.append(message)

    def open(self, url: str) -> tuple[str, list[str]]:
        """Load ``url`` in a new tab; returns its session and the errors it logged while loading."""
        target = self.send("Target.createTarget", url="about:blank")["targetId"]
        session = self.send("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        for domain in ("Runtime", "Log", "Page"):
            self.send(f"{domain}.enable", session)
        self.events.clear()
        self.send("Page.navigate", session, url=url)
        while not any(e.get("method") == "Page.loadEventFired" for e in self.events):
            self.events.append(self._message())
        return session, [text for e in self.events if (text := _error_text(e)) is not None]

    def evaluate(self, session: str, expression: str) -> Any:
        """The value of a JavaScript expression in the page (returned by value)."""
        result = self.send("Runtime.evaluate", session, expression=expression, returnByValue=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"the page threw: {result['exceptionDetails']}")
        return result["result"].get("value")


def _error_text(event: dict[str, Any]) -> str | None:
    """An event's text when it is a console error or warning, an uncaught exception, or an error log entry."""
    params = event.get("params", {})
    method = event.get("method")
    if method == "Runtime.consoleAPICalled" and params.get("type") in {"error", "warning", "assert"}:
        return "console: " + " ".join(str(a.get("value", a.get("description", ""))) for a in params.get("args", []))
    if method == "Runtime.exceptionThrown":
        details = params.get("exceptionDetails", {})
        return "exception: " + str(details.get("exception", {}).get("description", details.get("text")))
    if method == "Log.entryAdded" and params.get("entry", {}).get("level") in {"error", "warning"}:
        return "log: " + str(params["entry"].get("text"))
    return None
