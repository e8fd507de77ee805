"""A live ``kvpool serve`` app in this process: uvicorn on a port of its own (bound as port 0), on a thread of its own.

The folder is left out when the engine or the serve extra is not installed.
"""

from __future__ import annotations

import importlib.util
import threading
import time
from typing import Any

_DEPS = ("torch", "transformers", "starlette", "uvicorn", "prometheus_client", "httpx", "openai")
if any(importlib.util.find_spec(name) is None for name in _DEPS):
    collect_ignore_glob = ["test_*.py"]


def bound_port(server: Any) -> int:
    """The port a started ``uvicorn.Server`` listens on: it was given port 0, and the OS chose one."""
    return int(server.servers[0].sockets[0].getsockname()[1])


class LiveServer:
    """``app`` served on 127.0.0.1 until :meth:`stop`, on a port the OS chose when it bound (port 0)."""

    def __init__(self, app: Any) -> None:
        import uvicorn

        self.app = app
        self._server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", access_log=False)
        )
        self._thread = threading.Thread(target=self._server.run, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)
        self.port = bound_port(self._server)
        self.url = f"http://127.0.0.1:{self.port}"
        self.base_url = f"{self.url}/v1"

    @property
    def engine_loop(self) -> Any:
        return self.app.state.server.loop

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(30)
