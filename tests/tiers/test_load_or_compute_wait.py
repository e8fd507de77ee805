"""How long a started load is waited for: its pieces, its compute-bounded deadlines, and what a miss teaches."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.errors import ConfigError
from kvpool.tiers.load_or_compute import DEFAULT_WAIT_MARGIN, LinkPrior, LoadOrCompute, LoadWait, TransferCosts
from tests.tiers.test_load_or_compute import BLOCK_BYTES, BS, FAST, RATE, SLOW, TRICKLE, match

BLOCK_S = BS / RATE  # computing one block: 4 ms
SLUGGISH = LinkPrior(bandwidth_bytes_per_s=1e9, latency_s=0.01)  # 10 ms a fetch, then 1 us a block


def costs(**links: LinkPrior) -> TransferCosts:
    return TransferCosts(links, block_bytes=BLOCK_BYTES, prefill_tokens_per_s=RATE)


def wait(tier: str, link: LinkPrior, blocks: int, cap_s: float = 2.0) -> LoadWait:
    return costs(**{tier: link}).load_wait([(tier, blocks)], block_size=BS, cap_s=cap_s)


def test_a_tier_of_no_latency_is_read_block_by_block():
    # latency 0: a piece of one block is already worth its latency, and a larger one saves none
    assert wait("disk", FAST, 9).pieces == (("disk", 1), ("disk", 1), ("disk", 1), ("disk", 1), ("disk", 1),
                                            ("disk", 1), ("disk", 1), ("disk", 1), ("disk", 1))  # fmt: skip


def test_a_tier_with_latency_starts_at_the_smallest_piece_worth_it_and_doubles_to_a_tenth_latency():
    # 10 ms latency against 4 ms / 1.1 of compute a block: 3 blocks at least; pieces grow to 10 ms / (0.1 x 1 us)
    pieces = wait("redis", SLUGGISH, 40).pieces
    assert pieces == (("redis", 3), ("redis", 6), ("redis", 12), ("redis", 19))
    assert sum(n for _, n in pieces) == 40


def test_a_tier_slower_than_computing_is_one_piece_waited_for_as_long_as_computing_it_all():
    w = wait("redis", SLOW, 5)  # a second a fetch: no piece ever beats computing it
    assert w.pieces == (("redis", 5),)
    assert w.deadline_s(0) == pytest.approx(DEFAULT_WAIT_MARGIN * 5 * BLOCK_S)


def test_the_deadline_is_the_compute_of_the_blocks_to_the_end_of_the_next_piece_within_the_fixed_one():
    w = wait("redis", SLUGGISH, 40)
    per_block = DEFAULT_WAIT_MARGIN * BLOCK_S
    # pieces end at 3, 9, 21, 40 blocks, expected at 10, 20, 30, 40 ms (and a microsecond a block)
    expected = [4 * (0.01 * (i + 1) + end * 1e-6) + 0.02 * (i + 1) for i, end in enumerate((3, 9, 21, 40))]
    assert [w.deadline_s(k) for k in (0, 3, 9, 21)] == pytest.approx(
        [min(e, end * per_block) for e, end in zip(expected, (3, 9, 21, 40))]
    )
    assert w.deadline_s(21) == pytest.approx(40 * per_block)  # the compute is the sooner bound here
    assert wait("redis", SLUGGISH, 40, cap_s=0.05).deadline_s(21) == 0.05  # the fixed deadline bounds it


def test_a_tier_far_slower_than_its_estimate_is_given_up_at_four_times_its_expected_arrival():
    slow_prefill = TransferCosts({"redis": FAST}, block_bytes=BLOCK_BYTES, prefill_tokens_per_s=10.0)
    w = slow_prefill.load_wait([("redis", 8)], block_size=BS, cap_s=2.0)  # computing a block: 0.4 s
    assert w.deadline_s(0) == pytest.approx(4 * 1e-6 + 0.02)  # a block expected in 1 us: 20 ms, not 0.44 s
    assert w.deadline_s(1) == pytest.approx(4 * 2e-6 + 0.04)  # 20 ms more for each piece


@settings(max_examples=60, deadline=None)
@given(
    latency=st.floats(0, 2.0),
    bandwidth=st.floats(1e3, 1e12),
    blocks=st.lists(st.integers(1, 70), min_size=1, max_size=3),
)
def test_pieces_cover_the_runs_in_order_and_deadlines_grow_within_the_compute_of_all(latency, bandwidth, blocks):
    links = {name: LinkPrior(bandwidth_bytes_per_s=bandwidth, latency_s=latency) for name in ("disk", "redis")}
    runs = [(("disk", "redis")[i % 2], n) for i, n in enumerate(blocks)]
    w = costs(**links).load_wait(runs, block_size=BS, cap_s=1e9)
    regrouped: list[tuple[str, int]] = []
    for tier, n in w.pieces:
        assert n >= 1
        if regrouped and regrouped[-1][0] == tier:
            regrouped[-1] = (tier, regrouped[-1][1] + n)
        else:
            regrouped.append((tier, n))
    merged: list[tuple[str, int]] = []
    for tier, n in runs:
        if merged and merged[-1][0] == tier:
            merged[-1] = (tier, merged[-1][1] + n)
        else:
            merged.append((tier, n))
    assert regrouped == merged
    ends = []
    end = 0
    for _, n in w.pieces:
        ends.append(w.deadline_s(end))
        end += n
    assert ends == sorted(ends)
    assert ends[-1] <= DEFAULT_WAIT_MARGIN * BLOCK_S * sum(blocks) * (1 + 1e-9)


def test_a_miss_makes_the_tier_owe_its_piece_and_nothing_loads_from_it_until_the_piece_comes():
    c = costs(cpu=FAST, redis=FAST)
    rule = LoadOrCompute(c, block_size=BS)
    offered = match(("cpu", 2), ("redis", 5))
    assert rule.choose(offered) == offered  # a fast tier: loaded
    c.note_deadline_miss("redis", late_blocks=1, abandoned_blocks=5, seconds=DEFAULT_WAIT_MARGIN * BLOCK_S)
    assert c.owes("redis") and not c.owes("cpu")
    assert rule.choose(offered) == match(("cpu", 2))  # up to the tier that owes, the rest computed
    assert rule.choose(match(("redis", 5))).num_tokens == 0
    c.note_late_piece_done("redis")
    c.note_load("redis", 1, BLOCK_BYTES, 10 * BLOCK_S)  # the piece's real time: a block in ten blocks' compute
    assert not c.owes("redis")
    assert rule.choose(offered) == match(("cpu", 2))  # decided on the real time: still computed
    tiers = c.figures()["tiers"]
    assert (
        tiers["redis"] | {"deadline_misses": 1, "blocks_abandoned": 5, "late_pieces": 0, "failed_loads": 1}
        == tiers["redis"]
    )
    assert (tiers["cpu"]["deadline_misses"], tiers["cpu"]["blocks_abandoned"]) == (0, 0)


def test_a_piece_never_started_is_owed_by_nobody():
    c = costs(redis=TRICKLE)
    c.note_deadline_miss("redis", late_blocks=3, abandoned_blocks=3, seconds=0.5, reading=False)
    assert not c.owes("redis")
    assert c.figures()["tiers"]["redis"]["deadline_misses"] == 1


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        (dict(late_blocks=0, abandoned_blocks=1, seconds=1.0), "late_blocks"),
        (dict(late_blocks=1, abandoned_blocks=-1, seconds=1.0), "abandoned_blocks"),
        (dict(late_blocks=1, abandoned_blocks=1, seconds=float("nan")), "seconds"),
        (dict(late_blocks=1, abandoned_blocks=1, seconds=-1.0), "seconds"),
    ],
)
def test_a_bad_miss_is_refused_by_name_and_changes_nothing(kwargs, name):
    c = costs(redis=FAST)
    before = c.figures()
    with pytest.raises(ConfigError, match=name):
        c.note_deadline_miss("redis", **kwargs)
    assert c.figures() == before and not c.owes("redis")


def test_bad_waits_are_refused_by_name():
    c = costs(redis=FAST)
    with pytest.raises(ConfigError, match="owes no late piece"):
        c.note_late_piece_done("redis")
    with pytest.raises(ConfigError, match="cap_s"):
        c.load_wait([("redis", 2)], block_size=BS, cap_s=0.0)
    with pytest.raises(ConfigError, match="margin"):
        c.load_wait([("redis", 2)], block_size=BS, cap_s=1.0, margin=float("inf"))
    with pytest.raises(ConfigError, match="'disk'"):
        c.load_wait([("disk", 2)], block_size=BS, cap_s=1.0)
    with pytest.raises(ConfigError, match="blocks"):
        c.load_wait([("redis", 0)], block_size=BS, cap_s=1.0)


def test_a_lookup_is_skipped_where_no_store_asked_could_be_loaded_from():
    c = costs(cpu=FAST, redis=FAST, disk=SLOW)
    rule = LoadOrCompute(c, block_size=BS, probe_every=None)
    assert rule.worth_looking_up(8, 8 * BS, 2.0, ["redis"])
    assert not rule.worth_looking_up(8, 8 * BS, 2.0, ["disk"])  # a second a fetch: 8 blocks are never loaded
    c.note_deadline_miss("redis", late_blocks=1, abandoned_blocks=8, seconds=0.001)
    assert not rule.worth_looking_up(8, 8 * BS, 2.0, ["redis"])  # it owes a piece
    assert rule.lookups == {"asked": 1, "skipped": 2}
    with pytest.raises(ConfigError, match="'nvme'"):
        rule.worth_looking_up(8, 8 * BS, 2.0, ["nvme"])
    assert rule.lookups == {"asked": 1, "skipped": 2}  # refused, nothing counted
