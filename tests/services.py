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
    """A TCP port free a moment ago, for the one server that cannot bind port 0 itself: Redis over TCP.

    ``redis-server --port 0`` turns TCP off rather than letting the OS choose, so the Redis
    tests that need TCP (TLS, a password URL, a cluster) take one here and race for it; every
    other Redis listens on a unix socket of its test's own (:class:`RedisServer`), and every
    other server a test starts binds port 0 and reads its port back.
    """
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RedisServer:
    """One ``redis-server`` process, which a test may kill and start again at the same address.

    By default it listens on a unix socket in ``directory`` and on no TCP port: a path of the
    test's own, which nothing else can take, known before the server starts (``url``).
    ``tcp=True`` listens on a loopback TCP port instead (``port``, or one from :func:`free_port`),
    for what a unix socket cannot carry: TLS, a cluster, a ``redis://`` URL.
    """

    def __init__(self, directory: Path, port: int | None = None, *extra: str, tcp: bool = False) -> None:
        self.binary = require_binary("redis-server")
        self.directory = directory
        self.directory.mkdir(parents=True, exist_ok=True)
        self.tcp = tcp or port is not None
        self.port = (port or free_port()) if self.tcp else 0
        self.socket_path = self.directory / "redis.sock"
        self.extra = extra
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0" if self.tcp else f"unix://{self.socket_path}"

    def _answers(self) -> bool:
        try:
            if self.tcp:
                conn = socket.create_connection(("127.0.0.1", self.port), timeout=0.2)
            else:
                conn = socket.socket(socket.AF_UNIX)
                conn.settimeout(0.2)
                conn.connect(str(self.socket_path))
            with conn:
                conn.sendall(b"PING\r\n")
                return conn.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def start(self) -> RedisServer:
        args = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        if not self.tcp:
            args += ["--unixsocket", str(self.socket_path), "--unixsocketperm", "700"]
        args += ["--dir", str(self.directory), *self.extra]
        self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self._answers():
                return self
            if self.process.poll() is not None:
                break
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"redis-server did not answer at {self.url}")

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
