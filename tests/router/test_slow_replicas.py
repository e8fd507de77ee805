"""A slow replica is not a dead one: a health check it misses takes it out of rotation, its cache stays known."""

from __future__ import annotations

import asyncio

import httpx

from kvpool.router.index import MemoryIndex
from kvpool.router.monitor import ReplicaMonitor
from kvpool.router.replicas import Replica

URL = "http://replica-a:8000"
HASHES = [b"block-%d" % i for i in range(4)]


class Feed:
    """Stands in for a replica's event feed: the monitor stops it when the replica is gone."""

    def __init__(self) -> None:
        self.stopped = False

    def stop(self) -> None:
        self.stopped = True


def monitor_with(answer) -> tuple[ReplicaMonitor, Replica, MemoryIndex, Feed]:
    replica = Replica(URL, base=URL, up=True)
    index = MemoryIndex()
    index.store(URL, HASHES)
    monitor = ReplicaMonitor([replica], index, interval=1.0, timeout=0.5)
    feed = Feed()
    monitor.feeds[URL] = feed  # type: ignore[assignment]
    monitor._client = httpx.AsyncClient(transport=httpx.MockTransport(answer))
    return monitor, replica, index, feed


def held(index: MemoryIndex) -> int:
    return index.match(HASHES, [URL])[0]


def timing_out(request: httpx.Request) -> httpx.Response:
    raise httpx.ReadTimeout("no answer", request=request)


def test_a_missed_health_check_keeps_the_replicas_entries_and_feed_and_an_answer_brings_it_back():
    answers = {"health": timing_out}
    monitor, replica, index, feed = monitor_with(lambda request: answers["health"](request))
    asyncio.run(monitor.check(replica))
    assert not replica.up and "no answer in 0.5 s" in (replica.last_error or "")
    assert held(index) == 4 and monitor.feeds[URL] is feed and not feed.stopped
    answers["health"] = lambda request: httpx.Response(200, json={"status": "ok"})
    asyncio.run(monitor.check(replica))
    assert replica.up and held(index) == 4 and monitor.feeds[URL] is feed  # as it was: no new feed


def test_a_refused_connection_drops_the_entries_even_after_the_replica_was_slow():
    answers = {"health": timing_out}
    monitor, replica, index, feed = monitor_with(lambda request: answers["health"](request))
    asyncio.run(monitor.check(replica))
    assert held(index) == 4

    def refused(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    answers["health"] = refused
    asyncio.run(monitor.check(replica))
    assert not replica.up and held(index) == 0 and feed.stopped and URL not in monitor.feeds


def test_a_request_that_times_out_connecting_keeps_the_entries_one_refused_drops_them():
    answers = {"health": timing_out}
    monitor, replica, index, feed = monitor_with(lambda request: answers["health"](request))
    request = httpx.Request("POST", URL + "/v1/completions")
    monitor.suspect(replica, httpx.ConnectTimeout("slow to accept", request=request))
    assert not replica.up and held(index) == 4 and not feed.stopped
    answers["health"] = lambda request: httpx.Response(200, json={"status": "ok"})
    asyncio.run(monitor.check(replica))
    assert replica.up and monitor.feeds[URL] is feed
    monitor.suspect(replica, httpx.ConnectError("refused", request=request))
    assert not replica.up and held(index) == 0 and feed.stopped
