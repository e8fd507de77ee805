"""A shared block index whose server may fail: requests are then routed by load, and the index heals after.

:class:`GuardedIndex` wraps a :class:`~kvpool.router.index.BlockIndex` kept on another
server (Redis). When a call fails with one of the server's errors:

* a lookup answers "nothing cached anywhere", so the request is routed by load alone
  (never a 500); a count answers 0; a write is lost;
* the first failure of an outage is logged in one line, and the outage counted; the
  calls it fails or skips are counted in :attr:`GuardedIndex.failures`;
* while the outage lasts the server is tried again at most once per retry interval
  (doubling from ``retry_s`` to ``max_retry_s``), so a server that hangs costs a request
  at most one socket timeout per interval instead of one per call;
* the first call that succeeds ends the outage (one line logged): the entries of every
  replica whose writes were lost are cleared, since a lost removal could leave a claim
  that is no longer true, and ``on_recovered`` is told which replicas those were (the
  router has their event feeds start over, catching up from their replay buffers).

All of it runs on the router's event loop, so nothing here locks.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar

from kvpool.checks import counted
from kvpool.router.index import WHOLE, BlockIndex, ExternalHash, Group, HeldMedia, Medium, RedisIndex

__all__ = ["GuardedIndex", "guarded"]

log = logging.getLogger("kvpool.route")

T = TypeVar("T")


def guarded(index: BlockIndex) -> BlockIndex:
    """``index`` as the router uses it: a Redis one guarded against its server's failures."""
    if isinstance(index, RedisIndex):
        import redis

        return GuardedIndex(index, (redis.RedisError, OSError))
    return index


class GuardedIndex:
    """``inner`` with its server's failures (``errors``) turned into load-only routing (see the module)."""

    def __init__(
        self,
        inner: BlockIndex,
        errors: tuple[type[BaseException], ...],
        *,
        retry_s: float = 1.0,
        max_retry_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.inner = inner
        self.errors = errors
        self.retry_s = retry_s
        self.max_retry_s = max_retry_s
        self.failures = 0  # calls failed or skipped during outages
        self.outages = 0
        self.on_recovered: Callable[[set[str]], None] | None = None
        self._clock = clock
        self._down_since: float | None = None
        self._retry_at = 0.0
        self._delay = retry_s
        self._lost: set[str] = set()  # replicas whose writes were lost in this outage

    @property
    def available(self) -> bool:
        """Whether the last call reached the server."""
        return self._down_since is None

    def _call(self, call: Callable[[], T], fallback: T, replica: str | None = None) -> T:
        now = self._clock()
        try:
            if self._down_since is not None:
                if now < self._retry_at:
                    self.failures += 1
                    if replica is not None:
                        self._lost.add(replica)
                    return fallback
                for lost in sorted(self._lost):  # before anything is read: claims a lost removal left
                    self.inner.clear(lost)
            result = call()
        except self.errors as exc:
            self._fail(now, exc, replica)
            return fallback
        if self._down_since is not None:
            self._recover(now)
        return result

    def _fail(self, now: float, exc: BaseException, replica: str | None) -> None:
        self.failures += 1
        if replica is not None:
            self._lost.add(replica)
        if self._down_since is None:
            self.outages += 1
            self._down_since = now
            self._delay = self.retry_s
            log.warning("the block index does not answer (%s): routing by load until it does", exc)
        else:
            self._delay = min(2 * self._delay, self.max_retry_s)
        self._retry_at = now + self._delay

    def _recover(self, now: float) -> None:
        assert self._down_since is not None
        lost, self._lost = self._lost, set()
        log.warning(
            "the block index answers again after %.1f s; %s failed in all; %s entries are rebuilt",
            now - self._down_since,
            counted(self.failures, "call"),
            "1 replica's" if len(lost) == 1 else f"{len(lost)} replicas'",
        )
        self._down_since = None
        if self.on_recovered is not None and lost:
            self.on_recovered(lost)

    def store(self, replica: str, hashes: Iterable[ExternalHash], medium: Medium = None, group: Group = WHOLE) -> None:
        self._call(lambda: self.inner.store(replica, hashes, medium, group), None, replica)

    def remove(self, replica: str, hashes: Iterable[ExternalHash], medium: Medium = None, group: Group = WHOLE) -> None:
        self._call(lambda: self.inner.remove(replica, hashes, medium, group), None, replica)

    def clear(self, replica: str) -> None:
        self._call(lambda: self.inner.clear(replica), None, replica)

    def match(self, hashes: Sequence[ExternalHash], replicas: Sequence[str]) -> list[int]:
        return self._call(lambda: self.inner.match(hashes, replicas), [0] * len(replicas))

    def match_media(self, hashes: Sequence[ExternalHash], replicas: Sequence[str]) -> list[HeldMedia]:
        return self._call(lambda: self.inner.match_media(hashes, replicas), [() for _ in replicas])

    def num_blocks(self, replica: str) -> int:
        return self._call(lambda: self.inner.num_blocks(replica), 0)

    def limit(self, replica: str, num_blocks: int | None) -> None:
        self.inner.limit(replica, num_blocks)

    def figures(self) -> dict[str, object]:
        return {**self.inner.figures(), "available": self.available, "outages": self.outages, "failures": self.failures}
