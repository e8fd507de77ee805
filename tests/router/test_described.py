"""Replicas described on the command line (not kvpool), what the router reads back, and what it refuses."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from kvpool.errors import ConfigError
from kvpool.router import MemoryIndex, RouteOptions, Router
from kvpool.router.index import Group
from kvpool.router.replica_config import load_config, parse_replica
from kvpool.router.replicas import HashForm
from kvpool.router.stats import HashVerdict
from kvpool.router.usage import UsageScanner, cached_tokens_of
from kvpool.tenancy import SaltPolicy
from tests.router.fakes import BLOCK_SIZE, ByteTokenizer, FakeReplica, RouterThread, wait_for
from tests.router.test_route import SALTS, ask, system

# -- specs ----------------------------------------------------------------------------------


def test_a_described_vllm_replica_reads_every_key() -> None:
    spec = parse_replica(
        "http://10.0.0.5:8000,events=tcp://*:5557,replay=tcp://10.0.0.5:5558,block-size=128,hash=sha256,seed=0"
    )
    info = spec.events
    assert spec.described and info is not None
    assert info.endpoint == "tcp://10.0.0.5:5557"  # a wildcard names the replica's host
    assert info.replay_endpoint == "tcp://10.0.0.5:5558" and info.block_size == 128
    assert info.hash_form is HashForm.INT64 and info.hash_seed == "0"
    assert parse_replica("http://h:1,events=none").events is None
    assert parse_replica("http://h:1").discover
    kvpool = parse_replica("http://h:1,events=tcp://h:2,block-size=16,hash=kvpool_sha256").events
    assert kvpool is not None and kvpool.hash_form is HashForm.BYTES


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ("http://h:1,events=tcp://h:2,block-size=0", "0"),
        ("http://h:1,events=tcp://h:2,block-size=abc", "abc"),
        ("http://h:1,events=tcp://h:2,block-size=16,hash=md5", "md5"),
        ("http://h:1,events=tcp://h:2,block-size=16,block-hash=int32", "int32"),
        ("http://h:1,events=http://h:2,block-size=16", "http://h:2"),
        ("http://h:1,events=tcp://h:2", "block-size"),
        ("http://h:1,block-size=16", "events"),
        ("http://h:1,event=tcp://h:2", "event"),
        ("http://h:1,events=none,block-size=16", "block_size"),
        ("http://h:1,events", "events"),
        ("ftp://h:1,events=none", "ftp://h:1"),
    ],
)
def test_a_bad_description_is_refused_naming_the_value(text: str, named: str) -> None:
    with pytest.raises(ConfigError, match=named.replace("?", r"\?")):
        parse_replica(text)


def test_a_config_file_completes_each_replica_with_its_defaults(tmp_path: object) -> None:
    from pathlib import Path

    path = Path(str(tmp_path)) / "route.toml"
    path.write_text(
        '[defaults]\nblock_size = 128\nhash = "sha256"\n\n'
        '[[replica]]\nurl = "http://a:8000"\nevents = "tcp://a:5557"\n\n'
        '[[replica]]\nurl = "http://b:8000"\nevents = "none"\n\n'
        '[[replica]]\nurl = "http://c:8000"\nevents = "tcp://c:5557"\nblock_size = 16\n'
    )
    a, b, c = load_config(path)
    assert a.events is not None and a.events.block_size == 128 and b.events is None
    assert c.events is not None and c.events.block_size == 16
    path.write_text('[[replica]]\nurl = "http://a:8000"\nevents = "tcp://a:5557"\nblock_size = -1\n')
    with pytest.raises(ConfigError, match="-1"):
        load_config(path)
    path.write_text("[[replica]\n")
    with pytest.raises(ConfigError, match="not TOML"):
        load_config(path)


# -- cached_tokens read back -----------------------------------------------------------------


def test_cached_tokens_are_read_from_a_body_and_from_a_stream_split_anywhere() -> None:
    body = b'{"usage": {"prompt_tokens": 300, "prompt_tokens_details": {"cached_tokens": 256}}}'
    assert cached_tokens_of(body) == 256 and cached_tokens_of(b'{"usage": {}}') is None
    assert cached_tokens_of(b"<html>501</html>") is None
    stream = b'data: {"choices": [{"delta": {"content": "hi"}}]}\n\ndata: ' + body + b"\n\ndata: [DONE]\n\n"
    for cut in range(1, len(stream)):
        scanner = UsageScanner()
        scanner.feed(stream[:cut])
        scanner.feed(stream[cut:])
        assert scanner.cached_tokens == 256, cut


# -- hybrid groups ----------------------------------------------------------------------------


def test_a_hybrid_prefix_counts_only_where_every_group_holds_what_it_needs() -> None:
    index = MemoryIndex()
    h = [bytes([i]) * 32 for i in range(6)]
    full, window = Group(0), Group(1, tail=2)  # a sliding window over the last two blocks
    index.store("r", h[:6], group=full)
    index.store("r", h[2:4], group=window)  # the window group kept blocks 2 and 3 only
    assert index.match(h, ["r"]) == [4]  # a prefix of 4 blocks: full attention has 0..3, the window 2..3
    index.remove("r", [h[2]], group=window)
    assert index.match(h, ["r"]) == [0]  # no prefix end with both of its window's blocks held
    index.store("r", h[4:5], group=Group(2, tail=1))  # a Mamba group: its state after block 4
    index.store("r", h[3:5], group=window)
    assert index.match(h, ["r"]) == [5]
    index.remove("r", [h[1]], group=full)
    assert index.match(h, ["r"]) == [0]  # full attention misses block 1: nothing past it is usable


# -- a replica marked down ---------------------------------------------------------------------


class _PlainServer(BaseHTTPRequestHandler):
    posts = 0

    def do_GET(self) -> None:
        self.send_response(404)
        self.end_headers()

    def do_POST(self) -> None:
        type(self).posts += 1
        self.send_response(501)
        self.send_header("content-type", "text/html")
        self.end_headers()
        self.wfile.write(b"<html>501</html>")

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def plain() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _PlainServer)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_a_replica_marked_down_gets_nothing_and_the_answer_is_a_503_in_openais_shape(plain: str) -> None:
    options = RouteOptions(
        replicas=(parse_replica(plain + ",events=none"),),
        tokenizer=ByteTokenizer(),
        keys=None,
        salts=SaltPolicy.shared(),
        health_interval=0.1,
    )
    router = RouterThread(Router(options, MemoryIndex()))
    try:
        wait_for(lambda: "404" in (router.router.replicas[0].last_error or ""), "the replica marked down")
        reply = router.chat([ask("hi")])
        assert reply.status_code == 503
        error = reply.json()["error"]
        assert error["code"] == "no_replica" and error["type"] == "service_unavailable" and "message" in error
        assert _PlainServer.posts == 0
        assert router.client.get("/v1/models").status_code == 503 and _PlainServer.posts == 0
        assert "kvpool_router_no_replica_total 1" in router.client.get("/metrics").text
    finally:
        router.stop()


# -- wrong settings are caught ---------------------------------------------------------------


def test_a_replica_described_with_the_wrong_block_size_is_reported_unmatched(caplog: object) -> None:
    replica = FakeReplica("r0", SALTS).start()
    wrong = parse_replica(
        f"{replica.url},events=tcp://127.0.0.1:{replica.events_port},replay=tcp://127.0.0.1:{replica.replay_port},"
        f"block-size={2 * BLOCK_SIZE},hash=kvpool_sha256"
    )
    options = RouteOptions(replicas=(wrong,), tokenizer=ByteTokenizer(), keys=None, salts=SALTS, health_interval=0.1)
    router = RouterThread(Router(options, MemoryIndex()))
    try:
        core = router.router
        wait_for(lambda: core.prefix_mode_now == "precise" and replica.url in core.monitor.feeds, "it is followed")
        for i in range(5):
            assert router.chat([system(i), ask("hi")]).status_code == 200
        feed = core.monitor.feeds[replica.url]
        wait_for(lambda: feed.stored >= len(replica.cached) > 0, "its events applied")
        metrics = router.client.get("/metrics").text
        assert f'kvpool_router_replica_hash_check{{replica="{replica.url}",verdict="unmatched"}} 1' in metrics
        assert core.replicas[0].stats.verdict is HashVerdict.UNMATCHED
        assert "never name the blocks" in caplog.text  # type: ignore[attr-defined]  # pytest's LogCaptureFixture
    finally:
        router.stop()
        replica.kill()


def test_a_replica_described_rightly_is_matching_and_its_cached_tokens_are_predicted() -> None:
    replica = FakeReplica("r0", SALTS).start()
    right = parse_replica(
        f"{replica.url},events=tcp://127.0.0.1:{replica.events_port},replay=tcp://127.0.0.1:{replica.replay_port},"
        f"block-size={BLOCK_SIZE},hash=kvpool_sha256"
    )
    options = RouteOptions(replicas=(right,), tokenizer=ByteTokenizer(), keys=None, salts=SALTS, health_interval=0.1)
    router = RouterThread(Router(options, MemoryIndex()))
    try:
        core = router.router
        wait_for(lambda: replica.url in core.monitor.feeds, "it is followed")
        for i in range(4):
            router.chat([system(i), ask("hi")])
        wait_for(lambda: core.index.num_blocks(replica.url) == len(replica.cached), "its events applied")
        for i in range(4):
            router.chat([system(i), ask("hi"), {"role": "assistant", "content": "ok"}, ask("more")])
        core.check_hashes(core.replicas[0])
        stats = core.replicas[0].stats
        assert stats.verdict is HashVerdict.MATCHING
        assert stats.reports == 8 and stats.reported_cached_tokens > 0
        assert stats.predicted_reported == stats.reported_cached_tokens
    finally:
        router.stop()
        replica.kill()
