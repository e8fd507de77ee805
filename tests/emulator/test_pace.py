"""Steps last what the cost profile says, times the time scale, on the engine's clock (a manual one: no waiting)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvpool.emulator import EmulatedEngine, ManualClock
from kvpool.sampling_params import SamplingParams
from tests.emulator.conftest import PROFILE


def _modelled(prefill: int, decodes: int, context: int) -> float:
    """PROFILE's step, written out: 10 ms, 1 ms a prompt token, 2 ms a decoding sequence, 0.1 ms a context token."""
    return 0.01 + 0.001 * prefill + 0.002 * decodes + 0.0001 * context


@pytest.mark.parametrize("scale", [1.0, 2.5])
def test_each_token_arrives_when_the_profile_says(make_engine: Callable[..., EmulatedEngine], scale: float) -> None:
    engine = make_engine(time_scale=scale, max_num_batched_tokens=8)
    clock = engine.clock
    assert isinstance(clock, ManualClock)
    engine.add_requests([list(range(10, 30))], [SamplingParams(max_tokens=4)], request_ids=["a"])
    arrivals = []
    while engine.has_unfinished_requests():
        if engine.step():
            arrivals.append(clock.now())
    # 20 prompt tokens in chunks of 8, 8, 4 (each reading the chunks before), then 3 decodes over 20, 21, 22
    steps = [_modelled(8, 0, 0), _modelled(8, 0, 8), _modelled(4, 0, 16)] + [_modelled(0, 1, c) for c in (20, 21, 22)]
    first_token = sum(steps[:3]) * scale
    expected = [first_token] + [first_token + sum(steps[3 : 3 + k]) * scale for k in (1, 2, 3)]
    assert arrivals == pytest.approx(expected)
    assert engine.modelled_seconds == pytest.approx(sum(steps))
    assert PROFILE.step_seconds(8, 0, context_tokens=8) == pytest.approx(steps[1])


def test_two_sequences_share_a_step_and_its_overhead(make_engine: Callable[..., EmulatedEngine]) -> None:
    engine = make_engine()
    engine.add_requests([[5] * 8, [6] * 8], [SamplingParams(max_tokens=2)] * 2, request_ids=["a", "b"])
    outputs = engine.run_until_done()
    prefill, decode = _modelled(16, 0, 0), _modelled(0, 2, 16)
    assert engine.clock.now() == pytest.approx(prefill + decode)
    assert {rid: out.time_to_first_token for rid, out in outputs.items()} == {
        "a": pytest.approx(prefill),
        "b": pytest.approx(prefill),
    }
    assert {out.finish_reason.value for out in outputs.values()} == {"length"}


def test_a_step_that_starts_late_is_not_made_up_for(make_engine: Callable[..., EmulatedEngine]) -> None:
    """The engine's own time is absorbed while a step lasts longer; idle time is never paid back later."""
    engine = make_engine()
    clock = engine.clock
    assert isinstance(clock, ManualClock)
    engine.add_requests([[7] * 4], [SamplingParams(max_tokens=1)], request_ids=["a"])
    engine.step()
    first = clock.now()
    clock.sleep_until(first + 100.0)  # the replica sat idle
    engine.add_requests([[8] * 4], [SamplingParams(max_tokens=1)], request_ids=["b"])
    engine.step()
    assert clock.now() == pytest.approx(first + 100.0 + _modelled(4, 0, 0))


def test_the_engines_own_time_between_busy_steps_is_part_of_the_next_step(
    make_engine: Callable[..., EmulatedEngine],
) -> None:
    engine = make_engine()
    clock = engine.clock
    assert isinstance(clock, ManualClock)
    engine.add_requests([[7] * 4], [SamplingParams(max_tokens=3)], request_ids=["a"])
    engine.step()
    prefill_end = clock.now()
    clock.sleep_until(prefill_end + 0.001)  # 1 ms of the engine's own work, shorter than a step: absorbed
    engine.step()
    assert clock.now() == pytest.approx(prefill_end + _modelled(0, 1, 4))
    clock.sleep_until(clock.now() + 1.0)  # longer than a step (an overloaded machine): lost, not made up for
    before = clock.now()
    engine.step()
    assert clock.now() == pytest.approx(before + _modelled(0, 1, 5))


def test_streaming_over_http_runs_on_the_engines_clock(make_engine: Callable[..., EmulatedEngine]) -> None:
    pytest.importorskip("starlette")
    httpx = pytest.importorskip("httpx")
    from kvpool.serve import build_app
    from tests.emulator.conftest import serve_config
    from tests.serve.conftest import LiveServer

    engine = make_engine()
    live = LiveServer(build_app(engine, serve_config()))
    try:
        body = {"model": "emulated", "prompt": list(range(10, 22)), "max_tokens": 5, "stream": True}
        with httpx.stream("POST", f"{live.base_url}/completions", json=body, timeout=30) as response:
            chunks = [line for line in response.iter_lines() if line.startswith("data: {")]
    finally:
        live.stop()
    assert '"finish_reason":"length"' in chunks[-1]  # on a manual clock the deltas come at once: merged chunks
    steps = [_modelled(12, 0, 0)] + [_modelled(0, 1, c) for c in (12, 13, 14, 15)]
    assert engine.clock.now() == pytest.approx(sum(steps))


def test_a_pool_too_small_for_the_batch_preempts_and_every_request_still_finishes(
    make_engine: Callable[..., EmulatedEngine],
) -> None:
    engine = make_engine(num_blocks=12, block_size=4)  # 11 usable blocks: 44 tokens for 4 requests of 10 + 12
    engine.add_requests(
        [[10 + i] * 10 for i in range(4)], [SamplingParams(max_tokens=12)] * 4, request_ids=["a", "b", "c", "d"]
    )
    outputs = engine.run_until_done()
    assert sorted(outputs) == ["a", "b", "c", "d"]
    assert all(out.num_output_tokens == 12 for out in outputs.values())
    assert engine.scheduler.num_preemptions > 0
    # a preempted request computes its tokens again (prefill chunks, priced as such by step_seconds)
    assert sum(out.num_computed_tokens for out in outputs.values()) > 4 * (10 + 11)
    engine.manager.check_invariants()


def test_a_stop_string_ends_a_request_by_its_text(make_engine: Callable[..., EmulatedEngine]) -> None:
    engine = make_engine()
    engine.add_requests([list(range(10, 20))], [SamplingParams(max_tokens=64, stop=("a",))], request_ids=["a"])
    engine.add_requests([list(range(10, 20))], [SamplingParams(max_tokens=64)], request_ids=["free"])
    outputs = engine.run_until_done()
    free, stopped = outputs["free"], outputs["a"]
    assert "a" in free.text  # the same prompt draws the same tokens: this one shows where "a" comes
    assert (stopped.finish_reason.value, stopped.stop_reason) == ("stop", "a")
    assert stopped.text == free.text[: free.text.index("a")]
    assert stopped.num_output_tokens < free.num_output_tokens == 64


def test_logprobs_are_the_draws_own(make_engine: Callable[..., EmulatedEngine]) -> None:
    import math

    engine = make_engine()
    engine.add_requests([list(range(10, 20))], [SamplingParams(max_tokens=4, logprobs=2)], request_ids=["a"])
    [output] = engine.run_until_done().values()
    ordinary = engine.tokenizer.vocab_size - len(engine.tokenizer.special_token_ids)
    assert output.logprobs is not None and len(output.logprobs) == 4
    for token, logprobs in zip(output.output_token_ids, output.logprobs):
        assert logprobs.token_id == token and logprobs.logprob == pytest.approx(-math.log(ordinary))
        assert len(logprobs.top) == 2 and logprobs.top[0] == (token, logprobs.logprob)
