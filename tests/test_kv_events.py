"""KV events on the wire: vLLM's bytes, a live PUB/SUB stream with replay, a manager's events end to end."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvpool import AllBlocksCleared, BlockRemoved, BlockStored, ConfigError, KVCacheManager, MultiModalInput, Request
from kvpool.hashing import BlockHash
from kvpool.kv_events import (
    EventBatch,
    EventStreamError,
    KVEventPublisher,
    KVEventSubscriber,
    LostBatches,
    PublisherRestarted,
    SequencedBatch,
    decode_batch,
    describe_events,
    encode_batch,
)
from tests.group_helpers import full, sliding
from tests.helpers import admit
from tests.test_hashing_vllm import _vllm_python

ROOT = Path(__file__).resolve().parents[1]
RECORDED = json.loads((ROOT / "tests" / "fixtures" / "vllm_events" / "batches.json").read_text())["batches"]


def h(i: int) -> BlockHash:
    return BlockHash(bytes([i]) * 32)


# The recorded batches (benchmarks/record_vllm_hashes.py), as kvpool events.
EXPECTED = [
    EventBatch(
        1796000000.25,
        (
            BlockStored(
                block_hashes=(h(1), h(2)),
                parent_block_hash=None,
                token_ids=tuple(range(100, 108)),
                block_size=4,
                lora_name=None,
                extra_keys=(None, None),
                spec_kind="full_attention",
            ),
            BlockRemoved(block_hashes=(h(3),)),
        ),
        0,
    ),
    EventBatch(
        1796000001.5,
        (
            BlockStored(
                block_hashes=(h(4), h(5)),
                parent_block_hash=h(2),
                token_ids=(7, 8, 9, 10, 11, 12, 13, 14),
                block_size=4,
                lora_name="sql-adapter",
                extra_keys=(
                    (("lora", "sql-adapter"), ("mm", "img-1", -2), ("cache_salt", "tenant-a")),
                    (("lora", "sql-adapter"),),
                ),
                group_id=1,
                spec_kind="sliding_window",
                sliding_window=128,
            ),
            BlockRemoved(block_hashes=(h(6),), group_id=1, medium="CPU"),
            AllBlocksCleared(),
        ),
        0,
    ),
    EventBatch(
        1796000002.0,
        (
            BlockStored(
                block_hashes=(h(7),),
                parent_block_hash=None,
                token_ids=(1, 2),
                block_size=2,
                lora_name=None,
                extra_keys=((("cache_salt", "m"), ("mm", "audio", 0)),),
                group_id=2,
                spec_kind="mamba",
            ),
        ),
        0,
    ),
    EventBatch(1796000003.0, (), 0),
]


@pytest.mark.parametrize("index", range(len(EXPECTED)))
def test_vllm_bytes_decode_to_kvpool_events(index):
    assert decode_batch(bytes.fromhex(RECORDED[index]["payload_hex"])) == EXPECTED[index]


@pytest.mark.parametrize("index", range(len(EXPECTED)))
def test_kvpool_encodes_the_bytes_vllm_encodes(index):
    batch = EXPECTED[index]
    payload = encode_batch(batch.events, ts=batch.ts, data_parallel_rank=batch.data_parallel_rank)
    assert payload.hex() == RECORDED[index]["payload_hex"]


def test_kind_names_follow_vllm_on_the_wire():
    event = BlockStored(
        block_hashes=(h(1),),
        parent_block_hash=None,
        token_ids=(1,),
        block_size=1,
        lora_name=None,
        extra_keys=(None,),
        spec_kind="mla",
    )
    import msgspec

    wire = msgspec.msgpack.decode(encode_batch([event], ts=0.0))
    assert wire[1][0]["kv_cache_spec_kind"] == "mla_attention"
    assert decode_batch(encode_batch([event], ts=0.0)).events == (event,)


def test_integer_hashes_from_vllm_come_back_as_bytes():
    import msgspec

    payload = msgspec.msgpack.encode([0.0, [{"type": "BlockRemoved", "block_hashes": [5], "medium": None}], None])
    (event,) = decode_batch(payload).events
    assert event == BlockRemoved(block_hashes=((5).to_bytes(8, "big"),))


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        (b"\xc1", "not a msgpack event batch"),
        (b"\x93\xcb\x00\x00\x00\x00\x00\x00\x00\x00\x91\x81\xa4type\xa3Foo\xc0", "unknown event type 'Foo'"),
        (b"\x92\x01\x02", "an event batch is an array"),
    ],
)
def test_a_malformed_batch_is_refused(payload, message):
    with pytest.raises(EventStreamError, match=message):
        decode_batch(payload)


# -- a real manager's events -----------------------------------------------------------


def manager_events() -> list:
    """Stores (salted, LoRA, media; two groups of a hybrid model), evictions and a reset."""
    mgr = KVCacheManager.from_groups(
        [full(bs=4), sliding(8, bs=4, layer=1)], 12, enable_events=True, hash_algo="sha256_cbor"
    )
    image = MultiModalInput(identifier="img-1", offset=2, length=4)
    a = Request("a", list(range(10)), cache_salt="tenant-a", lora_name="sql", mm_inputs=[image])
    admit(mgr, a)
    mgr.free(a)
    b = Request("b", list(range(50, 66)))  # needs the pool: evicts a's cached blocks
    admit(mgr, b)
    mgr.free(b)
    assert mgr.reset_prefix_cache()
    events = mgr.take_events()
    kinds = {type(e) for e in events}
    assert kinds == {BlockStored, BlockRemoved, AllBlocksCleared}
    stored = [e for e in events if isinstance(e, BlockStored)]
    assert {e.group_id for e in stored} == {0, 1}
    assert {e.spec_kind for e in stored} == {"full_attention", "sliding_window"}
    assert {e.sliding_window for e in stored} == {None, 8}
    assert any(e.extra_keys[0] and ("mm", "img-1", 2) in e.extra_keys[0] for e in stored)
    return events


def test_a_managers_events_round_trip_with_every_field():
    events = manager_events()
    assert decode_batch(encode_batch(events, ts=3.0)) == EventBatch(3.0, tuple(events), 0)


VLLM_DECODER = """
import json, sys, msgspec
from vllm.distributed.kv_events import KVEventBatch
decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
out = []
for line in sys.stdin:
    batch = decoder.decode(bytes.fromhex(line.strip()))
    out.append({"ts": batch.ts, "rank": batch.data_parallel_rank, "events": [
        {"type": type(e).__name__, **{f: getattr(e, f) for f in e.__struct_fields__}} for e in batch.events]})
def default(value):
    if isinstance(value, bytes):
        return value.hex()
    raise TypeError(value)
print(json.dumps(out, default=default))
"""


@pytest.mark.slow
def test_vllms_own_decoder_reads_kvpools_stream_with_the_same_fields():
    """Live where vLLM is importable (a library, not a service: skipped without it)."""
    python = _vllm_python()
    if python is None:
        pytest.skip("vLLM is not importable here; set VLLM_PYTHON to a Python that has it")
    events = manager_events() + [BlockRemoved(block_hashes=(h(9),), medium="CPU")]
    payload = encode_batch(events, ts=12.5)
    done = subprocess.run(
        [python, "-c", VLLM_DECODER], input=payload.hex() + "\n", capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    (batch,) = json.loads(done.stdout.strip().splitlines()[-1])
    assert batch["ts"] == 12.5 and batch["rank"] == 0
    assert len(batch["events"]) == len(events)
    for ours, theirs in zip(events, batch["events"], strict=True):
        assert theirs["type"] == type(ours).__name__
        if isinstance(ours, AllBlocksCleared):
            continue
        assert theirs["block_hashes"] == [x.hex() for x in ours.block_hashes]
        assert theirs["medium"] == ours.medium and theirs["group_idx"] == ours.group_id
        if isinstance(ours, BlockStored):
            assert theirs["parent_block_hash"] == (ours.parent_block_hash.hex() if ours.parent_block_hash else None)
            assert theirs["token_ids"] == list(ours.token_ids) and theirs["block_size"] == ours.block_size
            assert theirs["lora_name"] == ours.lora_name
            assert theirs["kv_cache_spec_kind"] == ours.spec_kind
            assert theirs["kv_cache_spec_sliding_window"] == ours.sliding_window
            untagged = [
                None if keys is None else [list(k[1:]) if k[0] == "mm" else k[1] for k in keys]
                for keys in ours.extra_keys
            ]
            assert theirs["extra_keys"] == untagged


# -- on the wire ------------------------------------------------------------------------


#: Where a test publisher binds (its stream, its replay socket): the loopback, at ports the OS picks as it
#: binds them (port 0), so nothing races for a port; subscribers connect where the publisher says it bound.
BIND, BIND_REPLAY = "bind:tcp://127.0.0.1:0", "tcp://127.0.0.1:0"


def addresses(publisher: KVEventPublisher) -> tuple[str, str]:
    """Where subscribers reach ``publisher``: the stream and the replay socket it bound."""
    assert publisher.replay_endpoint is not None
    return publisher.endpoint, publisher.replay_endpoint


def batch_of(i: int) -> list:
    return [BlockRemoved(block_hashes=(h(i % 256),))]


def publish_until_heard(publisher: KVEventPublisher, sub: KVEventSubscriber, timeout: float = 10.0) -> list:
    """Publish ``batch_of(seq)`` until the subscriber hears one live; return all it received.

    A SUB socket hears nothing until its subscription reaches the publisher, so
    a fixed sleep would make these tests depend on the machine's load.
    """
    got: list = []
    deadline = time.monotonic() + timeout
    while not any(isinstance(x, SequencedBatch) and not x.replayed for x in got):
        assert time.monotonic() < deadline, f"nothing heard within {timeout} s"
        publisher.publish(batch_of(publisher.next_seq))
        got += sub.receive(timeout=0.1)
    return got


def assert_in_order(got: list, first: int) -> None:
    """Batches ``first, first+1, ...`` with their contents; the last one live."""
    assert [x.seq for x in got] == list(range(first, first + len(got)))
    assert all(x.batch.events == tuple(batch_of(x.seq)) for x in got)
    assert not got[-1].replayed


def test_publish_and_subscribe_with_a_gap_repaired_through_replay():
    with KVEventPublisher(BIND, replay_endpoint=BIND_REPLAY, topic="kv") as publisher:
        connect, connect_replay = addresses(publisher)
        for address in (connect, connect_replay):  # the loopback, at the port the OS chose
            assert address.startswith("tcp://127.0.0.1:") and not address.endswith(":0")
        # a subscriber that wants everything from the start: what it joined too late for is replayed
        with KVEventSubscriber(connect, replay_endpoint=connect_replay, topic="kv", last_seq=-1) as sub:
            for i in range(3):
                assert publisher.publish(batch_of(i)) == i
            got = publish_until_heard(publisher, sub)
            assert_in_order(got, 0)
            last = got[-1].seq
        # it disconnects; two batches go out while no one listens
        publisher.publish(batch_of(last + 1))
        publisher.publish(batch_of(last + 2))
        with KVEventSubscriber(connect, replay_endpoint=connect_replay, topic="kv") as probe:  # both sent already
            assert [b.seq for b in probe.replay(last + 1)] == [last + 1, last + 2]
        with KVEventSubscriber(connect, replay_endpoint=connect_replay, topic="kv", last_seq=last) as sub:
            got = publish_until_heard(publisher, sub)
        assert_in_order(got, last + 1)
        assert got[0].replayed and got[1].replayed
        assert all(x.batch.data_parallel_rank == 0 for x in got)


def test_a_gap_the_replay_buffer_no_longer_holds_is_reported():
    with KVEventPublisher(BIND, replay_endpoint=BIND_REPLAY, buffer_steps=2) as publisher:
        connect, connect_replay = addresses(publisher)
        for i in range(5):  # nobody listens
            publisher.publish(batch_of(i))
        # publish() only queues: once the replay buffer holds batch 4, all five are sent, none to the subscriber
        with KVEventSubscriber(connect, replay_endpoint=connect_replay) as probe:
            assert [b.seq for b in probe.replay(0)] == [3, 4]  # the publisher sends queued batches before a replay
        with KVEventSubscriber(connect, replay_endpoint=connect_replay, last_seq=0) as sub:
            got = publish_until_heard(publisher, sub)
    live = got[-1].seq  # the buffer held live - 1 and live when the gap was seen
    assert got[0] == LostBatches(1, live - 2)
    assert_in_order(got[1:], live - 1)
    assert got[1].replayed


def test_without_a_replay_socket_a_gap_is_reported_and_a_restart_is_seen(tmp_path):
    # the subscriber connects before the publisher binds: an ipc path of this test's own, which nothing else takes
    bind, connect = f"bind:ipc://{tmp_path}/events", f"ipc://{tmp_path}/events"
    with KVEventSubscriber(connect, last_seq=600) as sub:
        with KVEventPublisher(bind) as publisher:  # a new publisher: its sequence starts at 0
            got = publish_until_heard(publisher, sub)
            first = got[-1].seq
            assert got[0] == PublisherRestarted(first)
            assert got[1:-1] == ([LostBatches(0, first - 1)] if first else [])
            assert_in_order(got[-1:], first)
            publisher.publish(batch_of(first + 1))
            assert [x.seq for x in collect(sub, 1)] == [first + 1]
        assert sub.last_seq == first + 1
        assert sub.replay(0) == []


def test_a_replay_socket_that_does_not_answer_leaves_the_gap_reported(tmp_path):
    nobody = f"ipc://{tmp_path}/nobody"  # nothing ever binds it
    with KVEventPublisher(BIND, replay_endpoint=BIND_REPLAY) as publisher:
        connect, connect_replay = addresses(publisher)
        for i in range(3):
            publisher.publish(batch_of(i))
        with KVEventSubscriber(connect, replay_endpoint=connect_replay) as probe:  # all three sent, none heard
            assert [b.seq for b in probe.replay(0)] == [0, 1, 2]
        with KVEventSubscriber(connect, replay_endpoint=nobody, last_seq=0, replay_timeout=0.3) as sub:
            got = publish_until_heard(publisher, sub)
    live = got[-1].seq
    assert got[0] == LostBatches(1, live - 1)
    assert_in_order(got[1:], live)
    with KVEventSubscriber(connect, replay_endpoint=nobody, replay_timeout=0.1) as sub:
        with pytest.raises(EventStreamError, match="did not finish"):
            sub.replay(0)


def collect(sub: KVEventSubscriber, count: int, timeout: float = 5.0) -> list:
    got: list = []
    deadline = time.monotonic() + timeout
    while sum(isinstance(x, SequencedBatch) for x in got) < count and time.monotonic() < deadline:
        got += sub.receive(timeout=0.1)
    return got


def test_the_replay_socket_answers_a_plain_zmq_client_as_vllm_does():
    import zmq

    with KVEventPublisher(BIND, replay_endpoint=BIND_REPLAY, topic="t") as publisher:
        _, connect_replay = addresses(publisher)
        for i in range(3):
            publisher.publish(batch_of(i), ts=float(i))
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.connect(connect_replay)
        sock.send_multipart((b"", b"not a sequence number"))  # ignored
        sock.send_multipart((b"", (1).to_bytes(8, "big")))
        frames = []
        while True:
            assert sock.poll(3000)
            msg = sock.recv_multipart()
            frames.append(msg)
            if int.from_bytes(msg[2], "big", signed=True) == -1:
                break
        sock.close(linger=0)
        ctx.term()
    assert [m[1] for m in frames[:2]] == [b"t", b"t"]
    assert [int.from_bytes(m[2], "big") for m in frames[:2]] == [1, 2]
    assert frames[1][3] == encode_batch(batch_of(2), ts=2.0)
    assert frames[2] == [b"", b"", (-1).to_bytes(8, "big", signed=True), b""]


def test_a_managers_events_go_over_the_wire_intact():
    events = manager_events()
    with KVEventPublisher(BIND, replay_endpoint=BIND_REPLAY) as publisher:
        connect, connect_replay = addresses(publisher)
        publisher.publish(events)  # perhaps before the subscription is up: then it is replayed
        with KVEventSubscriber(connect, replay_endpoint=connect_replay, last_seq=-1) as sub:
            got = publish_until_heard(publisher, sub)
    assert got[0].seq == 0 and got[0].batch.events == tuple(events)


def test_publisher_arguments_are_checked():
    with pytest.raises(ConfigError, match="ZeroMQ endpoint"):
        KVEventPublisher("localhost:5557")
    with pytest.raises(ConfigError, match="replay_endpoint"):
        KVEventPublisher("tcp://*:0", replay_endpoint="5558")
    with pytest.raises(ConfigError, match="buffer_steps"):
        KVEventPublisher("tcp://*:0", buffer_steps=0)
    with pytest.raises(ConfigError, match="last_seq"):
        KVEventSubscriber("tcp://127.0.0.1:1", last_seq=-2)
    with KVEventPublisher("tcp://*:0") as taken, pytest.raises(ConfigError, match="cannot open"):
        KVEventPublisher(f"tcp://*:{taken.endpoint.rsplit(':', 1)[1]}")  # the port is taken
    publisher = KVEventPublisher("tcp://*:0")
    assert publisher.endpoint.startswith("tcp://*:") and not publisher.endpoint.endswith(":0")
    publisher.close()
    with pytest.raises(ConfigError, match="closed"):
        publisher.publish([])


def test_missing_msgspec_names_the_events_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "msgspec", None)
    with pytest.raises(ConfigError, match=r"kvpool\[events\]"):
        encode_batch([])


def test_describe_events_tells_a_router_everything_it_needs(monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    mgr = KVCacheManager(8, 16, hash_algo="sha256_cbor")
    info = describe_events(mgr.hasher, endpoint="tcp://10.0.0.5:5557", replay_endpoint="tcp://10.0.0.5:5558")
    assert info == {
        "enabled": True,
        "endpoint": "tcp://10.0.0.5:5557",
        "replay_endpoint": "tcp://10.0.0.5:5558",
        "topic": "",
        "format": "vllm-0.33-msgpack",
        "data_parallel_rank": 0,
        "content": "full",
        "curve_public_key": None,
        "num_blocks": None,
        "snapshot": None,  # a server that answers GET /kv-events/snapshot names its path
        "hash_algorithm": "sha256_cbor",
        "hash_seed": "vllm-default",
        "block_size": 16,
    }
    assert json.loads(json.dumps(info)) == info
    assert describe_events(KVCacheManager(8, 4).hasher, endpoint=None)["enabled"] is False


def test_importing_kv_events_needs_neither_zmq_nor_msgspec():
    code = "import sys; sys.modules['zmq'] = sys.modules['msgspec'] = None; import kvpool.kv_events"
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "PYTHONPATH": str(ROOT / "src")})


def test_the_documented_example_runs():
    """docs/kv_events.md: publish a manager's events, receive them, recompute their hashes from the prompt."""
    text = (ROOT / "docs" / "kv_events.md").read_text()
    (code,) = [block for block in re.findall(r"```python\n(.*?)```", text, re.S) if "KVEventPublisher" in block]
    namespace: dict = {}
    exec(compile(code, "docs/kv_events.md", "exec"), namespace)
    assert namespace["stored"].block_hashes and namespace["info"]["hash_algorithm"] == "sha256_cbor"
