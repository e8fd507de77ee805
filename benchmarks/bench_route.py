"""The router, measured: its block index (in memory and in Redis), and a live fleet under each routing rule.

``--index``: the cost of one lookup (a prompt of ``--prompt-blocks`` blocks against an index
holding ``--blocks`` blocks on each of ``--replicas`` replicas), median of ``--repeats``, for
the in-memory index and, with ``--redis URL``, for the Redis one, beside Redis' memory per
(block, replica) entry.

``--fleet``: two live ``kvpool serve`` replicas (SmolLM2 on this machine) behind ``kvpool
route``, one router per routing rule, all at once: ``--conversations`` conversations with
distinct long system prompts per rule, ``--turns`` follow-ups each, sent one at a time, the
rules' requests interleaved so that every rule meets the same machine. Each rule's
conversations are its own (the replicas are shared, so no rule reuses another's prefixes).
An odd number of conversations keeps round-robin from landing every follow-up on its
conversation's replica by parity. Reported per rule: the share of prompt tokens the replicas found cached, the
median and 90th percentile latency of a follow-up (``max_tokens`` 4), and how many requests
each replica served.

    python benchmarks/bench_route.py --index --redis redis://127.0.0.1:6379/0
    python benchmarks/bench_route.py --fleet
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from kvpool.router.index import BlockIndex, MemoryIndex, index_from_url


def _chain(seed: int, n: int) -> list[bytes]:
    rng = random.Random(seed)
    return [rng.randbytes(32) for _ in range(n)]


def bench_index(index: BlockIndex, replicas: int, blocks: int, prompt_blocks: int, repeats: int) -> dict[str, Any]:
    names = [f"http://replica-{r}:8000" for r in range(replicas)]
    chains = []
    for r, name in enumerate(names):
        chain = _chain(r, blocks)
        for start in range(0, blocks, 256):  # as BlockStored batches arrive
            index.store(name, chain[start : start + 256])
        chains.append(chain)
    prompt = chains[0][:prompt_blocks]
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        found = index.match(prompt, names)
        times.append(time.perf_counter_ns() - t0)
    assert found[0] == prompt_blocks and not any(found[1:])
    return {"median_us": statistics.median(times) / 1000, "found": found[0]}


def run_index(args: argparse.Namespace) -> None:
    shape = f"{args.replicas} replicas x {args.blocks:,} blocks, a prompt of {args.prompt_blocks} blocks"
    print(f"index lookup ({shape}), median of {args.repeats}:")
    memory = bench_index(MemoryIndex(), args.replicas, args.blocks, args.prompt_blocks, args.repeats)
    print(f"  in memory: {memory['median_us']:.1f} us")
    if args.redis:
        import redis

        client = redis.Redis.from_url(args.redis)
        prefix = f"bench:{os.getpid()}"
        before = int(client.info("memory")["used_memory"])
        shared = bench_index(
            index_from_url(args.redis, prefix=prefix), args.replicas, args.blocks, args.prompt_blocks, args.repeats
        )
        used = int(client.info("memory")["used_memory"]) - before
        print(f"  in Redis:  {shared['median_us']:.1f} us (one script call, loopback)")
        print(f"  Redis memory: {used / (args.replicas * args.blocks):.0f} bytes per (block, replica) entry")
        for key in client.scan_iter(f"{prefix}:*", count=10_000):
            client.delete(key)


# -- the live fleet ----------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _kvpool(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    with open(log, "wb") as out:
        return subprocess.Popen(
            [sys.executable, "-c", "from kvpool.cli import main; main()", *args], stdout=out, stderr=subprocess.STDOUT
        )


def _wait(url: str, ready: Any, what: str, timeout: float = 900) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if ready(httpx.get(url, timeout=2)):
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"timed out waiting for {what}")


def _system(run: int, i: int) -> dict[str, str]:
    topic = f"{run}{i:02d}"
    rules = " ".join(f"Rule {k}: answer questions on topic {topic} in one sentence." for k in range(14))
    return {"role": "system", "content": f"Topic {topic}. You are the guide for topic {topic}. {rules}"}


def run_fleet(args: argparse.Namespace) -> None:
    import httpx

    tmp = Path(tempfile.mkdtemp(prefix="bench-route-"))
    secret = tmp / "secret"
    secret.write_text("the fleet's shared tenant secret")
    processes, urls = [], []
    try:
        for k in range(2):
            port = _free_port()
            events = ["--kv-events-endpoint", f"tcp://*:{_free_port()}"]
            events += ["--kv-events-replay-endpoint", f"tcp://*:{_free_port()}"]
            serve = ["serve", "--port", str(port), "--kv-cache-memory", "256MiB", "--max-model-len", "2048"]
            processes.append(_kvpool(serve + events + ["--tenant-secret-file", str(secret)], tmp / f"replica{k}.log"))
            urls.append(f"http://127.0.0.1:{port}")
        routers = {}
        for rule in args.rules:
            port = _free_port()
            cmd = ["route", "--port", str(port), "--routing", rule, "--tenant-secret-file", str(secret)]
            processes.append(_kvpool(cmd + [a for url in urls for a in ("--replica", url)], tmp / f"router-{rule}.log"))
            routers[rule] = f"http://127.0.0.1:{port}"
        for rule, base in routers.items():
            _wait(
                base + "/health",
                lambda r, rule=rule: r.status_code == 200
                and all(x["up"] for x in r.json()["replicas"])
                and (rule != "prefix" or r.json()["prefix_routing"]),
                f"the {rule} router and its replicas (logs in {tmp})",
            )
        print(
            f"two replicas (SmolLM2, CPU), one router per rule; {args.conversations} conversations x "
            f"{args.turns} follow-ups per rule, the rules' requests interleaved one by one"
        )
        for line in _workload(httpx, routers, args):
            print(line)
    finally:
        for p in processes:
            p.send_signal(signal.SIGTERM)
        for p in processes:
            p.wait(60)


class _Run:
    """One rule's conversations and figures."""

    def __init__(self, base: str, number: int, conversations: int) -> None:
        self.base = base
        self.histories = [[_system(number, i), {"role": "user", "content": "Hello."}] for i in range(conversations)]
        self.prompt = self.cached = 0
        self.latencies: list[float] = []
        self.served: Counter[str] = Counter()

    def send(self, httpx: Any, messages: list[dict[str, str]]) -> float:
        t0 = time.perf_counter()
        body = {"model": "smollm2-135m", "messages": messages, "max_tokens": 4, "temperature": 0}
        reply = httpx.post(self.base + "/v1/chat/completions", json=body, timeout=300)
        elapsed = time.perf_counter() - t0
        reply.raise_for_status()
        usage = reply.json()["usage"]
        self.prompt += usage["prompt_tokens"]
        self.cached += usage["prompt_tokens_details"]["cached_tokens"]
        self.served[reply.headers["x-kvpool-replica"]] += 1
        return elapsed


def _workload(httpx: Any, routers: dict[str, str], args: argparse.Namespace) -> list[str]:
    runs = {rule: _Run(base, n, args.conversations) for n, (rule, base) in enumerate(routers.items())}
    for i in range(args.conversations):
        for run in runs.values():
            run.send(httpx, run.histories[i])
    time.sleep(0.5)  # the replicas' events reach the routers
    for turn in range(args.turns):
        for i in range(args.conversations):
            for run in runs.values():
                history = run.histories[i]
                history += [{"role": "assistant", "content": "Sure."}, {"role": "user", "content": f"And {turn}?"}]
                run.latencies.append(run.send(httpx, history))
    lines = []
    for rule, run in runs.items():
        latencies = sorted(run.latencies)
        p90 = latencies[int(0.9 * (len(latencies) - 1))]
        split = "/".join(str(n) for _, n in sorted(run.served.items()))
        lines.append(
            f"  {rule:>12}: cached {run.cached / run.prompt:6.1%} of {run.prompt} prompt tokens; follow-up latency "
            f"median {statistics.median(latencies) * 1000:.0f} ms, p90 {p90 * 1000:.0f} ms; served {split}"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--index", action="store_true", help="time the block index")
    parser.add_argument("--redis", default=None, help="also time the Redis index on this server")
    parser.add_argument("--replicas", type=int, default=8)
    parser.add_argument("--blocks", type=int, default=50_000)
    parser.add_argument("--prompt-blocks", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=201)
    parser.add_argument("--fleet", action="store_true", help="run the live two-replica fleet")
    parser.add_argument("--rules", nargs="+", default=["prefix", "round-robin"])
    parser.add_argument("--conversations", type=int, default=5)
    parser.add_argument("--turns", type=int, default=3)
    args = parser.parse_args()
    if not (args.index or args.fleet):
        parser.error("say --index, --fleet or both")
    if args.index:
        run_index(args)
    if args.fleet:
        run_fleet(args)


if __name__ == "__main__":
    main()
