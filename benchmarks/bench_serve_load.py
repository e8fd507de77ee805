"""Load on a live ``kvpool serve``: many concurrent streaming ``openai`` clients, some leaving mid-stream.

Each client loops until the run's time is up (or, with ``--requests``, until
it has been served that many requests): it picks one of a few shared
prefixes (a long "document" of a given length) and appends a question of its
own, so prompts share prefixes and differ in length; it streams the answer
with usage, and one request in ``--disconnect`` (a fraction) closes its stream
after a few tokens. A 429 (the server's waiting queue is full) is a designed
refusal: the client waits ``Retry-After`` and sends the same request again.
Any other error is a failure. Answers ignore EOS, so a planned disconnect
always happens.

After the run, once nothing runs, the server's ``/health?verbose=1`` must
report no block owned by any request and the pool's invariants intact.
Reported: requests, output tokens per second, time to first token
percentiles, the prefix cache's hit rate (from ``/metrics``) and the share of
prompt tokens the clients saw as cached.

    python benchmarks/bench_serve_load.py --clients 32 --duration 60
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_timing_leak import MODEL, serving  # noqa: E402

_WORDS = (
    "cache block token prefix request tenant server stream batch layer model memory page table hash queue "
    "router replica metric latency budget chunk decode prefill evict store load admit abort"
).split()


@dataclass
class Tally:
    started: int = 0
    completed: int = 0
    disconnected: int = 0
    rejected_429: int = 0
    failures: list[str] = field(default_factory=list)
    ttfts: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0


def _prefixes(rng: random.Random, lengths: Sequence[int]) -> list[str]:
    return [f"Document {i}: " + " ".join(rng.choice(_WORDS) for _ in range(n)) for i, n in enumerate(lengths)]


@dataclass(frozen=True, slots=True)
class Stop:
    """When a client stops: after ``requests`` served requests, or at ``deadline`` (monotonic seconds)."""

    requests: int | None = None
    deadline: float | None = None

    def reached(self, served: int) -> bool:
        if self.requests is not None:
            return served >= self.requests
        assert self.deadline is not None
        return time.monotonic() >= self.deadline


@dataclass(frozen=True, slots=True)
class Ask:
    """One request a client will make: its prompt, its length, and when (if ever) it leaves mid-stream."""

    prompt: str
    max_tokens: int
    leave_after: int | None  # tokens read before the client closes its stream; None: reads to the end


def _ask(rng: random.Random, prefixes: list[str], disconnect: float) -> Ask:
    prefix = rng.choice(prefixes)
    question = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(3, 40)))
    leave_after = rng.randint(1, 6) if rng.random() < disconnect else None
    return Ask(f"{prefix}\nQuestion: {question}\nAnswer:", rng.randint(8, 48), leave_after)


async def _client(
    client: Any,
    rng: random.Random,
    prefixes: list[str],
    stop: Stop,
    disconnect: float,
    tally: Tally,
) -> None:
    """Send requests until ``stop`` says so; a request refused with 429 is sent again after ``Retry-After``."""
    import openai

    served = 0
    ask = _ask(rng, prefixes, disconnect)
    while not stop.reached(served):
        tally.started += 1
        start = time.perf_counter()
        try:
            stream = await client.completions.create(
                model=MODEL,
                prompt=ask.prompt,
                max_tokens=ask.max_tokens,
                temperature=0.7,
                stream=True,
                stream_options={"include_usage": True},
                # Every answer runs to max_tokens (>= 8 > any leave_after): a planned disconnect always happens.
                extra_body={"ignore_eos": True},
            )
            tokens = 0
            first = None
            async for chunk in stream:
                if chunk.choices:
                    if first is None:
                        first = time.perf_counter() - start
                    tokens += 1
                    if ask.leave_after is not None and tokens >= ask.leave_after:
                        break
                if chunk.usage is not None:
                    tally.output_tokens += chunk.usage.completion_tokens
                    tally.prompt_tokens += chunk.usage.prompt_tokens
                    details = chunk.usage.prompt_tokens_details
                    tally.cached_tokens += (details.cached_tokens or 0) if details is not None else 0
            await stream.close()
            if first is not None:
                tally.ttfts.append(first)
            if ask.leave_after is not None and tokens >= ask.leave_after:
                tally.disconnected += 1
            else:
                tally.completed += 1
        except openai.RateLimitError as exc:
            tally.rejected_429 += 1
            await asyncio.sleep(float(exc.response.headers.get("retry-after", "1")))
            continue  # the same request again
        except Exception as exc:  # everything else is a failure of the server
            tally.failures.append(f"{type(exc).__name__}: {exc}")
        served += 1
        ask = _ask(rng, prefixes, disconnect)


async def _drive(url: str, clients: int, stop: Stop, disconnect: float, seed: int) -> Tally:
    import httpx
    import openai

    rng = random.Random(seed)
    prefixes = _prefixes(rng, (40, 120, 250, 400))
    tally = Tally()
    limits = httpx.Limits(max_connections=clients * 2, max_keepalive_connections=clients)
    async with httpx.AsyncClient(limits=limits, timeout=300) as http:
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, http_client=http)
        ticker = asyncio.ensure_future(_progress(tally, stop))
        await asyncio.gather(
            *(
                _client(client, random.Random(seed * 1000 + i), prefixes, stop, disconnect, tally)
                for i in range(clients)
            )
        )
        ticker.cancel()
    return tally


async def _progress(tally: Tally, stop: Stop, every: float = 10.0) -> None:
    while True:
        await asyncio.sleep(every)
        left = "" if stop.deadline is None else f"; {max(0.0, stop.deadline - time.monotonic()):.0f} s of load left"
        print(
            f"  {tally.completed} completed, {tally.disconnected} left, {tally.rejected_429} refused (429), "
            f"{len(tally.failures)} failed{left}",
            file=sys.stderr,
            flush=True,
        )


def _percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _metric(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


def settle(url: str, timeout: float = 120.0) -> dict[str, Any]:
    """``/health?verbose=1`` once nothing runs or waits."""
    import httpx

    deadline = time.monotonic() + timeout
    while True:
        health: dict[str, Any] = httpx.get(f"{url}/health", params={"verbose": "1"}, timeout=30).json()
        if health["running"] == 0 and health["waiting"] == 0:
            return health
        if time.monotonic() > deadline:
            raise RuntimeError(f"requests still running {timeout:.0f} s after the load: {health}")
        time.sleep(0.2)


def run(
    url: str,
    clients: int,
    duration: float | None,
    disconnect: float,
    seed: int,
    *,
    requests: int | None = None,
) -> dict[str, Any]:
    """Load ``url`` with ``clients`` clients for ``duration`` seconds, or for ``requests`` served requests each.

    A count of requests makes the run the same work however busy the machine is (tests use it);
    a duration makes it the same time (the benchmark's default).
    """
    import httpx

    if (duration is None) == (requests is None):
        raise ValueError(f"give a duration or a request count, not both or neither: {duration!r}, {requests!r}")
    began = time.monotonic()
    stop = Stop(requests=requests, deadline=None if duration is None else began + duration)
    tally = asyncio.run(_drive(url, clients, stop, disconnect, seed))
    elapsed = time.monotonic() - began
    health = settle(url)
    metrics = httpx.get(f"{url}/metrics", timeout=30).text
    queries = _metric(metrics, "vllm:prefix_cache_queries_total")
    hits = _metric(metrics, "vllm:prefix_cache_hits_total")
    return {
        "clients": clients,
        "seconds": elapsed,
        "requests": tally.started,
        "completed": tally.completed,
        "disconnected": tally.disconnected,
        "rejected_429": tally.rejected_429,
        "failures": tally.failures,
        "output_tokens_per_s": tally.output_tokens / elapsed,
        "requests_per_s": (tally.completed + tally.disconnected) / elapsed,
        "ttft_p50_ms": 1000 * _percentile(tally.ttfts, 0.5),
        "ttft_p90_ms": 1000 * _percentile(tally.ttfts, 0.9),
        "ttft_p99_ms": 1000 * _percentile(tally.ttfts, 0.99),
        "prefix_hit_rate": hits / queries if queries else 0.0,
        "usage_cached_share": tally.cached_tokens / tally.prompt_tokens if tally.prompt_tokens else 0.0,
        "blocks_owned_after": health["blocks_owned"],
        "invariants_after": health["invariants"],
    }


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--duration", type=float, default=None, help="seconds of load [60 unless --requests]")
    parser.add_argument("--requests", type=int, default=None, help="served requests per client, instead of a duration")
    parser.add_argument("--disconnect", type=float, default=0.15, help="fraction of requests that leave mid-stream")
    parser.add_argument("--max-waiting", type=int, default=24, help="the server's waiting queue (429 beyond it)")
    parser.add_argument("--kv-cache-memory", default="256MiB")
    parser.add_argument("--threads", type=int, default=None, help="the server's torch threads [torch's default]")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    flags = [
        "--max-waiting",
        str(args.max_waiting),
        "--kv-cache-memory",
        args.kv_cache_memory,
        "--max-model-len",
        "1024",
    ]
    duration = None if args.requests is not None else (60.0 if args.duration is None else args.duration)
    span = f"{args.requests} requests each" if duration is None else f"{duration:.0f} s"
    print(f"starting kvpool serve; then {args.clients} clients for {span}", file=sys.stderr, flush=True)
    with serving(flags, args.threads) as server:
        result = run(server.url, args.clients, duration, args.disconnect, args.seed, requests=args.requests)
    for name, value in result.items():
        if name != "failures":
            print(f"{name:>22}: {value:.3f}" if isinstance(value, float) else f"{name:>22}: {value}")
    print(f"{'failures':>22}: {len(result['failures'])}")
    for failure in result["failures"][:10]:
        print(f"    {failure}")
    ok = not result["failures"] and result["blocks_owned_after"] == 0 and result["invariants_after"] == "ok"
    print("PASS" if ok else "FAIL")
    if not ok:
        sys.exit(1)
    return result


if __name__ == "__main__":
    main()
