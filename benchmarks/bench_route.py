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

``--vllm``: two real vLLM-CPU replicas (``benchmarks/vllm_fleet.py``), each with a KV cache
of ``--num-blocks`` blocks, behind every router at once: ``kvpool route`` precise and
approximate, round-robin (``kvpool route --routing round-robin``), and the routers on PyPI a
user would pick instead, ``vllm-router --policy cache_aware`` and ``sglang-router launch
--policy cache_aware`` (each from its own virtual environment, ``--vllm-router`` /
``--sglang-router``; a router that cannot start is reported with its error, and the others
still run). The routers take turns, one phase each per round, ``--rounds`` rounds with the
order rotated: both replicas' prefix caches are emptied, then ``--conversations``
conversations run at once through that router (``benchmarks/route_workload.py``: shared
system prompts, a history of their own, ``--turns`` turns, streamed with ``include_usage``),
and after ``--wipe-after`` turns one replica loses its whole cache (vLLM's ``POST
/reset_prefix_cache``, as a restart would lose it, without the downtime): replica 1 in the
first round, replica 0 in the second, and so on, so that a router that favours one replica
is neither spared nor hit by it every time. Reported per
router, the median over its rounds: prompt tokens vLLM served from cache, time to first
token p50/p90 over all requests, throughput (requests per second of the phase), and the
requests each replica served (from vLLM's ``/metrics``). ``--precise-load-costs 2 ...`` adds a
precise router per load cost, to weigh the prefix-against-load trade.

    python benchmarks/bench_route.py --index --redis redis://127.0.0.1:6379/0
    python benchmarks/bench_route.py --fleet
    python benchmarks/bench_route.py --vllm --conversations 12 --turns 5 --num-blocks 64 --wipe-after 3 --rounds 2

``--overhead``: the router's own cost per request. A trivial upstream (``--upstream``: a
process that answers every chat request at once, streamed as vLLM streams it, usage last)
is asked directly and through ``kvpool route --routing precise`` (the real model's
tokenizer and chat template, sha256 blocks of 128 tokens) and ``--routing round-robin``
(no tokenizing), ``--requests`` times each, the three interleaved; a ~720-token chat.
Reported: median and p90 time to first byte and to the stream's end, and the router's
median overhead over the direct path.

    python benchmarks/bench_route.py --overhead --requests 400

``--relay-cpu``: the router's CPU per request (user + system, from /proc), streamed and not,
one ``kvpool route --routing round-robin`` per source tree in ``--trees NAME=FOLDER`` (its
``PYTHONPATH`` that checkout's ``src``; an empty folder: this one), all in front of the same
two emulated replicas (``--emulate PROFILE``), started at once; ``--rounds`` rounds of
``--requests`` requests one at a time (a ~7,500-token prompt, distinct per request,
``--max-tokens`` output tokens) to each router in turn. Reported: the median over rounds and
each round's figure. The router's background work (two health checks a second) counts in.

    git worktree add /work/wt-X-base 88e4336
    python benchmarks/bench_route.py --relay-cpu --trees before=/work/wt-X-base after= \\
        --requests 40 --rounds 3 --max-tokens 32
"""

from __future__ import annotations

import argparse
import contextlib
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


def _vllm_system(run: int, i: int) -> dict[str, str]:
    topic = f"{run}{i:02d}"
    return {"role": "system", "content": f"Topic {topic}. " + f"You answer questions on topic {topic} briefly. " * 32}


def _external(cmd: list[str], log: Path) -> tuple[subprocess.Popen[bytes] | None, str]:
    """Start a router from another virtual environment; (None, why) when it cannot start."""
    if not Path(cmd[0]).is_file():
        return None, f"{cmd[0]} is not installed"
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    return proc, ""


def run_vllm(args: argparse.Namespace) -> None:
    import httpx

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import route_workload
    import vllm_fleet

    python, why = vllm_fleet.vllm_python()
    if python is None:
        raise SystemExit(f"no vLLM-CPU: {why}")
    model = vllm_fleet.model_folder()
    tmp = Path(tempfile.mkdtemp(prefix="bench-route-vllm-"))
    replicas = [
        vllm_fleet.VLLMReplica(python, model, tmp, f"vllm-{k}", num_blocks=args.num_blocks, dev_mode=True).start()
        for k in range(2)
    ]
    processes: list[subprocess.Popen[bytes]] = []
    routers: dict[str, str] = {}
    failed: dict[str, str] = {}
    try:
        t0 = time.monotonic()
        for r in replicas:
            r.wait_ready()
        print(f"two vLLM-CPU replicas ready in {time.monotonic() - t0:.0f} s (--enforce-eager; logs in {tmp})")
        specs = [a for r in replicas for a in ("--replica", r.spec)]
        urls = [r.url for r in replicas]
        named = {"precise": "kvpool precise", "approximate": "kvpool approximate", "round-robin": "round-robin"}
        kvpool_routers = [(named.get(rule, f"kvpool {rule}"), rule, 8.0) for rule in args.kvpool_rules]
        kvpool_routers[1:1] = [(f"kvpool precise, load cost {c:g}", "precise", c) for c in args.precise_load_costs]
        for name, routing, load_cost in kvpool_routers:
            port = _free_port()
            cmd = ["route", "--port", str(port), "--routing", routing, "--model", str(model), *specs]
            cmd += ["--load-cost", str(load_cost)]
            processes.append(_kvpool(cmd, tmp / f"router-{routing}-{load_cost:g}.log"))
            routers[name] = f"http://127.0.0.1:{port}"
        for name, cmd in (
            ("vllm-router cache_aware", [args.vllm_router, "--policy", "cache_aware", "--worker-urls", *urls]),
            ("sglang-router cache_aware", [args.sglang_router, "launch", "--policy", "cache_aware", "--worker-urls", *urls]),
        ):  # fmt: skip
            port = _free_port()
            # both default their Prometheus exporter to port 29000: each gets its own
            cmd += ["--prometheus-port", str(_free_port())]
            proc, why = _external([*cmd, "--host", "127.0.0.1", "--port", str(port)], tmp / f"{name.split()[0]}.log")
            if proc is None:
                failed[name] = why
                continue
            processes.append(proc)
            routers[name] = f"http://127.0.0.1:{port}"
        for name, base in list(routers.items()):
            probe = "/health" if name.startswith(("kvpool", "round")) else "/v1/models"
            try:
                _wait(base + probe, lambda r: r.status_code == 200, name, timeout=120)
            except SystemExit as exc:
                log = tmp / (f"{name.split()[0]}.log" if not name.startswith(("kvpool", "round")) else "")
                tail = log.read_text(errors="replace")[-600:] if log.is_file() else ""
                failed[name] = f"{exc}: {tail.strip()}"
                del routers[name]
        for name, base in routers.items():
            if name.startswith("kvpool") and name != "kvpool approximate":  # the rules that read events
                _wait(base + "/health", lambda r: r.json().get("prefix_mode") == "precise", f"{name} mode", 120)
        print(
            f"{len(routers)} routers in front of the same two replicas ({args.num_blocks} blocks of 128 tokens each), "
            f"one phase per router per round, {args.rounds} rounds, the order rotated each round: "
            f"{args.conversations} conversations at once on {args.system_prompts} shared system prompts, "
            f"{args.turns} turns each, max_tokens {args.max_tokens}; one replica's cache wiped after turn "
            f"{args.wipe_after} (replica 1 in odd rounds, replica 0 in even ones); load average before: {os.getloadavg()[0]:.1f}"
        )
        results: dict[str, list[Any]] = {name: [] for name in routers}
        splits: dict[str, list[list[int]]] = {name: [] for name in routers}  # requests per replica, per phase
        names = list(routers)
        loads = []
        for round_ in range(args.rounds):
            for k in range(len(names)):
                name = names[(k + round_) % len(names)]
                for r in replicas:  # every phase starts from empty caches
                    r.reset_cache()
                tag = f"r{round_}p{k}"
                before = [r.counters() for r in replicas]
                result = route_workload.run_phase(
                    routers[name], str(model), tag, conversations=args.conversations, turns=args.turns,
                    system_prompts=args.system_prompts, max_tokens=args.max_tokens, wipe_after=args.wipe_after,
                    on_wipe=replicas[(round_ + 1) % 2].reset_cache,  # 1, then 0: no favourite replica is spared
                )  # fmt: skip
                loads.append(os.getloadavg()[0])
                results[name].append(result)
                after = [r.counters() for r in replicas]
                served = [int(a["requests"] - b["requests"]) for a, b in zip(after, before)]
                preempted = sum(int(a["preemptions"] - b["preemptions"]) for a, b in zip(after, before))
                splits[name].append(served)
                print(
                    f"  round {round_ + 1} {name}: cached {result.cached}/{result.prompt}, "
                    f"{result.requests} requests in {result.wall:.1f} s, {result.failed} failed, load {loads[-1]:.1f}; "
                    f"served {served[0]}/{served[1]}, {preempted} preempted; "
                    "cached by turn: " + " ".join(f"{c}/{p}" for _, (p, c) in sorted(result.by_turn.items())),
                    flush=True,
                )
        print(f"load average during the phases: {min(loads):.1f} to {max(loads):.1f}")
        print(
            "| router | prompt tokens from cache | TTFT p50 | TTFT p90 | throughput | requests per replica | failed |"
        )
        print("| --- | ---: | ---: | ---: | ---: | --- | ---: |")
        for name, phases in results.items():
            s = route_workload.summary(phases)
            split = ", ".join(f"{a}/{b}" for a, b in splits[name])
            print(
                f"| {name} | {s['cached_share']:.1%} ({s['cached']:,.0f} of {s['prompt']:,.0f}) | "
                f"{s['ttft_p50']:,.0f} ms | {s['ttft_p90']:,.0f} ms | {s['throughput']:.2f} req/s | {split} | "
                f"{s['failed']} |"
            )
        for name, why in failed.items():
            print(f"| {name} | could not run: {why[:300]} | | | | | |")
        for name, base in routers.items():
            if name == "kvpool precise":
                metrics = httpx.get(base + "/metrics").text
                keep = ("kvpool_router_reported_cached", "kvpool_router_predicted_reported", "kvpool_router_exact",
                        "kvpool_router_reports_total", "kvpool_router_event_lag", "kvpool_router_requests_total")  # fmt: skip
                print("kvpool precise /metrics:")
                for line in metrics.splitlines():
                    if line.startswith(keep):
                        print("  " + line)
    finally:
        for p in processes:
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signal.SIGTERM)
        for p in processes:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
        for r in replicas:
            r.kill()


# -- the router's own cost -------------------------------------------------------------------


def serve_upstream(port: int, events_port: int) -> None:
    """A replica that costs nothing: every chat request answered at once, streamed as vLLM streams it."""
    import json

    import uvicorn
    import zmq
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response, StreamingResponse
    from starlette.routing import Route

    publisher = zmq.Context().socket(zmq.PUB)  # described with events, so the router runs in precise mode
    publisher.bind(f"tcp://127.0.0.1:{events_port}")
    pieces = [f"word{i} " for i in range(8)]
    usage = {"prompt_tokens": 700, "completion_tokens": 8, "total_tokens": 708,
             "prompt_tokens_details": {"cached_tokens": 640}}  # fmt: skip

    def sse(payload: dict[str, Any]) -> bytes:
        return b"data: " + json.dumps(payload).encode() + b"\n\n"

    async def chat(request: Request) -> Response:
        body = json.loads(await request.body())
        base = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0, "model": body["model"]}
        if not body.get("stream"):
            answer = {**base, "object": "chat.completion", "usage": usage,
                      "choices": [{"index": 0, "message": {"role": "assistant", "content": "".join(pieces)}}]}  # fmt: skip
            return JSONResponse(answer)

        async def chunks() -> Any:
            yield sse({**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
            for piece in pieces:
                yield sse({**base, "choices": [{"index": 0, "delta": {"content": piece}}]})
            yield sse({**base, "choices": [], "usage": usage})
            yield b"data: [DONE]\n\n"

        return StreamingResponse(chunks(), media_type="text/event-stream")

    async def health(request: Request) -> Response:
        return Response(b"")

    app = Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"]), Route("/health", health)])
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)


def _overhead_chat() -> list[dict[str, str]]:
    messages = [_vllm_system(9, 0), {"role": "user", "content": "Hello."}]
    for turn in range(6):
        answer = "Sure, here is a short answer about the point you raised. " * 3
        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": f"And point {turn}?"}]
    return messages


def _timed_stream(client: Any, url: str, body: dict[str, Any]) -> tuple[float, float]:
    """(seconds to the first content byte, seconds to the stream's end) of one streamed request."""
    t0 = time.perf_counter()
    first = None
    with client.stream("POST", url, json=body) as reply:
        reply.raise_for_status()
        for chunk in reply.iter_raw():
            if first is None and b'"content": "word' in chunk:
                first = time.perf_counter()
    end = time.perf_counter()
    return (first or end) - t0, end - t0


def run_overhead(args: argparse.Namespace) -> None:
    import httpx

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import vllm_fleet

    model = vllm_fleet.model_folder()
    tmp = Path(tempfile.mkdtemp(prefix="bench-route-overhead-"))
    port, events_port = _free_port(), _free_port()
    processes = []
    with open(tmp / "upstream.log", "wb") as out:
        upstream = [sys.executable, __file__, "--upstream", str(port), str(events_port)]
        processes.append(subprocess.Popen(upstream, stdout=out, stderr=subprocess.STDOUT))
    spec = f"http://127.0.0.1:{port},events=tcp://127.0.0.1:{events_port},block-size=128,hash=sha256"
    targets = {"direct": f"http://127.0.0.1:{port}"}
    try:
        for routing in ("precise", "round-robin"):
            router_port = _free_port()
            cmd = ["route", "--port", str(router_port), "--routing", routing, "--model", str(model), "--replica", spec]
            if args.profile and routing == "precise":
                (tmp / "route.py").write_text("from kvpool.cli import main\n\nmain()\n")
                cmd = ["-m", "cProfile", "-o", str(args.profile), str(tmp / "route.py"), *cmd]
                with open(tmp / "router-precise.log", "wb") as out:
                    processes.append(subprocess.Popen([sys.executable, *cmd], stdout=out, stderr=subprocess.STDOUT))
            else:
                processes.append(_kvpool(cmd, tmp / f"router-{routing}.log"))
            targets[f"kvpool route {routing}"] = f"http://127.0.0.1:{router_port}"
        _wait(targets["direct"] + "/health", lambda r: r.status_code == 200, "the upstream", 60)
        for name, base in targets.items():
            if name != "direct":
                ready = "precise" if "precise" in name else "load only"
                _wait(base + "/health", lambda r, m=ready: r.json().get("prefix_mode") == m, name, 120)
        body = {"model": str(model), "messages": _overhead_chat(), "max_tokens": 8, "stream": True,
                "stream_options": {"include_usage": True}}  # fmt: skip
        times: dict[str, list[tuple[float, float]]] = {name: [] for name in targets}
        with httpx.Client(timeout=30) as client:
            for base in targets.values():  # warm: connections opened, the tokenizer's first calls made
                for _ in range(20):
                    _timed_stream(client, base + "/v1/chat/completions", body)
            for _ in range(args.requests):
                for name, base in targets.items():
                    times[name].append(_timed_stream(client, base + "/v1/chat/completions", body))
        load = os.getloadavg()[0]
        print(f"{args.requests} streamed chat requests per path, interleaved; load average {load:.1f}")
        print("| path | first byte p50 | p90 | stream end p50 | p90 | overhead (end, p50) |")
        print("| --- | ---: | ---: | ---: | ---: | ---: |")
        direct_end = statistics.median(t[1] for t in times["direct"])
        for name, pairs in times.items():
            first = sorted(t[0] for t in pairs)
            end = sorted(t[1] for t in pairs)
            p90 = int(0.9 * (len(end) - 1))
            extra = statistics.median(end) - direct_end
            print(
                f"| {name} | {statistics.median(first) * 1e3:.2f} ms | {first[p90] * 1e3:.2f} ms | "
                f"{statistics.median(end) * 1e3:.2f} ms | {end[p90] * 1e3:.2f} ms | "
                f"{'' if name == 'direct' else f'{extra * 1e3:+.2f} ms'} |"
            )
    finally:
        for p in processes:
            # SIGINT: uvicorn passes it on as KeyboardInterrupt once it has shut down, and cProfile
            # writes its file on the way out (SIGTERM, passed on, would end the process first)
            p.send_signal(signal.SIGINT)
        for p in processes:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()


def _cpu_seconds(pid: int) -> float:
    """The user plus system CPU seconds process ``pid`` has used (Linux's /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _relay_prompt(i: int) -> list[dict[str, str]]:
    words = " ".join(f"w{(i * 7919 + k) % 5003}" for k in range(1500))  # a few thousand tokens, distinct per request
    return [{"role": "user", "content": f"Request {i}. {words}"}]


def run_relay_cpu(args: argparse.Namespace) -> None:
    """The router's CPU per request, streamed and not, for each source tree in ``--trees``, side by side.

    Two emulated replicas (one process), one ``kvpool route --routing round-robin`` per tree (its
    ``PYTHONPATH`` set to that tree's ``src``), all started at once; ``--rounds`` rounds, each sending
    ``--requests`` requests one at a time to every router in turn (streamed, then not), the router's
    CPU (user + system, from /proc) read around each router's batch. Reported: the median over rounds.
    """
    import httpx

    tmp = Path(tempfile.mkdtemp(prefix="bench-route-relay-"))
    (tmp / "secret").write_text(os.urandom(32).hex() + "\n")
    processes: list[subprocess.Popen[bytes]] = []
    try:
        fleet_cmd = ["serve", "--emulate", args.emulate, "--replicas", "2", "--port", "0", "--disable-log-stats"]
        fleet_cmd += [
            "--tenant-secret-file",
            str(tmp / "secret"),
            "--max-model-len",
            "16384",
            "--num-gpu-blocks-override",
            "8192",
        ]
        processes.append(_kvpool(fleet_cmd, tmp / "fleet.log"))
        urls = _lines_matching(tmp / "fleet.log", r" serving [^\n]*?(http://[0-9.:]+)", 2, processes[0])
        routers: dict[str, tuple[subprocess.Popen[bytes], str]] = {}
        for tree in args.trees:
            name, _, folder = tree.partition("=")
            port = _free_port()
            cmd = ["route", "--port", str(port), "--routing", "round-robin", "--model", args.model]
            cmd += ["--tenant-secret-file", str(tmp / "secret"), *[a for u in urls for a in ("--replica", u)]]
            env = dict(os.environ, PYTHONPATH=str(Path(folder) / "src")) if folder else None
            with open(tmp / f"router-{name}.log", "wb") as out:
                proc = subprocess.Popen(
                    [sys.executable, "-c", "from kvpool.cli import main; main()", *cmd],
                    stdout=out, stderr=subprocess.STDOUT, env=env,
                )  # fmt: skip
            processes.append(proc)
            routers[name] = (proc, f"http://127.0.0.1:{port}")
        for name, (_, base) in routers.items():
            _wait(base + "/health", lambda r: r.status_code == 200, f"router {name}", 120)
        per: dict[tuple[str, bool], list[float]] = {(n, s): [] for n in routers for s in (True, False)}
        chunks: list[int] = []
        with httpx.Client(timeout=60) as client:
            for base in [b for _, b in routers.values()]:  # warm: connections opened, first calls made
                for i in range(4):
                    _relay_request(client, base, args, i, stream=i % 2 == 0)
            for round_ in range(args.rounds):
                print(f"round {round_ + 1} of {args.rounds}", file=sys.stderr, flush=True)
                for stream in (True, False):
                    for name, (proc, base) in routers.items():
                        before = _cpu_seconds(proc.pid)
                        for i in range(args.requests):
                            n = _relay_request(client, base, args, 1000 * round_ + i, stream=stream)
                            if stream:
                                chunks.append(n)
                        per[name, stream].append((_cpu_seconds(proc.pid) - before) / args.requests)
        print(
            f"router CPU per request (user + system), {args.requests} requests one at a time, median of "
            f"{args.rounds} rounds; 2 emulated replicas ({args.emulate}), --routing round-robin, "
            f"{args.max_tokens} output tokens ({statistics.median(chunks)} chunks a stream, read as they came); "
            f"load average {os.getloadavg()[0]:.1f}"
        )
        print("| tree | streamed | not streamed | streamed, each round | not streamed, each round |")
        print("| --- | ---: | ---: | --- | --- |")
        for name in routers:
            cells = [f"{statistics.median(per[name, s]) * 1e3:.2f} ms" for s in (True, False)]
            rounds = [" / ".join(f"{v * 1e3:.1f}" for v in per[name, s]) for s in (True, False)]
            print(f"| {name} | {cells[0]} | {cells[1]} | {rounds[0]} | {rounds[1]} |")
    finally:
        for p in processes:
            p.send_signal(signal.SIGINT)
        for p in processes:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()


def _lines_matching(log: Path, pattern: str, count: int, proc: subprocess.Popen[bytes]) -> list[str]:
    import re

    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        found = re.findall(pattern, log.read_text(errors="replace"))
        if len(found) >= count:
            return found[:count]
        if proc.poll() is not None:
            raise SystemExit(f"the fleet exited: {log.read_text(errors='replace')[-600:]}")
        time.sleep(0.2)
    raise SystemExit(f"timed out waiting for {count} lines in {log}")


def _relay_request(client: Any, base: str, args: argparse.Namespace, i: int, *, stream: bool) -> int:
    """One chat request through the router; the chunks its stream came in (1 unstreamed)."""
    body: dict[str, Any] = {"model": args.model, "messages": _relay_prompt(i), "max_tokens": args.max_tokens}
    if not stream:
        reply = client.post(base + "/v1/chat/completions", json=body)
        reply.raise_for_status()
        return 1
    body |= {"stream": True, "stream_options": {"include_usage": True}}
    n = 0
    with client.stream("POST", base + "/v1/chat/completions", json=body) as reply:
        reply.raise_for_status()
        for _ in reply.iter_raw():
            n += 1
    return n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--index", action="store_true", help="time the block index")
    parser.add_argument("--redis", default=None, help="also time the Redis index on this server")
    parser.add_argument("--replicas", type=int, default=8)
    parser.add_argument("--blocks", type=int, default=50_000)
    parser.add_argument("--prompt-blocks", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=201)
    parser.add_argument("--fleet", action="store_true", help="run the live two-replica fleet")
    parser.add_argument("--vllm", action="store_true", help="two vLLM-CPU replicas behind every router, side by side")
    parser.add_argument("--vllm-router", default="/root/.venvs/vllm-router/bin/vllm-router")
    parser.add_argument("--sglang-router", default="/root/.venvs/sglang-router/bin/sglang-router")
    parser.add_argument("--rules", nargs="+", default=["prefix", "round-robin"])
    parser.add_argument("--overhead", action="store_true", help="the router's own cost per request")
    parser.add_argument("--requests", type=int, default=300, help="--overhead: requests per path")
    parser.add_argument("--profile", default=None, help="--overhead: write the precise router's cProfile here")
    parser.add_argument("--relay-cpu", action="store_true", help="the router's CPU per request, tree against tree")
    parser.add_argument(
        "--trees", nargs="+", default=["after="], help="--relay-cpu: NAME=FOLDER (a checkout; empty: this one)"
    )
    parser.add_argument("--emulate", default="llama-3.1-8b-h100", help="--relay-cpu: the replicas' profile")
    parser.add_argument("--model", default="smollm2-135m", help="--relay-cpu: the replicas' model")
    parser.add_argument("--upstream", nargs=2, type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--conversations", type=int, default=5, help="--fleet; --vllm: at once, per phase")
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--system-prompts", type=int, default=3, help="--vllm: shared system prompts per phase")
    parser.add_argument("--max-tokens", type=int, default=16, help="--vllm: tokens per answer")
    parser.add_argument("--num-blocks", type=int, default=64, help="--vllm: each replica's KV cache, in blocks")
    parser.add_argument("--wipe-after", type=int, default=2, help="--vllm: turns before replica 1 loses its cache")
    parser.add_argument("--rounds", type=int, default=2, help="--vllm: phases per router")
    parser.add_argument(
        "--kvpool-rules",
        nargs="+",
        default=["precise", "approximate", "round-robin"],
        help="--vllm: kvpool routers by --routing value (precise, approximate, round-robin, expected-ttft, threshold)",
    )
    parser.add_argument(
        "--precise-load-costs", type=float, nargs="*", default=[], help="--vllm: more precise routers, these load costs"
    )
    args = parser.parse_args()
    if args.upstream is not None:
        serve_upstream(*args.upstream)
        return
    if not (args.index or args.fleet or args.vllm or args.overhead or args.relay_cpu):
        parser.error("say --index, --fleet, --vllm, --overhead, --relay-cpu or several")
    if args.relay_cpu:
        run_relay_cpu(args)
    if args.overhead:
        run_overhead(args)
    if args.index:
        run_index(args)
    if args.fleet:
        run_fleet(args)
    if args.vllm:
        run_vllm(args)


if __name__ == "__main__":
    main()
