"""KV events under ZeroMQ CURVE: only subscribers holding an allowed key pair hear the stream or its replay."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytest.importorskip("zmq")
import zmq  # noqa: E402
import zmq.auth  # noqa: E402

from kvpool import BlockRemoved, ConfigError  # noqa: E402
from kvpool.hashing import BlockHash  # noqa: E402
from kvpool.kv_events import (  # noqa: E402
    CurveClient,
    CurveKeyPair,
    CurveServer,
    CurveTrust,
    EventStreamError,
    KVEventPublisher,
    KVEventSubscriber,
    SequencedBatch,
    load_public_keys,
)


@pytest.fixture
def keys(tmp_path: Path) -> dict[str, Path]:
    """Certificates for a publisher, an allowed client and a stranger, as ``zmq.auth.create_certificates`` writes them."""
    made = {}
    for name in ("replica", "router", "stranger"):
        (tmp_path / name).mkdir()
        public, secret = zmq.auth.create_certificates(tmp_path / name, name)
        made[name], made[name + ".key"] = Path(secret), Path(public)
    return made


def removed(i: int) -> list[BlockRemoved]:
    return [BlockRemoved(block_hashes=(BlockHash(bytes([i]) * 32),))]


def curve_publisher(keys: dict[str, Path]) -> KVEventPublisher:
    server = CurveServer.load(keys["replica"], keys["router.key"])
    # port 0: the OS picks both ports as they are bound; subscribers read them from the publisher
    return KVEventPublisher("bind:tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0", curve=server)


def subscriber(publisher: KVEventPublisher, curve: CurveClient | None, timeout: float = 2.0) -> KVEventSubscriber:
    assert publisher.replay_endpoint is not None
    return KVEventSubscriber(
        publisher.endpoint, replay_endpoint=publisher.replay_endpoint, curve=curve, replay_timeout=timeout, last_seq=-1
    )


def hear(publisher: KVEventPublisher, sub: KVEventSubscriber) -> list:
    """Publish until ``sub`` hears a batch live (its subscription may still be joining); what it received."""
    for _ in range(200):
        publisher.publish(removed(publisher.next_seq % 256))
        got = sub.receive(timeout=0.05)
        if got:
            return got
    raise AssertionError("the authorised subscriber heard nothing")


def handshake_failed(monitor: object) -> bool:
    """Read a socket's monitor until its handshake fails or succeeds (waiting on the event, not a time)."""
    from zmq.utils.monitor import recv_monitor_message

    failed = (
        zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    )
    while monitor.poll(10_000):  # type: ignore[attr-defined]
        event = recv_monitor_message(monitor)  # type: ignore[arg-type]
        if event["event"] & failed:
            return True
        if event["event"] & zmq.EVENT_HANDSHAKE_SUCCEEDED:
            return False
    return False


def test_an_authorised_subscriber_receives_the_batches_and_their_replay(keys):
    with curve_publisher(keys) as publisher:
        assert publisher.curve_public_key == zmq.auth.load_certificate(keys["replica.key"])[0].decode()
        client = CurveClient.load(keys["router"], keys["replica.key"])
        with subscriber(publisher, client) as sub:
            got = hear(publisher, sub)
            assert isinstance(got[-1], SequencedBatch) and got[-1].batch.events == tuple(removed(got[-1].seq))
            replayed = sub.replay(0)
        assert [b.seq for b in replayed] == list(range(publisher.next_seq))
        assert all(b.replayed for b in replayed)


@pytest.mark.parametrize("who", ["plain", "stranger", "wrong server key"])
def test_a_subscriber_without_the_right_keys_hears_nothing_and_cannot_replay(keys, who):
    with curve_publisher(keys) as publisher:
        if who == "plain":
            curve = None
        elif who == "stranger":  # a key pair the publisher does not allow
            curve = CurveClient.load(keys["stranger"], keys["replica.key"])
        else:  # an allowed key pair, but it expects another publisher's key
            curve = CurveClient.load(keys["router"], keys["stranger.key"])
        allowed = CurveClient.load(keys["router"], keys["replica.key"])
        with subscriber(publisher, curve, timeout=0.5) as outsider, subscriber(publisher, allowed) as insider:
            # the outsider's handshake is refused (its socket's monitor says so) ...
            raw = outsider._ctx.socket(zmq.SUB)
            if curve is not None:
                curve.secure(raw, zmq)
            raw.setsockopt(zmq.SUBSCRIBE, b"")
            monitor = raw.get_monitor_socket()
            raw.connect(publisher.endpoint)
            try:
                assert handshake_failed(monitor)
            finally:
                raw.disable_monitor()
                monitor.close(0)
                raw.close(0)
            # ... while the insider hears batches, and the outsider none of them
            hear(publisher, insider)
            publisher.publish(removed(1))
            assert insider.receive(timeout=5.0)
            assert outsider.receive(timeout=0.2) == []
            with pytest.raises(EventStreamError, match="did not finish"):
                outsider.replay(0)
            assert insider.replay(0)


def test_key_files_are_checked(keys, tmp_path):
    with pytest.raises(ConfigError, match="public key only"):
        CurveKeyPair.load(keys["replica.key"])
    with pytest.raises(ConfigError, match="cannot read"):
        CurveKeyPair.load(tmp_path / "missing.key_secret")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="holds no public key"):
        load_public_keys(tmp_path / "empty")
    bad = tmp_path / "bad.key"
    bad.write_text('public-key = "short"\n')
    with pytest.raises(ConfigError, match="'short'"):
        load_public_keys(bad)
    # a directory gives every *.key in it
    directory = tmp_path / "clients"
    directory.mkdir()
    for name in ("router", "stranger"):
        (directory / f"{name}.key").write_bytes(keys[name + ".key"].read_bytes())
    assert len(load_public_keys(directory)) == 2
    with pytest.raises(ConfigError, match="CurveServer"):
        KVEventPublisher("bind:tcp://127.0.0.1:0", curve="keys")  # type: ignore[arg-type]


def test_a_router_trusts_only_the_publisher_keys_it_was_given(keys):
    trust = CurveTrust.load(keys["router"], keys["replica.key"])
    replica_key = keys["replica.key"].read_text().split('"')[1]
    assert trust.client_for(replica_key, "replica A").server_key == replica_key.encode()
    stranger_key = keys["stranger.key"].read_text().split('"')[1]
    with pytest.raises(ConfigError, match=re.escape(repr(stranger_key)) + ".*not trusted"):
        trust.client_for(stranger_key, "replica B")
    with pytest.raises(ConfigError, match="not a Z85"):
        trust.client_for("nonsense", "replica C")


def test_a_key_file_that_is_a_fifo_is_refused_at_once_not_waited_on(keys, tmp_path):
    from tests.test_secret_files import fifo_with_a_writer

    with fifo_with_a_writer(tmp_path / "replica.key_secret", keys["replica"].read_bytes()) as path:
        with pytest.raises(ConfigError, match=f"CURVE secret key file {str(path)!r} is a FIFO, not a regular file"):
            CurveKeyPair.load(path)
    with fifo_with_a_writer(tmp_path / "router.key", keys["router.key"].read_bytes()) as path:
        with pytest.raises(ConfigError, match=f"CURVE public key file {str(path)!r} is a FIFO"):
            load_public_keys(path)
    clients = tmp_path / "clients"
    clients.mkdir()
    (clients / "router.key").write_bytes(keys["router.key"].read_bytes())
    with fifo_with_a_writer(clients / "stranger.key", keys["stranger.key"].read_bytes()) as path:
        with pytest.raises(ConfigError, match=f"{str(path)!r} is a FIFO"):
            load_public_keys(clients)


def test_a_key_file_that_is_a_device_or_huge_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="'/dev/null' is a character device"):
        CurveKeyPair.load("/dev/null")
    with pytest.raises(ConfigError, match=f"{str(tmp_path)!r} is a directory"):
        CurveKeyPair.load(tmp_path)
    huge = tmp_path / "huge.key"
    huge.write_bytes(b"# padding\n" * 10_000)
    with pytest.raises(ConfigError, match="holds more than"):
        load_public_keys(huge)
