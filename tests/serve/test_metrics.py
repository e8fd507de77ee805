"""ServerMetrics follows an engine's counters by their increments and fills vLLM's series (a stand-in engine; no model)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from kvpool.engine.outputs import RequestDelta, RequestOutput
from kvpool.engine.sampling import SamplingParams
from kvpool.errors import ConfigError
from kvpool.scheduler import FinishReason
from kvpool.serve.engine_loop import Job
from kvpool.serve.metrics import DEFAULT_PREFIX, ServerMetrics, check_prefix, request_token_buckets
from kvpool.stats import PrefixCacheStats
from tests.serve.vllm_metrics import LABEL, SAMPLE, VLLM_MAX_MODEL_LEN, parse, vllm_families


def _engine(queries: int, hits: int, preemptions: int, by_tier: dict[str, int], live: tuple[str, ...] = ()) -> Any:
    scheduler = SimpleNamespace(
        num_running=2,
        num_waiting=1,
        num_preemptions=preemptions,
        running_ids=lambda: list(live),
        waiting_ids=lambda: [],
        metrics=lambda rid: SimpleNamespace(num_prompt_tokens=10, num_cached_tokens=4),
    )
    manager = SimpleNamespace(usage=0.25, prefix_cache_stats=PrefixCacheStats(queries=queries, hits=hits))
    return SimpleNamespace(scheduler=scheduler, manager=manager, cached_tokens_by_tier=by_tier)


def _value(metrics: ServerMetrics, name: str, **labels: str | None) -> float:
    """The value of sample ``name`` with ``model_name="m"``, ``engine="0"`` and ``labels`` (None: no such label)."""
    wanted = {k: v for k, v in {"model_name": "m", "engine": "0", **labels}.items() if v is not None}
    for line in metrics.render()[0].decode().splitlines():
        match = SAMPLE.match(line)
        if match and match.group(1) == name and dict(LABEL.findall(match.group(2) or "")) == wanted:
            return float(match.group(3))
    raise AssertionError(f"no sample {name} {wanted}")


def _output(rid: str, reason: FinishReason, generated: int, **changes: Any) -> RequestOutput:
    fields: dict[str, Any] = {
        "request_id": rid,
        "prompt": None,
        "prompt_token_ids": tuple(range(40)),
        "output_token_ids": tuple(range(generated)),
        "text": "",
        "finish_reason": reason,
        "num_cached_tokens": 32,
        "cached_tokens_by_tier": {"gpu": 16, "cpu": 16},
        "num_computed_tokens": 8 + generated,
        "time_to_first_token": 0.5,
        "queue_time": 0.125,
        "latency": 2.5,
        "num_preemptions": 1,
    }
    fields.update(changes)
    return RequestOutput(**fields)


def _job(rid: str, max_tokens: int | None) -> Job:
    return Job(
        request_id=rid, prompt_token_ids=(1, 2, 3), params=SamplingParams(max_tokens=max_tokens), cache_salt=None
    )


def test_counters_follow_the_engine_by_increments() -> None:
    metrics = ServerMetrics("m")
    metrics.after_step(_engine(100, 40, 1, {"gpu": 40}), [])
    metrics.after_step(_engine(150, 70, 3, {"gpu": 48, "cpu": 22}), [])
    assert _value(metrics, "vllm:prefix_cache_queries_total") == 150
    assert _value(metrics, "vllm:prefix_cache_hits_total") == 70
    assert _value(metrics, "vllm:num_preemptions_total") == 3
    assert _value(metrics, "vllm:prefix_cache_hits_by_tier_total", engine=None, tier="gpu") == 48
    assert _value(metrics, "vllm:prefix_cache_hits_by_tier_total", engine=None, tier="cpu") == 22
    assert _value(metrics, "vllm:prompt_tokens_cached_by_source_total", source="device") == 48
    assert _value(metrics, "vllm:prompt_tokens_cached_by_source_total", source="host") == 22
    assert _value(metrics, "vllm:external_prefix_cache_hits_total") == 22
    assert _value(metrics, "vllm:external_prefix_cache_queries_total") == 0  # no tiers configured
    assert _value(metrics, "vllm:num_requests_running") == 2
    assert _value(metrics, "vllm:num_requests_waiting_by_reason", reason="capacity") == 1
    assert _value(metrics, "vllm:kv_cache_usage_perc") == 0.25
    assert _value(metrics, "vllm:engine_sleep_state", sleep_state="awake") == 1


def test_finished_requests_fill_vllms_request_series() -> None:
    metrics = ServerMetrics("m")
    # one HTTP request: two prompts, n=2 each; then one request not seen by expect (the engine used directly)
    jobs = [_job("a-0-0", 8), _job("a-0-1", 8), _job("a-1-0", None), _job("a-1-1", None)]
    metrics.expect(jobs, 2)
    engine = _engine(0, 0, 0, {})
    metrics.after_step(engine, [RequestDelta(request_id="a-0-0", token_ids=(5,), text="", finished=False)])
    metrics.after_step(
        engine,
        [
            RequestDelta(request_id=rid, token_ids=(5,), text="", finished=True, output=_output(rid, reason, k))
            for rid, reason, k in (
                ("a-0-0", FinishReason.EOS, 2),
                ("a-0-1", FinishReason.STOP, 5),
                ("a-1-0", FinishReason.LENGTH, 1),
                ("other", FinishReason.LENGTH, 3),
            )
        ],
    )
    text = metrics.render()[0].decode()
    assert "eos" not in text
    assert _value(metrics, "vllm:request_success_total", finished_reason="stop") == 2  # EOS is stop, as vLLM
    assert _value(metrics, "vllm:request_success_total", finished_reason="length") == 2
    assert _value(metrics, "vllm:request_success_total", finished_reason="abort") == 0
    # the first prompt's two sequences have finished: its n and its longest; the second waits for a-1-1
    assert _value(metrics, "vllm:request_params_n_count") == 1
    assert _value(metrics, "vllm:request_params_n_sum") == 2
    assert _value(metrics, "vllm:request_max_num_generation_tokens_sum") == 5
    # max_tokens per sequence; None is the rest of the context (2048 - 3 prompt tokens)
    assert _value(metrics, "vllm:request_params_max_tokens_count") == 3
    assert _value(metrics, "vllm:request_params_max_tokens_sum") == 8 + 8 + 2045
    assert _value(metrics, "vllm:request_prompt_tokens_sum") == 4 * 40
    assert _value(metrics, "vllm:request_generation_tokens_sum") == 2 + 5 + 1 + 3
    assert _value(metrics, "vllm:prompt_tokens_by_source_total", source="local_compute") == 4 * 8
    assert _value(metrics, "vllm:prompt_tokens_by_source_total", source="local_cache_hit") == 4 * 16
    assert _value(metrics, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") == 4 * 16
    assert _value(metrics, "vllm:prompt_tokens_cached_total") == 4 * 32
    assert _value(metrics, "vllm:request_prefill_kv_computed_tokens_sum") == 4 * 8
    assert _value(metrics, "vllm:request_num_preemptions_sum") == 4
    assert _value(metrics, "vllm:request_queue_time_seconds_sum") == 4 * 0.125
    assert _value(metrics, "vllm:request_prefill_time_seconds_sum") == 4 * 0.375
    assert _value(metrics, "vllm:request_decode_time_seconds_sum") == 4 * 2.0
    assert _value(metrics, "vllm:request_inference_time_seconds_sum") == 4 * 2.375
    # decode time over the tokens after the first; 0 for a request of one token
    assert _value(metrics, "vllm:request_time_per_output_token_seconds_sum") == 2.0 + 0.5 + 0 + 1.0
    # steps: a-0-0's first token and uncached prompt (10 - 4, from the scheduler); then four tokens, and
    # the uncached prompts (40 - 32) of the three that got their first token
    assert _value(metrics, "vllm:iteration_tokens_total_count") == 2
    assert _value(metrics, "vllm:iteration_tokens_total_sum") == (1 + 6) + (4 + 3 * 8)


def test_refused_and_aborted_sequences_are_forgotten() -> None:
    metrics = ServerMetrics("m")
    metrics.expect([_job("refused", 4)], 1)
    metrics.not_admitted([_job("refused", 4)], queue_full=True)
    assert _value(metrics, "vllm:admission_rejections_total", engine=None, reason="max_num_queued_reqs") == 1
    metrics.expect([_job(f"aborted-{i}", 4) for i in range(100)], 1)
    engine = _engine(0, 0, 0, {}, live=("aborted-0",))
    metrics.after_step(engine, [])  # marked once: one may not have been queued yet
    assert len(metrics._expected) == 100
    metrics.after_step(engine, [])  # still unknown to the engine: aborted
    assert set(metrics._expected) == {"aborted-0"}


def test_no_created_series_and_vllms_buckets() -> None:
    metrics = ServerMetrics("m")
    ours = parse(metrics.render()[0].decode())
    assert not [name for family in ours.values() for name in family.samples if name.endswith("_created")]
    theirs = vllm_families()
    assert request_token_buckets(VLLM_MAX_MODEL_LEN) == tuple(sorted(theirs["vllm:request_prompt_tokens"].buckets))
    for name, family in theirs.items():
        if family.type == "histogram":
            assert ours[name].buckets == family.buckets, name  # ServerMetrics without an engine: 2048 tokens


def test_prefixes() -> None:
    from kvpool.cli.serve import serve

    [option] = [p for p in serve.params if p.name == "metrics_prefix"]
    assert option.default == DEFAULT_PREFIX == "vllm:"
    ours = ServerMetrics("m", "kvpool:").render()[0].decode()
    assert 'kvpool:generation_tokens_total{engine="0",model_name="m"} 0.0' in ours
    assert "vllm:" not in ours


@pytest.mark.parametrize("prefix", ["", "9x:", "vllm-", "kv pool:"])
def test_bad_prefixes_are_refused(prefix: str) -> None:
    with pytest.raises(ConfigError, match="metrics prefix"):
        check_prefix(prefix)
    assert check_prefix("vllm:") == "vllm:"


def test_load_or_compute_series_follow_the_engines_chooser() -> None:
    from kvpool.connector import ExternalMatch, TierRun
    from kvpool.tiers.load_or_compute import LinkPrior, LoadOrCompute, TransferCosts

    links = {
        "cpu": LinkPrior(bandwidth_bytes_per_s=25e9, latency_s=10e-6),
        "redis": LinkPrior(bandwidth_bytes_per_s=1.25e9, latency_s=0.5),  # a slow Redis: half a second a fetch
    }
    chooser = LoadOrCompute(TransferCosts(links, block_bytes=1000, prefill_tokens_per_s=2000.0), block_size=4)
    engine = _engine(0, 0, 0, {})
    engine.kv_tiers = SimpleNamespace(chooser=chooser)
    metrics = ServerMetrics("m")
    metrics.after_step(engine, [])
    assert _value(metrics, "vllm:measured_prefill_tokens_per_second") == 2000
    assert _value(metrics, "vllm:kv_tier_load_bandwidth_bytes_per_second", tier="redis") == 1.25e9
    assert _value(metrics, "vllm:kv_tier_load_latency_seconds", tier="redis") == 0.5
    assert _value(metrics, "vllm:kv_tier_blocks_computed_total", tier="redis") == 0
    assert _value(metrics, "vllm:kv_tier_load_decisions_total", decision="cut") == 0

    offered = ExternalMatch((TierRun("cpu", 8), TierRun("redis", 12)))
    for _ in range(2):
        chooser.count(offered, chooser.choose(offered))  # the CPU tier's two blocks loaded, Redis's three computed
    chooser.costs.note_load("cpu", 2, 2000, 0.001)  # a slower CPU tier than its prior
    chooser.costs.note_failed_load("redis", 3, 2.0)
    metrics.after_step(engine, [])
    metrics.after_step(engine, [])  # counters follow increments: nothing counted twice
    assert _value(metrics, "vllm:kv_tier_blocks_loaded_total", tier="cpu") == 4
    assert _value(metrics, "vllm:kv_tier_blocks_computed_total", tier="redis") == 6
    assert _value(metrics, "vllm:kv_tier_blocks_computed_total", tier="cpu") == 0
    assert _value(metrics, "vllm:kv_tier_failed_loads_total", tier="redis") == 1
    assert _value(metrics, "vllm:kv_tier_load_decisions_total", decision="cut") == 2
    assert _value(metrics, "vllm:kv_tier_load_decisions_total", decision="loaded") == 0
    assert _value(metrics, "vllm:kv_tier_load_latency_seconds", tier="cpu") > 10e-6
    assert _value(metrics, "vllm:kv_tier_load_deadline_misses_total", tier="redis") == 0
    chooser.costs.note_deadline_miss("redis", late_blocks=2, abandoned_blocks=5, seconds=0.3)
    metrics.after_step(engine, [])
    assert _value(metrics, "vllm:kv_tier_load_deadline_misses_total", tier="redis") == 1
    assert _value(metrics, "vllm:kv_tier_blocks_abandoned_total", tier="redis") == 5


def test_no_load_or_compute_series_without_a_chooser() -> None:
    metrics = ServerMetrics("m")
    engine = _engine(0, 0, 0, {})
    metrics.after_step(engine, [])  # no kv_tiers at all
    engine.kv_tiers = SimpleNamespace()  # tiers from before the chooser
    metrics.after_step(engine, [])
    engine.kv_tiers = SimpleNamespace(chooser=None)
    metrics.after_step(engine, [])
    assert "kv_tier_load_bandwidth" not in "".join(
        line for line in metrics.render()[0].decode().splitlines() if not line.startswith("#")
    )
