"""A vLLM replica's rates, read from its Prometheus ``GET /metrics``: what a replica that has no ``/rates`` says.

A vLLM replica publishes no ``/rates`` (:mod:`kvpool.replica_rates`), but its ``/metrics`` holds what
the figure rules need, as counters that only grow. Between two reads:

* ``prefill_tokens_per_s``: the prompt tokens its finished requests computed (not served from a cache,
  ``vllm:request_prefill_kv_computed_tokens``) over the seconds those requests spent in prefill
  (``vllm:request_prefill_time_seconds``: first scheduled to first token);
* ``decode_step_s``: the mean gap between a request's consecutive tokens
  (``vllm:inter_token_latency_seconds``), one decode step at the replica's batch.

Each rate is read over a window of the last :data:`WINDOW_READS` reads, so a quiet few seconds keep the
last minute's figure. Requests prefilled side by side each count their whole prefill time, so under
concurrent prefills the rate reads low: it is the rate one request saw, which is what its time to first
token pays. A counter that went down means the replica restarted: the window starts again there.
A replica that prefilled nothing in the window has no new rate (``None``: its old one stands).

Source ``"metrics"``. A spec's ``profile`` (:mod:`kvpool.router.replica_config`) is an operator's
override: a replica that has one is not read. Series summed over their label sets (one per engine).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from kvpool.errors import ConfigError
from kvpool.replica_rates import ReplicaRates

__all__ = ["METRICS_SOURCE", "WINDOW_READS", "MetricsSample", "MetricsWindow"]

#: The ``source`` of rates read from ``/metrics``.
METRICS_SOURCE = "metrics"
#: Reads a :class:`MetricsWindow` spans (at the router's 5 s rates interval: about a minute).
WINDOW_READS = 12

#: The series read, by the sample field each feeds.
_SERIES = {
    "vllm:request_prefill_time_seconds_sum": "prefill_s",
    "vllm:request_prefill_kv_computed_tokens_sum": "computed_tokens",
    "vllm:inter_token_latency_seconds_sum": "itl_s",
    "vllm:inter_token_latency_seconds_count": "itl_gaps",
}

_PREFIXES = tuple(sorted({name.rsplit("_", 1)[0] for name in _SERIES}))


@dataclass(frozen=True, slots=True)
class MetricsSample:
    """One read of the counters: seconds in prefill, prompt tokens computed, seconds between tokens, and gaps."""

    prefill_s: float
    computed_tokens: float
    itl_s: float
    itl_gaps: float

    @classmethod
    def parse(cls, text: str, where: str) -> MetricsSample:
        """The sample in a Prometheus text body; ConfigError naming ``where`` when it is not one, or lacks a series.

        ``where`` names the body's origin (``"GET http://10.0.0.5:8000/metrics"``).
        """
        from prometheus_client.parser import text_string_to_metric_families

        found = dict.fromkeys(_SERIES.values(), 0.0)
        seen: set[str] = set()
        # only the series read are parsed: a vLLM body is ~55 kB, 10 ms to parse whole, a small part of that so
        wanted = "\n".join(line for line in text.splitlines() if line.startswith(_PREFIXES))
        try:
            for family in text_string_to_metric_families(wanted):
                for sample in family.samples:
                    field = _SERIES.get(sample.name)
                    if field is not None:
                        found[field] += sample.value
                        seen.add(sample.name)
        except (ValueError, TypeError, IndexError) as err:
            raise ConfigError(f"{where}: the body is not Prometheus text ({err})") from None
        missing = sorted(set(_SERIES) - seen)
        if missing:
            raise ConfigError(f"{where}: the metrics lack {missing}: not a vLLM replica's /metrics")
        bad = {name: value for name, value in found.items() if not math.isfinite(value) or value < 0}
        if bad:
            raise ConfigError(f"{where}: counters must be finite and >= 0, got {bad}")
        return cls(**found)

    def went_down_from(self, earlier: MetricsSample) -> bool:
        """Whether any counter is below ``earlier``'s: the replica restarted between them."""
        return (
            self.prefill_s < earlier.prefill_s
            or self.computed_tokens < earlier.computed_tokens
            or self.itl_s < earlier.itl_s
            or self.itl_gaps < earlier.itl_gaps
        )


class MetricsWindow:
    """The last ``reads`` samples of one replica's counters, and the rates between the oldest and the newest."""

    __slots__ = ("_samples",)

    def __init__(self, reads: int = WINDOW_READS) -> None:
        if isinstance(reads, bool) or not isinstance(reads, int) or reads < 2:
            raise ConfigError(f"MetricsWindow reads must be an integer >= 2, got {reads!r}")
        self._samples: deque[MetricsSample] = deque(maxlen=reads)

    def note(self, sample: MetricsSample) -> ReplicaRates | None:
        """Take one read; the window's rates, or ``None`` when it holds no prefill (or restarted with this read)."""
        if self._samples and sample.went_down_from(self._samples[-1]):
            self._samples.clear()
        self._samples.append(sample)
        first, last = self._samples[0], sample
        prefill_s = last.prefill_s - first.prefill_s
        tokens = last.computed_tokens - first.computed_tokens
        if prefill_s <= 0 or tokens <= 0:
            return None
        gaps = last.itl_gaps - first.itl_gaps
        decode_step_s = (last.itl_s - first.itl_s) / gaps if gaps > 0 else 0.0
        return ReplicaRates(prefill_tokens_per_s=tokens / prefill_s, decode_step_s=decode_step_s, source=METRICS_SOURCE)
