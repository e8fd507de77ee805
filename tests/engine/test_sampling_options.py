"""vLLM's sampling options in the sampler: each changes a row exactly as its formula says.

Small hand-made logits go through :func:`sample_rows`; the expected rows are
written out from the formulas (repetition, then frequency, then presence,
before temperature; min-p relative to the best token; the min_tokens mask;
log-probabilities of the raw row), so a wrong order or sign fails here.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.engine.penalties import apply_penalties
from kvpool.engine.sampling import (
    MAX_LOGPROBS,
    RowContext,
    SampledToken,
    SamplingFailure,
    SamplingParams,
    make_generator,
    sample_rows,
)
from kvpool.errors import ConfigError

pytestmark = pytest.mark.engine


def _one(logits: list[float], params: SamplingParams, context: RowContext | None = None) -> SampledToken:
    [row] = sample_rows(torch.tensor([logits]), [params], [make_generator(params)], [context])
    assert isinstance(row, SampledToken), row
    return row


# -- the formulas ------------------------------------------------------------------------


def test_penalties_follow_vllms_formulas_in_order() -> None:
    logits = torch.tensor([2.0, -1.0, 0.5, 3.0, -2.0, 1.0])
    prompt = [0, 1]  # seen in the prompt only
    output = [2, 2, 3]  # token 2 twice, token 3 once
    out = apply_penalties(logits, prompt, output, presence=0.5, frequency=0.25, repetition=2.0)
    expected = [
        2.0 / 2,  # prompt, positive: divided
        -1.0 * 2,  # prompt, negative: multiplied
        0.5 / 2 - 0.25 * 2 - 0.5,  # output twice: repetition, frequency x2, presence once
        3.0 / 2 - 0.25 * 1 - 0.5,
        -2.0,  # never seen
        1.0,
    ]
    assert out.tolist() == pytest.approx(expected)
    assert logits.tolist() == [2.0, -1.0, 0.5, 3.0, -2.0, 1.0]  # the input row is left alone


def test_negative_penalties_encourage_repeats() -> None:
    out = apply_penalties(torch.tensor([0.0, 0.0]), [], [1, 1], presence=-1.0, frequency=-2.0, repetition=1.0)
    assert out.tolist() == [0.0, 5.0]


def test_a_greedy_row_with_penalties_is_the_argmax_of_the_penalised_logits() -> None:
    logits = [1.0, 3.0, 2.5, 0.0]
    context = RowContext(prompt_token_ids=[], output_token_ids=[1])
    assert _one(logits, SamplingParams(temperature=0.0)).token_id == 1
    # 3.0 - 1.0 (presence) = 2.0 < 2.5: token 2 wins.
    assert _one(logits, SamplingParams(presence_penalty=1.0), context).token_id == 2
    # repetition 1.25 on the prompt's token 1: 3.0 / 1.25 = 2.4 < 2.5.
    assert _one(logits, SamplingParams(repetition_penalty=1.25), RowContext(prompt_token_ids=[1])).token_id == 2
    assert _one(logits, SamplingParams(repetition_penalty=1.1), RowContext(prompt_token_ids=[1])).token_id == 1


def test_min_tokens_masks_the_end_tokens_until_enough_were_generated() -> None:
    logits = [0.0, 5.0, 4.0, 1.0]  # token 1 is the best: call it EOS
    params = SamplingParams(min_tokens=2, max_tokens=8)
    early = RowContext(output_token_ids=[3], end_token_ids=[1, 2])
    assert _one(logits, params, early).token_id == 3  # EOS and the stop token 2 are masked
    enough = RowContext(output_token_ids=[3, 3], end_token_ids=[1, 2])
    assert _one(logits, params, enough).token_id == 1


def test_a_row_whose_only_tokens_are_masked_fails_alone() -> None:
    params = SamplingParams(min_tokens=1)
    rows = sample_rows(
        torch.tensor([[float("-inf"), 1.0], [0.0, 1.0]]),
        [params, SamplingParams()],
        [None, None],
        [RowContext(end_token_ids=[1]), None],
    )
    assert isinstance(rows[0], SamplingFailure) and "min_tokens" in rows[0].reason
    assert rows[1] == SampledToken(token_id=1)


def test_min_p_drops_tokens_below_its_share_of_the_best() -> None:
    # probabilities 0.5, 0.3, 0.2 at temperature 1: min_p 0.5 keeps p >= 0.25, so only tokens 0 and 1.
    logits = [math.log(0.5), math.log(0.3), math.log(0.2)]
    params = SamplingParams(temperature=1.0, min_p=0.5, seed=0)
    drawn = {_one(logits, SamplingParams(temperature=1.0, min_p=0.5, seed=s)).token_id for s in range(200)}
    assert drawn == {0, 1}
    assert {_one(logits, SamplingParams(temperature=1.0, seed=s)).token_id for s in range(200)} == {0, 1, 2}
    assert _one(logits, params).token_id in (0, 1)
    # min_p 1 keeps only the most likely token.
    assert {_one(logits, SamplingParams(temperature=1.0, min_p=1.0, seed=s)).token_id for s in range(50)} == {0}


def test_logprobs_are_the_raw_rows_whatever_the_penalties_and_temperature() -> None:
    logits = [1.0, 3.0, 2.0, 0.0]
    raw = torch.log_softmax(torch.tensor(logits), dim=-1).tolist()
    params = SamplingParams(presence_penalty=2.0, logprobs=2)
    row = _one(logits, params, RowContext(output_token_ids=[1]))
    assert row.token_id == 2  # 3 - 2 = 1 < 2
    assert row.logprobs is not None
    assert row.logprobs.token_id == 2 and row.logprobs.logprob == pytest.approx(raw[2])
    assert [t for t, _ in row.logprobs.top] == [1, 2]
    assert [lp for _, lp in row.logprobs.top] == pytest.approx([raw[1], raw[2]])
    hot = _one(logits, SamplingParams(temperature=5.0, seed=3, logprobs=0))
    assert hot.logprobs is not None and hot.logprobs.top == ()
    assert hot.logprobs.logprob == pytest.approx(raw[hot.token_id])


def test_rows_that_ask_no_logprobs_get_none() -> None:
    rows = sample_rows(
        torch.tensor([[0.0, 1.0], [1.0, 0.0]]), [SamplingParams(logprobs=1), SamplingParams()], [None, None]
    )
    assert isinstance(rows[0], SampledToken) and rows[0].logprobs is not None
    assert rows[1] == SampledToken(token_id=0)


def test_logprob_ties_list_the_lower_token_first() -> None:
    row = _one([1.0, 2.0, 2.0, 2.0], SamplingParams(logprobs=3))
    assert row.logprobs is not None and [t for t, _ in row.logprobs.top] == [1, 2, 3]


# -- the fields ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -2.01}, "frequency_penalty"),
        ({"frequency_penalty": math.nan}, "nan"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": math.inf}, "inf"),
        ({"repetition_penalty": True}, "True"),
        ({"min_p": 1.5}, "min_p"),
        ({"min_p": "0.1"}, "'0.1'"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 20, "max_tokens": 10}, "min_tokens \\(20\\)"),
        ({"stop": [""]}, "stop\\[0\\]"),
        ({"stop": ["a", 3]}, "stop\\[1\\]"),
        ({"stop": b"x"}, "b'x'"),
        ({"include_stop_str_in_output": 1}, "include_stop_str_in_output"),
        ({"logprobs": MAX_LOGPROBS + 1}, "21"),
        ({"logprobs": -1}, "logprobs"),
        ({"logprobs": True}, "True"),
        ({"max_tokens": 0}, "max_tokens"),
    ],
)
def test_a_bad_value_is_refused_naming_it(fields: dict[str, object], named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        SamplingParams(**fields)  # type: ignore[arg-type]


def test_the_new_fields_keep_vllms_defaults_and_forms() -> None:
    p = SamplingParams(max_tokens=None, stop="###", presence_penalty=1, min_p=0)
    assert p.max_tokens is None and p.stop == ("###",)
    assert p.presence_penalty == 1.0 and isinstance(p.presence_penalty, float)
    d = SamplingParams()
    assert (d.repetition_penalty, d.min_p, d.min_tokens, d.logprobs, d.stop) == (1.0, 0.0, 0, None, ())
    assert not d.has_penalties and SamplingParams(repetition_penalty=0.5).has_penalties


_extreme = st.one_of(
    st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from([0.0, -0.0, 1e-300, -1e-300, 1e300, -1e300, 5e-324]),
)


@settings(max_examples=150, deadline=None)
@given(
    row=st.lists(st.one_of(_extreme, st.sampled_from([math.inf, -math.inf])), min_size=1, max_size=6),
    presence=st.floats(-2, 2),
    frequency=st.floats(-2, 2),
    repetition=st.one_of(st.floats(min_value=1e-6, max_value=1e6), st.sampled_from([1e-6, 1e6])),
    min_p=st.floats(0, 1),
    temperature=st.one_of(st.just(0.0), st.floats(min_value=0, max_value=1e6)),
    top_k=st.integers(0, 8),
    min_tokens=st.integers(0, 3),
    logprobs=st.one_of(st.none(), st.integers(0, MAX_LOGPROBS)),
    outputs=st.lists(st.integers(0, 7), max_size=4),
)
def test_extreme_values_never_raise_in_the_sampler(
    row, presence, frequency, repetition, min_p, temperature, top_k, min_tokens, logprobs, outputs
) -> None:
    params = SamplingParams(
        max_tokens=8,
        temperature=temperature,
        top_k=top_k,
        presence_penalty=presence,
        frequency_penalty=frequency,
        repetition_penalty=repetition,
        min_p=min_p,
        min_tokens=min_tokens,
        logprobs=logprobs,
        seed=1,
    )
    context = RowContext(prompt_token_ids=[0, 9], output_token_ids=outputs, end_token_ids=[0, 99])
    [result] = sample_rows(torch.tensor([row], dtype=torch.float32), [params], [make_generator(params)], [context])
    if isinstance(result, SampledToken):
        assert 0 <= result.token_id < len(row)
        assert (result.logprobs is None) == (logprobs is None)
        if result.logprobs is not None:
            assert len(result.logprobs.top) == min(logprobs, len(row))
    else:
        assert isinstance(result, SamplingFailure) and result.reason


@pytest.mark.parametrize("penalty", [1e-300, 5e-324, 9.9e-7, 1.01e6, 1e300, 0.0, -1.0])
def test_a_repetition_penalty_past_float32s_safe_range_is_refused(penalty: float) -> None:
    """1e-300 once made the penalised logits overflow and the request fail with a 500; now it is refused."""
    with pytest.raises(ConfigError, match="repetition_penalty"):
        SamplingParams(repetition_penalty=penalty)
