"""Load or compute: the measured costs, the rule that trims a tier match, and the rule through the scheduler."""

from __future__ import annotations

import copy
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool import KVCacheManager, Request
from kvpool.connector import NO_MATCH, ExternalMatch, TierRun, TransferResult
from kvpool.errors import ConfigError
from kvpool.scheduler import Scheduler, SchedulerConfig, StopConditions
from kvpool.tiers.hierarchy import ByteTier, HostTier, MatchChooser, TierHierarchyConnector
from kvpool.tiers.load_or_compute import (
    DEFAULT_MARGIN,
    LinkPrior,
    LoadOrCompute,
    TransferCosts,
    registry_links,
)
from tests.integrations.test_vllm_plan import DictStore

BS = 4  # tokens per block
BLOCK_BYTES = 1_000
RATE = 1_000.0  # prefill tokens/s: computing a block takes 4 ms

FAST = LinkPrior(bandwidth_bytes_per_s=1e9, latency_s=0.0)  # a block in 1 us
SLOW = LinkPrior(bandwidth_bytes_per_s=1e9, latency_s=1.0)  # a second per fetch
TRICKLE = LinkPrior(bandwidth_bytes_per_s=1e5, latency_s=0.0)  # 10 ms a block: slower than computing it


def costs(**links: LinkPrior) -> TransferCosts:
    return TransferCosts(links or {"cpu": FAST}, block_bytes=BLOCK_BYTES, prefill_tokens_per_s=RATE)


def chooser(**links: LinkPrior) -> LoadOrCompute:
    return LoadOrCompute(costs(**links), block_size=BS)


def match(*runs: tuple[str, int]) -> ExternalMatch:
    """Runs of ``(tier, blocks)``."""
    return ExternalMatch(tuple(TierRun(tier, blocks * BS) for tier, blocks in runs))


# -- the rule -----------------------------------------------------------------------------------


def test_a_fast_tier_is_loaded_and_a_slow_one_computed():
    rule = chooser(cpu=FAST, redis=SLOW, disk=TRICKLE)
    as_chooser: MatchChooser = rule  # the connector's interface (mypy checks it)
    assert as_chooser is rule
    offered = match(("cpu", 8))
    assert rule.choose(offered) == offered
    assert rule.choose(match(("redis", 8))) == NO_MATCH  # 1 s to fetch 32 ms of compute
    assert rule.choose(match(("disk", 100))) == NO_MATCH  # bandwidth-bound: 10 ms a block against 4 ms


def test_the_match_is_cut_where_a_slow_tier_begins():
    rule = chooser(cpu=FAST, redis=SLOW)
    assert rule.choose(match(("cpu", 3), ("redis", 5))) == match(("cpu", 3))
    # A slow tier first: loading anything means its fetch; the whole match is computed.
    assert rule.choose(match(("redis", 2), ("cpu", 6))) == NO_MATCH


def test_a_tier_touched_again_costs_its_latency_once():
    # A second per fetch, but 400 blocks of it: 1.6 s of compute; fetched in one batch, across both runs.
    rule = chooser(cpu=FAST, redis=SLOW)
    offered = match(("redis", 150), ("cpu", 100), ("redis", 150))
    assert rule.choose(offered) == offered
    # Half of it alone does not pay for the fetch (0.6 s against 1 s): cut before it.
    assert rule.choose(match(("cpu", 100), ("redis", 150))) == match(("cpu", 100))


def test_latency_dominates_small_prompts():
    rule = chooser(redis=LinkPrior(bandwidth_bytes_per_s=1e9, latency_s=0.05))  # 50 ms a fetch
    assert rule.choose(match(("redis", 2))) == NO_MATCH  # 8 ms of compute
    assert rule.choose(match(("redis", 10))) == NO_MATCH  # 40 ms of compute: still below the 50 ms fetch
    big = match(("redis", 100))  # 400 ms of compute
    assert rule.choose(big) == big


def test_the_margin_decides_near_break_even():
    # 10 blocks: 40 ms to compute, 30 ms to load (1.33x faster).
    link = LinkPrior(bandwidth_bytes_per_s=1e9, latency_s=0.03 - 10 * BLOCK_BYTES / 1e9)
    offered = match(("redis", 10))
    assert LoadOrCompute(costs(redis=link), block_size=BS).choose(offered) == offered  # 1.33 > 1.25
    assert LoadOrCompute(costs(redis=link), block_size=BS, margin=1.5).choose(offered) == NO_MATCH
    assert DEFAULT_MARGIN == 1.25


def test_choose_changes_nothing():
    rule = chooser(cpu=FAST, redis=SLOW)
    before = rule.figures()
    for _ in range(3):
        assert rule.choose(match(("cpu", 2), ("redis", 2))) == match(("cpu", 2))
    assert rule.figures() == before


# -- the measurement ------------------------------------------------------------------------------


def test_fetches_of_several_sizes_separate_latency_from_bandwidth():
    measured = costs(redis=LinkPrior(bandwidth_bytes_per_s=1.25e9, latency_s=300e-6))
    latency, bandwidth = 0.002, 2e8  # what the tier really does: 2 ms a fetch, 200 MB/s
    for i in range(60):
        blocks = 1 + (i * 7) % 32
        measured.note_load("redis", blocks, blocks * BLOCK_BYTES, latency + blocks * BLOCK_BYTES / bandwidth)
    tier = measured.figures()["tiers"]["redis"]
    assert tier["load_latency_s"] == pytest.approx(latency, rel=0.01)
    assert tier["load_bandwidth_bytes_per_s"] == pytest.approx(bandwidth, rel=0.01)
    assert tier["loads"] == 60
    assert measured.load_seconds("redis", 10) == pytest.approx(latency + 10 * BLOCK_BYTES / bandwidth, rel=0.01)


def test_fetches_of_one_size_keep_the_priors_split_scaled_to_them():
    measured = costs(redis=LinkPrior(bandwidth_bytes_per_s=1e6, latency_s=0.001))  # 1 ms + 1 ms a block
    for _ in range(100):
        measured.note_load("redis", 4, 4 * BLOCK_BYTES, 0.050)  # ten times the prior's 5 ms
    assert measured.load_seconds("redis", 4) == pytest.approx(0.050, rel=0.01)
    tier = measured.figures()["tiers"]["redis"]
    assert tier["load_latency_s"] == pytest.approx(0.010, rel=0.01)  # the prior's share (1 in 5), scaled


def test_a_tier_that_slows_down_is_computed_within_a_few_fetches():
    rule = chooser(redis=FAST)
    offered = match(("redis", 8))
    assert rule.choose(offered) == offered
    slow_fetches = 0
    while rule.choose(offered) == offered:
        rule.costs.note_load("redis", 8, 8 * BLOCK_BYTES, 0.5)  # a stalled Redis: 0.5 s for 32 ms of compute
        slow_fetches += 1
    assert slow_fetches <= 3


def test_a_failed_load_counts_its_seconds():
    rule = chooser(redis=FAST)
    offered = match(("redis", 8))
    rule.costs.note_failed_load("redis", 8, 2.0)  # timed out at its deadline
    assert rule.choose(offered) == NO_MATCH
    assert rule.figures()["tiers"]["redis"]["failed_loads"] == 1


def test_the_prefill_rate_follows_the_steps():
    measured = costs()
    assert measured.figures()["prefill_tokens_per_s"] == pytest.approx(RATE)
    for i in range(50):
        tokens = 64 + (i * 37) % 2048
        measured.note_prefill(tokens, 0.010 + tokens / 4_000)  # a step's overhead, and 4,000 tokens/s
    measured.note_prefill(0, 0.010)  # a decode step: nothing to learn
    figures = measured.figures()
    assert figures["prefill_tokens_per_s"] == pytest.approx(4_000, rel=0.01)
    assert figures["prefill_steps"] == 50
    assert measured.compute_seconds(400) == pytest.approx(0.1, rel=0.01)  # the marginal cost, no overhead


def test_a_faster_prefill_makes_a_tier_not_worth_it():
    rule = chooser(redis=LinkPrior(bandwidth_bytes_per_s=1e9, latency_s=0.02))
    offered = match(("redis", 16))  # 64 ms of compute at the prior rate, 20 ms to load
    assert rule.choose(offered) == offered
    for i in range(30):
        tokens = 256 + 64 * i
        rule.costs.note_prefill(tokens, tokens / 20_000)  # the accelerator computes 20,000 tokens/s
    assert rule.choose(offered) == NO_MATCH  # now 3.2 ms of compute


def test_registry_links_are_the_backends_defaults():
    links = registry_links(["cpu", "redis"])
    assert links["cpu"] == LinkPrior(bandwidth_bytes_per_s=25e9, latency_s=10e-6)
    assert links["redis"] == LinkPrior(bandwidth_bytes_per_s=1.25e9, latency_s=300e-6)
    with pytest.raises(ConfigError, match="'tape'"):
        registry_links(["tape"])


# -- counting ----------------------------------------------------------------------------------------


def test_decisions_are_counted_per_tier_and_per_request():
    rule = chooser(cpu=FAST, redis=SLOW)
    for offered in (match(("cpu", 2)), match(("cpu", 3), ("redis", 5)), match(("redis", 4))):
        rule.count(offered, rule.choose(offered))
    figures = rule.figures()
    assert (figures["tiers"]["cpu"]["blocks_loaded"], figures["tiers"]["cpu"]["blocks_computed"]) == (5, 0)
    assert (figures["tiers"]["redis"]["blocks_loaded"], figures["tiers"]["redis"]["blocks_computed"]) == (0, 9)
    assert figures["requests"] == {"loaded": 1, "cut": 1, "computed": 1, "probed": 0}
    assert figures["margin"] == DEFAULT_MARGIN


def test_how_a_match_loads_is_not_what_is_counted():
    rule = chooser(cpu=FAST, redis=FAST)
    offered = match(("cpu", 2), ("redis", 2))
    rule.count(offered, ExternalMatch(offered.runs, asynchronous=True))  # the connector loads it off the step
    assert rule.figures()["requests"]["loaded"] == 1


def test_a_declined_tier_is_probed_once_in_a_while():
    rule = LoadOrCompute(costs(redis=SLOW), block_size=BS, probe_every=3)
    offered = match(("redis", 4))
    for _ in range(3):
        chosen = rule.choose(offered)
        assert chosen == NO_MATCH
        rule.count(offered, chosen)
    assert rule.choose(offered) == offered  # the fourth loads, and measures the tier again
    rule.count(offered, offered)
    assert rule.choose(offered) == NO_MATCH
    assert rule.figures()["requests"] == {"loaded": 0, "cut": 0, "computed": 3, "probed": 1}
    never = LoadOrCompute(costs(redis=SLOW), block_size=BS, probe_every=None)
    for _ in range(10):
        never.count(offered, never.choose(offered))
    assert never.choose(offered) == NO_MATCH


# -- bad input -----------------------------------------------------------------------------------------


BAD_NOTES = [
    ("note_load", ("tape", 1, 1000, 0.1), "'tape'"),
    ("note_load", ("redis", 0, 1000, 0.1), "num_blocks"),
    ("note_load", ("redis", 1, -5, 0.1), "num_bytes"),
    ("note_load", ("redis", 1, 1000, -0.1), "seconds"),
    ("note_load", ("redis", 1, 1000, math.nan), "seconds"),
    ("note_load", ("redis", 1, 1000, math.inf), "seconds"),
    ("note_load", ("redis", True, 1000, 0.1), "num_blocks"),
    ("note_load", ("redis", 1, 1000, "0.1"), "seconds"),
    ("note_failed_load", ("redis", 1.5, 0.1), "num_blocks"),
    ("note_failed_load", ("redis", 1, None), "seconds"),
    ("note_prefill", (-1, 0.1), "num_tokens"),
    ("note_prefill", (10, math.nan), "seconds"),
    ("load_seconds", ("redis", -1), "num_blocks"),
    ("compute_seconds", (2.5,), "num_tokens"),
    ("load_cost", ("tape", 4), "'tape'"),
    ("load_cost", ("redis", 0), "block_size"),
]


@pytest.mark.parametrize(("method", "args", "message"), BAD_NOTES)
def test_bad_measurements_are_refused_with_nothing_changed(method, args, message):
    measured = costs(redis=FAST)
    measured.note_load("redis", 2, 2000, 0.001)
    before = copy.deepcopy(measured.figures())
    with pytest.raises(ConfigError, match=message):
        getattr(measured, method)(*args)
    assert measured.figures() == before


BAD_COSTS = [
    ({}, {}, "links"),
    ({"redis": (1e9, 0.0)}, {}, "LinkPrior"),
    ({"redis": FAST}, {"block_bytes": 0}, "block_bytes"),
    ({"redis": FAST}, {"prefill_tokens_per_s": 0}, "prefill_tokens_per_s"),
    ({"redis": FAST}, {"prefill_tokens_per_s": math.inf}, "prefill_tokens_per_s"),
    ({"redis": FAST}, {"decay": 1.0}, "decay"),
    ({"redis": FAST}, {"decay": 0}, "decay"),
]


@pytest.mark.parametrize(("links", "changes", "message"), BAD_COSTS)
def test_bad_costs_are_refused(links, changes, message):
    kwargs = {"block_bytes": BLOCK_BYTES, "prefill_tokens_per_s": RATE} | changes
    with pytest.raises(ConfigError, match=message):
        TransferCosts(links, **kwargs)


def test_bad_links_and_rules_are_refused():
    with pytest.raises(ConfigError, match="bandwidth"):
        LinkPrior(bandwidth_bytes_per_s=0, latency_s=0.0)
    with pytest.raises(ConfigError, match="latency"):
        LinkPrior(bandwidth_bytes_per_s=1e9, latency_s=-1.0)
    with pytest.raises(ConfigError, match="margin"):
        LoadOrCompute(costs(), block_size=BS, margin=0)
    with pytest.raises(ConfigError, match="probe_every"):
        LoadOrCompute(costs(), block_size=BS, probe_every=0)
    with pytest.raises(ConfigError, match="TransferCosts"):
        LoadOrCompute({"cpu": FAST}, block_size=BS)  # type: ignore[arg-type]  # refused


def test_bad_matches_are_refused_with_nothing_counted():
    rule = chooser(cpu=FAST, redis=SLOW)
    before = copy.deepcopy(rule.figures())
    with pytest.raises(ConfigError, match="'disk'"):
        rule.choose(match(("disk", 1)))
    with pytest.raises(ConfigError, match="whole blocks"):
        rule.choose(ExternalMatch((TierRun("cpu", 3),)))
    with pytest.raises(ConfigError, match="ExternalMatch"):
        rule.choose(8)  # type: ignore[arg-type]  # refused
    with pytest.raises(ConfigError, match="leading part"):
        rule.count(match(("cpu", 2)), match(("redis", 2)))
    with pytest.raises(ConfigError, match="leading part"):
        rule.count(match(("cpu", 2)), match(("cpu", 3)))
    assert rule.figures() == before


# -- through the tier hierarchy and the scheduler -------------------------------------------------------


def _scheduler(redis: LinkPrior) -> tuple[Scheduler, HostTier, DictStore, LoadOrCompute]:
    mgr = KVCacheManager(64, BS)
    host, store = HostTier(16), DictStore("redis")
    rule = chooser(cpu=FAST, redis=redis)
    conn = TierHierarchyConnector(mgr, [host, ByteTier(store)], chooser=rule)
    return Scheduler(mgr, SchedulerConfig(), connector=conn), host, store, rule


def _held(host: HostTier, store: DictStore, request: Request, host_blocks: int) -> None:
    """The request's first ``host_blocks`` blocks in the CPU tier, the rest of its full blocks in Redis."""
    keys = [bytes(h) for h in request.block_hashes]
    for key in keys[:host_blocks]:
        slot = host.reserve(key)
        assert slot is not None
        host.release([slot])
    store.keys.update(keys[host_blocks:])


def _admit(sched: Scheduler, request: Request):
    sched.add_request(request, StopConditions(max_tokens=1))
    out = sched.schedule()
    rid = request.request_id
    out = sched.apply_transfers(out, TransferResult(finished_loads=frozenset({rid})))
    (metrics,) = sched.update(out, {rid: 1})
    return out, metrics


@pytest.mark.parametrize("redis_is_fast", [False, True])
def test_the_scheduler_loads_a_fast_tier_and_computes_a_slow_ones_blocks(redis_is_fast):
    sched, host, store, rule = _scheduler(FAST if redis_is_fast else SLOW)
    request = Request("a", list(range(100, 133)))  # 33 tokens: 8 full blocks before the last token
    sched.manager.hash_request(request)
    _held(host, store, request, host_blocks=3)
    out, metrics = _admit(sched, request)
    (chunk,) = out.chunks
    loads = [(load.position, load.tier) for load in out.connector_meta.loads]
    tiers = rule.figures()["tiers"]
    if redis_is_fast:
        assert loads == [(p, "cpu") for p in range(3)] + [(p, "redis") for p in range(3, 8)]
        assert chunk.start_position == 32
        assert metrics.cached_tokens_by_tier == {"gpu": 0, "cpu": 12, "redis": 20}
        assert (tiers["redis"]["blocks_loaded"], tiers["redis"]["blocks_computed"]) == (5, 0)
    else:
        assert loads == [(p, "cpu") for p in range(3)]  # Redis's five blocks are computed
        assert chunk.start_position == 12 and chunk.num_tokens == 21
        assert metrics.cached_tokens_by_tier == {"gpu": 0, "cpu": 12}
        assert (tiers["redis"]["blocks_loaded"], tiers["redis"]["blocks_computed"]) == (0, 5)
        assert rule.figures()["requests"]["cut"] == 1
    assert (tiers["cpu"]["blocks_loaded"], tiers["cpu"]["blocks_computed"]) == (3, 0)


_TIERS = ("cpu", "disk", "redis")


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.sampled_from(_TIERS), st.integers(1, 40)), min_size=1, max_size=6),
    st.lists(st.tuples(st.floats(1e4, 1e10), st.floats(0, 0.5)), min_size=3, max_size=3),
    st.floats(100, 1e6),
    st.floats(0.5, 2.0),
)
def test_the_chosen_cut_saves_at_least_as_much_as_any_block_boundary(runs, links, rate, margin):
    """Against every cut at a block boundary (inside runs too), the rule's cut saves the most."""
    priors = {
        name: LinkPrior(bandwidth_bytes_per_s=bandwidth, latency_s=latency)
        for name, (bandwidth, latency) in zip(_TIERS, links, strict=True)
    }
    measured = TransferCosts(priors, block_bytes=BLOCK_BYTES, prefill_tokens_per_s=rate)
    rule = LoadOrCompute(measured, block_size=BS, margin=margin)
    offered = match(*runs)
    chosen = rule.choose(offered)
    assert offered.truncated(chosen.num_tokens) == chosen

    def saving(tokens: int) -> float:
        part = offered.truncated(tokens)
        load = sum(measured.load_seconds(tier, n // BS) for tier, n in part.tokens_by_tier().items())
        return measured.compute_seconds(tokens) - margin * load

    best = max(saving(blocks * BS) for blocks in range(offered.num_tokens // BS + 1))
    assert saving(chosen.num_tokens) >= best - 1e-9 * max(1.0, abs(best))
