"""Where event sockets attach (the endpoint rule), and what a stored-block event says about its request."""

from __future__ import annotations

import pytest

pytest.importorskip("zmq")

from kvpool import BlockStored, ConfigError  # noqa: E402
from kvpool.hashing import BlockHash, BlockHasher  # noqa: E402
from kvpool.kv_events import (  # noqa: E402
    Attach,
    EventContent,
    KVEventPublisher,
    KVEventSubscriber,
    decode_batch,
    describe_events,
    encode_batch,
    parse_publisher_endpoint,
    parse_replay_endpoint,
    parse_subscriber_endpoint,
)


@pytest.mark.parametrize(
    ("value", "address", "attach"),
    [
        # vLLM's rule, unchanged for the forms vLLM uses
        ("tcp://*:5557", "tcp://*:5557", Attach.BIND),
        ("tcp://[::]:5557", "tcp://[::]:5557", Attach.BIND),
        ("ipc:///tmp/kv", "ipc:///tmp/kv", Attach.BIND),
        ("inproc://kv", "inproc://kv", Attach.BIND),
        ("tcp://127.0.0.1:5557", "tcp://127.0.0.1:5557", Attach.CONNECT),
        ("tcp://forwarder.local:5557", "tcp://forwarder.local:5557", Attach.CONNECT),
        # the markers say it outright
        ("bind:tcp://127.0.0.1:5557", "tcp://127.0.0.1:5557", Attach.BIND),
        ("bind:tcp://10.0.0.5:0", "tcp://10.0.0.5:0", Attach.BIND),
        ("bind:tcp://0.0.0.0:5557", "tcp://0.0.0.0:5557", Attach.BIND),
        ("connect:tcp://forwarder.local:5557", "tcp://forwarder.local:5557", Attach.CONNECT),
        ("connect:ipc:///tmp/kv", "ipc:///tmp/kv", Attach.CONNECT),
    ],
)
def test_the_publisher_endpoint_rule(value, address, attach):
    endpoint = parse_publisher_endpoint(value)
    assert (endpoint.address, endpoint.attach) == (address, attach)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("tcp://0.0.0.0:5557", "ambiguous"),  # vLLM would connect to it
        ("connect:tcp://*:5557", "no peer"),
        ("connect:tcp://127.0.0.1:0", "no peer"),
        ("bind:localhost:5557", "ZeroMQ endpoint"),
        ("listen:tcp://127.0.0.1:5557", "ZeroMQ endpoint"),
        ("tcp://127.0.0.1", "port number"),
        ("bind:tcp://127.0.0.1:http", "port number"),
        ("bind:tcp://:5557", "port number"),
        ("ipc://", "names no path"),
        (5557, "ZeroMQ endpoint"),
    ],
)
def test_ambiguous_or_broken_publisher_endpoints_are_refused_by_value(value, message):
    with pytest.raises(ConfigError, match=message) as raised:
        parse_publisher_endpoint(value)
    assert repr(value) in str(raised.value)


def test_replay_endpoints_are_bound_and_subscribers_connect():
    assert parse_replay_endpoint("tcp://127.0.0.1:5558").attach is Attach.BIND  # vLLM binds its replay socket
    assert parse_replay_endpoint("bind:tcp://127.0.0.1:5558").address == "tcp://127.0.0.1:5558"
    with pytest.raises(ConfigError, match="'connect:tcp://127.0.0.1:5558'"):
        parse_replay_endpoint("connect:tcp://127.0.0.1:5558")
    assert parse_subscriber_endpoint("connect:tcp://127.0.0.1:5557") == "tcp://127.0.0.1:5557"
    for value in ("bind:tcp://127.0.0.1:5557", "tcp://*:5557", "tcp://0.0.0.0:5557"):
        with pytest.raises(ConfigError, match=repr(value).replace("*", r"\*")):
            parse_subscriber_endpoint(value)
    with pytest.raises(ConfigError, match="bind:tcp"):
        KVEventSubscriber("bind:tcp://127.0.0.1:5557")


def test_a_publisher_binds_the_loopback_alone():
    with KVEventPublisher("bind:tcp://127.0.0.1:0", replay_endpoint="bind:tcp://127.0.0.1:0") as publisher:
        port = int(publisher.endpoint.rsplit(":", 1)[1])  # the port the OS chose as it bound port 0
        assert publisher.attach is Attach.BIND
        assert publisher.endpoint == f"tcp://127.0.0.1:{port}"
        assert publisher.replay_endpoint is not None and publisher.replay_endpoint.startswith("tcp://127.0.0.1:")
        # bound: the port is taken on the loopback (an unmarked tcp://127.0.0.1 would have connected instead)
        with pytest.raises(ConfigError, match="cannot open"):
            KVEventPublisher(f"bind:tcp://127.0.0.1:{port}")
        with KVEventSubscriber(publisher.endpoint, replay_endpoint=publisher.replay_endpoint, last_seq=-1) as sub:
            publisher.publish([])
            assert [b.seq for b in sub.replay(0)] == [0]
    with KVEventPublisher(f"tcp://127.0.0.1:{port}") as forwarding:  # vLLM's rule: connected to
        assert forwarding.attach is Attach.CONNECT


def stored_with_everything() -> BlockStored:
    return BlockStored(
        block_hashes=(BlockHash(b"\x01" * 32), BlockHash(b"\x02" * 32)),
        parent_block_hash=BlockHash(b"\x00" * 32),
        token_ids=tuple(range(500, 508)),
        block_size=4,
        lora_name="acme-legal",
        extra_keys=(
            (("lora", "acme-legal"), ("mm", "img-1", 0), ("cache_salt", "9f" * 32)),
            (("lora", "acme-legal"),),
        ),
        group_id=1,
        medium="CPU",
        spec_kind="sliding_window",
        sliding_window=64,
    )


def test_hashes_only_leaves_out_tokens_salts_and_adapter_names():
    import msgspec

    event = stored_with_everything()
    payload = encode_batch([event], ts=1.0, content=EventContent.HASHES)
    for secret in (b"9f9f9f", b"acme-legal", b"img-1"):
        assert secret not in payload
    (wire,) = msgspec.msgpack.decode(payload)[1]
    assert wire["token_ids"] == [] and wire["lora_name"] is None and "extra_keys" not in wire
    (back,) = decode_batch(payload).events  # kvpool's own decoder reads it
    assert isinstance(back, BlockStored)
    assert back.block_hashes == event.block_hashes and back.parent_block_hash == event.parent_block_hash
    assert (back.block_size, back.group_id, back.medium, back.spec_kind, back.sliding_window) == (
        4,
        1,
        "CPU",
        "sliding_window",
        64,
    )
    assert back.token_ids == () and back.lora_name is None and back.extra_keys == (None, None)
    # the full form still carries all of it (what a trusted vLLM-style indexer asks for)
    (full,) = decode_batch(encode_batch([event], ts=1.0)).events
    assert full == event


def test_a_publisher_sends_what_its_content_says():
    with KVEventPublisher(
        "bind:tcp://127.0.0.1:0", replay_endpoint="bind:tcp://127.0.0.1:0", content=EventContent.HASHES
    ) as pub:
        pub.publish([stored_with_everything()])
        assert pub.replay_endpoint is not None
        with KVEventSubscriber(pub.endpoint, replay_endpoint=pub.replay_endpoint) as sub:
            (got,) = sub.replay(0)
    (event,) = got.batch.events
    assert isinstance(event, BlockStored) and event.token_ids == () and event.extra_keys == (None, None)
    info = describe_events(BlockHasher(4), endpoint=pub.endpoint, content=pub.content)
    assert info["content"] == "hashes"
    with pytest.raises(ConfigError, match="'tokens'"):
        KVEventPublisher("bind:tcp://127.0.0.1:0", content="tokens")  # type: ignore[arg-type]
