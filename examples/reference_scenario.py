"""The reference scenario, as a readable trace.

Twelve blocks of four tokens (block 0 is the null block). Two requests share a
system prompt, finish, and leave their blocks in the free queue in eviction
order; a salted tenant gets no hit on the same tokens; a repeat of B's prompt
hits all but its last block; a new request evicts the oldest cached blocks.

Run: python examples/reference_scenario.py
"""

from __future__ import annotations

from kvpool import BlockRemoved, KVCacheManager, Request

mgr = KVCacheManager(num_blocks=12, block_size=4, enable_events=True)
system = list(range(100, 112))  # a 12-token shared system prompt


def admit(request: Request) -> None:
    hit, num_hit = mgr.get_computed_blocks(request)
    mgr.allocate_slots(request, request.num_tokens - num_hit, num_hit, hit)
    request.num_computed_tokens = request.num_tokens
    for event in mgr.take_events():
        if isinstance(event, BlockRemoved):
            print(f"    reuse drops cached hash {event.block_hashes[0].hex()[:12]}...")
    (table,) = mgr.get_block_ids(request.request_id)
    print(
        f"  {request.request_id}  tokens={request.num_tokens:<3} cached={num_hit:<3} "
        f"to compute={request.num_tokens - num_hit:<3} blocks={table}"
    )
    mgr.check_invariants()


print("Step 1 - admit A, then B (same 12-token system prompt) while A still runs")
a = Request("A", system + [1, 2, 3, 4, 5])
b = Request("B", system + [7, 8, 9, 10])
admit(a)
admit(b)
print("   owners per block:", {i: mgr.pool.block(i).ref_cnt for i in range(1, 7)})

print("Step 2 - free A, then B; free queue from next-to-reuse to last-to-reuse:")
mgr.free(a)
mgr.free(b)
print("  ", mgr.free_queue_block_ids())

print("Step 3 - C: same tokens as B under cache_salt='T2' (another tenant)")
admit(Request("C", system + [7, 8, 9, 10], cache_salt="T2"))

print("Step 4 - D: B's exact prompt again; logits need the last block recomputed")
admit(Request("D", system + [7, 8, 9, 10]))
print("   free queue now:", mgr.free_queue_block_ids())

print("Step 5 - E: 12 unrelated tokens while C and D hold their blocks")
admit(Request("E", list(range(500, 512))))
print(f"   usage {mgr.usage:.0%}, prefix-cache hit rate {mgr.prefix_cache_stats.hit_rate:.0%}")
