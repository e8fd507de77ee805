"""The layer specs (planner) and the group managers (scheduler) give one answer per layer type.

``LayerSpec.blocks_per_request`` (kvpool.specs) is what ``kvpool plan`` and
engine start-up size a pool with; a group manager's ``max_blocks_for`` and
``blocks_held_after`` are what the scheduler admits with and the manager
refuses with. These tests pin that they give one answer, and that the answer
is what a request really holds; and that both say the same about prefix
caching.
"""

from __future__ import annotations

import pytest

from kvpool import CapacityError, KVCacheManager, Request
from kvpool.model_config import load_model_config
from kvpool.planner import plan_kv_cache
from kvpool.scheduler import Scheduler, SchedulerConfig, StopConditions
from kvpool.specs import KVCacheGroup, LayerKind, MambaSpec
from tests.group_helpers import chunked, cross, decode, full, mamba, mla, sliding, step

BS = 4
LENGTHS = range(0, 64)

GROUPS = {
    "full": full(BS),
    "mla": mla(BS),
    "sliding 1": sliding(1, BS),
    "sliding 4": sliding(4, BS),
    "sliding 5": sliding(5, BS),
    "sliding 9": sliding(9, BS),
    "chunked 8": chunked(8, BS),
    "chunked 6": chunked(6, BS),
    "mamba": mamba(BS),
    "cross": cross(BS),
}


def test_every_layer_kind_is_covered():
    assert {g.kind for g in GROUPS.values()} == set(LayerKind)


@pytest.mark.parametrize("name", sorted(GROUPS))
def test_the_group_manager_caches_what_the_spec_says_is_cacheable(name):
    group = GROUPS[name]
    (manager,) = _manager(group).groups
    assert manager.enable_caching == group.spec.prefix_cacheable


def _manager(group: KVCacheGroup, num_blocks: int = 64) -> KVCacheManager:
    return KVCacheManager(num_blocks, BS, groups=[group])


@pytest.mark.parametrize("name", sorted(GROUPS))
def test_the_group_manager_asks_the_spec(name):
    group = GROUPS[name]
    (manager,) = _manager(group).groups
    for n in LENGTHS:
        expected = group.spec.blocks_per_request(n)
        if manager.uses_encoder_tokens:
            # the count is in encoder tokens; decoder tokens need no room here
            assert manager.blocks_held_after(0, n) == expected, n
            assert manager.max_blocks_for(n) == 0
        else:
            assert manager.max_blocks_for(n) == expected, n


def _real_blocks(mgr: KVCacheManager, request: Request) -> int:
    (table,) = mgr.get_block_ids(request.request_id)
    return sum(1 for block_id in table if block_id)


@pytest.mark.parametrize("name", sorted(n for n in GROUPS if n != "cross"))
def test_the_count_is_what_a_decoding_request_holds_at_its_peak(name):
    """One token per step from a one-token prompt: the peak after reaching ``n`` tokens is the spec's count.

    A chunk that is not a whole number of blocks is counted as if it could
    start anywhere inside a block; chunk 6 with 4-token blocks only starts at
    offsets 0 and 2, so it never needs its third block (the count is an upper
    bound there).
    """
    group = GROUPS[name]
    chunk = group.spec.attention_chunk_size
    tight = chunk is None or chunk % BS == 0
    mgr = _manager(group)
    request = Request("a", [0])
    assert step(mgr, request, 1) is not None
    peak = _real_blocks(mgr, request)
    for n in range(2, LENGTHS[-1]):
        assert decode(mgr, request, n % 50) is not None
        assert mgr.coordinator.blocks_held_after(n - 1, n) == _real_blocks(mgr, request)
        peak = max(peak, _real_blocks(mgr, request))
        count = group.spec.blocks_per_request(n)
        assert peak == count if tight else peak <= count, n
        mgr.check_invariants()


@pytest.mark.parametrize("chunk", [1, 2, 3, 4, 5, 7, 8, 9])
def test_a_mamba_request_holds_what_the_spec_says_after_every_step(chunk):
    """Any step size: two blocks right after a step that leaves the state's block, else one."""
    spec = mamba(BS).spec
    mgr = _manager(mamba(BS))
    request = Request("a", list(range(40)))
    computed = 0
    while computed < request.num_tokens:
        num_new = min(chunk, request.num_tokens - computed)
        assert step(mgr, request, num_new) is not None
        held = _real_blocks(mgr, request)
        assert held == spec.blocks_held_after(computed, computed + num_new)
        assert held <= spec.blocks_per_request(computed + num_new) <= spec.max_state_blocks
        computed += num_new
        mgr.check_invariants()


def test_a_mamba_request_crossing_a_block_needs_two_free_blocks():
    """Admission and the planner count two: with one free block a crossing step is refused."""
    mgr = _manager(mamba(BS), num_blocks=3)  # two usable blocks
    request = Request("a", list(range(BS + 1)))
    assert step(mgr, request, BS) == ([1],)
    blocker = Request("b", [9])
    assert step(mgr, blocker, 1) == ([2],)
    assert step(mgr, request, 1) is None  # the step reads block 1 and needs a second one to write
    mgr.free(blocker)
    assert step(mgr, request, 1) == ([2],)
    assert mgr.get_block_ids("a") == ([1, 2],)


HYBRID = ["jamba-mini-1.6", "nemotron-h-8b", "granite-4.0-h-tiny", "qwen3-next-80b-a3b", "gemma-3-12b", "gpt-oss-20b"]


@pytest.mark.parametrize("name", HYBRID)
def test_plan_and_admission_agree_on_shipped_configs(name):
    """A pool of exactly the planned blocks admits a max-length request; one block fewer refuses it."""
    max_len = 4096
    plan = plan_kv_cache(
        load_model_config(name),
        gpu_memory_bytes="80GB",
        weights_bytes=0,
        activation_bytes=0,
        other_overhead_bytes=0,
        max_model_len=max_len,
    )
    groups = [KVCacheGroup(spec=g.spec, layer_ids=g.layer_ids) for g in plan.groups]
    if any(g.kind is LayerKind.MAMBA for g in groups):
        assert any(isinstance(g.spec, MambaSpec) and g.blocks_per_request == 2 for g in plan.groups)
    usable = plan.blocks_per_request
    mgr = KVCacheManager.from_groups(groups, num_blocks=usable + 1)  # block 0 is the null block
    assert mgr.coordinator.max_blocks_for(max_len) == usable
    prompt = Request("a", [1] * (max_len // 2))
    stop = StopConditions(max_tokens=max_len - prompt.num_tokens)
    Scheduler(mgr, SchedulerConfig(max_model_len=max_len)).add_request(prompt, stop)

    short = KVCacheManager.from_groups(groups, num_blocks=usable)
    with pytest.raises(CapacityError, match=f"need {usable} blocks"):
        Scheduler(short, SchedulerConfig(max_model_len=max_len)).add_request(Request("a", [1] * (max_len // 2)), stop)
