"""The replicas' loads summed over every router in front of them: a board in Redis that each choice reserves on.

Routers that share one block index (``--index-redis``) each know only the requests they
sent themselves; a burst of one prefix spread over them would find every replica idle in
every router's eyes and pile up. The board holds, per replica, the requests in flight and
the prompt tokens still to prefill (the ``expected-ttft`` rule's queue) of *all* of them.

Each router writes only its own counts, under its own key, as absolute values (never
deltas): a write lost to an outage is mended by the next one, and the board's figure for
a replica is the sum over the routers whose keys are alive. Keys (``P`` the prefix)::

    P:board             SET of router keys that have written
    P:board:<router>    HASH  i:<replica> -> requests in flight, p:<replica> -> prefill pending

A router's key expires ``ttl_s`` after its last write or :meth:`LoadBoard.refresh`, so a
router that dies takes its reservations with it; the reading script drops expired keys
from the set as it meets them.

**Select-and-reserve** is one check-and-set: the router ranks with the totals it read
(:meth:`LoadBoard.totals`), then :meth:`LoadBoard.claim` writes its new counts for the
chosen replica only if every candidate's totals are still those it ranked with, in one
script; when another router reserved in between, the script answers the new totals and
the router ranks again with them. So the rule stays where it is defined
(:mod:`kvpool.routing`), the server only compares numbers, and no choice is made on a
load that was stale when it was reserved.

When the server fails, :meth:`totals` answers None (the router ranks with its own loads),
each failure is counted, and the server is tried again at most once per retry interval
(doubling from ``retry_s`` to ``max_retry_s``); the first call that reaches it again
writes all of this router's counts first, so the board is whole again at once.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from redis import Redis

__all__ = ["CLAIM_TRIES", "BoardTotals", "LoadBoard", "NoBoard", "OwnCounts", "SharedBoard", "board_for", "keep_lease"]

log = logging.getLogger("kvpool.route")

#: Rankings a request may try before it reserves on whatever the board says (a burst under contention).
CLAIM_TRIES = 8

#: Per replica URL: (requests in flight, prompt tokens still to prefill).
BoardTotals = dict[str, tuple[int, int]]

#: This router's own counts, as :data:`BoardTotals`: what its board key should hold.
OwnCounts = Callable[[], Mapping[str, tuple[int, int]]]

# Sums the live routers' counts for ARGV's replicas (from ``first``), dropping expired routers' keys.
_SUM = """
local function totals(first)
  local n = (#ARGV - first + 1)
  local sums = {}
  for j = 1, 2 * n do sums[j] = 0 end
  for _, key in ipairs(redis.call('SMEMBERS', KEYS[1])) do
    if redis.call('EXISTS', key) == 0 then
      redis.call('SREM', KEYS[1], key)
    else
      for j = 1, n do
        local url = ARGV[first + j - 1]
        local got = redis.call('HMGET', key, 'i:' .. url, 'p:' .. url)
        sums[2 * j - 1] = sums[2 * j - 1] + (tonumber(got[1]) or 0)
        sums[2 * j] = sums[2 * j] + (tonumber(got[2]) or 0)
      end
    end
  end
  return sums
end
"""

# KEYS: set; ARGV: replica URLs. Answers in flight and pending, in pairs.
_TOTALS_SCRIPT = _SUM + "return totals(1)"

# KEYS: set, own key; ARGV: ttl ms, field/value count m, m pairs, then the seen totals (2 per URL), then the URLs.
_CLAIM_SCRIPT = (
    _SUM
    + """
local m = tonumber(ARGV[2])
local n = (#ARGV - 2 - 2 * m) / 3
local first = 3 + 2 * m + 2 * n
local now = totals(first)
for j = 1, 2 * n do
  if now[j] ~= tonumber(ARGV[2 + 2 * m + j]) then return {0, now} end
end
for j = 1, m do redis.call('HSET', KEYS[2], ARGV[1 + 2 * j], ARGV[2 + 2 * j]) end
redis.call('SADD', KEYS[1], KEYS[2])
redis.call('PEXPIRE', KEYS[2], ARGV[1])
return {1, {}}
"""
)

# KEYS: set, own key; ARGV: ttl ms, then field/value pairs (none: only the lease is renewed).
_WRITE_SCRIPT = """
for j = 2, #ARGV, 2 do redis.call('HSET', KEYS[2], ARGV[j], ARGV[j + 1]) end
if redis.call('EXISTS', KEYS[2]) == 1 then
  redis.call('SADD', KEYS[1], KEYS[2])
  redis.call('PEXPIRE', KEYS[2], ARGV[1])
end
return 1
"""


class LoadBoard(Protocol):
    """Where a router reads the fleet's loads and reserves its choices (:class:`SharedBoard`, :class:`NoBoard`)."""

    def totals(self, urls: Sequence[str]) -> BoardTotals | None:
        """Every router's loads at ``urls``; None: use this router's own."""
        ...

    def claim(self, seen: BoardTotals, url: str, counts: tuple[int, int]) -> BoardTotals | None:
        """Write this router's ``counts`` at ``url`` if the totals are still ``seen``; else the totals now."""
        ...

    def write(self, url: str, counts: tuple[int, int]) -> None:
        """This router's counts at ``url`` are now ``counts``."""
        ...

    def refresh(self) -> None:
        """Renew this router's lease on its counts."""
        ...

    def figures(self) -> dict[str, object]: ...


class NoBoard:
    """One router alone: its own loads are the fleet's, and nothing is written anywhere."""

    def totals(self, urls: Sequence[str]) -> BoardTotals | None:
        return None

    def claim(self, seen: BoardTotals, url: str, counts: tuple[int, int]) -> BoardTotals | None:
        return None

    def write(self, url: str, counts: tuple[int, int]) -> None:
        pass

    def refresh(self) -> None:
        pass

    def figures(self) -> dict[str, object]:
        return {"kind": "none"}


def _fields(url: str, counts: tuple[int, int]) -> list[str | int]:
    return [f"i:{url}", counts[0], f"p:{url}", counts[1]]


class SharedBoard:
    """The board in Redis (see the module); ``own`` answers this router's counts when the board must be rewritten.

    Every call is one script run: O(routers x candidates) on the server.
    """

    def __init__(
        self,
        client: Redis,
        own: OwnCounts,
        *,
        prefix: str = "kvpool:route",
        router_id: str | None = None,
        ttl_s: float = 30.0,
        retry_s: float = 1.0,
        max_retry_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not ttl_s > 0:
            raise ValueError(f"the load board's ttl_s must be positive, not {ttl_s!r}")
        import redis

        self.errors: tuple[type[BaseException], ...] = (redis.RedisError, OSError)
        self.own = own
        self.set_key = f"{prefix}:board"
        self.key = f"{prefix}:board:{router_id or uuid.uuid4().hex}"
        self.ttl_s = ttl_s
        self.retry_s, self.max_retry_s = retry_s, max_retry_s
        self.failures = 0  # calls failed or skipped during outages
        self.outages = 0
        self.claims = self.conflicts = 0
        self._clock = clock
        self._down_since: float | None = None
        self._retry_at = 0.0
        self._delay = retry_s
        self._totals = client.register_script(_TOTALS_SCRIPT)
        self._claim = client.register_script(_CLAIM_SCRIPT)
        self._write = client.register_script(_WRITE_SCRIPT)

    @property
    def available(self) -> bool:
        """Whether the last call reached the server."""
        return self._down_since is None

    @property
    def _ttl_ms(self) -> int:
        return max(1, int(self.ttl_s * 1000))

    def _reachable(self) -> bool:
        """Whether to try the server now; after an outage, this router's counts are written whole first."""
        if self._down_since is None:
            return True
        now = self._clock()
        if now < self._retry_at:
            self.failures += 1
            return False
        try:  # this router's counts, whole: those written in the outage were lost
            self._write(keys=[self.set_key, self.key], args=[self._ttl_ms, *self._own_pairs()])
        except self.errors as exc:
            self._fail(exc)
            return False
        log.warning(
            "the load board answers again after %.1f s; this router's loads are written", now - self._down_since
        )
        self._down_since = None
        return True

    def _own_pairs(self) -> list[str | int]:
        pairs: list[str | int] = []
        for url, counts in self.own().items():
            pairs += _fields(url, counts)
        return pairs

    def _fail(self, exc: BaseException) -> None:
        now = self._clock()
        self.failures += 1
        if self._down_since is None:
            self.outages += 1
            self._down_since = now
            self._delay = self.retry_s
            log.warning("the load board does not answer (%s): each choice sees this router's own loads", exc)
        else:
            self._delay = min(2 * self._delay, self.max_retry_s)
        self._retry_at = now + self._delay

    def totals(self, urls: Sequence[str]) -> BoardTotals | None:
        if not urls or not self._reachable():
            return None
        try:
            flat = self._totals(keys=[self.set_key], args=list(urls))
        except self.errors as exc:
            self._fail(exc)
            return None
        return {url: (int(flat[2 * j]), int(flat[2 * j + 1])) for j, url in enumerate(urls)}

    def claim(self, seen: BoardTotals, url: str, counts: tuple[int, int]) -> BoardTotals | None:
        if not self._reachable():
            return None  # reserved here only; written whole when the server is back
        urls = list(seen)
        args: list[str | int] = [self._ttl_ms, 2, *_fields(url, counts)]
        for u in urls:
            args += list(seen[u])
        try:
            done, now = self._claim(keys=[self.set_key, self.key], args=[*args, *urls])
        except self.errors as exc:
            self._fail(exc)
            return None
        self.claims += 1
        if done:
            return None
        self.conflicts += 1
        return {u: (int(now[2 * j]), int(now[2 * j + 1])) for j, u in enumerate(urls)}

    def write(self, url: str, counts: tuple[int, int]) -> None:
        self._run_write(_fields(url, counts))

    def refresh(self) -> None:
        """Renew the lease, and write all of this router's counts (a key that expired comes back whole)."""
        self._run_write(self._own_pairs())

    def _run_write(self, pairs: list[str | int]) -> None:
        if not self._reachable():
            return
        try:
            self._write(keys=[self.set_key, self.key], args=[self._ttl_ms, *pairs])
        except self.errors as exc:
            self._fail(exc)

    def figures(self) -> dict[str, object]:
        return {
            "kind": "redis",
            "available": self.available,
            "outages": self.outages,
            "failures": self.failures,
            "claims": self.claims,
            "conflicts": self.conflicts,
        }


def board_for(index: object, own: OwnCounts) -> LoadBoard:
    """The board the routers on ``index`` share: in its Redis, under its prefix, when it is a Redis index; else none."""
    from kvpool.router.index import RedisIndex
    from kvpool.router.index_guard import GuardedIndex

    inner = index.inner if isinstance(index, GuardedIndex) else index
    if isinstance(inner, RedisIndex):
        return SharedBoard(inner.client, own, prefix=inner.prefix)
    return NoBoard()


async def keep_lease(board: LoadBoard, ttl_s: float) -> None:
    """Renew ``board``'s lease three times per ``ttl_s`` until cancelled (the router's stop)."""
    import asyncio

    while True:
        await asyncio.sleep(ttl_s / 3)
        board.refresh()
