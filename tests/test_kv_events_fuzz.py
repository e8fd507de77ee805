"""Garbage on the event stream: the subscriber raises EventStreamError and nothing else, then reads on."""

from __future__ import annotations

import pytest

pytest.importorskip("zmq")
msgspec = pytest.importorskip("msgspec")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from kvpool import BlockRemoved  # noqa: E402
from kvpool.hashing import BlockHash  # noqa: E402
from kvpool.kv_events import (  # noqa: E402
    EventStreamError,
    KVEventPublisher,
    KVEventSubscriber,
    SequencedBatch,
    decode_batch,
    encode_batch,
)

GOOD_EVENTS = (BlockRemoved(block_hashes=(BlockHash(b"\x07" * 32),)),)
GOOD = encode_batch(GOOD_EVENTS, ts=1.0)

scalars = st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=8)
scalars |= st.binary(max_size=40)
values = st.recursive(
    scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4)
)
field_names = st.sampled_from(
    ["type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_name", "medium", "extra_keys"]
    + ["group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window"]
)
event_maps = st.dictionaries(field_names, values, max_size=8).map(
    lambda m: m if "type" in m else {**m, "type": "BlockStored"}
)
batches = st.tuples(values, st.lists(event_maps | values, max_size=3)).map(lambda b: [b[0], b[1], 0])


def _mutated(data: st.DataObject) -> bytes:
    payload = bytearray(GOOD)
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(payload) - 1))
        payload[i] = data.draw(st.integers(0, 255))
    return bytes(payload)


@st.composite
def payloads(draw: st.DrawFn) -> bytes:
    kind = draw(st.sampled_from(["random", "msgpack", "batch", "mutated", "deep", "huge"]))
    if kind == "random":
        return draw(st.binary(max_size=64))
    if kind == "msgpack":
        return msgspec.msgpack.encode(draw(values))
    if kind == "batch":
        return msgspec.msgpack.encode(draw(batches))
    if kind == "mutated":
        return _mutated(draw(st.data()))
    if kind == "deep":  # nesting far past any batch (and past the interpreter's recursion limit)
        return b"\x92\x01" + b"\x91" * draw(st.integers(900, 200_000)) + b"\xc0"
    # a header announcing more elements or bytes than the message holds
    return draw(st.sampled_from([b"\xdd\xff\xff\xff\xff", b"\xc6\xff\xff\xff\xff", b"\x93\x01\xdd\x7f\xff\xff\xff"]))


frames = st.one_of(
    st.lists(st.binary(max_size=16), max_size=5),  # any frame count, any sequence frame
    st.tuples(st.just(b""), st.integers(0, 2**63 - 1).map(lambda s: s.to_bytes(8, "big")), payloads()).map(list),
)


def test_decode_batch_raises_only_its_own_error_on_deep_nesting():
    with pytest.raises(EventStreamError, match="nests deeper"):
        decode_batch(b"\x92\x01" + b"\x91" * 100_000 + b"\xc0")
    # a container inside an error message is described, never repr'd (repr would recurse as deep)
    with pytest.raises(EventStreamError, match="a list of 1"):
        decode_batch(b"\x92\x01\x91" + b"\x91" * 500 + b"\xc0")


@pytest.fixture(scope="module")
def subscriber():
    with KVEventSubscriber("tcp://127.0.0.1:9") as sub:  # nothing listens: only accept() is exercised
        yield sub


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(garbage=frames)
def test_garbage_raises_event_stream_error_and_the_next_message_is_read(subscriber, garbage):
    malformed = subscriber.malformed
    try:
        subscriber.accept(garbage)
    except EventStreamError:
        assert subscriber.malformed == malformed + 1
    last = subscriber.last_seq
    seq = 0 if last is None or last >= 2**63 else last + 1
    got = subscriber.accept([b"", seq.to_bytes(8, "big"), GOOD])
    assert got[-1] == SequencedBatch(seq, decode_batch(GOOD))
    assert subscriber.last_seq == seq


def test_a_live_bad_message_is_raised_after_the_batches_before_it():
    with KVEventPublisher("bind:tcp://127.0.0.1:0") as publisher:
        with KVEventSubscriber(publisher.endpoint, last_seq=-1) as sub:
            for _ in range(200):  # until the subscription is heard
                publisher.publish(GOOD_EVENTS)
                if sub.receive(timeout=0.05):
                    break
            else:
                raise AssertionError("the subscription was never heard")
            # a good batch, a bad one and a good one, sent straight on the PUB socket's thread
            seq = publisher.next_seq
            publisher._outbox.send_multipart((seq.to_bytes(8, "big"), GOOD))
            publisher._outbox.send_multipart(((seq + 1).to_bytes(8, "big"), b"\xc1"))
            publisher._next_seq += 2
            publisher.publish(GOOD_EVENTS)
            got: list = []
            error = None
            while len([g for g in got if isinstance(g, SequencedBatch) and g.seq >= seq]) < 2:
                try:
                    got += sub.receive(timeout=5.0)
                except EventStreamError as exc:
                    error = exc
            assert error is not None and sub.malformed == 1
            # the bad batch's number is a gap: without a replay socket it is reported lost
            assert [type(g).__name__ for g in got if not isinstance(g, SequencedBatch) or g.seq >= seq][-3:] == [
                "SequencedBatch",
                "LostBatches",
                "SequencedBatch",
            ]


@pytest.mark.parametrize(
    ("field", "value", "words"),
    [
        ("token_ids", ["x"], "token_ids must be a list of integers"),
        ("token_ids", None, "token_ids must be a list of integers"),
        ("block_size", True, "'block_size' has the wrong type"),
        ("block_size", None, "block_size must be an integer"),
        ("block_hashes", [-1], "64-bit integer"),
        ("extra_keys", [[{"k": 1}]], "unknown extra key a dict of 1"),
    ],
)
def test_fields_of_the_wrong_type_are_refused(field, value, words):
    event = {"type": "BlockStored", "block_hashes": [b"a"], "parent_block_hash": None, "token_ids": [1]}
    event |= {"block_size": 1, "medium": None, "lora_name": None, field: value}
    with pytest.raises(EventStreamError, match=words):
        decode_batch(msgspec.msgpack.encode([0.0, [event], 0]))
