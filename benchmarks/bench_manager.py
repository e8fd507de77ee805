"""Replay a synthetic serving trace through the KV cache manager and time every call.

The workload: a few shared system prompts (500-2,000 tokens), multi-turn
conversations whose later turns extend earlier ones (outputs included),
outputs of 50-300 tokens, 16-token blocks, up to 256 running requests, FCFS
admission, and when a decode step does not fit, preemption of the newest
running request (recomputed later, mostly from the cache).

Run::

    python benchmarks/bench_manager.py                 # kvpool, with and without eviction
    python benchmarks/bench_manager.py --vs-vllm       # the same trace through vLLM's manager too
    python benchmarks/bench_manager.py --workload production --vs-vllm
    python benchmarks/bench_manager.py --workload long-prompts
    python benchmarks/bench_manager.py --workload long-prompts --clock cpu   # on a busy machine

Workloads (``--workload``):

* ``default``: the trace above, through pools of 12,000 and 400,000 blocks.
* ``production``: the same kind of conversations, but 20% of them belong to
  tenants with a cache salt (4 tenants; a salted prompt hashes its first block
  with the salt, so tenants never share blocks), a tight pool of 3,000 blocks
  and at most 64 running, so preemption happens. Prompt hashing is counted
  where each system does it: kvpool when a request arrives
  (``hash_request``), vLLM when its ``Request`` is built (its block hasher);
  both hash the blocks that sampled tokens fill as they are appended. The
  table gives the time per phase (hashing, lookup, allocate, free), summed
  over the run, and the ratio of manager plus hashing.
* ``prefill-heavy``: the production replay on a mix where prompts dominate:
  half the conversations salted (8 tenants), user turns of 300-1,500 tokens,
  outputs of 8-48, the same 3,000-block pool and 64 running (it preempts).
* ``long-prompts``: the first 2,000 requests of the Mooncake conversation
  trace (``--trace``, by default ``../shared/traces/conversation_trace.jsonl``
  from the repository root), about 13,700 prompt tokens each, expanded to
  tokens as ``kvpool.sim.traces`` does (hash ID ``h`` at offset ``j`` is token
  ``h * 512 + j``), replayed one at a time through a 512,000-token cache
  (32,000 blocks of 16 tokens plus the null block), prefill only: hash,
  lookup, allocate (evicting as needed), mark computed, free. kvpool with
  SHA-256 and with xxh3_128 (the verified index). ``benchmarks/bench_radix.py``
  runs the same replay beside SGLang's radix cache.

Every run is seeded; times are medians of ``--repeats`` runs.

``--vs-vllm`` needs vLLM importable beside kvpool (never a kvpool dependency):
``pip install --no-deps vllm==0.33.0`` plus the modules ``vllm.v1.core`` imports.
It checks that every admission's hit count and block table, every decode
allocation and the final free queue agree, and reports the speed ratio.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import subprocess
import sys
import time
import tracemalloc
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# A worker process of ``--builds`` imports the build it is given (see ``run_builds``).
sys.path.insert(0, os.environ.get("KVPOOL_BENCH_PATH") or str(REPO / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from kvpool import CapacityError, KVCacheManager, Request  # noqa: E402

BLOCK_SIZE = 16
MAX_RUNNING = 256


# -- the workload -------------------------------------------------------------------


@dataclass
class Conversation:
    system: list[int]
    turns: list[tuple[list[int], list[int]]]  # (user message, model output) per turn
    salt: str | None = None  # the tenant's cache salt, or None (shared cache)


def make_workload(
    num_requests: int = 2000,
    seed: int = 0,
    salted_fraction: float = 0.0,
    tenants: int = 4,
    user_tokens: tuple[int, int] = (20, 300),
    output_tokens: tuple[int, int] = (50, 300),
) -> list[Conversation]:
    """Seeded conversations; ``salted_fraction`` of them get one of ``tenants`` cache salts.

    Salts are drawn from a separate generator, so the tokens are the same
    whatever the fraction (the default workload has none). A user message and
    a model output are ``user_tokens`` and ``output_tokens`` long (ranges,
    inclusive).
    """
    salt_rng = random.Random(seed + 1_000_003)
    rng = random.Random(seed)
    systems = [[rng.randrange(32000) for _ in range(rng.randint(500, 2000))] for _ in range(6)]
    conversations = []
    made = 0
    while made < num_requests:
        turns = []
        for _ in range(min(rng.randint(1, 6), num_requests - made)):
            user = [rng.randrange(32000) for _ in range(rng.randint(*user_tokens))]
            output = [rng.randrange(32000) for _ in range(rng.randint(*output_tokens))]
            turns.append((user, output))
            made += 1
        conversations.append(Conversation(rng.choice(systems), turns))
    if salted_fraction > 0:
        for conv in salt_rng.sample(conversations, round(salted_fraction * len(conversations))):
            conv.salt = f"tenant-{salt_rng.randrange(tenants)}"
    return conversations


# -- adapters -----------------------------------------------------------------------


class KVPoolAdapter:
    name = "kvpool"

    def __init__(self, num_blocks: int, hash_algo: str = "kvpool_sha256") -> None:
        self.mgr = KVCacheManager(num_blocks, BLOCK_SIZE, hash_algo=hash_algo)

    def make_request(self, request_id: str, tokens, cache_salt: str | None = None) -> tuple[Request, int]:
        """The request, and the nanoseconds spent hashing its prompt."""
        request = Request(request_id, tokens, cache_salt=cache_salt)
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


class KVPoolFastHashAdapter(KVPoolAdapter):
    """kvpool with the fast hash (xxh3_128, every hit verified), for ``--fast-hash``."""

    name = "kvpool xxh3"

    def __init__(self, num_blocks: int) -> None:
        super().__init__(num_blocks, "xxh3_128")


class VLLMAdapter:
    name = "vllm"

    def __init__(self, num_blocks: int) -> None:
        from vllm_reference import VLLMManager

        self.mgr = VLLMManager(num_blocks, BLOCK_SIZE)

    def make_request(self, request_id: str, tokens, cache_salt: str | None = None):
        """The request, and the nanoseconds spent hashing its prompt.

        As ``VLLMManager.make_request_timed``, with the cache salt: vLLM's
        ``Request`` hashes its prompt when built (its block hasher), so the
        request is built without one, then the same hasher is timed alone.
        """
        if cache_salt is None:
            return self.mgr.make_request_timed(request_id, tokens)
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request as VRequest

        request = VRequest(
            request_id, list(tokens), SamplingParams(max_tokens=1 << 20), None, cache_salt=cache_salt, block_hasher=None
        )
        request._block_hasher = self.mgr._hasher
        start = time.perf_counter_ns()
        request.update_block_hashes()
        return request, time.perf_counter_ns() - start

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


def replay(adapter, conversations: list[Conversation], record: bool = False, max_running: int = MAX_RUNNING) -> Timings:
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
        request, hash_ns = adapter.make_request(rid, tokens, conv.salt)
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
        while waiting and len(running) < max_running:
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


# -- the production mix ----------------------------------------------------------------

PRODUCTION_BLOCKS = 3_000
PRODUCTION_RUNNING = 64
PRODUCTION_SALTED = 0.2
#: ``make_workload`` arguments of the mixes that share the production replay (same pool, same limit
#: on running requests). ``prefill-heavy``: half the conversations salted over 8 tenants, user turns
#: of 300-1,500 tokens and outputs of 8-48, so prompt hashing, lookup and admission dominate, and
#: long multi-turn prompts in a 3,000-block pool preempt.
MIXES: dict[str, dict] = {
    "production": {"salted_fraction": PRODUCTION_SALTED},
    "prefill-heavy": {
        "salted_fraction": 0.5,
        "tenants": 8,
        "user_tokens": (300, 1500),
        "output_tokens": (8, 48),
    },
}


def phase_totals(t: Timings) -> dict[str, float]:
    """Seconds per phase over the whole run; hashing = prompts on arrival + appended tokens."""
    out = {
        "hashing": (t.hash_ns + t.append_ns) / 1e9,
        "prompt hashing": t.hash_ns / 1e9,
        "append+hash": t.append_ns / 1e9,
        "lookup": sum(t.ns["lookup"]) / 1e9,
        "allocate": (sum(t.ns["prefill"]) + sum(t.ns["decode"])) / 1e9,
        "free": sum(t.ns["free"]) / 1e9,
    }
    out["manager"] = out["lookup"] + out["allocate"] + out["free"]
    out["total"] = out["manager"] + out["hashing"]
    return out


def run_production(args) -> None:
    mix = MIXES[args.workload]
    conversations = make_workload(args.requests, args.seed, **mix)
    salted = sum(1 for c in conversations if c.salt is not None)
    print(
        f"\n== {args.workload} mix: {args.requests:,} requests in {len(conversations):,} conversations "
        f"({salted:,} salted, {mix.get('tenants', 4)} tenants), {PRODUCTION_BLOCKS:,} blocks of {BLOCK_SIZE}, "
        f"at most {PRODUCTION_RUNNING} running; medians of {args.repeats} runs"
    )
    adapters = (
        [KVPoolAdapter] + ([KVPoolFastHashAdapter] if args.fast_hash else []) + ([VLLMAdapter] if args.vs_vllm else [])
    )
    # Each system once per round, rounds repeated, so load that comes and goes
    # on a shared machine hits both alike.

    def one_round(first_build: bool) -> dict[str, dict]:
        out = {}
        for adapter_type in adapters:
            if adapter_type is VLLMAdapter and not first_build:
                continue  # vLLM does not depend on kvpool's build: once per round
            adapter = adapter_type(PRODUCTION_BLOCKS)
            gc.collect()
            cpu = time.thread_time_ns()
            t = replay(adapter, conversations, max_running=PRODUCTION_RUNNING)
            cpu = time.thread_time_ns() - cpu
            # The whole replay's CPU time (the trace loop included, the same code for every
            # system): the figure a loaded machine disturbs least; the phases are elapsed time.
            out[adapter_type.name] = {**phase_totals(t), **summarize(t), "replay_cpu": cpu / 1e9}
        return out

    runs = run_builds(args, one_round)
    if args.worker:
        return
    rows = []
    for name, results in runs.items():
        result = {k: statistics.median(r[k] for r in results) for k in results[0]}
        result["spread"] = (min(r["total"] for r in results), max(r["total"] for r in results))
        rows.append((name, result))
    fields = [
        ("hashing s (prompt + append)", "hashing", "{:.3f}"),
        ("  prompt hashing s", "prompt hashing", "{:.3f}"),
        ("  append+hash s", "append+hash", "{:.3f}"),
        ("lookup s", "lookup", "{:.3f}"),
        ("allocate s (prefill + decode)", "allocate", "{:.3f}"),
        ("free s", "free", "{:.3f}"),
        ("manager s", "manager", "{:.3f}"),
        ("manager + hashing s", "total", "{:.3f}"),
        ("replay CPU s (whole loop)", "replay_cpu", "{:.3f}"),
        ("lookup us (median call)", "lookup_us_median", "{:.1f}"),
        ("prefill alloc us (median)", "prefill_us_median", "{:.1f}"),
        ("decode alloc us (median)", "decode_us_median", "{:.2f}"),
        ("free us (median)", "free_us_median", "{:.1f}"),
        ("calls", "calls", "{:,.0f}"),
        ("token hit rate", "hit_rate", "{:.4f}"),
        ("preemptions", "preemptions", "{:,.0f}"),
    ]
    # The ratio column: the last system's time over kvpool's (SHA-256), as "x times faster".
    names = [n for n, _ in rows]
    width = max(14, *(len(n) + 2 for n in names))
    print(f"{'':32}" + "".join(f"{n:>{width}}" for n in names) + ("       ratio" if len(rows) >= 2 else ""))
    for label, key, fmt in fields:
        line = f"{label:32}" + "".join(f"{fmt.format(r[key]):>{width}}" for _, r in rows)
        if len(rows) >= 2 and key in (
            "hashing",
            "prompt hashing",
            "append+hash",
            "lookup",
            "allocate",
            "free",
            "manager",
            "total",
            "replay_cpu",
        ):
            a, b = rows[0][1][key], rows[-1][1][key]
            line += f"{b / a:>11.2f}x" if a else ""
        print(line)
    for name, r in rows:
        lo, hi = r["spread"]
        print(f"{name}: manager + hashing over the {args.repeats} runs: {lo:.3f} .. {hi:.3f} s")
    by_name = dict(rows)
    builds = args.builds.split(",")
    if len(builds) > 1:
        pure, compiled = by_name[f"kvpool [{builds[0]}]"], by_name[f"kvpool [{builds[1]}]"]
        print(
            f"kvpool {builds[1]} / {builds[0]}, manager + hashing: {pure['total'] / compiled['total']:.2f}x as fast "
            f"(manager {pure['manager'] / compiled['manager']:.2f}x, hashing {pure['hashing'] / compiled['hashing']:.2f}x)"
        )
        if args.vs_vllm:
            vl = by_name["vllm"]
            for build in builds:
                kv = by_name[f"kvpool [{build}]"]
                print(f"kvpool [{build}] / vLLM, manager + hashing: x{vl['total'] / kv['total']:.2f}")
        for build in builds[1:]:
            print(f"decisions of kvpool [{build}] identical to those of kvpool [pure]: {same_decisions(args, build)}")
    elif args.fast_hash:
        sha, fast = rows[0][1], rows[1][1]
        print(
            f"kvpool xxh3_128 / kvpool SHA-256, manager + hashing: {fast['total'] / sha['total']:.2f} of the time "
            f"(hashing {fast['hashing'] / sha['hashing']:.2f}, manager {fast['manager'] / sha['manager']:.2f}); "
            f"token hit rate {fast['hit_rate']:.4f} and {sha['hit_rate']:.4f}"
        )
    if args.vs_vllm and len(builds) == 1:
        kv, vl = rows[0][1], rows[-1][1]
        print(
            f"kvpool / vLLM, manager + hashing: x{vl['total'] / kv['total']:.2f} (manager alone x{vl['manager'] / kv['manager']:.2f}, hashing x{vl['hashing'] / kv['hashing']:.2f})"
        )
        compare_decisions(
            lambda: KVPoolAdapter(PRODUCTION_BLOCKS),
            lambda: VLLMAdapter(PRODUCTION_BLOCKS),
            conversations,
            PRODUCTION_RUNNING,
        )
    if args.profile:
        profile(
            lambda: replay(KVPoolAdapter(PRODUCTION_BLOCKS), conversations, max_running=PRODUCTION_RUNNING),
            args.profile,
        )


def compare_decisions(make_a, make_b, conversations, max_running: int = MAX_RUNNING) -> bool:
    a = replay(make_a(), conversations, record=True, max_running=max_running).decisions
    b = replay(make_b(), conversations, record=True, max_running=max_running).decisions
    same = a == b
    admissions = sum(1 for d in a if d[0] == "admit")
    print(f"decisions identical: {same} ({admissions:,} admissions, {len(a):,} decisions compared)")
    if not same:
        first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        print(
            f"first difference at decision {first}: kvpool {a[first] if first < len(a) else None} vs vLLM {b[first] if first < len(b) else None}"
        )
    return same


def profile(fn, top: int) -> None:
    """Run ``fn`` under cProfile and print the ``top`` functions by own time."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    gc.collect()
    prof.enable()
    fn()
    prof.disable()
    print(f"\n-- cProfile of one kvpool run: top {top} functions by own time (tottime)")
    pstats.Stats(prof).sort_stats("tottime").print_stats(top)
    print(f"-- the same run, kvpool's own functions only: top {top} by own time")
    pstats.Stats(prof).sort_stats("tottime").print_stats(r"src/kvpool/", top)


# -- long prompts: the Mooncake conversation trace --------------------------------------

DEFAULT_TRACE = (
    Path(__file__).resolve().parents[1] / ".." / "shared" / "traces" / "conversation_trace.jsonl"
).resolve()
LONG_PROMPT_CACHE_TOKENS = 512_000
LONG_PROMPT_PHASES = ("hash", "lookup", "allocate", "free")

#: The long-prompt replays' clocks (``--clock``): ``wall`` is elapsed time; ``cpu`` is the
#: time this thread ran (``time.thread_time_ns``), which a busy machine's other work
#: inflates far less (cache sharing still shows). Per-request phases last 10-1,000 us, so the
#: CPU clock's own cost (a system call, well under 1 us) stays small beside them.
CLOCKS = {"wall": time.perf_counter_ns, "cpu": time.thread_time_ns}
clock_ns = CLOCKS["wall"]


def use_clock(name: str) -> None:
    """Time the long-prompt replays (and ``bench_radix``'s SGLang replay) with ``CLOCKS[name]``."""
    global clock_ns
    clock_ns = CLOCKS[name]


def load_long_prompts(trace: Path, num_requests: int) -> list:
    """The first ``num_requests`` prompts of a Mooncake trace, as ``array('I')`` token IDs.

    Expanded as ``kvpool.sim.traces`` does: hash ID ``h`` at offset ``j`` of
    its 512-token block is token ``h * 512 + j``.
    """
    from itertools import islice

    from kvpool.sim.traces import iter_trace

    return [req.prompt_token_ids() for req in islice(iter_trace(trace), num_requests)]


def replay_long_prompts(
    prompts, hash_algo: str = "kvpool_sha256", cache_tokens: int = LONG_PROMPT_CACHE_TOKENS
) -> dict:
    """One request at a time: hash, lookup, allocate (evicting), computed, free.

    Returns nanoseconds per phase (summed), prefix-hit tokens and prompt tokens.
    """
    mgr = KVCacheManager(cache_tokens // BLOCK_SIZE + 1, BLOCK_SIZE, hash_algo=hash_algo)
    clock = clock_ns
    ns = dict.fromkeys(LONG_PROMPT_PHASES, 0)
    hits = tokens = 0
    for i, prompt in enumerate(prompts):
        request = Request(f"r{i}", prompt)
        t0 = clock()
        mgr.hash_request(request)
        t1 = clock()
        hit, num_hit = mgr.get_computed_blocks(request)
        t2 = clock()
        new = mgr.allocate_slots(request, len(prompt) - num_hit, num_hit, hit)
        t3 = clock()
        if new is None:
            raise RuntimeError(f"request {i} ({len(prompt)} tokens) did not fit in {cache_tokens} tokens")
        request.num_computed_tokens = len(prompt)
        t4 = clock()
        mgr.free(request)
        t5 = clock()
        ns["hash"] += t1 - t0
        ns["lookup"] += t2 - t1
        ns["allocate"] += t3 - t2
        ns["free"] += t5 - t4
        hits += num_hit
        tokens += len(prompt)
    return {"ns": ns, "hits": hits, "tokens": tokens, "requests": len(prompts)}


def hash_floor(prompts, hash_algo: str = "kvpool_sha256") -> dict:
    """The hash floor: each prompt's chain of block hashes (kvpool's inputs, the same
    number of digests), with nothing else: no request, no manager, no index.

    Timed per request as ``replay_long_prompts`` times its phases; the shape of its result.
    """
    import hashlib

    from kvpool.hashing import BlockHasher, token_bytes

    hasher = BlockHasher(BLOCK_SIZE, hash_algo)
    if hash_algo == "xxh3_128":
        import xxhash

        digest = xxhash.xxh3_128_digest
    else:
        sha = hashlib.sha256

        def digest(data: bytes) -> bytes:
            return sha(data).digest()

    width = 4 * BLOCK_SIZE
    clock = clock_ns
    total = 0
    for prompt in prompts:
        t0 = clock()
        data = token_bytes(prompt)
        chained: bytes = hasher.root
        for off in range(0, len(data) - width + 1, width):
            chained = digest(chained + data[off : off + width])
        total += clock() - t0
    ns = dict.fromkeys(LONG_PROMPT_PHASES, 0)
    ns["hash"] = total
    return {"ns": ns, "hits": 0, "tokens": sum(len(p) for p in prompts), "requests": len(prompts)}


def long_prompt_round(prompts, floor: bool = True) -> dict[str, dict]:
    """One run of each kvpool hash on the replay, then (``floor``) the hash floor of each."""
    out = {}
    for algo in ("kvpool_sha256", "xxh3_128"):
        gc.collect()
        out[f"kvpool {algo}"] = replay_long_prompts(prompts, algo)
    if floor:  # the floor is the same code in either build: measured in the first
        for algo in ("kvpool_sha256", "xxh3_128"):
            gc.collect()
            out[f"hash floor {algo}"] = hash_floor(prompts, algo)
    return out


def print_floor_ratios(rows: list[tuple[str, dict]]) -> None:
    """Each kvpool row's total against the hash floor of its algorithm."""
    floors = {name.removeprefix("hash floor ").split(" ")[0]: r for name, r in rows if name.startswith("hash floor")}
    for name, r in rows:
        if name.startswith("hash floor"):
            continue
        for algo, f in floors.items():
            if f" {algo}" in name:
                print(f"{name}: {r['total_ns'] / f['total_ns']:.2f}x its hash floor")


# -- builds: the same benchmark against the pure-Python and the compiled core ----------

#: Where ``--builds compiled`` looks for the compiled core by default, and how to put it there.
COMPILED_PATH = REPO / ".kvpool-compiled"
COMPILE_COMMAND = "KVPOOL_COMPILE=1 pip install --no-deps --no-build-isolation --target .kvpool-compiled ."


def add_build_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--builds",
        default="pure",
        help="kvpool builds to run side by side, comma-separated: pure (src/), compiled (--compiled-path)",
    )
    parser.add_argument(
        "--compiled-path",
        default=str(COMPILED_PATH),
        help=f"a directory holding the compiled kvpool package (made by: {COMPILE_COMMAND})",
    )
    parser.add_argument(
        "--clock",
        choices=tuple(CLOCKS),
        default="wall",
        help="long prompts: time phases by elapsed time (wall) or by this thread's CPU time (cpu, for a busy machine)",
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--first-build", action="store_true", help=argparse.SUPPRESS)


def build_paths(args) -> dict[str, str]:
    """``{build: directory that holds its kvpool package}``, checked."""
    paths = {}
    for build in args.builds.split(","):
        if build == "pure":
            paths[build] = str(REPO / "src")
        elif build == "compiled":
            path = Path(args.compiled_path)
            if not any(path.glob("kvpool/*.so")):
                raise SystemExit(f"no compiled kvpool under {path}; from the repository root: {COMPILE_COMMAND}")
            paths[build] = str(path)
        else:
            raise SystemExit(f"--builds takes pure and compiled, got {build!r}")
    return paths


def run_builds(args, one_round) -> dict[str, list[dict]]:
    """``args.repeats`` rounds of ``one_round(first_build)``, each build once per round.

    One build (not a worker's): rounds run in this process. Several: each
    round of each build runs in a worker process that imports that build
    (``KVPOOL_BENCH_PATH``) and prints its results as JSON; names get the
    build in brackets. A worker checks that it imported the build it was
    asked for. Alternating builds within a round spreads a shared machine's
    changing load over both.
    """
    import kvpool

    if args.worker:
        expected = os.environ.get("KVPOOL_BENCH_BUILD", kvpool.BUILD)
        if kvpool.BUILD != expected:
            raise SystemExit(f"worker imported the {kvpool.BUILD} build from {kvpool.__file__}, not {expected}")
        print(json.dumps(one_round(args.first_build)))
        return {}
    paths = build_paths(args)
    runs: dict[str, list[dict]] = {}
    if len(paths) == 1 and next(iter(paths)) == kvpool.BUILD:
        for _ in range(args.repeats):
            for name, result in one_round(True).items():
                runs.setdefault(name, []).append(result)
        return runs
    for _ in range(args.repeats):
        for i, (build, path) in enumerate(paths.items()):
            for label, result in run_worker(sys.argv[1:], build, path, first_build=i == 0).items():
                runs.setdefault(label, []).append(result)
    return runs


def run_worker(argv: list[str], build: str, path: str, first_build: bool) -> dict[str, dict]:
    """One round of this benchmark (``argv``: its arguments) in a process that imports ``build`` from ``path``.

    Results are named as the round names them, kvpool's with ``[build]`` added.
    """
    argv = [a for a in argv if a != "--first-build"]
    cmd = [sys.executable, str(Path(__file__).resolve()), *argv, "--repeats", "1", "--worker"]
    if first_build:
        cmd.append("--first-build")
    env = {**os.environ, "KVPOOL_BENCH_PATH": path, "KVPOOL_BENCH_BUILD": build}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"the {build} worker failed:\n{done.stderr[-3000:]}")
    results = json.loads(done.stdout.strip().splitlines()[-1])
    return {
        (name if name.startswith(("hash floor", "vllm")) else f"{name} [{build}]"): result
        for name, result in results.items()
    }


def same_decisions(args, build: str) -> bool:
    """Whether kvpool's ``build`` makes, on ``args.workload``'s mix, the decisions the pure build makes (in a worker)."""
    path = build_paths(args)[build]
    code = (
        "import sys, json; sys.path.insert(0, sys.argv[1]); sys.path.insert(1, sys.argv[2]);"
        "import bench_manager as b;"
        "t = b.replay(b.KVPoolAdapter(b.PRODUCTION_BLOCKS), b.make_workload(int(sys.argv[3]), int(sys.argv[4]),"
        " **b.MIXES[sys.argv[5]]), record=True, max_running=b.PRODUCTION_RUNNING);"
        "print(json.dumps(t.decisions))"
    )
    here = str(Path(__file__).resolve().parent)
    decisions = []
    for p in (str(REPO / "src"), path):
        env = {**os.environ, "KVPOOL_BENCH_PATH": p}
        done = subprocess.run(
            [sys.executable, "-c", code, p, here, str(args.requests), str(args.seed), args.workload],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
        decisions.append(done.stdout.strip().splitlines()[-1])
    return decisions[0] == decisions[1]


def median_runs(runs: list[dict]) -> dict:
    """Per-phase medians over runs of ``replay_long_prompts``-shaped results."""
    out = dict(runs[0])
    out["ns"] = {k: statistics.median(r["ns"][k] for r in runs) for k in runs[0]["ns"]}
    totals = sorted(sum(r["ns"].values()) for r in runs)
    out["total_ns"] = statistics.median(totals)
    out["spread_ns"] = (totals[0], totals[-1])
    return out


def print_phase_table(rows: list[tuple[str, dict]]) -> None:
    """One row per system: seconds per phase, us per request, hit rate."""
    width = max(len(name) for name, _ in rows) + 2
    print(f"{'':{width}}{'phase s (median of runs)':>52}{'us/request':>12}{'hit rate':>10}{'spread s':>16}")
    for name, r in rows:
        n = r["requests"]
        phases = "  ".join(f"{k} {v / 1e9:.3f}" for k, v in r["ns"].items())
        lo, hi = r["spread_ns"]
        print(
            f"{name:{width}}{phases:>52}{r['total_ns'] / 1e3 / n:>12.1f}{r['hits'] / r['tokens']:>10.4f}{f'{lo / 1e9:.2f}..{hi / 1e9:.2f}':>16}"
        )


def run_long_prompts(args) -> None:
    prompts = load_long_prompts(Path(args.trace), args.requests)
    num_tokens = sum(len(p) for p in prompts)
    print(
        f"\n== long prompts: first {len(prompts):,} requests of {Path(args.trace).name} "
        f"({num_tokens / len(prompts):,.0f} prompt tokens each on average), one at a time through "
        f"{LONG_PROMPT_CACHE_TOKENS:,} tokens ({LONG_PROMPT_CACHE_TOKENS // BLOCK_SIZE:,} blocks of {BLOCK_SIZE}); "
        f"medians of {args.repeats} runs"
    )

    def one_round(first_build: bool) -> dict[str, dict]:
        return long_prompt_round(prompts, floor=first_build)

    runs = run_builds(args, one_round)
    if args.worker:
        return
    rows = [(name, median_runs(results)) for name, results in runs.items()]
    rows.sort(key=lambda row: row[0].startswith("hash floor"))  # the floors last
    print_phase_table(rows)
    print_floor_ratios(rows)
    if args.profile:
        profile(lambda: replay_long_prompts(prompts, "kvpool_sha256"), args.profile)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", choices=("default", *MIXES, "long-prompts"), default="default")
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=3, help="runs per configuration; medians are reported")
    parser.add_argument("--vs-vllm", action="store_true", help="also run vLLM's manager and compare decisions")
    parser.add_argument(
        "--fast-hash", action="store_true", help="production: also run kvpool with xxh3_128 (verified hits)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--trace", default=str(DEFAULT_TRACE), help="Mooncake trace for --workload long-prompts")
    parser.add_argument(
        "--profile", type=int, default=0, metavar="N", help="also profile one kvpool run; print the top N functions"
    )
    add_build_arguments(parser)
    args = parser.parse_args()
    use_clock(args.clock)
    if args.builds != "pure" and args.workload == "default":
        parser.error("--builds applies to the production, prefill-heavy and long-prompts workloads")
    if args.workload in MIXES:
        return run_production(args)
    if args.workload == "long-prompts":
        if args.vs_vllm:
            parser.error("--vs-vllm applies to the default and production workloads")
        return run_long_prompts(args)
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
