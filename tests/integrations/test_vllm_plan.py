"""The vLLM connector's scheduler side without vLLM: options, matches, loads and saves keyed by vLLM's hashes."""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

import pytest

from kvpool.errors import ConfigError
from kvpool.integrations.vllm.plan import (
    ConnectorOptions,
    TierPlanner,
    VllmBlockLoad,
    VllmBlockSave,
    VllmScheduledChunk,
)
from kvpool.tiers import ByteTier, CpuTarget, DiskTarget, HostTier

BS = 4  # tokens per block


def chain(tokens: Sequence[int], salt: bytes = b"") -> list[bytes]:
    """vLLM-shaped chained block hashes (32 bytes each) for the full blocks of ``tokens``."""
    hashes, parent = [], hashlib.sha256(b"none" + salt).digest()
    for start in range(0, len(tokens) - len(tokens) % BS, BS):
        parent = hashlib.sha256(parent + bytes(tokens[start : start + BS])).digest()
        hashes.append(parent)
    return hashes


@dataclass
class FakeRequest:
    request_id: str
    tokens: list[int]
    block_hashes: list[bytes] = field(init=False)

    def __post_init__(self) -> None:
        self.block_hashes = chain(self.tokens)

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)


class DictStore:
    """The lookup part of a BlockStore over a set of keys."""

    def __init__(self, name: str, keys: Sequence[bytes] = ()) -> None:
        self.name = name
        self.keys = set(keys)
        self.lookups = 0

    def contains_prefix(self, keys: Sequence[bytes]) -> int:
        self.lookups += 1
        count = 0
        for key in keys:
            if key not in self.keys:
                break
            count += 1
        return count


class FailingStore(DictStore):
    def contains_prefix(self, keys: Sequence[bytes]) -> int:
        raise ConnectionError("redis is down")


def new_chunk(rid: str, block_ids: Sequence[int], computed: int, scheduled: int) -> VllmScheduledChunk:
    return VllmScheduledChunk(
        request_id=rid,
        block_ids=tuple(block_ids),
        replace=True,
        num_computed_tokens=computed,
        num_scheduled_tokens=scheduled,
    )


# -- options ------------------------------------------------------------------------------------


def test_options_parse_the_tiers_in_order():
    options = ConnectorOptions.from_extra_config(
        {"tiers": ["cpu:1MiB", "disk:/tmp/kv:1GiB"], "namespace": "smol", "unauthenticated": True}
    )
    assert [type(t) for t in options.tiers] == [CpuTarget, DiskTarget]
    assert options.namespace == "smol" and options.needs_weights
    assert options.host_slots(1000) == (1 << 20) // 1000
    assert not ConnectorOptions.from_extra_config({"tiers": ["cpu:1MiB"]}).needs_weights


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        ({"tiers": ["cpu:1MiB"], "tier": "x"}, "'tier'"),
        ({"tiers": "cpu:1MiB"}, "'cpu:1MiB'"),
        ({"tiers": []}, "[]"),
        ({"tiers": ["tape:/dev/st0"]}, "'tape:/dev/st0'"),
        ({"tiers": ["cpu:1MiB", "cpu:2MiB"]}, "'cpu:2MiB'"),
        ({"tiers": ["cpu:1MiB"], "namespace": "has space"}, "'has space'"),
        ({"tiers": ["cpu:1MiB"], "secret_file": 7}, "7"),
        ("tiers=cpu:1MiB", "'tiers=cpu:1MiB'"),
    ],
)
def test_bad_options_are_refused_naming_the_value(extra, named):
    with pytest.raises(ConfigError, match=None) as info:
        ConnectorOptions.from_extra_config(extra)
    assert named in str(info.value)


def test_a_cpu_tier_smaller_than_a_block_is_refused_naming_it():
    options = ConnectorOptions.from_extra_config({"tiers": ["cpu:100"]})
    with pytest.raises(ConfigError, match="cpu:100 holds less than one block of 4096 bytes"):
        options.host_slots(4096)


def test_the_planner_refuses_a_cpu_tier_below_a_store():
    with pytest.raises(ConfigError, match=r"\['redis', 'cpu'\]"):
        TierPlanner([ByteTier(DictStore("redis")), HostTier(4)], BS)


# -- matches ------------------------------------------------------------------------------------


def test_a_match_is_keyed_by_vllm_block_hashes_and_stops_short_of_the_last_token():
    request = FakeRequest("a", list(range(12)))  # 3 full blocks; the last token is in block 2
    store = DictStore("redis", request.block_hashes)
    planner = TierPlanner([ByteTier(store)], BS)
    assert planner.match(request, 0) == 8  # blocks 0 and 1: block 2 holds the last token
    assert planner.match(request, 4) == 4  # after a local hit of one block
    assert planner.hit_tokens_by_tier("a") == {"redis": 4}


def test_a_match_runs_through_the_tiers_in_order():
    request = FakeRequest("a", list(range(21)))  # 5 full blocks, all offerable
    host = HostTier(8)
    for key in request.block_hashes[:2]:
        host.reserve(key)
    redis = DictStore("redis", request.block_hashes[2:4])
    planner = TierPlanner([host, ByteTier(redis)], BS)
    assert planner.match(request, 0) == 16
    assert planner.hit_tokens_by_tier("a") == {"cpu": 8, "redis": 8}


def test_other_salts_or_tokens_miss():
    request = FakeRequest("a", list(range(12)))
    store = DictStore("redis", chain(list(range(12)), salt=b"tenant-b"))
    assert TierPlanner([ByteTier(store)], BS).match(request, 0) == 0


def test_a_store_that_fails_is_a_miss():
    planner = TierPlanner([ByteTier(FailingStore("redis"))], BS)
    assert planner.match(FakeRequest("a", list(range(12))), 0) == 0


def test_a_match_changes_no_tier():
    request = FakeRequest("a", list(range(12)))
    host = HostTier(2)
    for key in request.block_hashes[:2]:
        host.reserve(key)
    host.release([1, 2])
    planner = TierPlanner([host], BS)
    for _ in range(3):
        assert planner.match(request, 0) == 8
    assert host.num_stored == 2


def test_an_unaligned_computed_count_is_refused_naming_it():
    planner = TierPlanner([ByteTier(DictStore("redis"))], BS)
    with pytest.raises(ConfigError, match="num_computed_tokens 5"):
        planner.match(FakeRequest("a", list(range(12))), 5)


# -- plans --------------------------------------------------------------------------------------


def test_loaded_blocks_are_loaded_into_their_block_ids_and_promoted_to_the_cpu_tier():
    request = FakeRequest("a", list(range(14)))  # 3 full blocks and 2 tokens
    redis = DictStore("redis", request.block_hashes[:2])
    host = HostTier(8)
    planner = TierPlanner([host, ByteTier(redis)], BS)
    planner.add(request)
    assert planner.match(request, 0) == 8
    planner.allocated(request, [10, 11, 12, 13], 8)
    plan = planner.build([new_chunk("a", [10, 11, 12, 13], computed=8, scheduled=6)])
    h = request.block_hashes
    assert plan.loads == (
        VllmBlockLoad(request_id="a", tier="redis", key=h[0], block_id=10),
        VllmBlockLoad(request_id="a", tier="redis", key=h[1], block_id=11),
    )
    # promotions to the tier above, then the computed full block 2 to every tier
    assert [(s.key, s.block_id, s.tiers) for s in plan.saves] == [
        (h[0], 10, ("cpu",)),
        (h[1], 11, ("cpu",)),
        (h[2], 12, ("cpu", "redis")),
    ]
    assert all(s.slot is not None for s in plan.saves)
    assert host.contains_prefix(h) == 3
    assert planner.matched_blocks == {"cpu": 0, "redis": 2}


def test_a_block_is_saved_once_as_it_fills_decode_included():
    request = FakeRequest("a", list(range(6)))
    planner = TierPlanner([ByteTier(DictStore("redis"))], BS)
    planner.add(request)
    assert planner.match(request, 0) == 0
    first = planner.build([new_chunk("a", [5, 6], computed=0, scheduled=6)])
    assert [s.block_id for s in first.saves] == [5]
    request.tokens += [6, 7]  # two decode steps fill block 1
    request.block_hashes = chain(request.tokens)
    step = VllmScheduledChunk(
        request_id="a", block_ids=(), replace=False, num_computed_tokens=6, num_scheduled_tokens=1
    )
    assert planner.build([step]).saves == ()  # block 1 holds 7 tokens after this step
    step = VllmScheduledChunk(
        request_id="a", block_ids=(), replace=False, num_computed_tokens=7, num_scheduled_tokens=1
    )
    assert [(s.key, s.block_id) for s in planner.build([step]).saves] == [(request.block_hashes[1], 6)]


def test_a_local_hit_is_not_saved_again():
    request = FakeRequest("a", list(range(12)))
    planner = TierPlanner([ByteTier(DictStore("redis"))], BS)
    planner.add(request)
    plan = planner.build([new_chunk("a", [1, 2, 3], computed=8, scheduled=4)])
    assert [s.block_id for s in plan.saves] == [3]


def test_a_failed_load_is_saved_again_when_vllm_recomputes_it():
    request = FakeRequest("a", list(range(13)))
    redis = DictStore("redis", request.block_hashes)
    planner = TierPlanner([ByteTier(redis)], BS)
    planner.add(request)
    assert planner.match(request, 0) == 12
    planner.allocated(request, [7, 8, 9, 10], 12)
    plan = planner.build([new_chunk("a", [7, 8, 9, 10], computed=12, scheduled=1)])
    assert len(plan.loads) == 3 and plan.saves == ()
    # block 8 was refused: vLLM reschedules the request from token 4 and computes blocks 1 and 2 again
    again = VllmScheduledChunk(
        request_id="a", block_ids=(), replace=False, num_computed_tokens=4, num_scheduled_tokens=9
    )
    assert [s.block_id for s in planner.build([again]).saves] == [8, 9]


def test_a_resumed_request_replaces_its_block_ids():
    request = FakeRequest("a", list(range(9)))
    planner = TierPlanner([ByteTier(DictStore("redis"))], BS)
    planner.add(request)
    planner.build([new_chunk("a", [1, 2, 3], computed=0, scheduled=4)])
    resumed = VllmScheduledChunk(
        request_id="a", block_ids=(20, 21, 22), replace=True, num_computed_tokens=0, num_scheduled_tokens=9
    )
    assert [s.block_id for s in planner.build([resumed]).saves] == [20, 21]


def test_external_tokens_that_are_not_the_match_are_refused_naming_them():
    request = FakeRequest("a", list(range(13)))
    planner = TierPlanner([ByteTier(DictStore("redis", request.block_hashes))], BS)
    planner.match(request, 0)
    with pytest.raises(ConfigError, match="6 external tokens"):
        planner.allocated(request, [1, 2, 3, 4], 6)
    with pytest.raises(ConfigError, match="16 external tokens"):
        planner.allocated(request, [1, 2, 3, 4], 16)


def test_a_full_host_tier_skips_the_cpu_save_and_keeps_the_others():
    request = FakeRequest("a", list(range(13)))
    planner = TierPlanner([HostTier(1), ByteTier(DictStore("redis"))], BS)
    planner.add(request)
    plan = planner.build([new_chunk("a", [1, 2, 3, 4], computed=0, scheduled=13)])
    assert [s.tiers for s in plan.saves] == [("cpu", "redis"), ("redis",), ("redis",)]
    assert isinstance(plan.saves[0], VllmBlockSave) and plan.saves[0].slot == 1


def test_finished_requests_are_forgotten():
    planner = TierPlanner([ByteTier(DictStore("redis"))], BS)
    planner.add(FakeRequest("a", [1, 2, 3]))
    planner.finished("a")
    planner.finished("never-seen")
    assert planner.num_tracked == 0
    assert planner.build([new_chunk("a", [1], computed=0, scheduled=3)]).saves == ()


def test_the_plan_module_imports_neither_vllm_nor_torch():
    import subprocess

    code = (
        "import sys, kvpool.integrations.vllm.plan, kvpool.integrations.vllm; "
        "print(sorted(m for m in ('vllm', 'torch') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
