"""The periodic health check: skipped after a sign of life, sent on a kept connection, the same verdicts."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

import httpx
import pytest

from kvpool.replica_rates import ReplicaRates
from kvpool.router.index import MemoryIndex
from kvpool.router.monitor import ReplicaMonitor, _HealthProbe
from kvpool.router.replicas import Replica

HASHES = [b"block-%d" % i for i in range(4)]


class Fake:
    """A replica's HTTP side on port 0: answers GET /health with ``status``, counts connections and requests."""

    def __init__(self) -> None:
        self.status = 200
        self.silent = False  # read requests, answer nothing
        self.close_after = False  # close each connection after its answer, without saying so
        self.chunked = False
        self.rates = b'{"source": "none yet"}'
        self.connections = 0
        self.requests = 0
        self.asked = asyncio.Event()
        self._writers: list[asyncio.StreamWriter] = []

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    async def stop(self) -> None:
        for writer in self._writers:
            writer.close()
        self.server.close()
        await self.server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self._writers.append(writer)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                path = head.split(b" ")[1]
                assert path in (b"/health", b"/rates")
                self.requests += 1
                self.asked.set()
                if self.silent:
                    continue
                body = self.rates if path == b"/rates" else b'{"status": "ok"}'
                if self.chunked:
                    writer.write(b"HTTP/1.1 %d X\r\ntransfer-encoding: chunked\r\n\r\n" % self.status)
                    writer.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body))
                else:
                    writer.write(b"HTTP/1.1 %d X\r\ncontent-length: %d\r\n\r\n%s" % (self.status, len(body), body))
                await writer.drain()
                if self.close_after:
                    writer.close()
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()


async def until(condition: Callable[[], bool], what: str, timeout: float = 20.0) -> None:
    """Wait (yielding to the monitor's loop) until ``condition`` holds; fail naming ``what`` past ``timeout``."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.005)  # a turn of the loop for the watch task, not a measured wait


def monitor_for(url: str, *, interval: float = 0.05, timeout: float = 0.5) -> tuple[ReplicaMonitor, Replica]:
    replica = Replica(url, up=True)
    index = MemoryIndex()
    index.store(url, HASHES)
    monitor = ReplicaMonitor([replica], index, interval=interval, timeout=timeout)
    return monitor, replica


def test_probe_keeps_one_connection_and_reads_both_body_framings() -> None:
    async def go() -> None:
        fake = Fake()
        url = await fake.start()
        probe = _HealthProbe.for_base(url)
        assert probe is not None
        assert [(await probe.get())[0] for _ in range(3)] == [200, 200, 200]
        fake.chunked, fake.status = True, 503
        assert await probe.get() == (503, b'{"status": "ok"}')  # the chunked body, joined
        assert fake.connections == 1 and fake.requests == 4
        fake.close_after = True
        fake.chunked, fake.status = False, 200
        assert (await probe.get())[0] == 200  # the replica closes it after this answer
        assert (await probe.get())[0] == 200  # opened again, silently
        assert fake.connections == 2
        probe.close()
        await fake.stop()

    asyncio.run(go())


def test_only_plain_http_without_credentials_is_probed() -> None:
    assert _HealthProbe.for_base("https://r:8000") is None
    assert _HealthProbe.for_base("http://user:secret@r:8000") is None
    assert _HealthProbe.for_base("http://r:8000") is not None


def test_the_loop_marks_a_silent_replica_slow_keeping_its_entries_and_a_refusing_one_down() -> None:
    async def go() -> None:
        fake = Fake()
        url = await fake.start()
        monitor, replica = monitor_for(url, interval=0.02, timeout=0.1)
        fake.silent = True
        watch = asyncio.create_task(monitor._watch(replica))
        await until(lambda: not replica.up, "the silent replica marked slow")
        assert "no answer in 0.1 s" in (replica.last_error or "")
        assert monitor.index.match(HASHES, [url])[0] == 4  # slow is not dead
        fake.silent = False
        await until(lambda: replica.up, "the replica back")  # it answers again: as it was, no bring-up
        assert monitor.index.match(HASHES, [url])[0] == 4
        await fake.stop()
        await until(lambda: not replica.up, "the refusing replica marked down")
        assert replica.last_error is not None and replica.last_error.startswith("/health: ")
        assert monitor.index.match(HASHES, [url])[0] == 0  # refused: entries dropped
        watch.cancel()
        with pytest.raises(asyncio.CancelledError):
            await watch
        assert monitor.probes > 0

    asyncio.run(go())


def test_a_status_other_than_200_takes_it_down() -> None:
    async def go() -> None:
        fake = Fake()
        url = await fake.start()
        fake.status = 503
        monitor, replica = monitor_for(url)
        watch = asyncio.create_task(monitor._watch(replica))
        await until(lambda: not replica.up, "the 503 replica marked down")
        assert replica.last_error == "/health answered 503"
        watch.cancel()
        await fake.stop()

    asyncio.run(go())


def test_an_answer_to_a_request_within_the_interval_skips_the_check() -> None:
    async def go() -> None:
        fake = Fake()
        url = await fake.start()
        monitor, replica = monitor_for(url, interval=0.05)
        monitor.succeeded(replica)
        assert monitor._heard_lately(replica)
        replica.held_until = float("inf")  # held (ejected, quarantined): always checked
        assert not monitor._heard_lately(replica)
        replica.held_until = 0.0
        monitor._slow.add(replica.url)
        assert not monitor._heard_lately(replica)
        monitor._slow.clear()
        replica.heard_at -= 1.0
        assert not monitor._heard_lately(replica)
        await fake.stop()

    asyncio.run(go())


def test_rates_are_read_and_a_bad_body_keeps_the_old_ones() -> None:
    good = ReplicaRates(prefill_tokens_per_s=9000.0, decode_step_s=0.02, source="measured")
    bodies = {"rates": json.dumps(good.to_json()).encode()}

    def answer(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/rates"
        return httpx.Response(200, content=bodies["rates"])

    monitor, replica = monitor_for("http://replica-a:8000")
    monitor._client = httpx.AsyncClient(transport=httpx.MockTransport(answer))
    asyncio.run(monitor.read_rates(replica))
    assert replica.rates == good and replica.rates_error is None
    bodies["rates"] = b'{"prefill_tokens_per_s": -1, "decode_step_s": 0, "source": "measured"}'
    asyncio.run(monitor.read_rates(replica))
    assert replica.rates == good
    assert replica.rates_error is not None and "GET http://replica-a:8000/rates" in replica.rates_error
    assert "prefill_tokens_per_s" in replica.rates_error
    assert replica.describe()["rates"] == good.to_json()
    bodies["rates"] = b'{"source": "none yet"}'
    asyncio.run(monitor.read_rates(replica))
    assert replica.rates == good and replica.rates_error is None


def test_a_described_replica_with_a_profile_is_not_asked_for_rates() -> None:
    def answer(request: httpx.Request) -> httpx.Response:
        raise AssertionError(f"asked {request.url}")

    monitor, replica = monitor_for("http://replica-a:8000")
    replica.discover = False
    profiled = ReplicaRates(prefill_tokens_per_s=5000.0, decode_step_s=0.03, source="profile:mine")
    replica.rates = profiled  # the operator's override: neither /rates nor /metrics is read
    monitor._client = httpx.AsyncClient(transport=httpx.MockTransport(answer))
    asyncio.run(monitor.read_rates(replica))
    assert replica.rates is profiled


def test_rates_are_read_on_the_kept_connection() -> None:
    async def go() -> None:
        fake = Fake()
        url = await fake.start()
        rates = ReplicaRates(prefill_tokens_per_s=7000.0, decode_step_s=0.01, source="measured")
        fake.rates = json.dumps(rates.to_json()).encode()
        fake.chunked = True
        monitor, replica = monitor_for(url)
        monitor._client = httpx.AsyncClient(transport=httpx.MockTransport(lambda r: httpx.Response(500)))
        probe = _HealthProbe.for_base(url)
        assert probe is not None
        await monitor.read_rates(replica, probe)
        assert replica.rates == rates and fake.connections == 1  # not through the client (it answers 500)
        fake.rates = b"{broken"
        await monitor.read_rates(replica, probe)
        assert replica.rates == rates and "not JSON" in (replica.rates_error or "")
        probe.close()
        await fake.stop()

    asyncio.run(go())
