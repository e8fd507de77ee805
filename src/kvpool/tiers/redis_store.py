"""KV blocks in a Redis server or a Redis Cluster, shared by every replica that points at it.

URLs are what redis-py takes, plus a cluster spelling and one kvpool option::

    redis://127.0.0.1:6379/0                 a server, database 0
    redis://:PASSWORD@host:6379/0            with a password (redis://USER:PASSWORD@... for an ACL user)
    rediss://host:6380/0?ssl_ca_certs=ca.pem TLS (any redis-py ssl_* option as a query argument)
    unix:///run/redis.sock?db=0              a local socket
    redis+cluster://host:7000                a Redis Cluster, discovered from any one node
    rediss+cluster://host:7000               a Redis Cluster over TLS
    ...?ttl=3600                             entries expire after an hour (default: never)

Keys are ``kvpool:<layout namespace>:<block hash in lowercase hex>``, printable ASCII throughout
(what ``redis-cli --scan`` and Redis Insight show as is; the disk tier names its files by the same
hex), where the namespace is named by the layout fingerprint, the model's weights included, so
models sharing a Redis never see each other's blocks (keys of the raw hash bytes, which kvpool
wrote before, are never read again: each is a miss, and leaves by its TTL or the server's memory
policy); values are entries (:mod:`kvpool.tiers.entry`), so a client that writes garbage, or
without the secret when the codec has one, cannot make kvpool read it. A value is read with
GETRANGE up to the longest entry of the layout, so a planted huge value costs no more than one
block; a value refused for any reason is deleted (it is under this model's own prefix), so the
block is computed and saved again instead of staying unloadable. kvpool does
not bound what it puts in Redis: entries leave by their TTL or by the server's own
``maxmemory-policy`` (``allkeys-lru`` suits a cache), and a block Redis evicted is a miss.

Many blocks travel in one round trip: a pipeline of SETs, at most :data:`PIPELINE_BLOCKS` blocks
each. Lookups and reads come back in one reply per round trip: a script (:data:`LOOKUP_SCRIPT`,
:data:`READ_SCRIPT`, sent by its SHA once loaded) runs each key's STRLEN or bounded GETRANGE on the
server and answers them together, where a pipeline answers once per key (a server or proxy that
spends a fixed time per reply made a 16-block lookup cost 16 of them). On a cluster (keys on many
nodes), or a server that refuses scripts (the refusal is logged once), they are pipelines. Replies are parsed by
hiredis where it is installed (the ``tiers`` extra installs it; redis-py picks it up), and
``get_many_into`` verifies each value and copies its payload straight into the caller's buffer. Faults never stop serving: a Redis that is down, dies or times out (short socket timeouts)
costs one warning; until a retry, cheaply timed with a doubling backoff, every call answers at
once with misses and stores nothing; the tier comes back when the server does.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar
from urllib.parse import parse_qsl, urlencode

from kvpool.errors import ConfigError
from kvpool.tiers.counters import StoreCounters, TierStats
from kvpool.tiers.entry import CorruptEntry, CorruptKind, EntryCodec, Payload
from kvpool.tiers.kinds import TierBackend, TierKind

__all__ = ["BACKEND", "LOOKUP_SCRIPT", "READ_SCRIPT", "REDIS_SCHEMES", "RedisStore", "RedisTarget"]

#: URL schemes a Redis tier spec may start with.
REDIS_SCHEMES = frozenset({"redis", "rediss", "unix", "redis+cluster", "rediss+cluster"})

_log = logging.getLogger("kvpool.tiers.redis")
_TIMEOUTS = {"socket_timeout": 1.0, "socket_connect_timeout": 0.5}

#: Blocks per pipeline (one round trip): measured with benchmarks/bench_tier_stores.py --pipeline-sweep;
#: past it, a longer pipeline only buffers more replies at once.
PIPELINE_BLOCKS = 16

#: A lookup of a run of keys in one reply: each key's length (0: absent).
LOOKUP_SCRIPT = "local r = {} for i, k in ipairs(KEYS) do r[i] = redis.call('STRLEN', k) end return r"
#: A read of a run of keys in one reply: each value's first ARGV[i] + 1 bytes (b"": absent).
READ_SCRIPT = "local r = {} for i, k in ipairs(KEYS) do r[i] = redis.call('GETRANGE', k, 0, ARGV[i]) end return r"


def _import_redis() -> Any:
    try:
        import redis
    except ImportError as exc:
        raise ConfigError("the redis tier needs the redis client: pip install 'kvpool[tiers]'") from exc
    return redis


@dataclass(frozen=True, slots=True)
class RedisTarget:
    """A Redis tier URL, checked: what redis-py is given, and kvpool's own options taken out of it."""

    url: str = field(repr=False)  # for redis-py: the scheme without "+cluster", the query without ttl (a password too)
    cluster: bool = False
    ttl_s: int | None = None
    display_url: str = ""  # for logs: no password, no query

    kind: ClassVar[TierKind] = TierKind.REDIS

    @classmethod
    def parse(cls, url: str) -> RedisTarget:
        """The target ``url`` names; ConfigError naming it if it is malformed (needs the redis client)."""
        redis = _import_redis()
        scheme, _, rest = url.partition("://")
        location, _, query = rest.partition("?")
        if scheme not in REDIS_SCHEMES or not location.strip("/"):
            raise ConfigError(f"redis tier URL {url!r} must be redis://, rediss://, unix:// or redis+cluster://")
        options = dict(parse_qsl(query, keep_blank_values=True))
        ttl_s = _ttl(options.pop("ttl", None), url)
        if "decode_responses" in options:
            raise ConfigError(f"redis tier URL {url!r}: entries are bytes, so decode_responses cannot be set")
        plain = f"{scheme.removesuffix('+cluster')}://{location}" + (f"?{urlencode(options)}" if options else "")
        try:
            redis.connection.parse_url(plain)
        except (ValueError, TypeError) as exc:
            raise ConfigError(f"redis tier URL {url!r} is not a valid Redis URL: {exc}") from exc
        return cls(plain, scheme.endswith("+cluster"), ttl_s, f"{scheme}://{location.rpartition('@')[2]}")


class RedisStore:
    """Blocks in Redis under a per-layout key prefix. Thread-safe: calls take turns on one client."""

    name = TierKind.REDIS.value

    def __init__(
        self,
        url: str | RedisTarget,
        codec: EntryCodec,
        *,
        backoff_s: tuple[float, float] = (0.25, 8.0),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        target = url if isinstance(url, RedisTarget) else RedisTarget.parse(url)
        redis = _import_redis()
        self.cluster = target.cluster
        self.ttl_s = target.ttl_s
        self.display_url = target.display_url
        self._url = target.url
        self._redis = redis
        self._faults: tuple[type[BaseException], ...] = (
            redis.exceptions.RedisError,
            redis.exceptions.RedisClusterException,
            OSError,
        )
        self._prefix = f"kvpool:{codec.namespace}:".encode()
        self._codec = codec
        self._counters = StoreCounters(self.name, codec, _log)
        self._client: Any = None
        self._backoff_s = backoff_s
        self._clock = clock
        self._failures = 0
        self._retry_at = float("-inf")
        self._closed = False
        self._lock = threading.Lock()
        self._scripts: dict[str, Any] | None = None  # per script: the client's Script; None: pipelines only
        self.scripted = not self.cluster  # False once the server refused a script (or on a cluster)

    # -- the BlockStore contract ------------------------------------------------------------

    @property
    def stats(self) -> TierStats:
        return self._counters.snapshot()

    @property
    def prefix(self) -> bytes:
        """What every key of this store starts with: ``kvpool:<layout namespace>:``."""
        return self._prefix

    def redis_key(self, key: bytes) -> bytes:
        """The Redis key the block ``key`` is stored under: the prefix, then ``key`` in lowercase hex."""
        return self._prefix + key.hex().encode()

    @property
    def available(self) -> bool:
        """False while the server is known to be down and the next retry is not yet due."""
        return not self._closed and self._clock() >= self._retry_at

    def contains_prefix(self, keys: Sequence[bytes]) -> int:
        if not keys:
            return 0

        def lengths(client: Any) -> list[int]:
            names = [self.redis_key(key) for key in keys]
            return self._each(client, LOOKUP_SCRIPT, "strlen", names, [()] * len(names))

        found = self._call("look up", lengths)
        count = 0
        for key, length in zip(keys, found or ()):
            if not 0 < length <= self._codec.max_entry_bytes(len(key)):
                break  # absent, or nothing an entry can be: offered as a miss, so the block is computed and saved
            count += 1
        return count

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        payloads: list[bytes | None] = []
        refused: list[bytes] = []
        for key, value in self._read(keys, refused):
            payload = None if value is None else self._counters.payload(key, value)
            if value is not None and payload is None:
                refused.append(self.redis_key(key))
            payloads.append(payload)
        if refused:
            self._remove(refused)
        return payloads

    def get_many_into(self, keys: Sequence[bytes], out: Sequence[memoryview]) -> list[bool]:
        """Each key's verified payload copied into its buffer in ``out`` (the one copy); whether it arrived.

        A buffer the payload does not fill exactly is a miss (the entry is refused); the contents
        of a buffer whose key missed are unspecified.
        """
        if len(out) != len(keys):
            raise ConfigError(f"get_many_into needs one buffer per key, got {len(out)} for {len(keys)} keys")
        arrived: list[bool] = []
        refused: list[bytes] = []
        decode_into = self._codec.decode_into
        for (key, value), buffer in zip(self._read(keys, refused), out):
            if value is None:
                arrived.append(False)
                continue
            try:
                decode_into(key, value, buffer)
            except CorruptEntry as exc:
                self._counters.refused(key, exc)
                refused.append(self.redis_key(key))
                arrived.append(False)
                continue
            self._counters.hit(len(value))
            arrived.append(True)
        if refused:
            self._remove(refused)
        return arrived

    def _read(self, keys: Sequence[bytes], refused: list[bytes]) -> Iterator[tuple[bytes, bytes | None]]:
        """Each key with its stored value, None for a miss (absent, oversized, or Redis down; counted here).

        The names of oversized values go to ``refused``, for the caller to delete.

        Values are read with bounded GETRANGEs, :data:`PIPELINE_BLOCKS` per round trip.
        """
        cap = self._codec.max_entry_bytes
        for start in range(0, len(keys), PIPELINE_BLOCKS):
            batch = keys[start : start + PIPELINE_BLOCKS]

            def read(client: Any, batch: Sequence[bytes] = batch) -> list[bytes]:
                names = [self.redis_key(key) for key in batch]
                bounds = [(0, cap(len(key))) for key in batch]  # one byte past the bound tells a bigger one
                return self._each(client, READ_SCRIPT, "getrange", names, bounds)

            values = self._call("read", read)
            if values is None:
                self._counters.add(misses=len(batch))
                yield from ((key, None) for key in batch)
                continue
            for key, value in zip(batch, values):
                if not value:  # GETRANGE answers b"" for an absent key
                    self._counters.add(misses=1)
                    yield key, None
                elif len(value) > cap(len(key)):
                    self._counters.refused(key, CorruptEntry(CorruptKind.OVERSIZED, f"more than {cap(len(key))} bytes"))
                    refused.append(self.redis_key(key))
                    yield key, None
                else:
                    yield key, value

    def _each(
        self, client: Any, script: str, command: str, names: list[bytes], args: Sequence[tuple[int, ...]]
    ) -> list[Any]:
        """``command(name, *arg)`` for each name, answered in one reply (a script) where the server runs scripts.

        A server that refuses the script (scripting disabled, an ACL without EVALSHA) is logged once and
        asked by pipelines from then on. Faults of the round trip itself propagate to :meth:`_call`.
        """
        scripts = self._scripts
        if self.scripted and scripts is not None and script in scripts:
            try:
                reply = scripts[script](keys=names, args=[a[-1] for a in args if a], client=client)
            except self._redis.exceptions.ResponseError as exc:
                self.scripted = False
                _log.warning(
                    "kvpool redis tier: %s refuses scripts (%s); lookups and reads use pipelines, one reply a key",
                    self.display_url,
                    exc,
                )
            else:
                if not isinstance(reply, list) or len(reply) != len(names):
                    raise self._redis.exceptions.DataError(f"a script answered {len(names)} keys with {reply!r:.80}")
                return reply
        pipe = client.pipeline(transaction=False)
        for name, arg in zip(names, args):
            getattr(pipe, command)(name, *arg)
        return list(pipe.execute())

    def _remove(self, names: list[bytes]) -> None:
        """Delete refused entries under this store's prefix, so their blocks can be saved again.

        The prefix names this layout and these weights: no other model's entry lives under it, and
        one that was refused here (damaged, planted, signed with another secret) is no use to anyone.
        """

        def delete(client: Any) -> int:
            pipe = client.pipeline(transaction=False)
            for name in names:
                pipe.delete(name)
            return sum(pipe.execute())

        removed = self._call("remove refused entries from", delete)
        if removed:
            self._counters.add(removed=removed)

    def put_many(self, items: Sequence[tuple[bytes, Payload]]) -> int:
        if not items or not self.available:
            return 0
        stored = 0
        for start in range(0, len(items), PIPELINE_BLOCKS):
            entries = [
                (self.redis_key(key), self._codec.encode(key, payload))
                for key, payload in items[start : start + PIPELINE_BLOCKS]
            ]

            def store(client: Any, entries: list[tuple[bytes, bytes]] = entries) -> int:
                pipe = client.pipeline(transaction=False)
                for name, entry in entries:
                    pipe.set(name, entry, ex=self.ttl_s)
                return sum(1 for ok in pipe.execute() if ok)

            done: int | None = self._call("write", store)
            if done is None:
                break
            stored += done
            self._counters.add(bytes_written=sum(len(entry) for _name, entry in entries))
        return stored

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._drop_client()

    # -- faults -----------------------------------------------------------------------------

    def _call(self, what: str, operation: Callable[[Any], Any]) -> Any:
        """``operation(client)``, or None at once while Redis is down; a fault starts or extends the backoff.

        The lock guards the client and the backoff only: the round trip itself runs outside it, so a
        large save on one thread (the save thread) never holds up a lookup or a load on another (the
        client's connection pool gives each its own connection).
        """
        with self._lock:
            if not self.available:
                return None
            try:
                if self._client is None:
                    self._client = self._connect()
            except self._faults as exc:
                self._failed(what, exc)
                return None
            client = self._client
        try:
            result = operation(client)
        except self._faults as exc:
            with self._lock:
                if self._client is client:  # the first to see this client fail backs off; the others just miss
                    self._failed(what, exc)
            return None
        if self._failures:
            with self._lock:
                if self._failures:
                    _log.warning(
                        "kvpool redis tier: %s answers again after %d failed tries", self.display_url, self._failures
                    )
                    self._counters.forget_warning("down")
                    self._failures = 0
        return result

    def _connect(self) -> Any:
        retry = self._redis.retry.Retry(self._redis.backoff.NoBackoff(), 0)  # our backoff decides when to retry
        if self.cluster:
            return self._redis.cluster.RedisCluster.from_url(self._url, retry=retry, **_TIMEOUTS)
        client = self._redis.Redis.from_url(self._url, retry=retry, **_TIMEOUTS)
        self._scripts = {script: client.register_script(script) for script in (LOOKUP_SCRIPT, READ_SCRIPT)}
        return client

    def _failed(self, what: str, exc: BaseException) -> None:
        self._drop_client()  # reconnect (and rediscover a cluster's nodes) on the next try
        first, ceiling = self._backoff_s
        delay = min(ceiling, first * 2**self._failures)
        self._failures += 1
        self._retry_at = self._clock() + delay
        self._counters.error(
            "down",
            f"cannot {what} {self.display_url}: {type(exc).__name__}: {exc}; skipping the tier (misses, no saves), "
            f"retrying with a backoff up to {ceiling:g}s",
        )

    def _drop_client(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            try:
                client.close()
            except self._faults:
                pass


def _ttl(text: str | None, url: str) -> int | None:
    if text is None:
        return None
    if not text.isdigit() or int(text) <= 0:
        raise ConfigError(f"ttl in redis tier URL {url!r} must be a positive number of seconds, got {text!r}")
    return int(text)


def _open(target: RedisTarget, codec: EntryCodec) -> RedisStore:
    return RedisStore(target, codec)


#: The Redis tier, as the registry (:data:`kvpool.tiers.store.BACKENDS`) holds it.
BACKEND = TierBackend(
    kind=TierKind.REDIS,
    prefixes=tuple(f"{scheme}://" for scheme in sorted(REDIS_SCHEMES)),
    parse=RedisTarget.parse,
    open=_open,
    example="redis://HOST:PORT/DB, rediss://... (TLS), redis+cluster://HOST:PORT or unix:///PATH",
    shared=True,
    outlives_process=True,
    fleet_wide=True,
    link=(1.25e9, 300e-6),  # a Redis server over 10 Gb/s
    vllm_hit_source="EXTERNAL_UNSPECIFIED",
    event_medium="STORAGE",  # kvpool.events.MEDIUM_STORAGE: vLLM's name for every tier below host memory
)
