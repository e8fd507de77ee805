"""What each block hash costs: kvpool's chains beside vLLM's algorithms, measured side by side in one run.

    python benchmarks/bench_hashes.py [--tokens 8192] [--repeats 15] [--vs-vllm]

Per algorithm: hashing a whole prompt (``BlockHasher.hash_token_ids``, plain
and with a cache salt and a LoRA adapter) and appending output tokens one at a
time to a bound request (each 16th token fills a block and hashes it), in
microseconds per token, medians of ``--repeats`` runs, and the ratio to
kvpool's default ``kvpool_sha256``. ``--vs-vllm`` (with vLLM importable, e.g.
``/work/venv-vllm/bin/python``) adds vLLM's own request block hasher for the
same prompt.
"""

from __future__ import annotations

import argparse
import importlib.util
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from kvpool import BlockHasher, HashAlgo, KVCacheManager, Request  # noqa: E402

BLOCK = 16


def one_run(algo: str, hasher: BlockHasher, prompt: list[int]) -> dict[str, float]:
    """Seconds for: the whole prompt; the prompt with a salt and a LoRA; appending its second half token by token."""
    start = time.perf_counter()
    hasher.hash_token_ids(prompt)
    plain = time.perf_counter() - start
    start = time.perf_counter()
    hasher.hash_token_ids(prompt, cache_salt="tenant-a", lora_name="adapter")
    keyed = time.perf_counter() - start
    half = len(prompt) // 2
    request = Request("r", prompt[:half])
    KVCacheManager(4, BLOCK, hash_algo=algo).hash_request(request)
    append = request.append_output_token_ids
    start = time.perf_counter()
    for token in prompt[half:]:
        append(token)
    return {"prompt": plain, "keyed": keyed, "append": time.perf_counter() - start}


def bench_vllm(algo: str, prompt: list[int], repeats: int) -> float:
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.request import Request as VllmRequest

    fn = get_hash_fn_by_name(algo)
    kv_cache_utils.init_none_hash(fn)
    block_hasher = kv_cache_utils.get_request_block_hasher(BLOCK, fn)

    def run() -> None:
        VllmRequest("r", prompt, SamplingParams(max_tokens=1), None, block_hasher=block_hasher)

    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times) / len(prompt) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--vs-vllm", action="store_true")
    args = parser.parse_args()
    rng = random.Random(0)
    prompt = [rng.randrange(0, 150_000) for _ in range(args.tokens)]
    algos = [a.value for a in HashAlgo if a is not HashAlgo.XXH3_128 or importlib.util.find_spec("xxhash")]
    hashers = {algo: BlockHasher(BLOCK, algo) for algo in algos}
    runs: dict[str, list[dict[str, float]]] = {algo: [] for algo in algos}
    for r in range(args.repeats):  # interleaved, so that the machine's noise falls on every algorithm alike
        print(f"run {r + 1}/{args.repeats}", file=sys.stderr)
        for algo in algos:
            runs[algo].append(one_run(algo, hashers[algo], prompt))
    per_token = {"prompt": args.tokens, "keyed": args.tokens, "append": args.tokens - args.tokens // 2}
    results = {
        algo: {k: statistics.median(run[k] for run in rs) / n * 1e6 for k, n in per_token.items()}
        for algo, rs in runs.items()
    }
    vllm = {}
    if args.vs_vllm:
        for algo in ("sha256", "sha256_cbor"):
            print(f"measuring vLLM's {algo} ...", file=sys.stderr)
            vllm[algo] = bench_vllm(algo, prompt, args.repeats)
    base = results[HashAlgo.SHA256.value]
    print(f"{args.tokens} tokens, {BLOCK}-token blocks, medians of {args.repeats} runs, us per token")
    print(
        "| algorithm | prompt | prompt, salt + LoRA | append + hash | prompt vs kvpool_sha256 |"
        + (" vLLM's own, prompt |" if vllm else "")
    )
    print("| --- | ---: | ---: | ---: | ---: |" + (" ---: |" if vllm else ""))
    for algo, r in results.items():
        row = f"| `{algo}` | {r['prompt']:.3f} | {r['keyed']:.3f} | {r['append']:.3f} | {r['prompt'] / base['prompt']:.2f}x |"
        if vllm:
            row += f" {vllm[algo]:.3f} |" if algo in vllm else " |"
        print(row)


if __name__ == "__main__":
    main()
