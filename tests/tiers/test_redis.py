"""The Redis tier against real servers: round trips, planted entries, faults, passwords, TLS and a cluster."""

from __future__ import annotations

import dataclasses
import logging
import shutil
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpool.errors import ConfigError
from kvpool.tiers import EntryCodec, RedisStore, open_store
from tests.services import RedisServer, free_port, require_binary, unavailable, under_ci
from tests.tiers.conftest import LAYOUT, block_key

try:
    import redis
except ImportError:  # the tiers extra: CI installs it, so there a missing client fails the run
    if under_ci():
        raise
    pytest.skip("the redis client is not installed (pip install -e '.[tiers]')", allow_module_level=True)


def fresh_codec(secret: bytes | None = None) -> EntryCodec:
    """A codec of a layout no other test uses: its own key namespace in a shared Redis."""
    return EntryCodec(dataclasses.replace(LAYOUT, hash_seed=uuid.uuid4().hex), secret)


def payload(i: int, size: int = 2048) -> bytes:
    return bytes([i % 251]) * size


def items(ids) -> list[tuple[bytes, bytes]]:
    return [(block_key(i), payload(i)) for i in ids]


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_round_trip(redis_url):
    codec = fresh_codec()
    store = open_store(redis_url, codec)
    assert isinstance(store, RedisStore)
    assert store.get_many([block_key(0)]) == [None]
    assert store.put_many(items(range(10))) == 10
    assert store.contains_prefix([block_key(i) for i in range(12)]) == 10
    assert store.contains_prefix([block_key(11), block_key(0)]) == 0
    keys = [block_key(i) for i in (3, 11, 0)]
    assert store.get_many(keys) == [payload(3), None, payload(0)]
    stats = store.stats
    assert (stats.hits, stats.misses, stats.corrupt, stats.errors) == (2, 2, 0, 0)
    entry = len(codec.encode(block_key(0), payload(0)))
    assert stats.bytes_written == 10 * entry and stats.bytes_read == 2 * entry
    client = redis.Redis.from_url(redis_url)
    assert client.get(f"kvpool:{codec.namespace}:{block_key(3).hex()}") == codec.encode(block_key(3), payload(3))
    assert client.ttl(f"kvpool:{codec.namespace}:{block_key(3).hex()}") == -1  # no TTL unless asked
    # another layout in the same Redis sees none of it, and counts nothing corrupt
    other = open_store(redis_url, fresh_codec())
    assert other.get_many([block_key(3)]) == [None] and other.stats.corrupt == 0
    store.close()


def test_ttl(redis_url):
    codec = fresh_codec()
    store = open_store(redis_url + "?ttl=60", codec)
    store.put_many(items([0]))
    ttl = redis.Redis.from_url(redis_url).ttl(f"kvpool:{codec.namespace}:{block_key(0).hex()}")
    assert 0 < ttl <= 60


def test_planted_entries_are_counted_misses(redis_url, caplog):
    secret = b"only the replicas know this"
    codec = fresh_codec(secret)
    store = open_store(redis_url, codec)
    store.put_many(items(range(6)))
    client = redis.Redis.from_url(redis_url)
    assert isinstance(store, RedisStore)
    entry = client.get(store.redis_key(block_key(0)))
    unsigned = EntryCodec(codec.fingerprint)  # a client without the secret
    client.set(store.redis_key(block_key(0)), entry[: len(entry) - 5])  # truncated
    own = client.get(store.redis_key(block_key(1)))
    client.set(store.redis_key(block_key(1)), own[:-1] + bytes([own[-1] ^ 1]))  # bit flip
    client.set(store.redis_key(block_key(2)), entry)  # a valid entry replayed under another hash
    client.set(store.redis_key(block_key(3)), unsigned.encode(block_key(3), b"planted KV"))  # unsigned
    client.set(
        store.redis_key(block_key(4)),
        EntryCodec(codec.fingerprint, b"a guess at the secret").encode(block_key(4), b"planted"),
    )
    with caplog.at_level(logging.WARNING, logger="kvpool.tiers"):
        assert store.get_many([block_key(i) for i in range(6)]) == [None] * 5 + [payload(5)]
    stats = store.stats
    assert stats.corrupt == 5 and stats.misses == 5 and stats.hits == 1
    kinds = {"truncated": 1, "checksum": 1, "foreign key": 1, "unsigned": 1, "bad signature": 1}
    assert stats.corrupt_by_kind == kinds
    assert len(caplog.records) == len(stats.corrupt_by_kind)


def test_killed_mid_run_then_back(redis_server, caplog):
    clock = FakeClock()
    store = RedisStore(redis_server.url, fresh_codec(), backoff_s=(1.0, 4.0), clock=clock)
    assert store.put_many(items(range(4))) == 4
    redis_server.stop()
    with caplog.at_level(logging.WARNING, logger="kvpool.tiers"):
        assert store.get_many([block_key(0), block_key(1)]) == [None, None]  # no exception
        assert not store.available
        assert store.put_many(items([9])) == 0 and store.contains_prefix([block_key(0)]) == 0
        assert store.get_many([block_key(2)]) == [None]
        assert store.stats.errors == 1  # skipped without trying while the backoff runs
        clock.now = 1.5
        assert store.get_many([block_key(2)]) == [None]  # tried again, still down: the backoff doubles
        assert store.stats.errors == 2 and not store.available
        redis_server.start()
        clock.now = 3.0
        assert not store.available  # 1.5 + 2.0
        clock.now = 3.6
        assert store.get_many([block_key(0)]) == [None]  # back, empty (the server kept nothing)
        assert store.put_many(items(range(4))) == 4
        assert store.get_many([block_key(0)]) == [payload(0)]
    downs = [r for r in caplog.records if "skipping the tier" in r.getMessage()]
    assert len(downs) == 1
    assert any("answers again" in r.getMessage() for r in caplog.records)
    stats = store.stats
    assert stats.errors == 2 and stats.corrupt == 0 and stats.hits == 1


def test_down_at_start_then_comes_up(tmp_path):
    server = RedisServer(tmp_path / "late")  # its unix socket's path is known, and free, before it starts
    clock = FakeClock()
    opened = open_store(server.url, fresh_codec())  # opening never connects, never raises
    assert opened.get_many([block_key(0)]) == [None] and opened.stats.errors == 1
    store = RedisStore(server.url, fresh_codec(), clock=clock)
    assert store.put_many(items([0])) == 0
    assert store.get_many([block_key(0)]) == [None]
    assert store.stats.errors == 1
    server.start()
    try:
        clock.now = 100.0
        assert store.put_many(items([0])) == 1
        assert store.get_many([block_key(0)]) == [payload(0)]
    finally:
        server.stop()


def test_a_server_that_stops_answering_times_out(redis_server):
    clock = FakeClock()
    store = RedisStore(redis_server.url, fresh_codec(), clock=clock)
    assert store.put_many(items([0])) == 1
    assert redis_server.process is not None
    redis_server.process.send_signal(signal.SIGSTOP)  # accepts bytes, answers nothing
    try:
        started = time.monotonic()
        assert store.get_many([block_key(0)]) == [None]
        assert time.monotonic() - started < 10  # a short socket timeout, not a hang
        assert store.stats.errors == 1
    finally:
        redis_server.process.send_signal(signal.SIGCONT)
    clock.now = 100.0
    assert store.get_many([block_key(0)]) == [payload(0)]


def test_password(tmp_path):
    server = RedisServer(tmp_path / "auth", tcp=True).start()
    try:
        redis.Redis(port=server.port).config_set("requirepass", "s3cret pass")
        clock = FakeClock()
        without = RedisStore(server.url, fresh_codec(), clock=clock)
        assert without.put_many(items([0])) == 0 and without.stats.errors == 1
        codec = fresh_codec()
        good = open_store(f"redis://:s3cret%20pass@127.0.0.1:{server.port}/0", codec)
        assert good.put_many(items([0])) == 1
        assert good.get_many([block_key(0)]) == [payload(0)] and good.stats.errors == 0
        assert isinstance(good, RedisStore) and "s3cret" not in good.display_url
    finally:
        server.stop()


def _certificates(directory: Path) -> Path:
    """A CA and a server certificate for 127.0.0.1, made with the openssl command."""
    openssl = shutil.which("openssl")
    if openssl is None:
        unavailable("openssl is not installed (needed to make test certificates)")
    assert openssl is not None
    directory.mkdir()

    def run(*args: str) -> None:
        subprocess.run([openssl, *args], cwd=directory, check=True, capture_output=True)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt", "-days", "2",
        "-subj", "/CN=kvpool test CA")  # fmt: skip
    run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=127.0.0.1")
    (directory / "ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    run("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
        "-out", "server.crt", "-days", "2", "-extfile", "ext")  # fmt: skip
    return directory


def test_tls(tmp_path):
    certs = _certificates(tmp_path / "certs")
    tls_port = free_port()
    tls = ("--tls-port", str(tls_port), "--tls-cert-file", str(certs / "server.crt"))
    tls += ("--tls-key-file", str(certs / "server.key"), "--tls-ca-cert-file", str(certs / "ca.crt"))
    try:
        server = RedisServer(tmp_path / "tls", None, *tls, "--tls-auth-clients", "no", tcp=True).start()
    except RuntimeError:
        unavailable("this redis-server was built without TLS (--tls-port)")
    try:
        codec = fresh_codec()
        store = open_store(f"rediss://127.0.0.1:{tls_port}/0?ssl_ca_certs={certs / 'ca.crt'}", codec)
        assert store.put_many(items(range(3))) == 3
        assert store.get_many([block_key(i) for i in range(3)]) == [payload(i) for i in range(3)]
        # the plain port holds the same data: it really went over TLS to this server
        assert redis.Redis(port=server.port).exists(f"kvpool:{codec.namespace}:{block_key(0).hex()}")
        untrusting = open_store(f"rediss://127.0.0.1:{tls_port}/0", fresh_codec())  # system CAs only
        assert untrusting.get_many([block_key(0)]) == [None] and untrusting.stats.errors == 1
    finally:
        server.stop()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[RedisServer]]:
    """Three masters on loopback, slots split between them."""
    cli = require_binary("redis-cli")
    root = tmp_path_factory.mktemp("cluster")
    nodes = []
    try:
        for i in range(3):
            config = str(root / f"nodes-{i}.conf")
            bus = ("--cluster-port", str(free_port()))  # not port + 10000, which may be taken or past 65535
            nodes.append(
                RedisServer(
                    root / f"n{i}", None, "--cluster-enabled", "yes", "--cluster-config-file", config, *bus, tcp=True
                )
            )
            nodes[-1].start()
        addresses = [f"127.0.0.1:{n.port}" for n in nodes]
        subprocess.run(
            [cli, "--cluster", "create", *addresses, "--cluster-replicas", "0", "--cluster-yes"],
            check=True,
            capture_output=True,
            timeout=60,
        )
        deadline = time.monotonic() + 30
        while not all(redis.Redis(port=n.port).cluster("info")["cluster_state"] == "ok" for n in nodes):
            assert time.monotonic() < deadline, "the cluster did not become ready"
            time.sleep(0.1)
        yield nodes
    finally:
        for node in nodes:
            node.stop()


@pytest.mark.slow
def test_cluster(cluster):
    codec = fresh_codec()
    store = open_store(f"redis+cluster://127.0.0.1:{cluster[1].port}", codec)
    assert isinstance(store, RedisStore) and store.cluster
    assert store.put_many(items(range(60))) == 60
    assert store.contains_prefix([block_key(i) for i in range(62)]) == 60
    assert store.get_many([block_key(i) for i in range(62)]) == [payload(i) for i in range(60)] + [None, None]
    # the keys really are spread over the three nodes
    held = [redis.Redis(port=n.port).dbsize() for n in cluster]
    assert sum(held) >= 60 and all(h > 0 for h in held)
    stats = store.stats
    assert (stats.hits, stats.misses, stats.errors, stats.corrupt) == (60, 2, 0, 0)
    cluster[2].stop()  # a node dies: its blocks are misses, nothing raises
    got = store.get_many([block_key(i) for i in range(60)])
    assert all(g is None or g == payload(i) for i, g in enumerate(got))
    assert store.stats.errors >= 1 and store.put_many(items([70])) == 0


def test_bad_urls():
    codec = fresh_codec()
    for url in ["redis://127.0.0.1:6379/0?ttl=0", "redis://127.0.0.1:6379/0?ttl=soon", "redis+cluster://"]:
        with pytest.raises(ConfigError, match="ttl|redis"):
            open_store(url, codec)
    with pytest.raises(ConfigError, match="decode_responses"):
        open_store("redis://127.0.0.1:6379/0?decode_responses=true", codec)
    with pytest.raises(ConfigError, match="notaport"):
        open_store("redis://127.0.0.1:notaport/0", codec)


def test_missing_client_names_the_extra(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "redis", None)
    with pytest.raises(ConfigError, match=r"pip install 'kvpool\[tiers\]'"):
        open_store("redis://127.0.0.1:6379/0", fresh_codec())


def test_threads_share_one_store(redis_url):
    import threading

    store = open_store(redis_url, fresh_codec())
    wrong: list[int] = []

    def work(offset: int) -> None:
        for _ in range(5):
            ids = range(offset, offset + 20)
            store.put_many(items(ids))
            got = store.get_many([block_key(i) for i in ids])
            wrong.extend(i for i, g in zip(ids, got) if g != payload(i))

    threads = [threading.Thread(target=work, args=(100 * t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert wrong == [] and store.stats.hits == 4 * 5 * 20 and store.stats.errors == 0


def test_lookups_and_reads_are_scripts_and_a_server_refusing_scripts_gets_pipelines(tmp_path, caplog):
    server = RedisServer(tmp_path / "noscript").start()  # a unix socket: no port to pick
    try:
        admin = redis.Redis(unix_socket_path=str(server.socket_path))
        admin.acl_setuser("noscript", enabled=True, passwords=["+pw"], keys=["~*"], commands=["+@all", "-@scripting"])
        scripted = RedisStore(server.url, fresh_codec())
        assert scripted.put_many(items(range(3))) == 3
        assert scripted.contains_prefix([block_key(i) for i in range(4)]) == 3
        assert scripted.get_many([block_key(2), block_key(9)]) == [payload(2), None]
        assert scripted.scripted and scripted.stats.errors == 0

        codec = fresh_codec()
        refused = RedisStore(f"unix://noscript:pw@{server.socket_path}", codec)
        assert refused.put_many(items(range(3))) == 3
        with caplog.at_level(logging.WARNING, logger="kvpool"):
            assert refused.contains_prefix([block_key(i) for i in range(4)]) == 3
            assert refused.get_many([block_key(1), block_key(9)]) == [payload(1), None]
            assert refused.contains_prefix([block_key(0)]) == 1
        assert not refused.scripted and refused.stats.errors == 0
        assert sum("refuses scripts" in r.getMessage() for r in caplog.records) == 1
    finally:
        server.stop()
