"""What each block hash costs: kvpool's chains beside vLLM's algorithms, measured side by side in one run.

    python benchmarks/bench_hashes.py [--tokens 8192] [--repeats 15] [--vs-vllm]

Per algorithm: hashing a whole prompt (``BlockHasher.hash_token_ids``, plain
and with a cache salt and a LoRA adapter) and appending output tokens one at a
time to a bound request (each 16th token fills a block and hashes it), in
microseconds per token, medians of ``--repeats`` runs, and the ratio to
kvpool's default ``kvpool_sha256``. ``--vs-vllm`` (with vLLM importable, e.g.
``/work/venv-vllm/bin/python``) adds vLLM's own request block hasher for the
same prompt, interleaved with kvpool's runs. Times are CPU time
(``time.process_time``): on a shared, oversubscribed machine the wall clock
also counts the time other processes hold the core.
"""

from __future__ import annotations

import argparse
import importlib.util
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from kvpool import BlockHasher, HashAlgo, KVCacheManager, Request  # noqa: E402

BLOCK = 16


def one_run(algo: str, hasher: BlockHasher, prompt: list[int]) -> dict[str, float]:
    """Seconds for: the whole prompt; the prompt with a salt and a LoRA; appending its second half token by token."""
    start = time.process_time()
    hasher.hash_token_ids(prompt)
    plain = time.process_time() - start
    start = time.process_time()
    hasher.hash_token_ids(prompt, cache_salt="tenant-a", lora_name="adapter")
    keyed = time.process_time() - start
    half = len(prompt) // 2
    request = Request("r", prompt[:half])
    KVCacheManager(4, BLOCK, hash_algo=algo).hash_request(request)
    append = request.append_output_token_ids
    start = time.process_time()
    for token in prompt[half:]:
        append(token)
    return {"prompt": plain, "keyed": keyed, "append": time.process_time() - start}


def vllm_hasher(algo: str, prompt: list[int]) -> Callable[[], None]:
    """One run of vLLM's own request block hasher over the prompt (vLLM's seed rule: its fixed default)."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.request import Request as VllmRequest

    fn = get_hash_fn_by_name(algo)
    block_hasher = kv_cache_utils.get_request_block_hasher(BLOCK, fn)

    def run() -> None:
        kv_cache_utils.init_none_hash(fn)  # NONE_HASH is global there: set it for this algorithm
        VllmRequest("r", prompt, SamplingParams(max_tokens=1), None, block_hasher=block_hasher)

    return run


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
    theirs = {algo: vllm_hasher(algo, prompt) for algo in ("sha256", "sha256_cbor")} if args.vs_vllm else {}
    runs: dict[str, list[dict[str, float]]] = {algo: [] for algo in algos}
    vllm_runs: dict[str, list[float]] = {algo: [] for algo in theirs}
    for r in range(args.repeats):  # interleaved, so that the machine's noise falls on every algorithm alike
        print(f"run {r + 1}/{args.repeats}", file=sys.stderr)
        for algo in algos:
            runs[algo].append(one_run(algo, hashers[algo], prompt))
        for algo, run in theirs.items():
            start = time.process_time()
            run()
            vllm_runs[algo].append(time.process_time() - start)
    per_token = {"prompt": args.tokens, "keyed": args.tokens, "append": args.tokens - args.tokens // 2}
    results = {
        algo: {k: statistics.median(run[k] for run in rs) / n * 1e6 for k, n in per_token.items()}
        for algo, rs in runs.items()
    }
    vllm = {algo: statistics.median(ts) / args.tokens * 1e6 for algo, ts in vllm_runs.items()}
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
