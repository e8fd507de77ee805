"""Fixtures shared by the core tests."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from tests.services import RedisServer


@pytest.fixture
def system_prompt() -> list[int]:
    return list(range(100, 112))


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A live Redis shared by the session: the one CI started, or one started here from the binary."""
    from tests.services import RedisServer, redis_url_or_unavailable

    if os.environ.get("KVPOOL_TEST_REDIS_URL"):
        yield redis_url_or_unavailable()
        return
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A Redis of the test's own, which it may kill and start again."""
    from tests.services import RedisServer

    server = RedisServer(tmp_path / "redis").start()
    try:
        yield server
    finally:
        server.stop()
