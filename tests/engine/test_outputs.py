"""Streaming text pieces and the per-request log line."""

from __future__ import annotations

import dataclasses

from kvpool.engine.outputs import IncrementalDetokenizer, RequestOutput, prompt_tokens_computed, request_log_line
from kvpool.scheduler import FinishReason


class ByteTokenizer:
    """Token ``i`` is byte ``i``; 0 is a special token that decodes to nothing."""

    def decode(self, ids, skip_special_tokens=True):
        data = bytes(i for i in ids if not (skip_special_tokens and i == 0))
        return data.decode("utf-8", errors="replace")


def test_pieces_wait_for_whole_characters_and_add_up_to_the_text():
    text = "né à 東京!"
    ids = list(text.encode())
    ids.insert(3, 0)  # a special token in the middle
    detok = IncrementalDetokenizer(ByteTokenizer())
    pieces = [detok.push(i) for i in ids]
    assert "".join(pieces) + detok.flush() == text
    assert "\ufffd" not in "".join(pieces)
    assert pieces[1] == ""  # the first byte of "é" alone is not a character yet
    assert pieces[2] == "é"


def test_flush_hands_out_an_incomplete_tail():
    detok = IncrementalDetokenizer(ByteTokenizer())
    assert detok.push(ord("a")) == "a"
    assert detok.push(0xE6) == ""
    assert detok.flush() == "\ufffd"


def test_request_log_line():
    out = RequestOutput(
        request_id="7",
        prompt=None,
        prompt_token_ids=tuple(range(40)),
        output_token_ids=(1, 2, 3, 4),
        text="",
        finish_reason=FinishReason.EOS,
        num_cached_tokens=32,
        num_computed_tokens=11,
        time_to_first_token=0.0504,
        queue_time=0.001,
        latency=0.5,
        num_preemptions=0,
    )
    assert out.tokens_per_second == 8.0
    assert request_log_line(out) == (
        "request 7: 40 prompt tokens (32 cached, 8 computed), 4 output tokens; "
        "time to first token 50 ms; 8.0 tokens/s; finished: eos"
    )
    # the prompt's computed tokens are the fed ones less the decode steps' (every output token but the last)
    assert prompt_tokens_computed(out) == 40 - 32
    tiered = dataclasses.replace(out, cached_tokens_by_tier={"gpu": 16, "cpu": 16})
    assert "(32 cached: 16 gpu, 16 cpu; 8 computed), 4 output tokens" in request_log_line(tiered)
