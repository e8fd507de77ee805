"""Replay a synthetic serving trace through the KV cache manager and time every call.

The workload: a few shared system prompts (500-2,000 tokens), multi-turn
conversations whose later turns extend earlier ones (outputs included),
outputs of 50-300 tokens, 16-token blocks, up to 256 running requests, FCFS
admission, and when a decode step does not fit, preemption of the newest
running request (recomputed later, mostly from the cache).

Run::

    python benchmarks/bench_manager.py                 # kvpool, with and without eviction
    python benchmarks/bench_manager.py --vs-vllm       # the same trace through vLLM's manager too

``--vs-vllm`` needs vLLM importable beside kvpool (never a kvpool dependency):
``pip install --no-deps vllm==0.33.0`` plus the modules ``vllm.v1.core`` imports.
It checks that every admission's hit count and block table, every decode
allocation and the final free queue agree, and reports the speed ratio.
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import sys
import time
import tracemalloc
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from kvpool import CapacityError, KVCacheManager, Request  # noqa: E402

BLOCK_SIZE = 16
MAX_RUNNING = 256


# -- the workload -------------------------------------------------------------------


@dataclass
class Conversation:
    system: list[int]
    turns: list[tuple[list[int], list[int]]]  # (user message, model output) per turn


def make_workload(num_requests: int = 2000, seed: int = 0) -> list[Conversation]:
    rng = random.Random(seed)
    systems = [[rng.randrange(32000) for _ in range(rng.randint(500, 2000))] for _ in range(6)]
    conversations = []
    made = 0
    while made < num_requests:
        turns = []
        for _ in range(min(rng.randint(1, 6), num_requests - made)):
            user = [rng.randrange(32000) for _ in range(rng.randint(20, 300))]
            output = [rng.randrange(32000) for _ in range(rng.randint(50, 300))]
            turns.append((user, output))
            made += 1
        conversations.append(Conversation(rng.choice(systems), turns))
    return conversations


# -- adapters -----------------------------------------------------------------------


class KVPoolAdapter:
    name = "kvpool"

    def __init__(self, num_blocks: int) -> None:
        self.mgr = KVCacheManager(num_blocks, BLOCK_SIZE)

    def make_request(self, request_id: str, tokens: list[int]) -> tuple[Request, int]:
        """The request, and the nanoseconds spent hashing its prompt."""
        request = Request(request_id, tokens)
        start = time.perf_counter_ns()
        self.mgr.hash_request(request)  # an engine's input thread does this on arrival
        return request, time.perf_counter_ns() - start

    def lookup(self, request):
        return self.mgr.get_computed_blocks(request)

    def allocate(self, request, num_new, num_hit=0, hit=None):
        try:
            return self.mgr.allocate_slots(request, num_new, num_hit, hit)
        except CapacityError:
            return None

    def free(self, request) -> None:
        self.mgr.free(request)

    def block_ids(self, request_id: str):
        return tuple(self.mgr.get_block_ids(request_id))

    def free_queue(self) -> list[int]:
        return self.mgr.free_queue_block_ids()


class VLLMAdapter:
    name = "vllm"

    def __init__(self, num_blocks: int) -> None:
        from vllm_reference import VLLMManager

        self.mgr = VLLMManager(num_blocks, BLOCK_SIZE)

    def make_request(self, request_id: str, tokens: list[int]):
        """The request, and the nanoseconds spent hashing its prompt."""
        return self.mgr.make_request_timed(request_id, tokens)

    def lookup(self, request):
        return self.mgr.get_computed_blocks(request)

    def allocate(self, request, num_new, num_hit=0, hit=None):
        result = self.mgr.allocate_slots(request, num_new, num_hit, hit)
        return None if result is None else tuple(result)

    def free(self, request) -> None:
        self.mgr.free(request)

    def block_ids(self, request_id: str):
        return tuple(self.mgr.get_block_ids(request_id))

    def free_queue(self) -> list[int]:
        return self.mgr.free_queue_block_ids()


# -- the replay ---------------------------------------------------------------------


@dataclass
class Timings:
    ns: dict[str, list[int]] = field(default_factory=lambda: {k: [] for k in ("lookup", "prefill", "decode", "free")})
    hash_ns: int = 0  # hashing prompts when requests arrive
    hashed_tokens: int = 0
    append_ns: int = 0  # appending sampled tokens (hashing each block that fills)
    appended_tokens: int = 0
    decisions: list = field(default_factory=list)
    hits: int = 0
    queries: int = 0
    preemptions: int = 0
    finished: int = 0

    @property
    def calls(self) -> int:
        return sum(len(v) for v in self.ns.values())

    @property
    def call_seconds(self) -> float:
        return sum(sum(v) for v in self.ns.values()) / 1e9


def replay(adapter, conversations: list[Conversation], record: bool = False) -> Timings:
    t = Timings()
    clock = time.perf_counter_ns
    waiting: deque = deque()
    running: list = []
    state: dict = {}  # request_id -> (conversation index, turn, target output length)

    def enqueue(ci: int, turn: int) -> None:
        conv = conversations[ci]
        tokens = list(conv.system)
        for user, output in conv.turns[:turn]:
            tokens += user + output
        tokens += conv.turns[turn][0]
        rid = f"c{ci}t{turn}"
        request, hash_ns = adapter.make_request(rid, tokens)
        t.hash_ns += hash_ns
        t.hashed_tokens += len(tokens)
        state[rid] = (ci, turn)
        waiting.append(request)

    for ci in range(len(conversations)):
        enqueue(ci, 0)

    def preempt(request) -> None:
        start = clock()
        adapter.free(request)
        t.ns["free"].append(clock() - start)
        running.remove(request)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        t.preemptions += 1
        waiting.appendleft(request)

    while waiting or running:
        for request in list(running):
            if request not in running:
                continue  # preempted earlier in this step
            ci, turn = state[request.request_id]
            output = conversations[ci].turns[turn][1]
            produced = request.num_tokens - request.num_prompt_tokens
            if produced >= len(output):
                start = clock()
                adapter.free(request)
                t.ns["free"].append(clock() - start)
                running.remove(request)
                t.finished += 1
                if turn + 1 < len(conversations[ci].turns):
                    enqueue(ci, turn + 1)
                continue
            start = clock()
            request.append_output_token_ids(output[produced])
            t.append_ns += clock() - start
            t.appended_tokens += 1
            while True:
                start = clock()
                new = adapter.allocate(request, 1)
                t.ns["decode"].append(clock() - start)
                if new is not None:
                    request.num_computed_tokens += 1
                    if record:
                        t.decisions.append(("decode", request.request_id, new))
                    break
                victim = running[-1]
                preempt(victim)
                if victim is request:
                    break
        while waiting and len(running) < MAX_RUNNING:
            request = waiting[0]
            start = clock()
            hit, num_hit = adapter.lookup(request)
            t.ns["lookup"].append(clock() - start)
            start = clock()
            new = adapter.allocate(request, request.num_tokens - num_hit, num_hit, hit)
            t.ns["prefill"].append(clock() - start)
            if new is None:
                break
            t.hits += num_hit
            t.queries += request.num_tokens
            waiting.popleft()
            request.num_computed_tokens = request.num_tokens
            running.append(request)
            if record:
                t.decisions.append(("admit", request.request_id, num_hit, adapter.block_ids(request.request_id)))
    if record:
        t.decisions.append(("free queue", adapter.free_queue()))
    return t


# -- reporting ----------------------------------------------------------------------


def summarize(t: Timings) -> dict[str, float]:
    out = {
        "calls": t.calls,
        "calls_per_s": t.calls / t.call_seconds,
        "hash_us_per_token": t.hash_ns / 1e3 / max(1, t.hashed_tokens),
        "append_us_per_token": t.append_ns / 1e3 / max(1, t.appended_tokens),
        "hit_rate": t.hits / max(1, t.queries),
        "preemptions": t.preemptions,
    }
    for kind, values in t.ns.items():
        out[f"{kind}_us_median"] = statistics.median(values) / 1e3 if values else 0.0
        out[f"{kind}_calls"] = len(values)
    return out


def measure(adapter_type, num_blocks: int, conversations, repeats: int) -> tuple[dict, Timings]:
    runs = []
    for _ in range(repeats):
        adapter = adapter_type(num_blocks)
        gc.collect()
        runs.append(summarize(replay(adapter, conversations)))
    keys = runs[0].keys()
    return {k: statistics.median(r[k] for r in runs) for k in keys}, None


def peak_memory(adapter_type, num_blocks: int, conversations) -> int:
    gc.collect()
    tracemalloc.start()
    adapter = adapter_type(num_blocks)
    replay(adapter, conversations)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return peak


def print_table(rows: list[tuple[str, dict]]) -> None:
    fields = [
        ("calls/s", "calls_per_s", "{:,.0f}"),
        ("lookup us", "lookup_us_median", "{:.1f}"),
        ("prefill alloc us", "prefill_us_median", "{:.1f}"),
        ("decode alloc us", "decode_us_median", "{:.2f}"),
        ("free us", "free_us_median", "{:.1f}"),
        ("prompt hashing us/token", "hash_us_per_token", "{:.3f}"),
        ("append+hash us/token", "append_us_per_token", "{:.3f}"),
        ("hit rate", "hit_rate", "{:.3f}"),
        ("preemptions", "preemptions", "{:,.0f}"),
        ("calls", "calls", "{:,.0f}"),
    ]
    print(f"{'':28}" + "".join(f"{name:>16}" for name, _ in rows))
    for label, key, fmt in fields:
        print(f"{label:28}" + "".join(f"{fmt.format(r[key]):>16}" for _, r in rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=3, help="runs per configuration; medians are reported")
    parser.add_argument("--vs-vllm", action="store_true", help="also run vLLM's manager and compare decisions")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    conversations = make_workload(args.requests, args.seed)
    pools = {"with eviction (12,000 blocks)": 12_000, "no eviction (400,000 blocks)": 400_000}
    adapters = [KVPoolAdapter] + ([VLLMAdapter] if args.vs_vllm else [])

    for label, num_blocks in pools.items():
        print(f"\n== {args.requests} requests, {label}")
        rows = []
        for adapter_type in adapters:
            result, _ = measure(adapter_type, num_blocks, conversations, args.repeats)
            result["peak_mib"] = peak_memory(adapter_type, num_blocks, conversations) / 2**20
            rows.append((adapter_type.name, result))
        print_table(rows)
        for name, r in rows:
            print(f"peak traced memory ({name}): {r['peak_mib']:.1f} MiB")
        if args.vs_vllm:
            kv, vl = rows[0][1], rows[1][1]
            print(
                f"kvpool / vLLM: calls/s x{kv['calls_per_s'] / vl['calls_per_s']:.2f}, "
                f"hashing x{vl['hash_us_per_token'] / kv['hash_us_per_token']:.2f}, "
                f"lookup x{vl['lookup_us_median'] / kv['lookup_us_median']:.2f}, "
                f"decode x{vl['decode_us_median'] / kv['decode_us_median']:.2f}"
            )
            a = replay(KVPoolAdapter(num_blocks), conversations, record=True).decisions
            b = replay(VLLMAdapter(num_blocks), conversations, record=True).decisions
            same = a == b
            admissions = sum(1 for d in a if d[0] == "admit")
            print(f"decisions identical: {same} ({admissions:,} admissions, {len(a):,} decisions compared)")
            if not same:
                first = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
                print(f"first difference at decision {first}: kvpool {a[first]} vs vLLM {b[first]}")


if __name__ == "__main__":
    main()
