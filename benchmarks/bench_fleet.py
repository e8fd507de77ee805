"""The router shootout: every router in front of the same emulated fleet, replaying the Mooncake trace.

An emulated fleet (``kvpool serve --emulate PROFILE --replicas N``: kvpool's real scheduler and KV
cache manager, which decide as vLLM does, time from a cost profile, no weights) serves a slice of
the Mooncake conversation trace (``fleet_workload.py``: prompt text sharing exactly the trace's
512-token blocks), replayed at the trace's own arrival times compressed to a load level, through
each router in turn:

* ``kvpool route`` by each law of ``kvpool.routing``: ``kvpool-precise`` (the linear ``prefix`` law,
  prefixes from the replicas' KV events), ``kvpool-approximate`` (the default law, prefixes from the
  router's own record of where it sent each prompt), ``kvpool-ttft`` (``expected-ttft``: the earliest
  expected first token from the replicas' rates and the prefill pending at each), ``kvpool-threshold``
  (the gate SGLang's and vLLM's routers use), and round-robin (``kvpool route --routing round-robin``);
* ``sglang-router`` and ``vllm-router`` with their cache-aware policy, each from its own virtual
  environment (``--sglang-router`` / ``--vllm-router``; a router that cannot start is reported
  with its error, the others still run).

Every phase (one router at one load) starts a fresh fleet, so each router meets empty caches. A
load level is the offered prefill work over what the fleet can compute: ``--loads 0.3,0.9,1.5``
compresses the trace's arrival times until the slice's prompt tokens arrive at 30%, 90% and 150%
of the fleet's servable prefill rate (the profile's, for full batches; before any cache hit).
Where that would send more requests a second than this machine can tokenize and stream,
``--time-scale`` slows the emulated clock (its replicas then run that many times slower than the
profile, and every arrival is stretched by it too): the figures below are in *modelled*
seconds (real seconds over the time scale), so they do not depend on it.

Reported per router and load: prompt tokens served from cache (the replicas' own
``cached_tokens``), time to first token p50/p90/p99, goodput (requests whose first token came
within ``--ttft-slo`` modelled seconds, per modelled second of the phase), requests running or
waiting per replica (the replicas' ``vllm:num_requests_running`` + ``_waiting``, sampled every
``--sample-every`` seconds: the largest, and the mean over replicas and samples), the router's CPU
seconds per request (its process tree's, from ``/proc``), and for kvpool's routers the routing
regret (cached tokens achieved over the most any replica held when the request was routed, from
the router's own ``/metrics``).

    python benchmarks/bench_fleet.py --replicas 8 --loads 0.3,0.9,1.5
    python benchmarks/bench_fleet.py --replicas 32 --loads 0.3,0.9,1.5 --time-scale 4
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import fleet_workload  # noqa: E402

#: kvpool's routers, by the ``--routing`` each runs: the laws of :mod:`kvpool.routing` (docs/routing.md).
KVPOOL_ROUTING = {
    "kvpool-precise": "prefix",  # the linear law, prefixes from the replicas' KV events
    "kvpool-approximate": "approximate",  # the default law, prefixes from the router's own memory
    "kvpool-ttft": "expected-ttft",
    "kvpool-threshold": "threshold",
    "round-robin": "round-robin",
}
ROUTERS = (*KVPOOL_ROUTING, "sglang-router", "vllm-router")
MODEL = "smollm2-135m"


def progress(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# -- processes ------------------------------------------------------------------------------------------------------


def _kvpool(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    with open(log, "wb") as out:
        return subprocess.Popen(
            [sys.executable, "-c", "from kvpool.cli import main; main()", *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def _wait_for_lines(proc: subprocess.Popen[bytes], log: Path, pattern: str, count: int, timeout: float) -> list[str]:
    """The log's first ``count`` matches of ``pattern``; SystemExit if the process dies or time runs out."""
    deadline = time.monotonic() + timeout
    while True:
        found = re.findall(pattern, log.read_text(errors="replace"))
        if len(found) >= count:
            return found[:count]
        if proc.poll() is not None:
            raise SystemExit(
                f"{log.name}: the process ended ({proc.returncode}): {log.read_text(errors='replace')[-800:]}"
            )
        if time.monotonic() > deadline:
            raise SystemExit(f"{log.name}: timed out waiting for {pattern!r}")
        time.sleep(0.1)


def _stop(proc: subprocess.Popen[bytes] | None) -> None:
    if proc is None or proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _free_port() -> int:
    """A port for a router that cannot bind port 0 and report it (sglang-router, vllm-router)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _tree_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of ``pid`` and every live descendant (Linux ``/proc``)."""
    ticks = os.sysconf("SC_CLK_TCK")
    parents: dict[int, int] = {}
    cpu: dict[int, float] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields_ = stat[stat.rindex(")") + 2 :].split()
        parents[int(entry)] = int(fields_[1])
        cpu[int(entry)] = (int(fields_[11]) + int(fields_[12])) / ticks
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        total += cpu.get(p, 0.0)
        todo.extend(c for c, parent in parents.items() if parent == p)
    return total


@dataclass
class Fleet:
    proc: subprocess.Popen[bytes] | None  # None: replicas this benchmark did not start
    urls: list[str]
    log: Path

    def stop(self) -> None:
        _stop(self.proc)


def start_fleet(args: argparse.Namespace, tmp: Path, tag: str, *, serve_flags: list[str] | None = None) -> Fleet:
    """``args.replicas`` emulated replicas of ``args.profile`` in one process, with KV events.

    ``serve_flags``: the replicas' own flags in place of this benchmark's (its KV memory, model length,
    time scale and tenant secret).
    """
    log = tmp / f"fleet-{tag}.log"
    cmd = ["serve", "--emulate", args.profile, "--replicas", str(args.replicas), "--port", "0"]
    if serve_flags is None:
        cmd += ["--kv-cache-memory", args.kv_cache_memory, "--max-model-len", str(args.max_model_len)]
        cmd += ["--time-scale", str(args.time_scale), "--tenant-secret-file", str(tmp / "secret")]
    else:
        cmd += serve_flags
    cmd += ["--disable-log-stats"]
    cmd += ["--kv-events-endpoint", "bind:tcp://127.0.0.1:0", "--kv-events-replay-endpoint", "tcp://127.0.0.1:0"]
    proc = _kvpool(cmd, log)
    lines = _wait_for_lines(proc, log, r" serving [^\n]*?(http://[0-9.:]+)", args.replicas, timeout=300)
    return Fleet(proc, lines, log)


@dataclass
class Router:
    name: str
    url: str
    proc: subprocess.Popen[bytes] | None
    kvpool: bool


def start_router(name: str, fleet: Fleet, args: argparse.Namespace, tmp: Path) -> Router:
    log = tmp / f"router-{name}.log"
    if name in KVPOOL_ROUTING:
        return start_kvpool_route(
            name, KVPOOL_ROUTING[name], fleet.urls, log, ["--tenant-secret-file", str(tmp / "secret")]
        )
    binary = args.sglang_router if name == "sglang-router" else args.vllm_router
    if not Path(binary).is_file():
        raise RuntimeError(f"{binary} is not installed")
    port = _free_port()
    cmd = [binary, *(["launch"] if name == "sglang-router" else []), "--policy", "cache_aware"]
    cmd += ["--worker-urls", *fleet.urls, "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--prometheus-port", str(_free_port())]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_http(f"{url}/v1/models", lambda body: True, name, proc=proc)
    except RuntimeError as exc:
        _stop(proc)
        raise RuntimeError(f"{exc}: {log.read_text(errors='replace')[-600:]}") from None
    return Router(name, url, proc, kvpool=False)


def start_kvpool_route(
    name: str, routing: str, replicas: list[str], log: Path, tenancy: list[str], *, model: str = MODEL
) -> Router:
    """``kvpool route --routing ROUTING`` in front of ``replicas`` (URLs or ``--replica`` specs), once it routes.

    ``tenancy``: its tenant flags (``--tenant-secret-file FILE`` or ``--no-tenant-isolation``); ``model``: its
    ``--model`` (a kvpool model name or a folder with ``tokenizer.json``). A rule that reads prefixes is
    returned once the router follows every replica's KV events (``prefix_mode`` precise).
    """
    cmd = ["route", "--port", "0", "--routing", routing, "--model", model, *tenancy]
    proc = _kvpool([*cmd, *[a for u in replicas for a in ("--replica", u)]], log)
    (url,) = _wait_for_lines(proc, log, r"routing on (http://[0-9.:]+)", 1, timeout=300)
    router = Router(name, url, proc, kvpool=True)
    if routing in ("prefix", "expected-ttft", "threshold"):
        try:
            _wait_http(f"{url}/health", lambda body: json.loads(body).get("prefix_mode") == "precise", name)
        except RuntimeError:
            _stop(proc)
            raise
    return router


def _wait_http(
    url: str, ready: Any, what: str, *, proc: subprocess.Popen[bytes] | None = None, timeout: float = 120
) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}")
        with contextlib.suppress(httpx.HTTPError, ValueError):
            response = httpx.get(url, timeout=2)
            if response.status_code == 200 and ready(response.text):
                return
        time.sleep(0.2)
    raise RuntimeError(f"timed out waiting for {what} at {url}")


# -- one phase ------------------------------------------------------------------------------------------------------


@dataclass
class Answer:
    arrival_s: float
    ttft_s: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None
    #: The replica that answered, as ``kvpool route``'s ``x-kvpool-replica`` header names it (None without one).
    replica: str | None = None


async def _send(
    client: Any,
    url: str,
    request: fleet_workload.FleetRequest,
    max_tokens: int,
    answer: Answer,
    body_extra: dict[str, Any] | None = None,
) -> None:
    body = {
        "model": MODEL,
        "prompt": request.prompt,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        **(body_extra or {}),
    }
    start = time.perf_counter()
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
            answer.replica = response.headers.get("x-kvpool-replica")
            if response.status_code != 200:
                answer.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if answer.ttft_s is None and chunk.get("choices") and chunk["choices"][0].get("text"):
                    answer.ttft_s = time.perf_counter() - start
                usage = chunk.get("usage")
                if usage:
                    answer.prompt_tokens = usage.get("prompt_tokens", 0)
                    answer.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    except Exception as exc:  # a benchmark reports every failure and goes on
        answer.error = f"{type(exc).__name__}: {exc}"


_GAUGE = re.compile(r"^vllm:num_requests_(?:running|waiting)(?:\{[^}]*\})? ([0-9.eE+-]+)$", re.M)


async def _sample_in_flight(
    client: Any, urls: list[str], every: float, samples: list[list[float]], stop: asyncio.Event
) -> None:
    while not stop.is_set():
        row = []
        for url in urls:
            try:
                text = (await client.get(f"{url}/metrics", timeout=5)).text
                row.append(sum(float(v) for v in _GAUGE.findall(text)))
            except Exception:
                row.append(math.nan)
        samples.append(row)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), every)


async def replay(
    router: Router,
    fleet: Fleet,
    requests: list[fleet_workload.FleetRequest],
    stretch: float,
    args: argparse.Namespace,
    *,
    body_extra: dict[str, Any] | None = None,
) -> tuple[list[Answer], list[list[float]], float]:
    """Send each request at its arrival (trace seconds x ``stretch``); ``body_extra``: fields added to each body."""
    import httpx

    limits = httpx.Limits(max_connections=4096, max_keepalive_connections=512)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None, connect=30), limits=limits) as client:
        stop = asyncio.Event()
        samples: list[list[float]] = []
        sampler = asyncio.create_task(_sample_in_flight(client, fleet.urls, args.sample_every, samples, stop))
        answers = [Answer(r.trace.arrival_s * stretch) for r in requests]
        t0 = time.perf_counter()
        tasks = []
        for request, answer in zip(requests, answers):
            delay = answer.arrival_s - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(_send(client, router.url, request, args.max_tokens, answer, body_extra)))
        await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - t0
        stop.set()
        await sampler
    return answers, samples, elapsed


def _metric(text: str, name: str) -> float:
    return sum(float(m) for m in re.findall(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? ([0-9.eE+-]+)$", text, re.M))


@dataclass
class PhaseResult:
    router: str
    load: float
    replicas: int
    requests: int
    failed: int
    prompt_tokens: int
    cached_tokens: int
    cached_share: float
    ttft_p50_s: float
    ttft_p90_s: float
    ttft_p99_s: float
    goodput_rps: float
    in_flight_max: float
    in_flight_mean: float
    router_cpu_ms_per_request: float
    regret: float | None
    modelled_seconds: float
    errors: list[str] = field(default_factory=list)


def _quantile(values: list[float], q: float) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def run_phase(
    name: str,
    load: float,
    requests: list[fleet_workload.FleetRequest],
    stretch: float,
    args: argparse.Namespace,
    tmp: Path,
) -> PhaseResult | str:
    import httpx

    fleet = start_fleet(args, tmp, f"{name}-{load:g}")
    router: Router | None = None
    try:
        try:
            router = start_router(name, fleet, args, tmp)
        except RuntimeError as exc:
            return str(exc)
        cpu0 = _tree_cpu_seconds(router.proc.pid) if router.proc else 0.0
        answers, samples, elapsed = asyncio.run(replay(router, fleet, requests, stretch, args))
        cpu = (_tree_cpu_seconds(router.proc.pid) if router.proc else 0.0) - cpu0
        regret = None
        if router.kvpool:
            text = httpx.get(f"{router.url}/metrics", timeout=10).text
            best = _metric(text, "kvpool_router_cached_tokens_best_available_total")
            achieved = _metric(text, "kvpool_router_cached_tokens_achieved_total")
            regret = achieved / best if best else None
    finally:
        if router is not None:
            _stop(router.proc)
        fleet.stop()
    scale = args.time_scale
    ok = [a for a in answers if a.error is None and a.ttft_s is not None]
    ttfts = [a.ttft_s / scale for a in ok if a.ttft_s is not None]
    prompt = sum(a.prompt_tokens for a in ok)
    cached = sum(a.cached_tokens for a in ok)
    modelled = elapsed / scale
    flat = [v for row in samples for v in row if not math.isnan(v)]
    return PhaseResult(
        router=name,
        load=load,
        replicas=args.replicas,
        requests=len(answers),
        failed=len(answers) - len(ok),
        prompt_tokens=prompt,
        cached_tokens=cached,
        cached_share=cached / prompt if prompt else 0.0,
        ttft_p50_s=_quantile(ttfts, 0.5),
        ttft_p90_s=_quantile(ttfts, 0.9),
        ttft_p99_s=_quantile(ttfts, 0.99),
        goodput_rps=sum(t <= args.ttft_slo for t in ttfts) / modelled if modelled else 0.0,
        in_flight_max=max(flat) if flat else math.nan,
        in_flight_mean=statistics.fmean(flat) if flat else math.nan,
        router_cpu_ms_per_request=1000 * cpu / len(answers) if answers else math.nan,
        regret=regret,
        modelled_seconds=modelled,
        errors=sorted({a.error for a in answers if a.error})[:3],
    )


# -- the shootout ---------------------------------------------------------------------------------------------------


def stretch_for(load: float, requests: list[fleet_workload.FleetRequest], args: argparse.Namespace) -> float:
    """Real seconds per trace second that make the slice's prompt tokens ``load`` x the fleet's servable rate."""
    from kvpool.cost_model import load_profile

    profile = load_profile(args.profile)
    servable = args.replicas * profile.servable_prefill_tokens_per_s(args.max_num_batched_tokens)
    span = max(r.trace.arrival_s for r in requests) or 1.0
    offered_at_trace_pace = sum(r.prompt_tokens for r in requests) / span
    # modelled stretch: trace seconds -> modelled seconds; real = modelled x time scale
    return offered_at_trace_pace / (load * servable) * args.time_scale


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", type=int, default=8)
    parser.add_argument("--first", type=int, default=0, help="the slice's first trace line")
    parser.add_argument("--count", type=int, default=None, help="requests in the slice (default: all)")
    parser.add_argument("--conversations", type=int, default=40, help="keep one conversation in this many")
    parser.add_argument("--loads", default="0.3,0.9,1.5", help="offered prefill over the fleet's servable rate")
    parser.add_argument("--routers", default=",".join(ROUTERS))
    parser.add_argument("--profile", default="llama-3.1-8b-h100")
    parser.add_argument("--kv-cache-memory", default="48GiB", help="each replica's KV pool")
    parser.add_argument("--max-model-len", type=int, default=131072)
    parser.add_argument(
        "--max-num-batched-tokens", type=int, default=2048, help="the replicas' (kvpool serve's default)"
    )
    parser.add_argument("--max-prompt-tokens", type=int, default=8192, help="longer trace prompts are cut to this")
    parser.add_argument("--max-tokens", type=int, default=32, help="output tokens per request (the trace's, capped)")
    parser.add_argument("--time-scale", type=float, default=1.0, help="real seconds per modelled second")
    parser.add_argument("--ttft-slo", type=float, default=2.0, help="modelled seconds, for goodput")
    parser.add_argument("--sample-every", type=float, default=1.0)
    parser.add_argument("--sglang-router", default="/root/.venvs/sglang-router/bin/sglang-router")
    parser.add_argument("--vllm-router", default="/root/.venvs/vllm-router/bin/vllm-router")
    parser.add_argument("--json", type=Path, default=None, help="write every phase's figures here")
    args = parser.parse_args()
    routers = [r for r in args.routers.split(",") if r]
    unknown = sorted(set(routers) - set(ROUTERS))
    if unknown:
        raise SystemExit(f"unknown routers {unknown}; the routers are {list(ROUTERS)}")
    loads = [float(x) for x in args.loads.split(",")]

    tokenizer = fleet_workload.load_tokenizer(fleet_workload.default_model_folder())
    trace = fleet_workload.read_trace(first=args.first, count=args.count, conversations=args.conversations)
    requests = list(fleet_workload.fleet_requests(tokenizer, trace, max_prompt_tokens=args.max_prompt_tokens))
    tmp = Path(tempfile.mkdtemp(prefix="bench-fleet-"))
    (tmp / "secret").write_text(os.urandom(32).hex() + "\n")
    progress(
        f"{len(requests)} requests (one conversation in {args.conversations} from line {args.first}, prompts cut to "
        f"{args.max_prompt_tokens} tokens, {sum(r.prompt_tokens for r in requests):,} prompt tokens, "
        f"{args.max_tokens} output tokens each); {args.replicas} emulated replicas ({args.profile}, "
        f"{args.kv_cache_memory} of KV each, time scale {args.time_scale:g}); logs in {tmp}"
    )
    results: list[PhaseResult] = []
    failures: dict[str, str] = {}
    for load in loads:
        stretch = stretch_for(load, requests, args)
        span = max(r.trace.arrival_s for r in requests) * stretch
        progress(
            f"load {load:g}: the slice's {span:.0f} real seconds of arrivals ({span / args.time_scale:.1f} modelled)"
        )
        for name in routers:
            if name in failures:
                continue
            t0 = time.monotonic()
            outcome = run_phase(name, load, requests, stretch, args, tmp)
            if isinstance(outcome, str):
                failures[name] = outcome
                progress(f"  {name}: did not start: {outcome}")
                continue
            results.append(outcome)
            progress(
                f"  {name}: cached {outcome.cached_share:.1%}, TTFT p50 {outcome.ttft_p50_s:.3f} s p90 "
                f"{outcome.ttft_p90_s:.3f} s, goodput {outcome.goodput_rps:.2f}/s, failed {outcome.failed} "
                f"({time.monotonic() - t0:.0f} s)"
            )
    print_table(results, failures, args)
    if args.json is not None:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)}, "results": [asdict(r) for r in results],
                                         "failures": failures}, indent=2, default=str))  # fmt: skip


def print_table(results: list[PhaseResult], failures: dict[str, str], args: argparse.Namespace) -> None:
    print(
        f"\n{args.replicas} replicas, one conversation in {args.conversations} from line {args.first} ({args.count or 'all'} "
        f"requests, prompts cut to {args.max_prompt_tokens}), profile {args.profile}, time scale "
        f"{args.time_scale:g}, TTFT in modelled seconds, goodput: TTFT within {args.ttft_slo:g} s\n"
    )
    print(
        "| load | router | cached | TTFT p50 | p90 | p99 | goodput/s | in flight max / mean | router CPU/request | regret | failed |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in results:
        regret = "" if r.regret is None else f"{r.regret:.3f}"
        print(
            f"| {r.load:g} | {r.router} | {r.cached_share:.1%} | {r.ttft_p50_s:.3f} | {r.ttft_p90_s:.3f} | "
            f"{r.ttft_p99_s:.3f} | {r.goodput_rps:.2f} | {r.in_flight_max:.0f} / {r.in_flight_mean:.1f} | "
            f"{r.router_cpu_ms_per_request:.1f} ms | {regret} | {r.failed} |"
        )
    for name, why in failures.items():
        print(f"\n{name} did not run: {why}")


if __name__ == "__main__":
    main()
