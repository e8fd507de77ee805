"""kvpool beside SGLang's radix cache on long prompts (the Mooncake conversation trace).

The replay of ``bench_manager.py --workload long-prompts``: the first 2,000
requests of ``conversation_trace.jsonl`` (about 13,700 prompt tokens each),
expanded to tokens as ``kvpool.sim.traces`` does (hash ID ``h`` at offset
``j`` is token ``h * 512 + j``), one request at a time, prefill only, through
a cache of 512,000 tokens. The same request sequence goes through:

* kvpool with SHA-256 and with xxh3_128 (16-token blocks; 32,000 blocks plus
  the reserved null block): ``hash_request`` (hash), ``get_computed_blocks``
  (lookup), ``allocate_slots`` (allocate: evicts cached blocks when the free
  list reaches them, and caches every newly full block), then ``free``.
* SGLang 0.5.23's ``RadixCache`` at page size 1 and 16, over its own
  allocator on a CPU tensor pool (``TokenToKVPoolAllocator`` for page 1,
  ``PagedTokenToKVPoolAllocator`` for page 16; ``size=512,000``,
  ``device="cpu"``, ``need_sort=False`` as in a non-disaggregated server; slot
  0 is SGLang's padding slot, so 512,000 slots are usable on both sides).
  Per request, what its scheduler does for a prefill:

  - match: ``match_prefix`` on a ``RadixKey`` of the prompt with
    ``limit = len - 1`` (SGLang never matches the last token, as kvpool
    never hits on it), ``lock`` the matched node (``inc_lock_ref``) and read
    the prefix's slot indices (``path_device_indices``);
  - allocate: SGLang's own ``alloc_token_slots`` (page 1) or
    ``alloc_paged_token_slots_extend`` (page 16), which evict from the tree
    when the allocator runs short;
  - insert: ``insert`` of the page-aligned prompt with its slot indices, then
    ``free_segment`` of the slots the tree already held (as its
    ``_insert_cache`` does);
  - release: ``free_segment`` of the unaligned tail (page 16) and ``unlock``
    (``dec_lock_ref``).

  What is left out on SGLang's side: the request-to-token table (a device
  tensor write), the scheduler's batch tensors, and the second
  ``match_prefix`` with a lock swap that its ``checkpoint`` does on release;
  leaving them out only makes SGLang's figures lower.

What differs between the two: kvpool hashes each 16-token block once (the
"hash" phase) and then works on block hashes; SGLang compares token arrays
while it walks the tree and hashes nothing. kvpool caches blocks inside
``allocate_slots``; SGLang inserts after the prefill. At page size 1 SGLang
also caches the partial last 16 tokens, so its hit rate may be a little
higher; at page size 16 the cacheable units are the same as kvpool's, and hit
rates differ only through the eviction order (SGLang evicts the least
recently used leaf of the tree, kvpool its free list in vLLM's order).

Setup (SGLang is never a kvpool dependency; a separate virtual environment)::

    python3 -m venv /work/venv-peers
    /work/venv-peers/bin/pip install torch==2.13.0            # the CPU wheel
    /work/venv-peers/bin/pip install -e ".[test,fast,sim]"
    /work/venv-peers/bin/pip install --no-deps vllm==0.33.0 sglang==0.5.23
    /work/venv-peers/bin/pip install --no-deps orjson dill sentencepiece \\
        <the modules vllm.v1.core imports; see record_vllm_decisions.py>
    /work/venv-peers/bin/python benchmarks/bench_radix.py --repeats 3

Stand-ins: SGLang's ``sglang.srt.mem_cache`` package imports, at module
level, ``triton`` (GPU kernels), ``torchvision`` and ``IPython`` (through its
model configs and utilities), ``sglang.kernels`` (Triton and CUDA kernels)
and ``sglang.srt.layers`` (model layers: quantization, MoE, attention, some of
which ``torch.compile`` at import). None of them runs in this benchmark: the
allocator's device kernels are used only when the platform supports Triton,
which a CPU does not, so the allocators take their pure-torch paths. This
file installs an import hook that answers those five module trees with empty
stand-in modules (every attribute is an inert placeholder class) before
SGLang is imported; no SGLang source is changed or copied. ``sglang.srt.layers``
must be stood in as well as ``triton``: some of its modules call
``torch.compile`` at import, which loads torch's compiler stack, and that
stack finds the stand-in ``triton`` and rejects it. Installing the real
``triton`` wheel instead would work for the import but adds hundreds of MB
that nothing here calls. Torch runs with one intra-op thread (see
``import_sglang``).

Run::

    python benchmarks/bench_radix.py                  # 2,000 requests, 3 runs each
    python benchmarks/bench_radix.py --requests 200 --repeats 1
    python benchmarks/bench_radix.py --no-sglang      # kvpool only (no SGLang installed)
"""

from __future__ import annotations

import argparse
import gc
import importlib.abc
import importlib.machinery
import sys
import types
from array import array
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_manager  # noqa: E402  (its clock, chosen by --clock)
from bench_manager import (  # noqa: E402
    BLOCK_SIZE,
    DEFAULT_TRACE,
    LONG_PROMPT_CACHE_TOKENS,
    add_build_arguments,
    build_paths,
    load_long_prompts,
    median_runs,
    print_floor_ratios,
    print_phase_table,
    replay_long_prompts,
    run_worker,
)

# -- stand-ins for SGLang's GPU-only imports ------------------------------------------

STAND_IN_MODULES = ("triton", "torchvision", "IPython", "sglang.kernels", "sglang.srt.layers")


class _StandInMeta(type):
    """Placeholder classes: any attribute is another placeholder; used as a decorator, a no-op."""

    def __getattr__(cls, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _placeholder(f"{cls.__qualname__}.{name}")

    def __call__(cls, *args, **kwargs):
        if len(args) == 1 and not kwargs and callable(args[0]) and not isinstance(args[0], _StandInMeta):
            return args[0]  # @decorator
        return super().__call__()

    def __getitem__(cls, _key):
        return cls  # kernel[grid] or a subscripted type hint

    def __or__(cls, _other):
        return cls

    __ror__ = __or__


class _StandIn(metaclass=_StandInMeta):
    def __init__(self, *args, **kwargs) -> None:
        pass

    def __call__(self, *args, **kwargs):
        if len(args) == 1 and not kwargs and callable(args[0]):
            return args[0]  # @decorator(...)
        return self

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _placeholder(name)


def _placeholder(name: str) -> type:
    return _StandInMeta(name, (_StandIn,), {"__qualname__": name})


class _StandInModule(types.ModuleType):
    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        value = _placeholder(f"{self.__name__}.{name}")
        setattr(self, name, value)
        return value


class _StandInFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers imports of the stand-in module trees with empty packages."""

    def __init__(self, roots: tuple[str, ...]) -> None:
        self.roots = roots

    def find_spec(self, fullname, path=None, target=None):
        if any(fullname == r or fullname.startswith(r + ".") for r in self.roots):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StandInModule(spec.name)
        module.__path__ = []
        module.__version__ = "0.0.0"  # transformers reads the version of packages it finds
        return module

    def exec_module(self, module) -> None:
        pass


def import_sglang():
    """SGLang's radix cache, allocators and allocation helpers, with the GPU-only imports stood in."""
    if not any(isinstance(f, _StandInFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _StandInFinder(STAND_IN_MODULES))
    import logging

    import torch
    from sglang.srt.mem_cache.allocation import alloc_paged_token_slots_extend, alloc_token_slots
    from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams, MatchPrefixParams
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.common import evict_from_tree_cache
    from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey
    from sglang.srt.platforms import current_platform

    logging.getLogger("sglang").setLevel(logging.ERROR)
    # One intra-op thread: the bookkeeping is sequential, as kvpool's is, and
    # with several threads the small tensor operations here spend most of
    # their time waking a thread pool (100x slower on a busy 2-core machine).
    torch.set_num_threads(1)
    if current_platform.capabilities.supports_triton:
        raise RuntimeError("SGLang reports Triton support: its allocators would call the stood-in kernels")
    return types.SimpleNamespace(
        torch=torch,
        RadixCache=RadixCache,
        RadixKey=RadixKey,
        CacheInitParams=CacheInitParams,
        MatchPrefixParams=MatchPrefixParams,
        InsertParams=InsertParams,
        TokenToKVPoolAllocator=TokenToKVPoolAllocator,
        PagedTokenToKVPoolAllocator=PagedTokenToKVPoolAllocator,
        alloc_token_slots=alloc_token_slots,
        alloc_paged_token_slots_extend=alloc_paged_token_slots_extend,
        evict_from_tree_cache=evict_from_tree_cache,
    )


# -- the SGLang replay ------------------------------------------------------------------

SGLANG_PHASES = ("match", "allocate", "insert", "release")


def replay_sglang(
    sgl, prompts, page_size: int, cache_tokens: int = LONG_PROMPT_CACHE_TOKENS, page_alloc: bool = False
) -> dict:
    """One request at a time through SGLang's RadixCache: match, allocate, insert, release.

    ``prompts`` are ``array('q')`` token IDs (SGLang's own token array type).
    With ``page_alloc`` (page size > 1 only), allocation evicts as
    ``alloc_paged_token_slots_extend`` does and then takes whole pages with
    the allocator's ``alloc``, instead of ``alloc_extend``: the same slots
    (the matched prefix always ends on a page boundary), without the CPU
    fallback of the Triton kernel that ``alloc_extend`` launches on a GPU.
    Returns nanoseconds per phase (summed), matched tokens and prompt tokens.
    """
    torch = sgl.torch
    if page_size == 1:
        allocator = sgl.TokenToKVPoolAllocator(cache_tokens, torch.int64, "cpu", None, False)
    else:
        allocator = sgl.PagedTokenToKVPoolAllocator(cache_tokens, page_size, torch.int64, "cpu", None, False)
    tree = sgl.RadixCache(
        sgl.CacheInitParams(
            disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=allocator, page_size=page_size
        )
    )
    RadixKey, MatchPrefixParams, InsertParams = sgl.RadixKey, sgl.MatchPrefixParams, sgl.InsertParams
    alloc_token_slots, alloc_paged = sgl.alloc_token_slots, sgl.alloc_paged_token_slots_extend
    evict_from_tree_cache = sgl.evict_from_tree_cache
    clock = bench_manager.clock_ns
    ns = dict.fromkeys(SGLANG_PHASES, 0)
    hits = tokens = 0
    no_prefix = torch.full((1,), -1, dtype=torch.int64)
    for prompt in prompts:
        n = len(prompt)
        t0 = clock()
        # match: the longest cached prefix, never the last token; lock it while the request runs
        match = tree.match_prefix(MatchPrefixParams(key=RadixKey(prompt, limit=n - 1)))
        prefix_len = match.device_prefix_len
        node = match.last_device_node
        lock = tree.lock(node)
        prefix = tree.path_device_indices(node)[:prefix_len]
        t1 = clock()
        # allocate the uncached tokens, evicting from the tree when short
        if page_size == 1:
            new = alloc_token_slots(tree, n - prefix_len)
        elif page_alloc:
            pages = -(-(n - prefix_len) // page_size)
            evict_from_tree_cache(tree, n - prefix_len + page_size)  # alloc_paged_token_slots_extend's demand
            new = allocator.alloc(pages * page_size)[: n - prefix_len]
        else:
            lens_prefix = torch.tensor([prefix_len], dtype=torch.int64)
            lens_seq = torch.tensor([n], dtype=torch.int64)
            last_loc = prefix[-1:] if prefix_len else no_prefix
            new = alloc_paged(tree, lens_prefix, lens_prefix, lens_seq, lens_seq, last_loc, n - prefix_len)
        row = torch.cat((prefix, new))
        t2 = clock()
        # (the prefill runs here) insert the page-aligned prompt; free the slots the tree already had
        aligned = n // page_size * page_size
        result = tree.insert(InsertParams(key=RadixKey(prompt[:aligned]), value=row[:aligned].clone()))
        if result.prefix_len > prefix_len:
            allocator.free_segment(row[prefix_len : result.prefix_len], start_pos=prefix_len)
        t3 = clock()
        # release: the unaligned tail goes back, the lock is dropped
        if aligned < n:
            allocator.free_segment(row[aligned:n], start_pos=aligned)
        tree.unlock(lock)
        t4 = clock()
        ns["match"] += t1 - t0
        ns["allocate"] += t2 - t1
        ns["insert"] += t3 - t2
        ns["release"] += t4 - t3
        hits += prefix_len
        tokens += n
    expected = cache_tokens - tree.evictable_size()
    if allocator.available_size() != expected or tree.protected_size() != 0:
        raise RuntimeError(
            f"SGLang bookkeeping off after the replay: {allocator.available_size()} free slots, "
            f"{tree.evictable_size()} cached, {tree.protected_size()} locked"
        )
    return {"ns": ns, "hits": hits, "tokens": tokens, "requests": len(prompts)}


# -- main ------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", default=str(DEFAULT_TRACE), help="Mooncake JSON Lines trace")
    parser.add_argument("--requests", type=int, default=2000, help="replay the first N requests")
    parser.add_argument("--repeats", type=int, default=3, help="runs per system; medians are reported")
    parser.add_argument("--page-sizes", default="1,16", help="SGLang page sizes, comma-separated")
    parser.add_argument("--no-sglang", action="store_true", help="kvpool only")
    parser.add_argument("--no-xxh3", action="store_true", help="skip kvpool with xxh3_128")
    add_build_arguments(parser)
    args = parser.parse_args()
    bench_manager.use_clock(args.clock)
    paths = build_paths(args)

    prompts = load_long_prompts(Path(args.trace), args.requests)
    num_tokens = sum(len(p) for p in prompts)
    print(
        f"== {len(prompts):,} requests of {Path(args.trace).name} ({num_tokens / len(prompts):,.0f} prompt "
        f"tokens each on average), one at a time, prefill only, through {LONG_PROMPT_CACHE_TOKENS:,} tokens "
        f"of cache; medians of {args.repeats} runs"
    )
    # Every system once per round, rounds repeated: on a shared machine, load
    # that comes and goes then hits every system alike.
    systems = [
        (f"kvpool {algo} (block {BLOCK_SIZE})", lambda algo=algo: replay_long_prompts(prompts, algo))
        for algo in ("kvpool_sha256",) + (() if args.no_xxh3 else ("xxh3_128",))
    ]
    # With --builds, kvpool runs in worker processes of bench_manager.py (one per build
    # per round; each also measures the hash floor once), SGLang in this one.
    by_builds = args.builds != "pure"
    worker_argv = ["--workload", "long-prompts", "--requests", str(args.requests), "--trace", args.trace]
    worker_argv += ["--clock", args.clock]
    if by_builds:
        systems = []
    if not args.no_sglang:
        sgl = import_sglang()
        import sglang

        q_prompts = [array("q", p) for p in prompts]  # SGLang keeps token IDs as array('q')
        for page_size in (int(p) for p in args.page_sizes.split(",")):
            for page_alloc in (False, True) if page_size > 1 else (False,):
                label = f"SGLang {sglang.__version__} page {page_size}" + (" (alloc)" if page_alloc else "")
                systems.append(
                    (label, lambda ps=page_size, pa=page_alloc: replay_sglang(sgl, q_prompts, ps, page_alloc=pa))
                )
    runs: dict[str, list[dict]] = {}
    for _ in range(args.repeats):
        if by_builds:
            for i, (build, path) in enumerate(paths.items()):
                for name, result in run_worker(worker_argv, build, path, first_build=i == 0).items():
                    runs.setdefault(name, []).append(result)
        for name, run in systems:
            gc.collect()
            runs.setdefault(name, []).append(run())
    rows = [(name, median_runs(results)) for name, results in runs.items()]
    print_phase_table(rows)
    print_floor_ratios(rows)
    base = rows[0][1]["total_ns"]
    for name, r in rows[1:]:
        print(f"{name}: {r['total_ns'] / base:.2f}x the time of {rows[0][0]}")


if __name__ == "__main__":
    main()
