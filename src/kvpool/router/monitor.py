"""Which replicas are up: health checks, and the event feed of each replica that is.

Every ``interval`` seconds the monitor asks each replica's ``GET /health``. (The load
figure is the router's own count of requests in flight at each replica, exact for
one router: a replica's ``/health?verbose=1`` reports its queue too, but it runs
the pool's invariant checker on the engine thread, too costly to poll.) A replica that
answers with an error or refuses a connection is marked down at once: its index entries
are dropped and its event feed stopped, so the router neither sends it requests nor
believes it holds blocks. When it answers again the monitor reads its ``GET /kv-events``
(where it publishes, how it hashes) and starts a new feed, which rebuilds its entries from
the replay buffer.

A replica that is *slow* (no answer within ``timeout``, to a health check or a
connection attempt) is out of rotation too, but it has not lost its cache: its entries
and its event feed are kept, and the next health check that it answers puts it back as
it was. On a busy machine every replica can miss a check at once; dropping their
entries then threw away what prefix routing knows (measured on an emulated fleet of 8:
a third of the cached tokens lost, TTFT p90 4x). Should the slow replica have restarted
meanwhile, its events say so (a new process clears its blocks) and the hash check of
its answers catches what they do not.

A replica that accepted a request and then stayed silent past the router's upstream
timeout may still answer ``/health`` (its HTTP loop alive, its engine stuck): it is
*quarantined*, down for ``quarantine`` seconds whatever its health checks say, so
requests go elsewhere meanwhile.

Passive health (*outlier ejection*, :class:`Ejection`): the answers themselves count too.
A replica that fails fast (answers 5xx at once) is always the least loaded, and would
take most of the traffic while its ``/health`` says 200. Every failed answer (a status of
500 or more, or a connection that broke: reset, closed before the answer) counts against
it, and any other answer clears the count; ``after`` failures in a row *eject* it, down
for ``time`` seconds whatever its health checks say. An ejection with no good answer
since the last one lasts twice as long as that one, up to ``max_time``; a good answer
starts the back-off over. When the time is up the health checks bring it back, and it is
tried again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import ssl
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from kvpool.errors import ConfigError, KVPoolError
from kvpool.hashing import VLLM_DEFAULT_SEED, BlockHasher, HashAlgo
from kvpool.replica_rates import ReplicaRates
from kvpool.router.feed import EventFeed
from kvpool.router.index import BlockIndex
from kvpool.router.metrics_rates import METRICS_SOURCE, MetricsSample, MetricsWindow
from kvpool.router.replicas import EventsInfo, Hashing, Replica
from kvpool.router.snapshot_loader import http_snapshot
from kvpool.router.stats import HashVerdict

if TYPE_CHECKING:
    import httpx

    from kvpool.kv_events import CurveTrust

__all__ = ["Ejection", "ReplicaMonitor"]

log = logging.getLogger("kvpool.route")

#: The least seconds a snapshot fetch may take (a large pool's body is tens of megabytes).
SNAPSHOT_TIMEOUT_S = 30.0


@dataclass(frozen=True, slots=True, kw_only=True)
class Ejection:
    """The passive health rule (see the module): ``after`` failed answers in a row eject a replica.

    The first ejection lasts ``time`` seconds, each further one in a row twice the last, at
    most ``max_time``. Bad values are a :class:`ConfigError` naming them.
    """

    after: int = 3
    time: float = 10.0
    max_time: float = 300.0

    def __post_init__(self) -> None:
        if isinstance(self.after, bool) or not isinstance(self.after, int) or self.after < 1:
            raise ConfigError(f"eject_after must be an integer >= 1 (failed answers in a row), got {self.after!r}")
        for name in ("time", "max_time"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < math.inf:
                raise ConfigError(f"eject_{name} must be a positive number of seconds, got {value!r}")
        if self.max_time < self.time:
            raise ConfigError(f"eject_max_time ({self.max_time!r}) must be at least eject_time ({self.time!r})")

    def duration(self, ejections: int) -> float:
        """How long the ``ejections``-th ejection in a row lasts (1: the first)."""
        return min(self.time * 2.0 ** min(ejections - 1, 64), self.max_time)


class ReplicaMonitor:
    """Health checks and event feeds for a fixed set of replicas."""

    def __init__(
        self,
        replicas: Sequence[Replica],
        index: BlockIndex,
        interval: float,
        timeout: float,
        admin_key: str | None = None,
        *,
        quarantine: float = 30.0,
        ejection: Ejection | None = None,
        trust: CurveTrust | None = None,
        rates_interval: float = 5.0,
    ) -> None:
        self.replicas = list(replicas)
        self._trust = trust  # CURVE: the router's keys and the replica keys it follows
        # /kv-events is open on a replica's loopback interface, elsewhere only with an admin key
        self._operator = {"authorization": f"Bearer {admin_key}"} if admin_key else {}
        self.index = index
        self.interval = interval
        self.timeout = timeout
        self.quarantine = quarantine
        self.ejection = ejection or Ejection()
        self.feeds: dict[str, EventFeed] = {}
        self._checks: list[asyncio.Task[None]] = []
        self._pending: set[asyncio.Task[None]] = set()  # checks asked for by failed requests
        self._hashers: dict[Hashing, BlockHasher | None] = {}
        self._client: httpx.AsyncClient | None = None
        self._tls: ssl.SSLContext | None = None  # for the snapshot fetches: the certificates, loaded once
        self.on_down: Callable[[str], None] | None = None  # told the URL of each replica marked down
        self._slow: set[str] = set()  # out of rotation for slowness: entries and feeds kept
        # GET /rates every this many intervals (rarely: rates move slowly, and a check costs the replica too)
        self.rates_every = max(1, round(rates_interval / interval)) if interval > 0 else 1
        self.skipped = 0  # periodic checks skipped: the replica had shown life within the interval
        self.probes = 0  # periodic checks sent on a kept connection (not through the HTTP client)
        self._metrics: dict[str, MetricsWindow] = {}  # a described replica's /metrics reads, by URL

    async def start(self, client: httpx.AsyncClient) -> None:
        self._client = client
        for replica in self.replicas:
            self.index.clear(replica.url)  # whatever a shared index held for it is older than this router
        await asyncio.gather(*(self.check(r) for r in self.replicas))
        self._checks = [asyncio.create_task(self._watch(r)) for r in self.replicas]

    async def stop(self) -> None:
        tasks = [*self._checks, *self._pending]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._checks.clear()
        for feed in self.feeds.values():
            feed.stop()
        self.feeds.clear()

    def hashers(self) -> dict[Hashing, BlockHasher]:
        """One block hasher per distinct hashing among the replicas that are up and publish events."""
        found = {}
        for replica in self.replicas:
            if replica.up and replica.events is not None:
                key = replica.events.hashing
                if key not in self._hashers:
                    self._hashers[key] = _hasher(replica.events, replica.url)
                hasher = self._hashers[key]
                if hasher is not None:
                    found[key] = hasher
        return found

    async def _watch(self, replica: Replica) -> None:
        probe = _HealthProbe.for_base(replica.base)
        beat = 0
        try:
            while True:
                await asyncio.sleep(self.interval)
                beat += 1
                if self._heard_lately(replica):
                    self.skipped += 1
                elif probe is None:
                    await self.check(replica)
                else:
                    await self._probe(replica, probe)
                if replica.up and self.rates_every and beat % self.rates_every == 0:
                    await self.read_rates(replica, probe)
        finally:
            if probe is not None:
                probe.close()

    def _heard_lately(self, replica: Replica) -> bool:
        """Whether ``replica`` showed it is alive within the last interval: a health check would tell nothing.

        Only an up replica with nothing held against it qualifies (a slow, down, quarantined or
        ejected one is always checked: its checks are what bring it back). Life is an answer to a
        request (:meth:`succeeded`) or an event batch its feed applied.
        """
        if not replica.up or replica.url in self._slow or replica.held_until > time.monotonic():
            return False
        if time.monotonic() - replica.heard_at < self.interval:
            return True
        feed = self.feeds.get(replica.url)
        last = getattr(feed, "last_applied", None)
        return last is not None and time.time() - last < self.interval

    async def check(self, replica: Replica) -> None:
        """One health check (through the HTTP client); brings the replica up (events and all) or marks it down."""
        import httpx

        assert self._client is not None
        try:
            response = await self._client.get(replica.base + "/health", timeout=self.timeout)
        except httpx.TimeoutException as exc:
            self.mark_slow(replica, f"/health: no answer in {self.timeout:g} s ({type(exc).__name__})")
            return
        except httpx.TransportError as exc:
            self.mark_down(replica, f"/health: {type(exc).__name__}")
            return
        await self._answered(replica, response.status_code)

    async def _probe(self, replica: Replica, probe: _HealthProbe) -> None:
        """The periodic health check on the replica's kept connection: the same verdicts as :meth:`check`."""
        self.probes += 1
        try:
            status, _ = await asyncio.wait_for(probe.get(), self.timeout)
        except TimeoutError:
            probe.close()  # an answer may still arrive on it: start the next check on a fresh connection
            self.mark_slow(replica, f"/health: no answer in {self.timeout:g} s (probe timeout)")
            return
        except (OSError, EOFError, ValueError) as exc:
            probe.close()
            self.mark_down(replica, f"/health: {type(exc).__name__}")
            return
        await self._answered(replica, status)

    async def _answered(self, replica: Replica, status: int) -> None:
        if status != 200:
            self.mark_down(replica, f"/health answered {status}")
            return
        if not replica.up and time.monotonic() >= replica.held_until:
            if replica.url in self._slow:  # slow, not gone: its feed and entries were kept
                self._slow.discard(replica.url)
                replica.up = True
                log.info("%s answers again (its index entries and event feed were kept)", replica.url)
            else:
                await self._bring_up(replica)

    async def read_rates(self, replica: Replica, probe: _HealthProbe | None = None) -> None:
        """Read a replica's rates into ``replica.rates``; a bad answer leaves the old rates, and says why.

        A kvpool replica's from its ``GET /rates`` (one that has not stepped yet, ``"source": "none
        yet"``, leaves the old rates too); a described (vLLM) one's from its ``GET /metrics``
        (:mod:`kvpool.router.metrics_rates`), unless its spec named a profile: the operator's
        override. On ``probe``'s kept connection when given, else through the HTTP client.
        """
        if self._client is None:
            return
        read: Callable[[bytes, str], ReplicaRates | None]
        if replica.discover:
            path, read, headers = "/rates", ReplicaRates.from_json, self._operator
        elif replica.rates is None or replica.rates.source == METRICS_SOURCE:
            window = self._metrics.setdefault(replica.url, MetricsWindow())
            path, headers = "/metrics", {}  # the admin key is a kvpool replica's: a vLLM one is not given it

            def read(content: bytes, where: str) -> ReplicaRates | None:
                return window.note(MetricsSample.parse(content.decode("utf-8", "replace"), where))
        else:
            return
        answer = await self._get(replica, probe, path, headers)
        if answer is None:
            return  # its health checks judge it; the rates wait for the next read
        status, content = answer
        where = f"GET {replica.url}{path}"
        if status != 200:
            replica.rates_error = f"{where} answered {status}"
            return
        try:
            rates = read(content, where)
        except ConfigError as exc:
            if replica.rates_error != str(exc):
                log.warning("%s (its old rates kept)", exc)
            replica.rates_error = str(exc)
            return
        replica.rates_error = None
        if rates is not None:
            replica.rates = rates

    async def _get(
        self, replica: Replica, probe: _HealthProbe | None, path: str, headers: dict[str, str]
    ) -> tuple[int, bytes] | None:
        """``replica``'s answer to ``GET path`` (on ``probe`` when given), or None when none came in time."""
        import httpx

        assert self._client is not None
        try:
            if probe is not None:
                return await asyncio.wait_for(probe.get(path), self.timeout)
            response = await self._client.get(replica.base + path, headers=headers, timeout=self.timeout)
        except (TimeoutError, OSError, EOFError, ValueError, httpx.TransportError):
            if probe is not None:
                probe.close()
            return None
        return response.status_code, response.content

    async def _bring_up(self, replica: Replica) -> None:
        import httpx

        assert self._client is not None
        replica.events = None
        replica.last_error = None
        if not replica.discover:  # described on the command line: nothing to ask
            replica.events = replica.described
        else:
            try:
                response = await self._client.get(
                    replica.base + "/kv-events", headers=self._operator, timeout=self.timeout
                )
                if response.status_code == 200:
                    replica.events = EventsInfo.from_json(response.json(), replica.url, self._trust)
                else:
                    hint = (
                        "give the router the replicas' --admin-key-file"
                        if response.status_code in (401, 403)
                        else "not a kvpool replica? describe its events with --replica URL,events=..."
                    )
                    replica.last_error = f"/kv-events answered {response.status_code} ({hint}): no events from it"
            except (httpx.TransportError, ValueError) as exc:  # ConfigError is a ValueError
                replica.last_error = f"/kv-events: {exc}; no events from it"
        if replica.last_error and replica.events is None:
            log.warning("%s: %s", replica.url, replica.last_error)
        replica.up = True
        replica.stats.check.reset()  # maybe another process, with other settings: judged afresh
        replica.stats.verdict = HashVerdict.UNCHECKED
        log.info("%s is up%s", replica.url, "" if replica.events is None else f", events at {replica.events.endpoint}")
        await self.read_rates(replica)
        if replica.events is not None:
            self.index.limit(replica.url, replica.events.num_blocks)
            feed = self._feed(replica, replica.events)
            self.feeds[replica.url] = feed
            feed.start(asyncio.get_running_loop())

    def _feed(self, replica: Replica, events: EventsInfo) -> EventFeed:
        """A feed of ``replica``'s events, loading its snapshot (asked with the admin key) where it has one."""
        snapshot = None
        if events.snapshot is not None:
            if self._tls is None:
                import httpx

                self._tls = httpx.create_ssl_context()  # httpx's defaults, as the router's own client has them
            snapshot = http_snapshot(
                replica.base + events.snapshot, self._operator, max(self.timeout, SNAPSHOT_TIMEOUT_S), self._tls
            )
        return EventFeed(replica.url, events, self.index, snapshot=snapshot)

    def resync(self, urls: set[str]) -> None:
        """Start these replicas' event feeds over (their index entries were cleared): each catches up again."""
        for replica in self.replicas:
            feed = self.feeds.get(replica.url)
            if replica.url in urls and feed is not None and replica.events is not None:
                feed.stop()
                self.feeds[replica.url] = fresh = self._feed(replica, replica.events)
                fresh.start(asyncio.get_running_loop())

    def suspect(self, replica: Replica, error: Exception) -> None:
        """A request to ``replica`` failed: a refused connection takes it down now, a replica that went
        silent past the upstream timeout is quarantined, anything else (a connection reset or closed
        before the answer's end) counts as a failed answer (:meth:`failed`) and has it checked now.

        (A keep-alive connection the replica closed as it was reused fails the same way as
        a crash mid-answer; the health check tells them apart.)
        """
        import httpx

        if isinstance(error, httpx.ConnectError):
            self.mark_down(replica, f"connection refused: {error!r}")
        elif isinstance(error, httpx.ConnectTimeout):
            self.mark_slow(replica, f"no connection in time: {error!r}")
        elif isinstance(error, httpx.TimeoutException):
            replica.held_until = time.monotonic() + self.quarantine
            self.mark_slow(
                replica, f"no answer in time ({type(error).__name__}): out of rotation for {self.quarantine:g} s"
            )
        else:
            self.failed(replica, f"connection broke: {type(error).__name__}")
            if replica.up and self._client is not None:
                task = asyncio.create_task(self.check(replica))
                self._pending.add(task)
                task.add_done_callback(self._pending.discard)

    def failed(self, replica: Replica, why: str) -> None:
        """A failed answer from ``replica`` (a 5xx, a broken connection): counted; ``after`` in a row eject it."""
        replica.consecutive_failures += 1
        replica.last_error = f"{why} ({replica.consecutive_failures} in a row)"
        if replica.consecutive_failures < self.ejection.after or not replica.up:
            return
        replica.ejections += 1
        replica.ejected += 1
        period = self.ejection.duration(replica.ejections)
        replica.held_until = time.monotonic() + period
        failures, replica.consecutive_failures = replica.consecutive_failures, 0
        self.mark_down(replica, f"ejected for {period:g} s: {failures} failed answers in a row, the last {why}")

    def succeeded(self, replica: Replica) -> None:
        """An answer that is not a failure: the count of failures in a row, and the back-off, start over.

        It is a sign of life too: the next health check within the interval is skipped.
        """
        replica.heard_at = time.monotonic()
        replica.consecutive_failures = 0
        replica.ejections = 0

    def mark_slow(self, replica: Replica, why: str) -> None:
        """Out of rotation, its cache believed intact: entries and feed kept (a health check it answers
        brings it back as it was)."""
        replica.last_error = why
        if not replica.up:
            return
        replica.up = False
        replica.failures += 1
        self._slow.add(replica.url)
        log.warning("%s is slow (%s): out of rotation; its index entries and event feed are kept", replica.url, why)

    def mark_down(self, replica: Replica, why: str) -> None:
        """Out of rotation at once: its entries dropped, its feed stopped (a health check brings it back)."""
        replica.last_error = why
        was_slow = replica.url in self._slow
        self._slow.discard(replica.url)
        if not replica.up and not was_slow:
            return
        if replica.up:
            replica.failures += 1
        replica.up = False
        log.warning("%s is down (%s): its index entries are dropped", replica.url, why)
        feed = self.feeds.pop(replica.url, None)
        if feed is not None:
            feed.stop()
        self.index.clear(replica.url)
        if self.on_down is not None:
            self.on_down(replica.url)


class _HealthProbe:
    """``GET /health`` (and ``/rates``, ``/metrics``) on one kept HTTP/1.1 connection, with asyncio's streams alone.

    The periodic check at every replica, every interval, is the router's idle CPU: through the
    HTTP client it cost about 5 ms a second per replica; a bare request on a kept connection
    costs a small part of that (``benchmarks/bench_router_idle.py``). Only a plain ``http://``
    base without credentials is probed this way (:meth:`for_base`); the others, and every
    check outside the periodic loop, go through the HTTP client.

    :meth:`get` answers the status code and the body. It raises ``OSError`` (refused, reset), ``EOFError``
    (closed before an answer) or ``ValueError`` (not an HTTP answer); the caller bounds its
    time and :meth:`close`s the connection after any of these. A kept connection the replica
    closed while idle is opened again once, silently.
    """

    __slots__ = ("_authority", "_host", "_port", "_reader", "_requests", "_writer")

    def __init__(self, host: str, port: int) -> None:
        self._host, self._port = host, port
        self._authority = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        self._requests: dict[str, bytes] = {}  # path -> its request's bytes, built once
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    @classmethod
    def for_base(cls, base: str) -> _HealthProbe | None:
        parts = urlsplit(base)
        if parts.scheme != "http" or parts.username is not None or parts.password is not None or not parts.hostname:
            return None
        return cls(parts.hostname, parts.port or 80)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
        self._reader = self._writer = None

    async def get(self, path: str = "/health") -> tuple[int, bytes]:
        request = self._requests.get(path)
        if request is None:
            text = f"GET {path} HTTP/1.1\r\nHost: {self._authority}\r\nAccept: */*\r\n\r\n"
            request = self._requests[path] = text.encode("ascii")
        reused = self._writer is not None
        try:
            return await self._exchange(request)
        except (OSError, EOFError):
            self.close()
            if not reused:
                raise
        return await self._exchange(request)  # the idle connection had been closed: once more on a fresh one

    async def _exchange(self, request: bytes) -> tuple[int, bytes]:
        if self._writer is None:
            self._reader, self._writer = await asyncio.open_connection(self._host, self._port)
        reader, writer = self._reader, self._writer
        assert reader is not None
        writer.write(request)
        head = await reader.readuntil(b"\r\n\r\n")  # IncompleteReadError is an EOFError
        lines = head.decode("latin-1").split("\r\n")
        version, _, rest = lines[0].partition(" ")
        if not version.startswith("HTTP/1.") or not rest[:3].isdigit():
            raise ValueError(f"not an HTTP answer: {lines[0][:80]!r}")
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip().lower()
        if "content-length" in headers:
            body = await reader.readexactly(int(headers["content-length"]))
        elif headers.get("transfer-encoding") == "chunked":
            pieces = []
            while size := int((await reader.readuntil(b"\r\n")).split(b";")[0], 16):
                pieces.append((await reader.readexactly(size + 2))[:-2])
            await reader.readuntil(b"\r\n")
            body = b"".join(pieces)
        else:  # the body runs to the connection's end
            body = await reader.read()
            self.close()
        if headers.get("connection") == "close" or version == "HTTP/1.0":
            self.close()
        return int(rest[:3]), body


def _hasher(info: EventsInfo, url: str) -> BlockHasher | None:
    """The hasher a replica advertises; None (route it by load) when this kvpool cannot compute its hashes."""
    try:
        # a described replica's seed is its PYTHONHASHSEED itself; a kvpool replica tells where its seed came from
        hasher = BlockHasher(info.block_size, info.hash_algorithm, _described_seed(info) if info.configured else None)
    except KVPoolError as exc:
        log.warning("%s hashes blocks with %r, which the router cannot reproduce: %s", url, info.hash_algorithm, exc)
        return None
    if not info.configured and info.hash_seed is not None and hasher.seed_name != info.hash_seed:
        log.warning(
            "%s seeds its block hashes from %r, the router from %r (PYTHONHASHSEED must match): routing it by load",
            url,
            info.hash_seed,
            hasher.seed_name,
        )
        return None
    return hasher


def _described_seed(info: EventsInfo) -> str | bytes | None:
    """The seed a described replica hashes with: its PYTHONHASHSEED, or vLLM's fixed default when it has none.

    (Never the router's own environment: the router's PYTHONHASHSEED says nothing about the replica's.)
    """
    if HashAlgo.parse(info.hash_algorithm).is_vllm:
        return info.hash_seed if info.hash_seed is not None else VLLM_DEFAULT_SEED
    return None if info.hash_seed is None else info.hash_seed.encode()
