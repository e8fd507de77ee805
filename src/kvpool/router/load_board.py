"""The replicas' loads summed over every router in front of them: a board in Redis that each choice reserves on.

Routers that share one block index (``--index-redis``) each know only the requests they
sent themselves; a burst of one prefix spread over them would find every replica idle in
every router's eyes and pile up. The board holds, per replica, the requests in flight and
the prompt tokens still to prefill (the ``expected-ttft`` rule's queue) of *all* of them.

Each router writes only its own counts, under its own key, as absolute values (never
deltas): a write lost to an outage is mended by the next one, and the board's figure for
a replica is the sum over the routers whose keys are alive. Keys (``P`` the prefix)::

    P:board             SET of router keys that have written
    P:board:<router>    HASH  i:<replica> -> requests in flight, p:<replica> -> prefill pending,
                              c:<replica>|<block> -> 1 while any of its requests there computes it

The ``c:`` fields are precise mode's blocks being computed (requests in flight whose
events are not out yet): one router's own requests already count as holding them, and
the board makes every router count every router's, so a burst over several routers
spreads as one router's would. Only a block's presence is written (when the first of the
router's requests there takes it, deleted when the last one ends): a burst on one shared
prefix writes each request's own blocks only. Because a block hash covers its whole
prefix, the blocks of a prompt computing at a replica are always a leading run of it, and
:meth:`LoadBoard.computing` finds its length by bisection: O(log blocks) probes a replica.

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
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Protocol

from kvpool.router.index import text_key

if TYPE_CHECKING:
    from redis import Redis

    from kvpool.hashing import BlockHash
    from kvpool.router.index import ExternalHash

__all__ = [
    "CLAIM_TRIES",
    "BoardTotals",
    "ComputingDepths",
    "LoadBoard",
    "NoBoard",
    "OwnComputing",
    "OwnCounts",
    "SharedBoard",
    "board_for",
    "keep_lease",
]

log = logging.getLogger("kvpool.route")

#: Rankings a request may try before it reserves on whatever the board says (a burst under contention).
CLAIM_TRIES = 8

#: Per replica URL: (requests in flight, prompt tokens still to prefill).
BoardTotals = dict[str, tuple[int, int]]

#: This router's own counts, as :data:`BoardTotals`: what its board key should hold.
OwnCounts = Callable[[], Mapping[str, tuple[int, int]]]
#: Per replica URL: its blocks being computed, each with this router's requests there holding it.
OwnComputing = Mapping[str, Mapping["BlockHash", int]]
#: Per replica URL: the leading blocks of the prompt asked about that some router's requests are computing there.
ComputingDepths = dict[str, int]

# Sums the live routers' counts for ARGV's replicas (from ``first``), dropping expired routers' keys.
_SUM = """
local function totals(first, n)
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
_TOTALS_SCRIPT = _SUM + "return totals(1, #ARGV)"

# KEYS: set, own key; ARGV: ttl ms, field/value count m, m pairs, then the seen totals (2 per URL), then the URLs.
_CLAIM_SCRIPT = (
    _SUM
    + """
local m = tonumber(ARGV[2])
local n = (#ARGV - 2 - 2 * m) / 3
local first = 3 + 2 * m + 2 * n
local now = totals(first, n)
for j = 1, 2 * n do
  if now[j] ~= tonumber(ARGV[2 + 2 * m + j]) then return {0, now} end
end
for j = 1, m do redis.call('HSET', KEYS[2], ARGV[1 + 2 * j], ARGV[2 + 2 * j]) end
redis.call('SADD', KEYS[1], KEYS[2])
redis.call('PEXPIRE', KEYS[2], ARGV[1])
return {1, {}}
"""
)

# KEYS: set, own key; ARGV: ttl ms, whole (1: the key is rewritten from nothing), then field/value pairs
# (a value 0 deletes its field; none: only the lease is renewed).
_WRITE_SCRIPT = """
if ARGV[2] == '1' then redis.call('DEL', KEYS[2]) end
for j = 3, #ARGV, 2 do
  if ARGV[j + 1] == '0' then redis.call('HDEL', KEYS[2], ARGV[j]) else redis.call('HSET', KEYS[2], ARGV[j], ARGV[j + 1]) end
end
if redis.call('EXISTS', KEYS[2]) == 1 then
  redis.call('SADD', KEYS[1], KEYS[2])
  redis.call('PEXPIRE', KEYS[2], ARGV[1])
end
return 1
"""

# From ARGV[first]: the number of prompts, each as one argument (its block keys, each ended by a newline),
# then (URL, prompt number) pairs to the end. Answers, per pair, the leading blocks of its prompt some live
# router's requests compute there.
_DEPTHS = """
local function computing(first)
  local routers = {}
  for _, key in ipairs(redis.call('SMEMBERS', KEYS[1])) do
    if redis.call('EXISTS', key) == 1 then routers[#routers + 1] = key end
  end
  local prompts, at = {}, first + 1
  for p = 1, tonumber(ARGV[first]) do
    local blocks = {}
    for key in string.gmatch(ARGV[at], '([^\\n]*)\\n') do blocks[#blocks + 1] = key end
    prompts[p] = blocks
    at = at + 1
  end
  local depths = {}
  while at < #ARGV do
    local url, prompt = ARGV[at], prompts[tonumber(ARGV[at + 1])]
    local low, high = 0, #prompt  -- blocks 1..low are computing somewhere; blocks past high are not
    while low < high do
      local mid = math.floor((low + high + 1) / 2)
      local field = 'c:' .. url .. '|' .. prompt[mid]
      local found = false
      for _, key in ipairs(routers) do
        if redis.call('HEXISTS', key, field) == 1 then found = true; break end
      end
      if found then low = mid else high = mid - 1 end
    end
    depths[#depths + 1] = low
    at = at + 2
  end
  return depths
end
"""

# KEYS: set; ARGV: n, n replica URLs, then what ``computing`` reads. Answers {totals, depths}: one round trip.
_SURVEY_SCRIPT = (
    _SUM
    + _DEPTHS
    + """
local n = tonumber(ARGV[1])
return {totals(2, n), computing(n + 2)}
"""
)


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

    def survey(
        self, urls: Sequence[str], prompts: Mapping[str, Sequence[ExternalHash]]
    ) -> tuple[BoardTotals, ComputingDepths] | None:
        """:meth:`totals` at ``urls`` and, per URL of ``prompts``, the leading blocks of its prompt that any
        router's requests are computing there, in one round trip; None: use this router's own."""
        ...

    def write_computing(self, url: str, blocks: Sequence[BlockHash], *, held: bool) -> None:
        """``blocks`` are now computed at ``url`` by some of this router's requests (``held``), or by none."""
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

    def survey(
        self, urls: Sequence[str], prompts: Mapping[str, Sequence[ExternalHash]]
    ) -> tuple[BoardTotals, ComputingDepths] | None:
        return None

    def write_computing(self, url: str, blocks: Sequence[BlockHash], *, held: bool) -> None:
        pass

    def refresh(self) -> None:
        pass

    def figures(self) -> dict[str, object]:
        return {"kind": "none"}


def _fields(url: str, counts: tuple[int, int]) -> list[str | int]:
    return [f"i:{url}", counts[0], f"p:{url}", counts[1]]


def _computing_fields(url: str, blocks: Iterable[BlockHash], held: bool = True) -> list[str | int]:
    pairs: list[str | int] = []
    value = int(held)
    for h in blocks:
        pairs += [f"c:{url}|{text_key(h).decode()}", value]
    return pairs


class SharedBoard:
    """The board in Redis (see the module); ``own`` answers this router's counts when the board must be rewritten.

    ``own_computing``: this router's blocks being computed (its bookkeeping's own map, read
    when the key is rewritten whole); None: it shares none.

    Every call is one script run: O(routers x candidates) on the server.
    """

    def __init__(
        self,
        client: Redis,
        own: OwnCounts,
        *,
        own_computing: OwnComputing | None = None,
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
        self.own_computing = own_computing
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
        self._survey = client.register_script(_SURVEY_SCRIPT)

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
            self._write(keys=[self.set_key, self.key], args=[self._ttl_ms, 1, *self._own_pairs()])
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
        for url, blocks in (self.own_computing or {}).items():
            pairs += _computing_fields(url, blocks)
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

    def survey(
        self, urls: Sequence[str], prompts: Mapping[str, Sequence[ExternalHash]]
    ) -> tuple[BoardTotals, ComputingDepths] | None:
        if not (urls or prompts) or not self._reachable():
            return None
        if self.own_computing is None:
            prompts = {}  # this router shares no blocks computing: it asks for none either
        numbers: dict[int, int] = {}  # id(prompt) -> its number: replicas of one hashing share one prompt
        spec: list[bytes] = []
        pairs: list[str | int] = []
        for url, prompt in prompts.items():
            if id(prompt) not in numbers:
                numbers[id(prompt)] = len(numbers) + 1
                spec.append(b"".join(text_key(h) + b"\n" for h in prompt))
            pairs += [url, numbers[id(prompt)]]
        try:
            flat, depths = self._survey(keys=[self.set_key], args=[len(urls), *urls, len(numbers), *spec, *pairs])
        except self.errors as exc:
            self._fail(exc)
            return None
        totals = {url: (int(flat[2 * j]), int(flat[2 * j + 1])) for j, url in enumerate(urls)}
        return totals, {url: int(d) for url, d in zip(prompts, depths)}

    def write_computing(self, url: str, blocks: Sequence[BlockHash], *, held: bool) -> None:
        if self.own_computing is not None and blocks:
            self._run_write(_computing_fields(url, blocks, held))

    def refresh(self) -> None:
        """Renew the lease, and write all of this router's counts (a key that expired comes back whole)."""
        self._run_write(self._own_pairs(), whole=True)

    def _run_write(self, pairs: list[str | int], *, whole: bool = False) -> None:
        if not self._reachable():
            return
        try:
            self._write(keys=[self.set_key, self.key], args=[self._ttl_ms, int(whole), *pairs])
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


def board_for(index: object, own: OwnCounts, own_computing: OwnComputing | None = None) -> LoadBoard:
    """The board the routers on ``index`` share: in its Redis, under its prefix, when it is a Redis index; else none."""
    from kvpool.router.index import RedisIndex
    from kvpool.router.index_guard import GuardedIndex

    inner = index.inner if isinstance(index, GuardedIndex) else index
    if isinstance(inner, RedisIndex):
        return SharedBoard(inner.client, own, own_computing=own_computing, prefix=inner.prefix)
    return NoBoard()


async def keep_lease(board: LoadBoard, ttl_s: float) -> None:
    """Renew ``board``'s lease three times per ``ttl_s`` until cancelled (the router's stop)."""
    import asyncio

    while True:
        await asyncio.sleep(ttl_s / 3)
        board.refresh()
