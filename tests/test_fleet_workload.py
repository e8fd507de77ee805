"""benchmarks/fleet_workload.py: the Mooncake trace's block sharing, carried exactly into prompt text."""

from __future__ import annotations

import itertools
import json
import string
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import fleet_workload  # noqa: E402

pytest.importorskip("tokenizers")


def byte_level_tokenizer():
    """A byte-level tokenizer of 400 space-led words, one token each (as SmolLM2's BPE spells them)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["".join(p) for p in itertools.islice(itertools.product(string.ascii_lowercase, repeat=3), 400)]
    vocab = {"<unk>": 0, **{"\u0120" + w: i + 1 for i, w in enumerate(words)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    return tokenizer


def test_prompts_share_exactly_the_trace_blocks_they_share(tmp_path):
    lines = [
        {"timestamp": 1000, "input_length": 1100, "output_length": 5, "hash_ids": [0, 1, 2]},
        {"timestamp": 1500, "input_length": 1300, "output_length": 7, "hash_ids": [0, 1, 3]},
        {"timestamp": 2500, "input_length": 600, "output_length": 9, "hash_ids": [0, 4]},
    ]
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    trace = fleet_workload.read_trace(path)
    assert [r.arrival_s for r in trace] == [0.0, 0.5, 1.5]
    tokenizer = byte_level_tokenizer()
    requests = list(fleet_workload.fleet_requests(tokenizer, trace))
    ids = [tokenizer.encode(r.prompt, add_special_tokens=False).ids for r in requests]
    assert [len(i) for i in ids] == [r.prompt_tokens for r in requests] == [1100, 1300, 600]
    assert 0 not in itertools.chain(*ids)  # every word is one known token

    def shared(a, b):
        return next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))

    # Blocks 0 and 1 (1,024 tokens) are common to the first two, block 0 (512) to all three; a different block
    # differs within its first few tokens (400 words drawn per token).
    assert 1024 <= shared(ids[0], ids[1]) < 1024 + 8
    assert 512 <= shared(ids[0], ids[2]) < 512 + 8
    assert ids[0][:1024] == ids[1][:1024]
    again = list(fleet_workload.fleet_requests(tokenizer, trace))
    assert [r.prompt for r in again] == [r.prompt for r in requests]  # the same trace, the same text


def test_a_prompt_can_be_cut_and_the_slice_starts_at_its_first_line(tmp_path):
    lines = [{"timestamp": t, "input_length": 900, "output_length": 1, "hash_ids": [0, t]} for t in (0, 10, 20)]
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    trace = fleet_workload.read_trace(path, first=1, count=1)
    assert [(r.index, r.arrival_s) for r in trace] == [(1, 0.0)]
    (request,) = fleet_workload.fleet_requests(byte_level_tokenizer(), trace, max_prompt_tokens=700)
    assert request.prompt_tokens == 700


def test_a_tokenizer_without_one_token_words_is_refused():
    from tokenizers import Tokenizer, models

    tokenizer = Tokenizer(models.WordLevel({"<unk>": 0, "a": 1}, unk_token="<unk>"))
    with pytest.raises(ValueError, match="one-token words"):
        fleet_workload.one_token_words(tokenizer)


def test_a_conversation_sample_keeps_whole_conversations(tmp_path):
    lines = [
        {"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [0, 4]},
        {"timestamp": 5, "input_length": 600, "output_length": 1, "hash_ids": [0, 5]},
        {"timestamp": 9, "input_length": 1100, "output_length": 1, "hash_ids": [0, 4, 6]},
        {"timestamp": 12, "input_length": 100, "output_length": 1, "hash_ids": [0]},
    ]
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    kept = fleet_workload.read_trace(path, conversations=2)
    assert [(r.index, r.arrival_s) for r in kept] == [(0, 0.0), (2, 0.009)]
    with pytest.raises(ValueError, match="conversations"):
        fleet_workload.read_trace(path, conversations=0)
