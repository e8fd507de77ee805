"""Decision-for-decision parity with vLLM's own KV cache manager.

Runs only where vLLM is importable beside kvpool (it is never a dependency):
``pip install --no-deps vllm==0.33.0`` plus the modules ``vllm.v1.core``
imports. Random admissions, decodes and frees go to both managers; hit counts,
new block IDs, block tables and the free-queue order must agree at every step.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm.v1.core.kv_cache_manager", reason="vLLM is not installed beside kvpool")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from vllm_reference import VLLMManager  # noqa: E402

from kvpool import CapacityError, KVCacheManager, Request  # noqa: E402


def drive(rng, ours, make_theirs, lookup_theirs, theirs, vocab: int, steps: int, check_hit_blocks: bool) -> None:
    """Random admissions, decodes and frees to both managers; every decision must agree."""

    def ids(blocks):
        return None if blocks is None else tuple(blocks)

    prefixes = [[rng.randrange(vocab) for _ in range(rng.randint(1, 40))] for _ in range(4)]
    running: dict[str, tuple] = {}
    for step in range(steps):
        op = rng.random()
        if op < 0.35 or not running:
            rid = f"r{step}"
            tokens = rng.choice(prefixes)[: rng.randint(0, 40)] + [rng.randrange(vocab) for _ in range(rng.randint(1, 16))]
            a, b = Request(rid, tokens), make_theirs(rid, tokens)
            (hit_a, n_a), (hit_b, n_b) = ours.get_computed_blocks(a), lookup_theirs(b)
            assert n_a == n_b
            if check_hit_blocks:
                assert hit_a.block_ids == tuple(hit_b.get_block_ids())
            try:
                new_a = ours.allocate_slots(a, a.num_tokens - n_a, n_a, hit_a)
            except CapacityError:
                continue
            assert new_a == ids(theirs.allocate_slots(b, b.num_tokens - n_b, n_b, hit_b))
            if new_a is not None:
                a.num_computed_tokens = b.num_computed_tokens = a.num_tokens
                running[rid] = (a, b)
        elif op < 0.8:
            rid = rng.choice(list(running))
            a, b = running[rid]
            token = rng.randrange(vocab)
            a.append_output_token_ids(token)
            b.append_output_token_ids(token)
            try:
                new_a = ours.allocate_slots(a, 1)
            except CapacityError:
                new_a = None
            assert new_a == ids(theirs.allocate_slots(b, 1))
            if new_a is None:
                ours.free(a)
                theirs.free(b)
                del running[rid]
            else:
                a.num_computed_tokens += 1
                b.num_computed_tokens += 1
        else:
            a, b = running.pop(rng.choice(list(running)))
            ours.free(a)
            theirs.free(b)
        assert ours.free_queue_block_ids() == theirs.free_queue_block_ids()
        for rid in running:
            assert ours.get_block_ids(rid) == tuple(theirs.get_block_ids(rid))
        ours.check_invariants()


@pytest.mark.parametrize("seed", range(60))
def test_random_traffic_makes_identical_decisions(seed):
    rng = random.Random(seed)
    num_blocks, block_size = rng.randint(8, 60), rng.choice([1, 2, 4, 16])
    theirs = VLLMManager(num_blocks, block_size)
    drive(rng, KVCacheManager(num_blocks, block_size), theirs.make_request, theirs.get_computed_blocks,
          theirs, vocab=50, steps=300, check_hit_blocks=False)


class _HybridView:
    """vLLM's manager with the two calls the driver needs in kvpool's shape."""

    def __init__(self, manager) -> None:
        self.manager = manager

    def allocate_slots(self, request, *args):
        result = self.manager.allocate_slots(request, *args)
        return None if result is None else result.get_block_ids()

    def free(self, request) -> None:
        self.manager.free(request)

    def get_block_ids(self, request_id: str):
        return self.manager.get_block_ids(request_id)

    def free_queue_block_ids(self) -> list[int]:
        return [blk.block_id for blk in self.manager.block_pool.free_block_queue.get_all_free_blocks()]


@pytest.mark.parametrize("seed", range(40))
def test_hybrid_groups_make_identical_decisions(seed):
    """Full attention, sliding window and chunked local groups, equal or multiple block sizes."""
    from vllm_reference import build_hybrid_pair

    rng = random.Random(seed)
    base = rng.choice([1, 2, 4])
    mixed_sizes = rng.random() < 0.5
    kinds = []
    for _ in range(rng.choice([1, 2, 2, 3])):
        kind = rng.choice(["full", "sw", "sw"] + ([] if mixed_sizes else ["cl"]))
        parameter = rng.randint(1, 20) if kind == "sw" else (base * rng.randint(1, 5) if kind == "cl" else None)
        kinds.append((kind, base * (rng.choice([1, 2, 3]) if mixed_sizes else 1), parameter))
    ours, theirs, make_theirs = build_hybrid_pair(rng.randint(8, 60), kinds)

    def lookup(request):
        blocks, num_hit, _ = theirs.get_computed_blocks(request)
        return blocks, num_hit

    drive(rng, ours, make_theirs, lookup, _HybridView(theirs), vocab=20, steps=250, check_hit_blocks=True)
