"""An emulated replica's ``GET /kv-events/snapshot``: the pool's cached blocks, after the last batch published."""

from __future__ import annotations

from collections.abc import Callable

import pytest

pytest.importorskip("zmq")
pytest.importorskip("msgspec")
pytest.importorskip("starlette")
httpx = pytest.importorskip("httpx")

from kvpool.emulator import EmulatedEngine  # noqa: E402
from kvpool.events import BlockRemoved, BlockStored  # noqa: E402
from kvpool.hashing import BlockHash  # noqa: E402
from kvpool.kv_events import KVEventPublisher, KVEventSubscriber  # noqa: E402
from kvpool.kv_events.snapshot import SNAPSHOT_PATH, decode_snapshot  # noqa: E402
from kvpool.serve import build_app  # noqa: E402
from tests.emulator.conftest import serve_config  # noqa: E402
from tests.serve.conftest import LiveServer  # noqa: E402


def _held(engine: EmulatedEngine) -> set[BlockHash]:
    return {block.block_hash for block in engine.manager.pool.blocks if block.block_hash is not None}


def _complete(live: LiveServer, prompt: list[int]) -> None:
    body = {"model": "emulated", "prompt": prompt, "max_tokens": 1}
    response = httpx.post(f"{live.base_url}/completions", json=body, timeout=30)
    assert response.status_code == 200, response.text


def test_the_snapshot_is_the_pools_cached_blocks_and_the_batches_after_it_complete_it(
    make_engine: Callable[..., EmulatedEngine],
) -> None:
    engine = make_engine(block_size=4, num_blocks=12, enable_kv_events=True)
    publisher = KVEventPublisher("bind:tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0")
    live = LiveServer(build_app(engine, serve_config(), events=publisher))
    try:
        assert httpx.get(f"{live.url}/kv-events", timeout=30).json()["snapshot"] == SNAPSHOT_PATH
        empty = decode_snapshot(httpx.get(f"{live.url}{SNAPSHOT_PATH}", timeout=30).content)
        assert empty.batch.events == () and empty.seq == publisher.next_seq - 1
        _complete(live, list(range(10, 30)))  # 5 blocks
        answer = httpx.get(f"{live.url}{SNAPSHOT_PATH}", timeout=30)
        assert answer.headers["content-type"] == "application/vnd.msgpack"
        snapshot = decode_snapshot(answer.content)
        held_then = _held(engine)  # the engine is idle: nothing changed since
        _complete(live, list(range(50, 86)))  # 9 blocks: the pool of 11 evicts some of the first's
        with KVEventSubscriber(publisher.endpoint, replay_endpoint=publisher.replay_endpoint) as subscriber:
            after = [item for item in subscriber.replay(0) if item.seq > snapshot.seq]
    finally:
        live.stop()
    claimed = {h for event in snapshot.batch.events for h in event.block_hashes}
    assert claimed == held_then and snapshot.num_blocks == len(held_then) == 5
    assert all(isinstance(e, BlockStored) and e.token_ids == () for e in snapshot.batch.events)
    for item in after:  # the snapshot, then the batches after it: exactly the pool
        for event in item.batch.events:
            if isinstance(event, BlockStored):
                claimed |= set(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                claimed -= set(event.block_hashes)
    assert claimed == _held(engine)
    assert any(isinstance(e, BlockRemoved) for item in after for e in item.batch.events)


def test_a_server_without_events_answers_no_snapshot(make_engine: Callable[..., EmulatedEngine]) -> None:
    live = LiveServer(build_app(make_engine(), serve_config()))
    try:
        answer = httpx.get(f"{live.url}{SNAPSHOT_PATH}", timeout=30)
    finally:
        live.stop()
    assert answer.status_code == 404 and "no KV event snapshot" in answer.text


def test_a_router_starting_after_the_buffer_moved_on_holds_exactly_the_replicas_blocks(
    make_engine: Callable[..., EmulatedEngine],
) -> None:
    from kvpool.router.feed import EventFeed
    from kvpool.router.index import MemoryIndex
    from kvpool.router.replicas import EventsInfo
    from kvpool.router.snapshot_loader import http_snapshot
    from tests.router.fakes import wait_for
    from tests.router.test_feed import Loop

    engine = make_engine(block_size=4, num_blocks=12, enable_kv_events=True)
    publisher = KVEventPublisher("bind:tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0", buffer_steps=2)
    live = LiveServer(build_app(engine, serve_config(), events=publisher))
    loop = Loop()
    feed = None
    try:
        for start in (10, 50, 90):  # 5, 9, 9 blocks in a pool of 11: more batches than the 2 buffered, and evictions
            _complete(live, list(range(start, start + 20 + 16 * (start > 10))))
        info = EventsInfo.from_json(httpx.get(f"{live.url}/kv-events", timeout=30).json(), live.url)
        assert info.snapshot == SNAPSHOT_PATH
        index = MemoryIndex()
        feed = EventFeed(live.url, info, index, snapshot=http_snapshot(live.url + info.snapshot, {}, 30.0))
        feed.start(loop.loop)
        wait_for(lambda: feed.snapshots == 1, "the snapshot", timeout=30)
        _complete(live, list(range(200, 220)))  # after the snapshot: its batch is applied on top
        held = _held(engine)

        def whole() -> bool:
            claimed = {h for h in held if index.match([h], [live.url]) == [1]}
            return claimed == held and index.num_blocks(live.url) == len(held)

        wait_for(whole, "exactly the replica's blocks", timeout=30)
        assert feed.figures()["snapshot_errors"] == 0 and feed.gaps == 0
    finally:
        if feed is not None:
            feed.stop()
        live.stop()
        loop.close()
