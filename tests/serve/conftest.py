"""A live ``kvpool serve`` app in this process: uvicorn on a free port, on a thread of its own.

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


class LiveServer:
    """``app`` served on 127.0.0.1 at a free port until :meth:`stop`."""

    def __init__(self, app: Any) -> None:
        import uvicorn

        from tests.services import free_port

        self.app = app
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.base_url = f"{self.url}/v1"
        self._server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning", access_log=False)
        )
        self._thread = threading.Thread(target=self._server.run, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the test server on port {self.port} did not start")
            time.sleep(0.02)

    @property
    def engine_loop(self) -> Any:
        return self.app.state.server.loop

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(30)
