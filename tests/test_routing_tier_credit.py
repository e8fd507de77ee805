"""Tier credit: a prefix held below a replica's GPU memory counts for the prefill time loading it saves."""

from __future__ import annotations

import math

import pytest

from kvpool.errors import ConfigError
from kvpool.routing import MediumCost, TierCredit, most_saved

POOL = frozenset({None, "GPU"})
RATE = 10_000.0  # tokens per second: one token computes in 100 us


def credit(**media: MediumCost) -> TierCredit:
    return TierCredit(prefill_tokens_per_s=RATE, main_pool=POOL, media=media)


def per_token(fraction_of_compute: float, latency_s: float = 0.0) -> MediumCost:
    """A medium that loads a token in ``fraction_of_compute`` of the time computing it takes."""
    return MediumCost(latency_s=latency_s, seconds_per_token=fraction_of_compute / RATE)


def test_gpu_blocks_count_in_full() -> None:
    assert credit().credited_tokens([({"GPU"}, 2), ({None}, 1)], 16) == 48
    assert credit().credited_tokens([], 16) == 0


def test_without_latency_a_tier_block_is_worth_what_loading_saves_of_computing() -> None:
    # max(0, 1 - load / prefill) of each block: a load at a quarter of the prefill time keeps three quarters
    rule = credit(CPU=per_token(0.25), STORAGE=per_token(0.5))
    assert rule.credited_tokens([({"CPU"}, 4)], 16) == 4 * 12
    assert rule.credited_tokens([({"STORAGE"}, 4)], 16) == 4 * 8
    # a medium slower than computing is worth nothing, however long the prefix
    assert credit(STORAGE=per_token(1.5)).credited_tokens([({"STORAGE"}, 100)], 16) == 0


def test_the_pool_run_comes_first_then_the_tier_blocks() -> None:
    rule = credit(CPU=per_token(0.25))
    assert rule.credited_tokens([({"GPU"}, 1), ({"GPU", "CPU"}, 1), ({"CPU"}, 2)], 16) == 32 + 2 * 12
    # past the pool's first miss, a block only the pool holds cannot be used: the prefix ends there
    assert rule.credited_tokens([({"GPU"}, 1), ({"CPU"}, 1), ({"GPU"}, 1), ({"CPU"}, 1)], 16) == 16 + 12
    # a block held in two tiers loads from the cheaper
    both = credit(CPU=per_token(0.25), STORAGE=per_token(0.75))
    assert both.credited_tokens([({"STORAGE", "CPU"}, 1)], 16) == 12


def test_latency_is_paid_once_per_medium_so_short_tier_prefixes_are_worth_less() -> None:
    slow_start = per_token(0.5, latency_s=16 * 0.5 / RATE)  # one fetch costs half a block's compute
    rule = credit(STORAGE=slow_start)
    assert rule.credited_tokens([({"STORAGE"}, 1)], 16) == 0  # 16 x 0.5 saved, minus 8 tokens of latency
    assert rule.credited_tokens([({"STORAGE"}, 4)], 16) == 4 * 8 - 8
    assert most_saved([("STORAGE", slow_start, 4)], 16, RATE) == (4, pytest.approx(24 / RATE))


def test_runs_give_what_blocks_one_by_one_give() -> None:
    fast, slow, late = per_token(0.25), per_token(2.0), per_token(0.5, latency_s=0.004)
    runs = [("CPU", fast, 3), ("STORAGE", late, 5), ("FS", slow, 2), ("CPU", fast, 4), ("STORAGE", late, 9)]
    one_by_one = most_saved([(medium, cost, 1) for medium, cost, n in runs for _ in range(n)], 16, RATE)
    k, saved = most_saved(runs, 16, RATE)
    assert (k, saved) == (one_by_one[0], pytest.approx(one_by_one[1]))
    assert one_by_one[0] == 23  # the far end: the second run of each medium pays no latency again


def test_the_best_cut_may_stop_inside_the_tier_blocks() -> None:
    fast, slow = per_token(0.25), per_token(2.0)
    k, saved = most_saved([("CPU", fast, 2), ("STORAGE", slow, 2)], 16, RATE)
    assert k == 2 and saved == pytest.approx(2 * 12 / RATE)
    assert most_saved([], 16, RATE) == (0, 0.0)
    assert most_saved([("STORAGE", slow, 1)], 16, RATE) == (0, 0.0)


def test_a_margin_asks_loads_to_be_that_much_faster_and_latency_is_per_medium() -> None:
    half = per_token(0.5)
    assert most_saved([("CPU", half, 4)], 16, RATE, margin=1.5)[0] == 4  # 0.75 of computing: still worth it
    assert most_saved([("CPU", half, 4)], 16, RATE, margin=2.0) == (0, 0.0)  # as slow as computing, at 2x
    fetch = per_token(0.0, latency_s=8 / RATE)  # no bandwidth cost, half a block's compute per fetch
    # two media with the same figures are still two fetches
    assert most_saved([("CPU", fetch, 1), ("STORAGE", fetch, 1)], 16, RATE)[1] == pytest.approx(16 / RATE)
    assert most_saved([("CPU", fetch, 1), ("CPU", fetch, 1)], 16, RATE)[1] == pytest.approx(24 / RATE)
    for margin in (0, -1.0, math.nan, math.inf, True):
        with pytest.raises(ConfigError, match="margin"):
            most_saved([], 16, RATE, margin=margin)


def test_a_medium_it_has_no_figure_for() -> None:
    held = [({"CPU_TIER2"}, 2)]
    assert credit(CPU=per_token(0.25)).credited_tokens(held, 16) == 0  # no cost known: not credited
    costed = TierCredit(prefill_tokens_per_s=RATE, main_pool=POOL, media={}, other=per_token(0.5))
    assert costed.credited_tokens(held, 16) == 16


def test_a_link_becomes_a_per_token_cost() -> None:
    cost = MediumCost.of_link(25e9, 10e-6, kv_bytes_per_token=131072)
    assert cost.latency_s == 10e-6 and cost.seconds_per_token == pytest.approx(131072 / 25e9)
    assert cost.seconds(0) == 0.0 and cost.seconds(2) == pytest.approx(10e-6 + 2 * 131072 / 25e9)


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: MediumCost(latency_s=-1.0, seconds_per_token=0.0), "latency_s"),
        (lambda: MediumCost(latency_s=0.0, seconds_per_token=math.nan), "seconds_per_token"),
        (lambda: MediumCost(latency_s=True, seconds_per_token=0.0), "latency_s"),
        (lambda: MediumCost.of_link(0, 0.0, kv_bytes_per_token=1), "bandwidth"),
        (lambda: MediumCost.of_link(1e9, 0.0, kv_bytes_per_token=0), "kv_bytes_per_token"),
        (lambda: TierCredit(prefill_tokens_per_s=0.0, main_pool=POOL), "prefill_tokens_per_s"),
        (lambda: TierCredit(prefill_tokens_per_s=math.inf, main_pool=POOL), "prefill_tokens_per_s"),
        (lambda: TierCredit(prefill_tokens_per_s=1.0, main_pool=POOL, media={"GPU": per_token(1)}), "own pool"),
        (lambda: TierCredit(prefill_tokens_per_s=1.0, main_pool=POOL, media={"CPU": 0.5}), "MediumCost"),  # type: ignore[dict-item]  # what a caller might pass
    ],
)
def test_bad_figures_are_refused_by_name(build, message: str) -> None:  # type: ignore[no-untyped-def]  # a lambda
    with pytest.raises(ConfigError, match=message):
        build()
