"""Which replica holds which block: the router's index, in memory or in Redis.

The index is fed by the replicas' KV events and asked one question per request:
for the request's chain of block hashes ``h[0], h[1], ...``, how long a prefix of
it does each replica hold? Because each hash covers its whole prefix, a replica
holds ``k`` leading blocks exactly when it holds ``h[k-1]``; the walk still goes
block by block from ``h[0]``, so an entry left behind by a missed removal cannot
claim a prefix whose earlier blocks are gone.

A block counts as held while at least one medium of the replica holds it: a block
evicted from GPU memory but kept by an offload tier (``medium="CPU"``) still saves
its prefill there. Events name the medium; ``None`` is the replica's main pool.

Hybrid models keep each block once per KV cache group (full attention, sliding window,
Mamba...), and a prefix is reusable only when every group holds what it needs of it.
Each claim records its :class:`Group`: a full-attention group needs every block of the
prefix, a sliding-window group only the blocks its window reaches back over from the
prefix's end, a Mamba group only the last. The in-memory index counts a prefix of ``k``
blocks for a replica with several groups only when each of its groups holds what it
needs (the groups a replica has are those its events named). The Redis index keeps the
group in each claim but counts a block held by any group.

Operations and their cost (``k`` hashes in the call, ``r`` replicas):

* :meth:`store` / :meth:`remove`: O(k).
* :meth:`clear`: a replica's cache was reset or its events can no longer be
  trusted; O(blocks it held).
* :meth:`match`: O(matched blocks x replicas holding them) in memory; one
  pipelined round trip in Redis.
* :meth:`match_media`: :meth:`match`, and the media holding each matched block, in runs
  of blocks held alike (what the router's tier credit weighs,
  :class:`kvpool.routing.TierCredit`); the same walk, and in Redis the same one round trip.

The in-memory index is bounded: a replica's claims are capped (by default
:data:`MAX_BLOCKS_PER_REPLICA`, or what the replica says it can hold when it says so,
whichever is smaller) and all claims together too (:data:`MAX_BLOCKS`). Past a cap
the replica's oldest claims are dropped, the least recently stored or matched first,
and counted: a dropped claim can only make the router miss a prefix the replica
holds, never believe it holds one it does not. (The Redis variant is bounded by the
Redis server's own memory policy.)

Both variants answer the same contract (``tests/router/test_index.py`` runs it on
each); the Redis one lets several routers share one index (docs/routing.md).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from itertools import groupby
from typing import TYPE_CHECKING, Any, Protocol

from kvpool.errors import ConfigError

if TYPE_CHECKING:
    from redis import Redis

__all__ = [
    "MAX_BLOCKS",
    "MAX_BLOCKS_PER_REPLICA",
    "BlockIndex",
    "Group",
    "HeldMedia",
    "MemoryIndex",
    "RedisIndex",
    "index_from_url",
]

#: Claims one replica may have in the in-memory index (about 350 MiB of index at the cap).
MAX_BLOCKS_PER_REPLICA = 2**19
#: Claims all replicas together may have in the in-memory index (about 700 MiB at the cap).
MAX_BLOCKS = 2**20

#: A block hash as replicas publish it: digest bytes (kvpool, vLLM's sha256 variants) or an int.
ExternalHash = bytes | int
#: The storage medium an event names (``None``: the replica's main pool).
Medium = str | None
#: One replica's matched prefix, in runs of consecutive blocks: (the media holding each block of the run, blocks).
HeldMedia = tuple[tuple[frozenset[Medium], int], ...]


def _runs(claims: Iterable[Collection[tuple[Medium, int]]]) -> HeldMedia:
    """Blocks' claims ``(medium, group)``, in order, as runs of blocks held in the same media. O(blocks)."""
    runs: list[tuple[frozenset[Medium], int]] = []
    for held, same in groupby(claims):  # equal claim sets compared in C: a run costs one frozenset
        count = len(list(same))
        media = frozenset(m for m, _ in held)
        if runs and runs[-1][0] == media:  # other groups, the same media
            runs[-1] = (media, runs[-1][1] + count)
        else:
            runs.append((media, count))
    return tuple(runs)


@dataclass(frozen=True, slots=True)
class Group:
    """A KV cache group of a replica: its index in the replica's groups, and what of a prefix it needs.

    ``tail`` None: every block of a prefix (full attention). ``tail=n``: only the
    prefix's last ``n`` blocks (a sliding window of ``n`` blocks; 1 for Mamba's state).
    """

    id: int = 0
    tail: int | None = None


#: The group of a model with one group, and of events that name none.
WHOLE = Group()


class BlockIndex(Protocol):
    """Block hash -> the replicas that hold it."""

    def store(self, replica: str, hashes: Iterable[ExternalHash], medium: Medium = None, group: Group = WHOLE) -> None:
        """``replica`` now holds these blocks in ``medium``, for ``group``."""

    def remove(self, replica: str, hashes: Iterable[ExternalHash], medium: Medium = None, group: Group = WHOLE) -> None:
        """``replica`` no longer holds these blocks in ``medium`` for ``group`` (unknown ones are ignored)."""

    def clear(self, replica: str) -> None:
        """Forget every block of ``replica`` (a cache reset, a replica gone, a stream that lost events)."""

    def match(self, hashes: Sequence[ExternalHash], replicas: Sequence[str]) -> list[int]:
        """For each of ``replicas``, how many leading blocks of ``hashes`` it holds."""

    def match_media(self, hashes: Sequence[ExternalHash], replicas: Sequence[str]) -> list[HeldMedia]:
        """For each of ``replicas``, the media holding the leading blocks of ``hashes`` it holds, in runs.

        The runs' blocks add up to what :meth:`match` answers.
        """

    def num_blocks(self, replica: str) -> int:
        """How many distinct blocks ``replica`` holds (any medium)."""

    def limit(self, replica: str, num_blocks: int | None) -> None:
        """``replica`` says it can hold ``num_blocks`` blocks at most (None: it does not say)."""

    def figures(self) -> dict[str, object]:
        """What the router's verbose health shows of the index."""


def _text_key(h: ExternalHash) -> bytes:
    """:func:`_key` in printable ASCII, for Redis: ``b`` and the bytes in lowercase hex, or ``i`` and the int."""
    if isinstance(h, bytes):
        return b"b" + h.hex().encode()
    return _key(h)


def _key(h: ExternalHash) -> bytes:
    """One canonical byte form per hash, so an int and its bytes never collide with another hash's."""
    if isinstance(h, bytes):
        return b"b" + h
    if isinstance(h, int) and not isinstance(h, bool):
        return b"i" + str(h).encode()
    raise ConfigError(f"a block hash is bytes or an int, got {h!r}")


class MemoryIndex:
    """The index in this process: two dictionaries kept in step, and bounded.

    ``_holders[hash]`` is the set of replicas holding the block; ``_held[replica][hash]``
    the set of (medium, group) pairs holding it there, oldest claim first (a store or a match moves a
    claim to the end). A block leaves ``_holders`` when its last medium on that replica
    lets it go, or when its claim is dropped for a cap (:attr:`dropped` counts those).

    ``max_blocks_per_replica`` / ``max_blocks``: the caps (see the module's docstring);
    :meth:`limit` lowers one replica's cap to what it says it can hold.
    """

    __slots__ = (
        "_holders",
        "_held",
        "_groups",
        "_limits",
        "_claims",
        "max_blocks",
        "max_blocks_per_replica",
        "dropped",
    )

    def __init__(self, *, max_blocks: int = MAX_BLOCKS, max_blocks_per_replica: int = MAX_BLOCKS_PER_REPLICA) -> None:
        for name, value in (("max_blocks", max_blocks), ("max_blocks_per_replica", max_blocks_per_replica)):
            if type(value) is not int or value < 1:
                raise ConfigError(f"{name} must be an integer >= 1, got {value!r}")
        self._holders: dict[bytes, set[str]] = {}
        self._held: dict[str, OrderedDict[bytes, set[tuple[Medium, int]]]] = {}
        self._groups: dict[str, dict[int, int | None]] = {}  # replica -> group id -> its tail (hybrid models)
        self._limits: dict[str, int] = {}  # replicas that said how many blocks they hold at most
        self._claims = 0  # (replica, block) pairs held, over all replicas
        self.max_blocks = max_blocks
        self.max_blocks_per_replica = max_blocks_per_replica
        self.dropped = 0

    def limit(self, replica: str, num_blocks: int | None) -> None:
        """Cap ``replica``'s claims at ``num_blocks`` (what it can hold; None: the default cap only)."""
        if num_blocks is None:
            self._limits.pop(replica, None)
        else:
            self._limits[replica] = max(1, num_blocks)
        held = self._held.get(replica)
        if held is not None:
            self._drop_oldest(replica, held, len(held) - self._cap(replica))

    def _cap(self, replica: str) -> int:
        return min(self.max_blocks_per_replica, self._limits.get(replica, self.max_blocks_per_replica))

    def store(self, replica: str, hashes: Iterable[ExternalHash], medium: Medium = None, group: Group = WHOLE) -> None:
        held = self._held.get(replica)
        if held is None:
            held = self._held[replica] = OrderedDict()
        self._groups.setdefault(replica, {})[group.id] = group.tail
        claim = (medium, group.id)
        before = len(held)
        for h in reversed(list(hashes)):  # a chain's root is the newest claim of the batch: dropped last
            key = _key(h)
            media = held.get(key)
            if media is None:
                held[key] = {claim}
                self._holders.setdefault(key, set()).add(replica)
            else:
                media.add(claim)
                held.move_to_end(key)
        self._claims += len(held) - before
        self._drop_oldest(replica, held, len(held) - self._cap(replica))
        while self._claims > self.max_blocks:  # the global cap takes from the replica with the most claims
            sizes = sorted(((len(held), r) for r, held in self._held.items()), reverse=True)
            (most, largest), runner_up = sizes[0], sizes[1][0] if len(sizes) > 1 else 0
            count = min(self._claims - self.max_blocks, most - runner_up + 1)
            self._drop_oldest(largest, self._held[largest], count)

    def _drop_oldest(self, replica: str, held: OrderedDict[bytes, set[tuple[Medium, int]]], count: int) -> None:
        for _ in range(max(0, count)):
            key, _media = held.popitem(last=False)
            self._forget_holder(key, replica)
        if count > 0:
            self._claims -= count
            self.dropped += count

    def remove(self, replica: str, hashes: Iterable[ExternalHash], medium: Medium = None, group: Group = WHOLE) -> None:
        held = self._held.get(replica)
        if held is None:
            return
        for h in hashes:
            key = _key(h)
            media = held.get(key)
            if media is None:
                continue
            media.discard((medium, group.id))
            if not media:
                del held[key]
                self._claims -= 1
                self._forget_holder(key, replica)

    def clear(self, replica: str) -> None:
        self._groups.pop(replica, None)
        held = self._held.pop(replica, None)
        if held is None:
            return
        self._claims -= len(held)
        for key in held:
            self._forget_holder(key, replica)

    def _forget_holder(self, key: bytes, replica: str) -> None:
        holders = self._holders[key]
        holders.discard(replica)
        if not holders:
            del self._holders[key]

    def match(self, hashes: Sequence[ExternalHash], replicas: Sequence[str]) -> list[int]:
        return self._match(hashes, replicas, None)

    def match_media(self, hashes: Sequence[ExternalHash], replicas: Sequence[str]) -> list[HeldMedia]:
        media: dict[str, HeldMedia] = {}
        self._match(hashes, replicas, media)
        return [media.get(r, ()) for r in replicas]

    def _match(
        self, hashes: Sequence[ExternalHash], replicas: Sequence[str], media: dict[str, HeldMedia] | None
    ) -> list[int]:
        """:meth:`match`; with ``media``, each replica's matched blocks' media go into it as well."""
        matched = dict.fromkeys(replicas, 0)
        alive = set(replicas)  # replicas whose run of held blocks has not ended yet
        keys = []
        for depth, h in enumerate(hashes):
            key = _key(h)
            holders = self._holders.get(key)
            if not holders:
                break
            alive &= holders
            if not alive:
                break
            keys.append(key)
            for replica in alive:
                matched[replica] = depth + 1
        for replica, depth in matched.items():
            groups = self._groups.get(replica)
            if depth and groups is not None and len(groups) > 1:
                matched[replica] = self._usable(self._held[replica], keys[:depth], groups)
        for replica, depth in matched.items():  # a prefix in use is the last a cap drops, its root last of all
            if depth:
                held = self._held[replica]
                prefix = keys[:depth]
                for key in reversed(prefix):
                    held.move_to_end(key)
                if media is not None:
                    media[replica] = _runs(map(held.__getitem__, prefix))
        return [matched[r] for r in replicas]

    @staticmethod
    def _usable(
        held: OrderedDict[bytes, set[tuple[Medium, int]]], keys: list[bytes], groups: dict[int, int | None]
    ) -> int:
        """The longest prefix of ``keys`` every group of a hybrid replica holds what it needs of.

        A full-attention group must hold each block up to the prefix's end; a group with a
        ``tail`` only the last ``tail`` blocks before it. O(len(keys) x groups x tail).
        """
        holding = [{g for _, g in held[key]} for key in keys]
        whole = [g for g, tail in groups.items() if tail is None]
        tailed = [(g, tail) for g, tail in groups.items() if tail is not None]
        best = 0
        for depth in range(1, len(keys) + 1):
            if not all(g in holding[depth - 1] for g in whole):
                break  # a full-attention group misses a block: no longer prefix can be used
            if all(all(g in holding[j] for j in range(max(0, depth - tail), depth)) for g, tail in tailed):
                best = depth
        return best

    def figures(self) -> dict[str, object]:
        return {
            "kind": "memory",
            "claims": self._claims,
            "dropped": self.dropped,
            "max_blocks": self.max_blocks,
            "max_blocks_per_replica": self.max_blocks_per_replica,
        }

    def num_blocks(self, replica: str) -> int:
        return len(self._held.get(replica, ()))


# KEYS: the prompt's block keys, in order; ARGV: replica names. Returns the matched depth per replica.
_MATCH_SCRIPT = """
local matched, alive = {}, {}
for i, replica in ipairs(ARGV) do matched[i] = 0; alive[replica] = true end
for depth, key in ipairs(KEYS) do
  local holders = {}
  for _, member in ipairs(redis.call('SMEMBERS', key)) do
    holders[string.match(member, '^(.*)|[^|]*$')] = true
  end
  local running = false
  for i, replica in ipairs(ARGV) do
    if alive[replica] and holders[replica] then matched[i] = depth; running = true else alive[replica] = false end
  end
  if not running then break end
end
return matched
"""


# As _MATCH_SCRIPT; returns per replica its runs of blocks held in the same media, flat:
# {media, blocks, media, blocks, ...}, a run's media sorted and joined by newlines ("" for none named).
_MATCH_MEDIA_SCRIPT = """
local alive, runs = {}, {}
for i, replica in ipairs(ARGV) do alive[replica] = true; runs[i] = {} end
for depth, key in ipairs(KEYS) do
  local holders = {}
  for _, member in ipairs(redis.call('SMEMBERS', key)) do
    local replica, claim = string.match(member, '^(.*)|([^|]*)$')
    local held = holders[replica]
    if not held then held = {}; holders[replica] = held end
    held[string.match(claim, '^([^#]*)')] = true
  end
  local running = false
  for i, replica in ipairs(ARGV) do
    local held = holders[replica]
    if alive[replica] and held then
      running = true
      local names = {}
      for medium in pairs(held) do names[#names + 1] = medium end
      table.sort(names)
      local joined, own = table.concat(names, '\\n'), runs[i]
      if #own > 0 and own[#own - 1] == joined then own[#own] = own[#own] + 1
      else own[#own + 1] = joined; own[#own + 1] = 1 end
    else alive[replica] = false end
  end
  if not running then break end
end
return runs
"""


class RedisIndex:
    """The index in Redis, shared by every router that names the same server and prefix.

    Keys (``P`` is the prefix, default ``kvpool:route``)::

        P:b:<hash>             SET of "<replica>|<medium>"  who holds this block, where
        P:r:<replica>|<medium> SET of <hash>                 what a replica's medium holds
        P:m:<replica>          SET of "<replica>|<medium>"  the replica's media (for clear)

    ``<hash>`` is printable (what ``redis-cli --scan`` shows as is): ``b`` and a digest's bytes
    in lowercase hex, or ``i`` and an integer hash in decimal.

    Every write is a set insertion or deletion, so routers that apply the same event
    stream converge on the same index whatever order their writes interleave in; a
    lookup is one call of a server-side script that walks the request's blocks and
    stops where every replica's run has ended.
    """

    __slots__ = ("_redis", "_prefix", "_match", "_match_media")

    def __init__(self, client: Redis, prefix: str = "kvpool:route") -> None:
        self._redis = client
        self._prefix = prefix.encode()
        self._match = client.register_script(_MATCH_SCRIPT)
        self._match_media = client.register_script(_MATCH_MEDIA_SCRIPT)

    def _block(self, key: bytes) -> bytes:
        return self._prefix + b":b:" + key

    def _medium(self, member: bytes) -> bytes:
        return self._prefix + b":r:" + member

    def _media(self, replica: str) -> bytes:
        return self._prefix + b":m:" + replica.encode()

    @staticmethod
    def _member(replica: str, medium: Medium, group: Group = WHOLE) -> bytes:
        name = "" if medium is None else medium
        return f"{replica}|{name if group.id == 0 else f'{name}#{group.id}'}".encode()

    def store(self, replica: str, hashes: Iterable[ExternalHash], medium: Medium = None, group: Group = WHOLE) -> None:
        keys = [_text_key(h) for h in hashes]
        if not keys:
            return
        member = self._member(replica, medium, group)
        pipe = self._redis.pipeline(transaction=False)
        pipe.sadd(self._media(replica), member)
        pipe.sadd(self._medium(member), *keys)
        for key in keys:
            pipe.sadd(self._block(key), member)
        pipe.execute()

    def remove(self, replica: str, hashes: Iterable[ExternalHash], medium: Medium = None, group: Group = WHOLE) -> None:
        keys = [_text_key(h) for h in hashes]
        if not keys:
            return
        member = self._member(replica, medium, group)
        pipe = self._redis.pipeline(transaction=False)
        pipe.srem(self._medium(member), *keys)
        for key in keys:
            pipe.srem(self._block(key), member)
        pipe.execute()

    def clear(self, replica: str) -> None:
        media: set[bytes] = self._redis.smembers(self._media(replica))  # type: ignore[assignment]  # the sync client returns the set itself
        for member in media:
            held: set[bytes] = self._redis.smembers(self._medium(member))  # type: ignore[assignment]  # as above
            pipe = self._redis.pipeline(transaction=False)
            for key in held:
                pipe.srem(self._block(key), member)
            pipe.delete(self._medium(member))
            pipe.srem(self._media(replica), member)
            pipe.execute()

    def match(self, hashes: Sequence[ExternalHash], replicas: Sequence[str]) -> list[int]:
        if not hashes or not replicas:
            return [0] * len(replicas)
        # One script call walks the chain on the server and stops at the first block no
        # replica still in the run holds: one round trip, a reply of one number per replica.
        keys = [self._block(_text_key(h)) for h in hashes]
        found: list[Any] = self._match(keys=keys, args=list(replicas))
        return [int(n) for n in found]

    def match_media(self, hashes: Sequence[ExternalHash], replicas: Sequence[str]) -> list[HeldMedia]:
        if not hashes or not replicas:
            return [() for _ in replicas]
        # the walk of match, in one script call as well, each replica's runs of media built on the server
        keys = [self._block(_text_key(h)) for h in hashes]
        found: list[Any] = self._match_media(keys=keys, args=list(replicas))
        return [
            tuple(
                (frozenset(m.decode() or None for m in runs[j].split(b"\n")), int(runs[j + 1]))
                for j in range(0, len(runs), 2)
            )
            for runs in found
        ]

    def num_blocks(self, replica: str) -> int:
        media: set[bytes] = self._redis.smembers(self._media(replica))  # type: ignore[assignment]  # the sync client returns the set itself
        if not media:
            return 0
        held: set[bytes] = self._redis.sunion([self._medium(m) for m in media])  # type: ignore[assignment]  # as above
        return len(held)

    def limit(self, replica: str, num_blocks: int | None) -> None:
        pass  # bounded by the Redis server's memory policy

    def figures(self) -> dict[str, object]:
        return {"kind": "redis"}


#: Seconds a call to the index Redis may take (it runs on the router's event loop).
REDIS_TIMEOUT_S = 0.5


def index_from_url(
    url: str | None,
    *,
    prefix: str = "kvpool:route",
    max_blocks: int = MAX_BLOCKS,
    max_blocks_per_replica: int = MAX_BLOCKS_PER_REPLICA,
) -> BlockIndex:
    """A :class:`MemoryIndex` with these caps (``url`` None), or a :class:`RedisIndex` on ``url``.

    The Redis one is checked with a PING; the router guards it
    (:mod:`kvpool.router.index_guard`): when the server fails later, requests are routed
    by load until it answers again.
    """
    if url is None:
        return MemoryIndex(max_blocks=max_blocks, max_blocks_per_replica=max_blocks_per_replica)
    try:
        import redis
    except ImportError:
        raise ConfigError("--index-redis needs the redis client: pip install 'kvpool[tiers]'") from None
    try:
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        client = redis.Redis.from_url(
            url,
            socket_timeout=REDIS_TIMEOUT_S,
            socket_connect_timeout=REDIS_TIMEOUT_S,
            retry=Retry(NoBackoff(), 0),  # one try: the guard decides when to try again
        )
        client.ping()
    except ValueError as exc:
        raise ConfigError(f"--index-redis {url!r} is not a Redis URL: {exc}") from None
    except redis.RedisError as exc:
        raise ConfigError(f"the index Redis at {url!r} does not answer: {exc}") from None
    return RedisIndex(client, prefix)
