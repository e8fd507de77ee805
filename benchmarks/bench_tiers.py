"""KV tiers through the engine: load and save throughput per tier, and time to first token against recompute.

Two measurements, SmolLM2-135M-Instruct's KV layout (30 layers, 3 KV heads of
64, block size 16; float32 on the CPU: 720 KiB per block):

* Throughput (GB/s of KV): :class:`kvpool.engine.kv_transfer.KVTransferWorker`
  saving ``--blocks`` (64) blocks from the engine's KV cache into each tier,
  then loading them back into other blocks, end to end: the tensor copies, and
  for disk and Redis the serialisation, the entry (checksum) and the store.
* Time to first token of one ``--prompt-tokens`` (1,500) token prompt on the
  real model, side by side in one engine per tier: computed (the first run,
  which also saves it), then loaded from the tier after the pool's prefix
  cache is emptied (``reset_prefix_cache``), which is what a replica that
  never saw the prompt, or a pool that evicted it, gets. Each repetition uses
  a new cache salt, so no run finds another's blocks.

* Two separate ``kvpool generate --json`` processes sharing one Redis
  (``--processes``): the first computes a ~1,500-token prompt (and saves it),
  the second, started afterwards, loads it; their time to first token and
  the second one's tokens from Redis, as each process reports them.

* ``--sweep``: time to first token over prompt sizes (``--sizes``: 256, 1k, 4k and 16k tokens,
  each capped at the model's context, ``max_position_embeddings`` (8,192 for SmolLM2-135M), less
  the one token generated) for each tier of ``--sweep-tiers``: ``cpu``, ``disk``, ``redis``, and
  ``redis-50ms`` and ``redis-trickle``, the same Redis behind ``benchmarks/throttled_redis.py``
  (``--delay-ms`` (50) per reply; ``--trickle-bytes`` (4,096) every ``--trickle-pause-ms`` (1)).
  Each size and repetition takes a new cache salt: an engine without tiers computes the prompt
  (the no-tier TTFT), each of cpu, disk and redis computes and saves it in its own engine, then
  loads it after ``reset_prefix_cache``; the throttled engines load what the redis engine saved,
  through their proxy. Interleaved (every engine, then the next size), medians of ``--repeats``;
  a request counts against a tier when its loaded TTFT exceeds the no-tier TTFT of the same size
  and repetition. The throttled tiers stop at ``--throttled-max-tokens`` (4,096) and
  ``--trickle-max-tokens`` (1,024): past them one load takes minutes. Then "other requests":
  a ``--other-loading-tokens`` (1,024) prompt loading from the 50 ms Redis and a
  ``--other-tokens`` (256) prompt of a new salt (in no tier) added right after it, against the
  same two prompts in the engine without tiers: the second one's TTFT in each.

Redis: ``--redis URL``, or else a private ``redis-server`` on a free loopback
port (killed at the end). Medians of ``--repeats`` (3), on ``--threads`` (1)
torch threads. Run::

    python benchmarks/bench_tiers.py
    python benchmarks/bench_tiers.py --sweep
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402
from throttled_redis import Hostility, ThrottledRedis  # noqa: E402  (beside this file)

from kvpool.connector import BlockLoad, BlockSave, ConnectorMetadata  # noqa: E402
from kvpool.engine.kv_cache import KVCacheSpec, allocate_kv_caches  # noqa: E402
from kvpool.engine.kv_transfer import KVTransferWorker  # noqa: E402
from kvpool.tiers.entry import EntryCodec, LayoutFingerprint  # noqa: E402
from kvpool.tiers.store import open_store  # noqa: E402

SMOLLM2 = dict(num_layers=30, num_kv_heads=3, head_dim=64, block_size=16, dtype=torch.float32)
TIERS = ("cpu", "disk", "redis")


@contextmanager
def redis_url(given: str | None) -> Iterator[str]:
    if given:
        yield given
        return
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("no --redis URL and no redis-server on PATH")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as folder:
        args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        args += ["--maxmemory", "2gb", "--maxmemory-policy", "allkeys-lru"]  # the sweep writes gigabytes
        proc = subprocess.Popen([*args, "--dir", folder], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            for _ in range(100):
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                    break
                except OSError:
                    time.sleep(0.05)
            yield f"redis://127.0.0.1:{port}/0"
        finally:
            proc.kill()
            proc.wait()


def tier_spec(tier: str, folder: Path, redis: str, size: str) -> str:
    return {"cpu": f"cpu:{size}", "disk": f"disk:{folder / 'disk'}:{size}", "redis": redis}[tier]


# -- throughput ---------------------------------------------------------------------------


def throughput(tier: str, spec_text: str, blocks: int, repeats: int) -> dict[str, float]:
    """Median GB/s saving ``blocks`` blocks into the tier and loading them back into other blocks."""
    spec = KVCacheSpec(**SMOLLM2)
    caches = allocate_kv_caches(spec, 2 * blocks + 1)
    for k, v in zip(caches.key_caches, caches.value_caches):
        k.normal_()
        v.normal_()
    stores = []
    if tier != "cpu":
        fingerprint = LayoutFingerprint(
            "bench", 30, 3, 64, "float32", 16, "kvpool_sha256", f"bench-{time.time_ns()}", "namespace:bench"
        )
        stores.append(open_store(spec_text, EntryCodec(fingerprint)))
    worker = KVTransferWorker(caches, blocks if tier == "cpu" else 0, stores)
    saves, loads = [], []
    for rep in range(repeats):
        keys = [f"{tier}-{rep}-{i}-{time.time_ns()}".encode() for i in range(blocks)]
        slots = [i + 1 if tier == "cpu" else None for i in range(blocks)]
        meta = ConnectorMetadata(
            loads=tuple(BlockLoad("r", i, blocks + 1 + i, keys[i], tier, slots[i]) for i in range(blocks)),
            saves=tuple(BlockSave("r", 1 + i, keys[i], (tier,), slots[i]) for i in range(blocks)),
        )
        started = time.perf_counter()
        worker.save(meta)
        saves.append(time.perf_counter() - started)
        started = time.perf_counter()
        worker.start_load(meta)
        loads.append(time.perf_counter() - started)
        result = worker.get_finished()
        assert not result.failed_loads, f"{tier}: loads failed {result.failed_loads}"
        for cache in (*caches.key_caches, *caches.value_caches):  # what was loaded is what was saved
            assert torch.equal(cache[1 : blocks + 1], cache[blocks + 1 :])
            cache[blocks + 1 :].zero_()
    worker.close()
    size = blocks * spec.block_bytes
    return {
        "block_bytes": spec.block_bytes,
        "save_gbps": size / statistics.median(saves) / 1e9,
        "load_gbps": size / statistics.median(loads) / 1e9,
    }


# -- time to first token -------------------------------------------------------------------


def ttft(tier: str, spec_text: str, prompt_tokens: int, repeats: int) -> dict[str, float]:
    """Median TTFT computed and loaded from the tier, side by side in one engine; and the tokens loaded."""
    from kvpool.engine.llm_engine import LLMEngine
    from kvpool.engine.sampling import SamplingParams

    # unsigned disk and Redis entries, as the published figures were measured (the checksum path)
    engine = LLMEngine(
        kv_cache_memory="256MiB", max_model_len=prompt_tokens + 64, max_num_batched_tokens=2048,
        kv_tiers=[spec_text], kv_tier_unauthenticated=tier != "cpu", log=lambda line: None,
    )  # fmt: skip
    prompt = bench_prompt(engine.runner.vocab_size, prompt_tokens)
    params = SamplingParams(max_tokens=1)
    computed, loaded, tokens = [], [], []
    for rep in range(repeats):
        salt = f"{tier}-{rep}-{time.time_ns()}"
        for times in (computed, loaded):
            settle(engine)
            engine.manager.reset_prefix_cache()
            rid = engine.add_request(prompt, params, cache_salt=salt)
            out = engine.run_until_done([rid])[rid]
            times.append(out.time_to_first_token)
        tokens.append(out.cached_tokens_by_tier.get(tier, 0))
    engine.kv_tiers.close()  # type: ignore[union-attr]  # built with a tier
    return {
        "computed_s": statistics.median(computed),
        "loaded_s": statistics.median(loaded),
        "speedup": statistics.median(computed) / statistics.median(loaded),
        "tokens_loaded": min(tokens),
    }


def two_processes(redis: str, prompt_tokens: int, threads: int) -> dict[str, float]:
    """Two ``kvpool generate --json`` processes, one after the other, sharing ``redis``."""
    import os

    from transformers import AutoTokenizer

    from kvpool.engine.model_store import resolve_model

    tokenizer = AutoTokenizer.from_pretrained(resolve_model("smollm2-135m"))
    words = [f"w{i * 7919 % 100003}" for i in range(prompt_tokens)]
    while len(tokenizer(" ".join(words))["input_ids"]) > prompt_tokens:
        words.pop()
    text = " ".join(words)
    code = "import sys; from kvpool.cli import main; sys.exit(main())"
    args = ["generate", text, "--raw", "--json", "--max-tokens", "1", "--kv-tier", redis, "--device", "cpu"]
    args += ["--kv-tier-unauthenticated"]  # unsigned entries, as the published figures were measured
    args += ["--max-model-len", str(prompt_tokens + 64), "--cache-salt", f"bench-{time.time_ns()}"]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    records = []
    for _ in range(2):
        done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, check=True)
        records.append(json.loads(done.stdout.splitlines()[-1]))
    first, second = records
    return {
        "prompt_tokens": first["num_prompt_tokens"],
        "first_ttft_s": first["time_to_first_token"],
        "second_ttft_s": second["time_to_first_token"],
        "speedup": first["time_to_first_token"] / second["time_to_first_token"],
        "second_tokens_from_redis": second["cached_tokens_by_tier"]["redis"],
        "first_full_prompt_blocks": first["num_prompt_tokens"] // 16,
    }


# -- time to first token over prompt sizes and tiers (--sweep) -----------------------------

SWEEP_SIZES = (256, 1024, 4096, 16384)
#: Tiers the sweep knows: the byte and host tiers as they are, and the same Redis behind the throttling proxy.
SWEEP_TIERS = ("cpu", "disk", "redis", "redis-50ms", "redis-trickle")
THROTTLED = ("redis-50ms", "redis-trickle")


@dataclass(frozen=True, slots=True, kw_only=True)
class SweepOptions:
    """What the sweep measures; bad values are refused (ValueError naming them)."""

    sizes: tuple[int, ...] = SWEEP_SIZES
    tiers: tuple[str, ...] = SWEEP_TIERS
    repeats: int = 3
    delay_ms: float = 50.0
    trickle_bytes: int = 4096
    trickle_pause_ms: float = 1.0
    throttled_max_tokens: int = 4096
    trickle_max_tokens: int = 1024
    other_loading_tokens: int = 1024
    other_tokens: int = 256
    kv_cache_memory: str = "512MiB"  # one 8k-token request at a time (45 KiB per token), or the two of "other requests"
    model: str | None = None  # the default model

    def __post_init__(self) -> None:
        unknown = [t for t in self.tiers if t not in SWEEP_TIERS]
        if unknown or not self.tiers:
            raise ValueError(f"sweep tiers {list(self.tiers)}: choose from {', '.join(SWEEP_TIERS)}")
        if not self.sizes or any(n < 2 for n in self.sizes):
            raise ValueError(f"sweep sizes must be prompts of 2 tokens or more, got {list(self.sizes)}")
        for name in ("repeats", "throttled_max_tokens", "trickle_max_tokens", "other_loading_tokens", "other_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        for tier in THROTTLED:
            self.hostility(tier)  # the proxy refuses bad figures, naming them

    def max_tokens(self, tier: str) -> int | None:
        """The largest prompt the tier is measured at (None: every size)."""
        return {"redis-50ms": self.throttled_max_tokens, "redis-trickle": self.trickle_max_tokens}.get(tier)

    def hostility(self, tier: str) -> Hostility:
        """What the proxy of a throttled tier does to each reply."""
        if tier == "redis-50ms":
            return Hostility(delay_ms=self.delay_ms)
        return Hostility(trickle=True, trickle_bytes=self.trickle_bytes, trickle_pause_ms=self.trickle_pause_ms)


@dataclass(slots=True)
class SweepCell:
    """One tier at one prompt size: each repetition's TTFTs, in order."""

    no_tier_s: list[float] = field(default_factory=list)
    computed_s: list[float] = field(default_factory=list)  # computed in the tier's own engine (saving it)
    loaded_s: list[float] = field(default_factory=list)
    tokens_loaded: list[int] = field(default_factory=list)

    @property
    def slower(self) -> int:
        """Repetitions whose loaded TTFT exceeded the no-tier TTFT of the same size and repetition."""
        return sum(loaded > base for loaded, base in zip(self.loaded_s, self.no_tier_s))

    def row(self) -> dict[str, Any]:
        median = statistics.median
        out: dict[str, Any] = {
            "no_tier_s": median(self.no_tier_s), "loaded_s": median(self.loaded_s),
            "ratio": median(self.loaded_s) / median(self.no_tier_s), "slower": self.slower,
            "repeats": len(self.loaded_s), "tokens_loaded": min(self.tokens_loaded),
        }  # fmt: skip
        if self.computed_s:
            out["computed_s"] = median(self.computed_s)
        return out


def bench_prompt(vocab: int, tokens: int) -> list[int]:
    """The benchmark's prompt of ``tokens`` token IDs: the same for every tier (the cache salt tells runs apart)."""
    return [(i * 7919 + 13) % (vocab - 200) + 100 for i in range(tokens)]


def model_context(model: str | None) -> int:
    """The model's ``max_position_embeddings``: the longest prompt plus output it was trained for."""
    from kvpool.engine.model_store import resolve_model
    from kvpool.model_names import DEFAULT_MODEL

    config = json.loads((Path(resolve_model(model or DEFAULT_MODEL)) / "config.json").read_text())
    return int(config["max_position_embeddings"])


def capped_sizes(sizes: tuple[int, ...], context: int) -> tuple[int, ...]:
    """Each size, capped at the context less the one token generated; each once, in order."""
    return tuple(dict.fromkeys(min(n, context - 1) for n in sizes))


def settle(engine: Any) -> None:
    """Wait until the engine's disk and Redis saves are written (they are written off the step): a load
    measured right after the compute that saved it would otherwise race its own saves."""
    flush = getattr(engine.kv_tiers, "flush_saves", None)  # None: no tiers, or saves on the step (older code)
    if flush is not None:
        flush(600)


def ttft_of(engine: Any, prompt: list[int], salt: str) -> tuple[float, int, str]:
    """One request's TTFT after the pool's prefix cache is emptied, the tokens it loaded from tiers, and from which."""
    from kvpool.engine.sampling import SamplingParams

    settle(engine)
    engine.manager.reset_prefix_cache()
    rid = engine.add_request(prompt, SamplingParams(max_tokens=1), cache_salt=salt)
    out = engine.run_until_done([rid])[rid]
    by_tier = {k: v for k, v in out.cached_tokens_by_tier.items() if k != "gpu" and v}
    tier = max(by_tier, key=by_tier.__getitem__) if by_tier else "-"
    return float(out.time_to_first_token), sum(by_tier.values()), tier


def pair_ttft(engine: Any, first: tuple[list[int], str], second: tuple[list[int], str]) -> tuple[float, float]:
    """Two requests added one right after the other: each one's TTFT."""
    from kvpool.engine.sampling import SamplingParams

    settle(engine)
    engine.manager.reset_prefix_cache()
    params = SamplingParams(max_tokens=1)
    a = engine.add_request(first[0], params, cache_salt=first[1])
    b = engine.add_request(second[0], params, cache_salt=second[1])
    outs = engine.run_until_done([a, b])
    return float(outs[a].time_to_first_token), float(outs[b].time_to_first_token)


@dataclass(slots=True)
class SweepEngines:
    """The engine without tiers, and one engine per tier (the redis one whenever a throttled tier runs)."""

    base: Any
    tiers: dict[str, Any]
    sizes: tuple[int, ...]
    context: int

    @classmethod
    def open(cls, options: SweepOptions, redis: str, folder: Path, stack: ExitStack) -> SweepEngines:
        """Start the proxies and engines; ``stack`` closes them."""
        from kvpool.engine.llm_engine import LLMEngine
        from kvpool.model_names import DEFAULT_MODEL

        context = model_context(options.model)
        sizes = capped_sizes(options.sizes, context)
        longest = max(max(sizes), options.other_loading_tokens + options.other_tokens)
        common: dict[str, Any] = dict(
            model=options.model or DEFAULT_MODEL, kv_cache_memory=options.kv_cache_memory,
            max_model_len=min(context, longest + 64), max_num_batched_tokens=2048, log=lambda line: None,
        )  # fmt: skip
        specs = {"cpu": "cpu:1GiB", "disk": f"disk:{folder / 'sweep-disk'}:4GiB", "redis": redis}
        throttled = [t for t in options.tiers if t in THROTTLED]
        for t in throttled:
            specs[t] = stack.enter_context(ThrottledRedis(redis, options.hostility(t))).url
        # the throttled tiers load what the redis engine saved: it runs whenever one of them does
        writers = [t for t in ("cpu", "disk", "redis") if t in options.tiers or (t == "redis" and throttled)]
        base = LLMEngine(**common)
        engines = {}
        for t in (*writers, *throttled):
            engines[t] = LLMEngine(**common, kv_tiers=[specs[t]], kv_tier_unauthenticated=t != "cpu")
            stack.callback(engines[t].kv_tiers.close)
        warm_up = bench_prompt(base.runner.vocab_size, 64)
        for engine in (base, *engines.values()):  # a process's first forward passes are slower: not measured
            ttft_of(engine, warm_up, f"warm-up-{time.time_ns()}")
        return cls(base, engines, sizes, context)


def sweep_size(
    engines: SweepEngines, cells: dict[str, SweepCell], n: int, salt: str, options: SweepOptions
) -> list[str]:
    """One repetition at one size, every engine in turn: into ``cells`` (by tier); a progress line per tier."""
    prompt = bench_prompt(engines.base.runner.vocab_size, n)
    no_tier, _, _ = ttft_of(engines.base, prompt, salt)
    lines = []
    for t, engine in engines.tiers.items():
        limit = options.max_tokens(t)
        if limit is not None and n > limit:
            continue
        computed = None if t in THROTTLED else ttft_of(engine, prompt, salt)[0]  # computes it, saves it in the tier
        loaded, tokens, source = ttft_of(engine, prompt, salt)
        cell = cells.get(t)
        if cell is None:
            continue  # the redis engine, run only to save what the throttled tiers load
        cell.no_tier_s.append(no_tier)
        if computed is not None:
            cell.computed_s.append(computed)
        cell.loaded_s.append(loaded)
        cell.tokens_loaded.append(tokens)
        lines.append(f"  {t}: no tier {no_tier:.2f} s, loaded {loaded:.2f} s ({tokens} tokens from {source})")
    return lines


def sweep(
    options: SweepOptions, redis: str, folder: Path, progress: Callable[[str], None] = lambda line: None
) -> dict[str, Any]:
    """The TTFT sweep (see the module docstring): per tier and size, medians and the count of slower loads."""
    with ExitStack() as stack:
        progress("engines: no tier, " + ", ".join(options.tiers))
        engines = SweepEngines.open(options, redis, folder, stack)
        cells = {t: {n: SweepCell() for n in engines.sizes} for t in options.tiers}
        for rep in range(options.repeats):
            for n in engines.sizes:  # interleaved: every engine at this size, then the next size
                progress(f"repetition {rep + 1}/{options.repeats}, {n} tokens")
                at_size = {t: by_size[n] for t, by_size in cells.items()}
                for line in sweep_size(engines, at_size, n, f"sweep-{rep}-{n}-{time.time_ns()}", options):
                    progress(line)
        result: dict[str, Any] = {
            "sizes": list(engines.sizes), "context": engines.context,
            "tiers": {t: {str(n): c.row() for n, c in by_size.items() if c.loaded_s} for t, by_size in cells.items()},
            "slower_requests": sum(c.slower for by_size in cells.values() for c in by_size.values()),
            "requests": sum(len(c.loaded_s) for by_size in cells.values() for c in by_size.values()),
        }  # fmt: skip
        result["deadlines"] = deadline_figures(engines, options.tiers)
        if "redis-50ms" in engines.tiers:
            result["other_request"] = other_requests(engines, options, progress)
        return result


def deadline_figures(engines: SweepEngines, tiers: tuple[str, ...]) -> dict[str, dict[str, int]]:
    """Per tier measured: its loads that ran past their (compute-bounded) deadline, and their blocks kept and not."""
    out: dict[str, dict[str, Any]] = {}
    for t in tiers:
        engine = engines.tiers[t]
        figures = next(iter(engine.kv_tier_figures().values()))  # one tier per engine
        out[t] = {k: int(figures.get(k, 0)) for k in ("deadline_misses", "kept_at_deadline", "timed_out_loads")}
        chooser = engine.kv_tiers.chooser
        if chooser is not None:  # load or compute's decisions and lookups, as /metrics counts them
            decided = chooser.figures()
            out[t]["decisions"] = decided["requests"]
            out[t]["lookups"] = {k: v for k, v in decided["lookups"].items() if k in ("asked", "skipped")}
    return out


def other_requests(engines: SweepEngines, options: SweepOptions, progress: Callable[[str], None]) -> dict[str, Any]:
    """A request of a new salt added right after one that loads from the 50 ms Redis: its TTFT, and with no tier."""
    vocab = engines.base.runner.vocab_size
    loading = bench_prompt(vocab, options.other_loading_tokens)
    other = [t + 1 for t in bench_prompt(vocab, options.other_tokens)]  # another prompt, not only another salt
    with_tier, without, first_with, first_without = [], [], [], []
    for rep in range(options.repeats):
        salt = f"other-{rep}-{time.time_ns()}"
        ttft_of(engines.tiers["redis"], loading, salt)  # saved in Redis, for the 50 ms engine to load
        a, b = pair_ttft(engines.base, (loading, salt + "-a"), (other, salt + "-b"))
        first_without.append(a)
        without.append(b)
        a, b = pair_ttft(engines.tiers["redis-50ms"], (loading, salt), (other, salt + "-c"))
        first_with.append(a)
        with_tier.append(b)
        progress(f"  other request: {without[-1]:.2f} s with no tier, {with_tier[-1]:.2f} s beside a 50 ms load")
    median = statistics.median
    return {
        "loading_tokens": options.other_loading_tokens, "other_tokens": options.other_tokens,
        "other_no_tier_s": median(without), "other_with_tier_s": median(with_tier),
        "ratio": median(with_tier) / median(without),
        "loading_no_tier_s": median(first_without), "loading_with_tier_s": median(first_with),
    }  # fmt: skip


def print_sweep(result: dict[str, Any]) -> None:
    print(f"# sizes {result['sizes']} (context {result['context']}); TTFT medians, ms")
    print(
        "| tier | prompt tokens | no tier | computed in tier engine | loaded | loaded / no tier | slower | tokens loaded |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for tier, by_size in result["tiers"].items():
        for n, r in by_size.items():
            computed = f"{r['computed_s'] * 1000:.0f}" if "computed_s" in r else "-"
            print(
                f"| {tier} | {n} | {r['no_tier_s'] * 1000:.0f} | {computed} | {r['loaded_s'] * 1000:.0f} | "
                f"{r['ratio']:.2f}x | {r['slower']} of {r['repeats']} | {r['tokens_loaded']} |"
            )
    print(f"requests slower with the tier than without: {result['slower_requests']} of {result['requests']}")
    for tier, d in result.get("deadlines", {}).items():
        print(
            f"{tier}: {d['deadline_misses']} loads past their deadline, {d['kept_at_deadline']} blocks taken "
            f"from them, {d['timed_out_loads']} computed instead; decisions {d.get('decisions')}, "
            f"lookups {d.get('lookups')}"
        )
    other = result.get("other_request")
    if other:
        print(
            f"other request ({other['other_tokens']} tokens, new salt) beside a {other['loading_tokens']}-token "
            f"load from the 50 ms Redis: {other['other_with_tier_s'] * 1000:.0f} ms, with no tier "
            f"{other['other_no_tier_s'] * 1000:.0f} ms ({other['ratio']:.2f}x)"
        )
    print(json.dumps({"sweep": result}))


def sweep_options(args: argparse.Namespace) -> SweepOptions:
    """The sweep's options from the command line (ValueError naming a bad one)."""
    try:
        sizes = tuple(int(n) for n in args.sizes.split(",") if n)
    except ValueError:
        raise ValueError(f"--sizes must be token counts separated by commas, got {args.sizes!r}") from None
    return SweepOptions(
        sizes=sizes, tiers=tuple(t for t in args.sweep_tiers.split(",") if t), repeats=args.repeats,
        delay_ms=args.delay_ms, trickle_bytes=args.trickle_bytes, trickle_pause_ms=args.trickle_pause_ms,
        throttled_max_tokens=args.throttled_max_tokens, trickle_max_tokens=args.trickle_max_tokens,
        other_loading_tokens=args.other_loading_tokens, other_tokens=args.other_tokens,
    )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--blocks", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=1500)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--redis", default=None, help="a Redis URL [default: start a private redis-server]")
    parser.add_argument("--tiers", default=",".join(TIERS))
    parser.add_argument("--skip-ttft", action="store_true")
    parser.add_argument("--processes", action="store_true", help="also: two kvpool generate processes, one Redis")
    parser.add_argument("--sweep", action="store_true", help="only the TTFT sweep over sizes and tiers")
    parser.add_argument("--sizes", default=",".join(map(str, SWEEP_SIZES)), help="sweep prompt sizes, tokens")
    parser.add_argument("--sweep-tiers", default=",".join(SWEEP_TIERS))
    parser.add_argument("--delay-ms", type=float, default=50.0, help="redis-50ms: each reply held this long")
    parser.add_argument("--trickle-bytes", type=int, default=4096, help="redis-trickle: bytes per piece")
    parser.add_argument("--trickle-pause-ms", type=float, default=1.0, help="redis-trickle: pause between pieces")
    parser.add_argument("--throttled-max-tokens", type=int, default=4096, help="redis-50ms: largest size")
    parser.add_argument("--trickle-max-tokens", type=int, default=1024, help="redis-trickle: largest size")
    parser.add_argument("--other-loading-tokens", type=int, default=1024)
    parser.add_argument("--other-tokens", type=int, default=256)
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads (1: steadiest on a shared machine, where OpenMP "
        "threads that wait on each other make small copies ten times slower)",
    )  # fmt: skip
    args = parser.parse_args()
    tiers = [t for t in args.tiers.split(",") if t]
    torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    print(f"# {platform.processor() or platform.machine()}, torch {torch.__version__}, {threads} threads", flush=True)
    results: dict[str, dict[str, float]] = {}
    if args.sweep:
        try:
            options = sweep_options(args)
        except ValueError as exc:
            parser.error(str(exc))
        with redis_url(args.redis) as redis, tempfile.TemporaryDirectory() as tmp:
            started = time.perf_counter()
            result = sweep(options, redis, Path(tmp), lambda line: print(line, file=sys.stderr, flush=True))
            result["seconds"] = round(time.perf_counter() - started)
        print_sweep(result)
        return
    with redis_url(args.redis) as redis, tempfile.TemporaryDirectory() as tmp:
        for tier in tiers:
            spec = tier_spec(tier, Path(tmp), redis, "2GiB")
            print(f"{tier}: throughput over {args.blocks} blocks ...", file=sys.stderr, flush=True)
            row = throughput(tier, spec, args.blocks, args.repeats)
            if not args.skip_ttft:
                print(f"{tier}: time to first token, {args.prompt_tokens} tokens ...", file=sys.stderr, flush=True)
                row.update(
                    ttft(tier, tier_spec(tier, Path(tmp) / "ttft", redis, "1GiB"), args.prompt_tokens, args.repeats)
                )
            results[tier] = row
            print(json.dumps({tier: row}), flush=True)
        if args.processes:
            print("two kvpool generate processes sharing Redis ...", file=sys.stderr, flush=True)
            print(json.dumps({"two_processes": two_processes(redis, args.prompt_tokens, args.threads)}), flush=True)
    print()
    print("| tier | save GB/s | load GB/s | TTFT computed | TTFT loaded | speed-up | tokens loaded |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for tier, r in results.items():
        t = (
            f"{r['computed_s'] * 1000:.0f} ms | {r['loaded_s'] * 1000:.0f} ms | {r['speedup']:.1f}x | {r['tokens_loaded']:.0f}"
            if "computed_s" in r
            else "- | - | - | -"
        )
        print(f"| {tier} | {r['save_gbps']:.2f} | {r['load_gbps']:.2f} | {t} |")


if __name__ == "__main__":
    main()
