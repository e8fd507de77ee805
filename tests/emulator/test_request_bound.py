"""One request's output bound (the server's max_request_tokens) is the scheduler's rule in both engines."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvpool.emulator import EmulatedEngine
from kvpool.errors import RequestTooLarge
from kvpool.sampling_params import SamplingParams


def test_a_request_past_the_bound_is_refused_naming_the_field_and_nothing_is_queued(
    make_engine: Callable[..., EmulatedEngine],
) -> None:
    engine = make_engine(num_blocks=128)
    prompts = [[5, 6, 7]] * 3
    with pytest.raises(RequestTooLarge, match="3 sequences x 20 tokens = 60") as refused:
        engine.add_requests(prompts, [SamplingParams(max_tokens=20)] * 3, max_output_tokens=50)
    assert refused.value.param == "max_tokens"
    with pytest.raises(RequestTooLarge, match="rest of the context"):
        engine.add_requests([[5, 6, 7]], [SamplingParams(max_tokens=None)], max_output_tokens=50)
    assert not engine.has_unfinished_requests()
    engine.add_requests(prompts, [SamplingParams(max_tokens=16)] * 3, max_output_tokens=50)
    assert engine.has_unfinished_requests()
