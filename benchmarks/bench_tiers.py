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

Redis: ``--redis URL``, or else a private ``redis-server`` on a free loopback
port (killed at the end). Medians of ``--repeats`` (3), on ``--threads`` (1)
torch threads. Run::

    python benchmarks/bench_tiers.py
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
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402

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
    vocab = engine.runner.vocab_size
    prompt = [(i * 7919 + 13) % (vocab - 200) + 100 for i in range(prompt_tokens)]
    params = SamplingParams(max_tokens=1)
    computed, loaded, tokens = [], [], []
    for rep in range(repeats):
        salt = f"{tier}-{rep}-{time.time_ns()}"
        for times in (computed, loaded):
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--blocks", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=1500)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--redis", default=None, help="a Redis URL [default: start a private redis-server]")
    parser.add_argument("--tiers", default=",".join(TIERS))
    parser.add_argument("--skip-ttft", action="store_true")
    parser.add_argument("--processes", action="store_true", help="also: two kvpool generate processes, one Redis")
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
