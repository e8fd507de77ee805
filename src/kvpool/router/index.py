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

Operations and their cost (``k`` hashes in the call, ``r`` replicas):

* :meth:`store` / :meth:`remove`: O(k).
* :meth:`clear`: a replica's cache was reset or its events can no longer be
  trusted; O(blocks it held).
* :meth:`match`: O(matched blocks x replicas holding them) in memory; one
  pipelined round trip in Redis.

Both variants answer the same contract (``tests/router/test_index.py`` runs it on
each); the Redis one lets several routers share one index (docs/routing.md).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from kvpool.errors import ConfigError

if TYPE_CHECKING:
    from redis import Redis

__all__ = ["BlockIndex", "MemoryIndex", "RedisIndex", "index_from_url"]

#: A block hash as replicas publish it: digest bytes (kvpool, vLLM's sha256 variants) or an int.
ExternalHash = bytes | int
#: The storage medium an event names (``None``: the replica's main pool).
Medium = str | None


class BlockIndex(Protocol):
    """Block hash -> the replicas that hold it."""

    def store(self, replica: str, hashes: Iterable[ExternalHash], medium: Medium = None) -> None:
        """``replica`` now holds these blocks in ``medium``."""

    def remove(self, replica: str, hashes: Iterable[ExternalHash], medium: Medium = None) -> None:
        """``replica`` no longer holds these blocks in ``medium`` (unknown ones are ignored)."""

    def clear(self, replica: str) -> None:
        """Forget every block of ``replica`` (a cache reset, a replica gone, a stream that lost events)."""

    def match(self, hashes: Sequence[ExternalHash], replicas: Sequence[str]) -> list[int]:
        """For each of ``replicas``, how many leading blocks of ``hashes`` it holds."""

    def num_blocks(self, replica: str) -> int:
        """How many distinct blocks ``replica`` holds (any medium)."""


def _key(h: ExternalHash) -> bytes:
    """One canonical byte form per hash, so an int and its bytes never collide with another hash's."""
    if isinstance(h, bytes):
        return b"b" + h
    if isinstance(h, int) and not isinstance(h, bool):
        return b"i" + str(h).encode()
    raise ConfigError(f"a block hash is bytes or an int, got {h!r}")


class MemoryIndex:
    """The index in this process: two dictionaries kept in step.

    ``_holders[hash]`` is the set of replicas holding the block; ``_held[replica][hash]``
    the set of media holding it there. A block leaves ``_holders`` when its last medium
    on that replica lets it go.
    """

    __slots__ = ("_holders", "_held")

    def __init__(self) -> None:
        self._holders: dict[bytes, set[str]] = {}
        self._held: dict[str, dict[bytes, set[Medium]]] = {}

    def store(self, replica: str, hashes: Iterable[ExternalHash], medium: Medium = None) -> None:
        held = self._held.setdefault(replica, {})
        for h in hashes:
            key = _key(h)
            media = held.get(key)
            if media is None:
                held[key] = {medium}
                self._holders.setdefault(key, set()).add(replica)
            else:
                media.add(medium)

    def remove(self, replica: str, hashes: Iterable[ExternalHash], medium: Medium = None) -> None:
        held = self._held.get(replica)
        if held is None:
            return
        for h in hashes:
            key = _key(h)
            media = held.get(key)
            if media is None:
                continue
            media.discard(medium)
            if not media:
                del held[key]
                self._forget_holder(key, replica)

    def clear(self, replica: str) -> None:
        for key in self._held.pop(replica, {}):
            self._forget_holder(key, replica)

    def _forget_holder(self, key: bytes, replica: str) -> None:
        holders = self._holders[key]
        holders.discard(replica)
        if not holders:
            del self._holders[key]

    def match(self, hashes: Sequence[ExternalHash], replicas: Sequence[str]) -> list[int]:
        matched = dict.fromkeys(replicas, 0)
        alive = set(replicas)  # replicas whose run of held blocks has not ended yet
        for depth, h in enumerate(hashes):
            holders = self._holders.get(_key(h))
            if not holders:
                break
            alive &= holders
            if not alive:
                break
            for replica in alive:
                matched[replica] = depth + 1
        return [matched[r] for r in replicas]

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


class RedisIndex:
    """The index in Redis, shared by every router that names the same server and prefix.

    Keys (``P`` is the prefix, default ``kvpool:route``)::

        P:b:<hash>             SET of "<replica>|<medium>"  who holds this block, where
        P:r:<replica>|<medium> SET of <hash>                 what a replica's medium holds
        P:m:<replica>          SET of "<replica>|<medium>"  the replica's media (for clear)

    Every write is a set insertion or deletion, so routers that apply the same event
    stream converge on the same index whatever order their writes interleave in; a
    lookup is one call of a server-side script that walks the request's blocks and
    stops where every replica's run has ended.
    """

    __slots__ = ("_redis", "_prefix", "_match")

    def __init__(self, client: Redis, prefix: str = "kvpool:route") -> None:
        self._redis = client
        self._prefix = prefix.encode()
        self._match = client.register_script(_MATCH_SCRIPT)

    def _block(self, key: bytes) -> bytes:
        return self._prefix + b":b:" + key

    def _medium(self, member: bytes) -> bytes:
        return self._prefix + b":r:" + member

    def _media(self, replica: str) -> bytes:
        return self._prefix + b":m:" + replica.encode()

    @staticmethod
    def _member(replica: str, medium: Medium) -> bytes:
        return f"{replica}|{'' if medium is None else medium}".encode()

    def store(self, replica: str, hashes: Iterable[ExternalHash], medium: Medium = None) -> None:
        keys = [_key(h) for h in hashes]
        if not keys:
            return
        member = self._member(replica, medium)
        pipe = self._redis.pipeline(transaction=False)
        pipe.sadd(self._media(replica), member)
        pipe.sadd(self._medium(member), *keys)
        for key in keys:
            pipe.sadd(self._block(key), member)
        pipe.execute()

    def remove(self, replica: str, hashes: Iterable[ExternalHash], medium: Medium = None) -> None:
        keys = [_key(h) for h in hashes]
        if not keys:
            return
        member = self._member(replica, medium)
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
        keys = [self._block(_key(h)) for h in hashes]
        found: list[Any] = self._match(keys=keys, args=list(replicas))
        return [int(n) for n in found]

    def num_blocks(self, replica: str) -> int:
        media: set[bytes] = self._redis.smembers(self._media(replica))  # type: ignore[assignment]  # the sync client returns the set itself
        if not media:
            return 0
        held: set[bytes] = self._redis.sunion([self._medium(m) for m in media])  # type: ignore[assignment]  # as above
        return len(held)


def index_from_url(url: str | None, *, prefix: str = "kvpool:route") -> BlockIndex:
    """A :class:`MemoryIndex` (``url`` None) or a :class:`RedisIndex` on ``url`` (checked with a PING)."""
    if url is None:
        return MemoryIndex()
    try:
        import redis
    except ImportError:
        raise ConfigError("--index-redis needs the redis client: pip install 'kvpool[tiers]'") from None
    try:
        client = redis.Redis.from_url(url, socket_timeout=5)
        client.ping()
    except ValueError as exc:
        raise ConfigError(f"--index-redis {url!r} is not a Redis URL: {exc}") from None
    except redis.RedisError as exc:
        raise ConfigError(f"the index Redis at {url!r} does not answer: {exc}") from None
    return RedisIndex(client, prefix)
