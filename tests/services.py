"""Real services for the tests that need them: Redis servers started from the system's binary.

A test that needs a service asks :func:`require_binary` or the ``redis_url`` fixture. When the
service cannot be had, the test fails under ``CI=true`` (CI installs and starts it) and skips
with the reason elsewhere.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest


def under_ci() -> bool:
    return os.environ.get("CI", "").lower() in {"1", "true", "yes"}


def unavailable(reason: str) -> None:
    """Fail under CI, skip elsewhere: a missing service is a broken CI machine, not a pass."""
    if under_ci():
        pytest.fail(f"{reason} (CI=true: CI must provide it)")
    pytest.skip(reason)


def require_binary(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        unavailable(f"{name} is not installed (apt-get install redis-server)")
    assert path is not None
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RedisServer:
    """One ``redis-server`` process on a loopback port, which a test may kill and start again."""

    def __init__(self, directory: Path, port: int | None = None, *extra: str) -> None:
        self.binary = require_binary("redis-server")
        self.directory = directory
        self.directory.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.extra = extra
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        args = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        args += ["--dir", str(self.directory), *self.extra]
        self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as conn:
                    conn.sendall(b"PING\r\n")
                    if conn.recv(16).startswith(b"+PONG"):
                        return self
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"redis-server did not answer on port {self.port}")

    def stop(self) -> None:
        """Kill the server at once (SIGKILL): what a crash looks like to a client."""
        if self.process is not None:
            self.process.kill()
            self.process.wait()
            self.process = None


def redis_url_or_unavailable() -> str:
    """The Redis CI started (``KVPOOL_TEST_REDIS_URL``), after checking that it answers."""
    url = os.environ.get("KVPOOL_TEST_REDIS_URL")
    if not url:
        unavailable("KVPOOL_TEST_REDIS_URL is not set (.ci/run starts a Redis and sets it)")
    assert url is not None
    try:
        import redis
    except ImportError:
        unavailable("the redis client is not installed (pip install -e '.[tiers]')")
    try:
        redis.Redis.from_url(url, socket_timeout=2).ping()
    except Exception as exc:  # noqa: BLE001 - any failure to reach it is the same verdict
        unavailable(f"Redis at {url} does not answer: {exc}")
    return url
