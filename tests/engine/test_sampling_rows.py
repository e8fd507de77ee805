"""The sampler over any sampling parameters and any logits: each row samples a valid token or fails alone.

Extreme floats (subnormal and 1e-300 temperatures, huge top_k, tiny top_p)
and extreme logits (huge, -inf, all equal, NaN rows) never raise for the
batch: a row either gets a token ID of the vocabulary or a
:class:`SamplingFailure` of its own, and what a row gets does not depend on
the other rows of the batch.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.engine.sampling import GREEDY_BELOW, SamplingFailure, SamplingParams, make_generator, sample_tokens

VOCAB = 12

_EXTREME_TEMPERATURES = [0.0, 5e-324, 1e-308, 1e-300, 1e-45, 1e-30, 9.99e-6, GREEDY_BELOW, 1e-4, 2.0, 1e30, 1e308]

temperatures = st.one_of(
    st.sampled_from(_EXTREME_TEMPERATURES),
    st.floats(min_value=0.0, max_value=1e308, allow_nan=False, allow_infinity=False, allow_subnormal=True),
)
top_ps = st.one_of(
    st.sampled_from([5e-324, 1e-300, 1e-8, 0.5, 1.0]),
    st.floats(min_value=5e-324, max_value=1.0, allow_nan=False, allow_subnormal=True),
)
top_ks = st.one_of(st.sampled_from([0, 1, VOCAB - 1, VOCAB, VOCAB + 1, 2**62]), st.integers(0, 2**62))
params = st.builds(
    SamplingParams,
    temperature=temperatures,
    top_p=top_ps,
    top_k=top_ks,
    seed=st.integers(0, 2**63 - 1),
)

_SPECIAL = [0.0, -0.0, 1e-45, -1e-45, 3e38, -3e38, 1e30, -1e30, math.inf, -math.inf, math.nan]
logit_values = st.one_of(st.sampled_from(_SPECIAL), st.floats(width=32))
rows = st.one_of(
    st.lists(logit_values, min_size=VOCAB, max_size=VOCAB),
    st.builds(lambda x: [x] * VOCAB, logit_values),  # all equal (all NaN, all -inf, all huge...)
    st.lists(st.floats(-50, 50, width=32), min_size=VOCAB, max_size=VOCAB),  # an honest row
)


def _alone(row: list[float], p: SamplingParams) -> int | SamplingFailure:
    return sample_tokens(torch.tensor([row], dtype=torch.float32), [p], [make_generator(p)])[0]


@settings(max_examples=400, deadline=None)
@given(st.lists(st.tuples(rows, params), min_size=1, max_size=4))
def test_every_row_samples_a_valid_token_or_fails_alone(batch: list[tuple[list[float], SamplingParams]]) -> None:
    logits = torch.tensor([row for row, _ in batch], dtype=torch.float32)
    ps = [p for _, p in batch]
    out = sample_tokens(logits, ps, [make_generator(p) for p in ps])  # never raises
    assert len(out) == len(batch)
    for (row, p), got in zip(batch, out):
        if isinstance(got, SamplingFailure):
            assert got.reason
        else:
            assert type(got) is int and 0 <= got < VOCAB
            assert not math.isnan(row[got]) and row[got] > -math.inf
        assert got == _alone(row, p)  # the same seed gives the same answer without the rest of the batch
        if all(math.isfinite(x) and abs(x) <= 1e30 for x in row):
            assert not isinstance(got, SamplingFailure), (row, p)  # honest numbers always sample
        if p.greedy and not isinstance(got, SamplingFailure):
            assert row[got] == max(row)


@pytest.mark.parametrize("temperature", [1e-300, 5e-324, 1e-6])
def test_a_temperature_too_small_to_divide_by_is_greedy(temperature: float) -> None:
    p = SamplingParams(temperature=temperature, seed=3)
    assert p.greedy and make_generator(p) is None
    logits = torch.tensor([[0.5, 2.0, 1.0]])
    assert sample_tokens(logits, [p], [None]) == [1]


def test_the_greedy_cut_is_vllms() -> None:
    assert GREEDY_BELOW == 1e-5
    assert not SamplingParams(temperature=1e-5).greedy
    assert SamplingParams(temperature=9.9e-6).greedy


def test_a_nan_row_fails_alone_and_its_neighbours_sample() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0], [math.nan, 1.0, 0.0], [-math.inf] * 3, [2.0, 1.0, 0.0]])
    hot = SamplingParams(temperature=1.0, seed=0)
    ps = [SamplingParams(), hot, SamplingParams(), hot]
    out = sample_tokens(logits, ps, [make_generator(p) for p in ps])
    assert out[0] == 1 and isinstance(out[3], int)
    assert isinstance(out[1], SamplingFailure) and "NaN" in out[1].reason
    assert isinstance(out[2], SamplingFailure) and "-inf" in out[2].reason
