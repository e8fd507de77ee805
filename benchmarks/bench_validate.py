"""Is ``kvpool simulate`` right? One trace slice through the simulator, the emulated fleet and live vLLM-CPU.

One slice of the Mooncake conversation trace (``fleet_workload.py``: prompt text sharing exactly
the trace's 512-token blocks, cut to ``--max-prompt-tokens``), three ways, each on empty caches:

1. **sim**: ``kvpool simulate`` in-process (:func:`kvpool.sim.study.run_study` on
   :class:`~kvpool.sim.options.SimulateOptions`, what the command builds) with the ``--profile``,
   ``--replicas`` replicas of ``--num-blocks`` blocks of 128 tokens each, the ``--routing`` rule, and
   vLLM-CPU's scheduler limits (2,048 batched tokens, 128 sequences: its defaults for an API server on
   the CPU). The slice is written as a token-level trace of the prompts' own token IDs (the
   model's tokenizer; SmolLM2's adds no special token), so the simulator hashes the blocks the
   servers hash; the equivalent command is printed.
2. **emulated**: ``kvpool serve --emulate PROFILE --replicas N`` with vLLM-CPU's settings
   (``--block-size 128 --hash sha256 --num-gpu-blocks-override N --no-tenant-isolation``, the same
   limits) behind ``kvpool route --routing RULE``.
3. **vllm**: ``--replicas`` live vLLM-CPU servers (``vllm_fleet.VLLMReplica``, the same pool) behind
   ``kvpool route --routing RULE`` (prefixes from their KV events).

The clocks are aligned so: the slice's trace arrival times are compressed by one factor (``--load``:
the slice's prompt tokens arrive at that share of the fleet's servable prefill rate, by the
profile: ``bench_fleet.stretch_for``), and that one list of arrival times, in seconds, is the
simulator's ``arrival_ms`` (over 1,000) and the live replays' send times (``bench_fleet.replay``,
real seconds from the first send; the emulated fleet at time scale 1, so its seconds are real).
Every request asks for ``--max-tokens`` tokens with ``ignore_eos``, and the simulator generates as
many. TTFT: the simulator's from arrival to the end of the step that samples the first token; the
live sides' from sending to the first streamed text (the router's hop, HTTP and tokenization
included).

Compared per request (by its index in the slice): ``cached_tokens`` (the servers'
``usage.prompt_tokens_details.cached_tokens``, the simulator's count at first admission), the
replica it ran on (``kvpool route``'s ``x-kvpool-replica`` header; the simulator's replica index),
and TTFT p50 and p90 of each side with their ratios. A request whose cached tokens differ is listed
with both sides' replicas: a different replica means the routing decision differed (routing weighs
load, and load depends on timing; ``--routing round-robin`` takes load out of the decision), the
same replica means its cache held other blocks then. The machine's load average is noted at each
side's start.

    python benchmarks/bench_validate.py --count 40 --conversations 40 --num-blocks 64 --json validate.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_fleet  # noqa: E402
import fleet_workload  # noqa: E402
import vllm_fleet  # noqa: E402

SIDES = ("sim", "emulated", "vllm")
#: vLLM-CPU's defaults for an API server (``--max-num-batched-tokens``, ``--max-num-seqs``), which the others copy.
MAX_NUM_BATCHED_TOKENS = 2048
MAX_NUM_SEQS = 128
MAX_MODEL_LEN = 2048
ROUTING_RULES = ("prefix", "round-robin", "least-loaded", "expected-ttft", "threshold")


@dataclass(frozen=True, slots=True)
class Outcome:
    """One request on one side: where it ran, its prompt, the tokens found cached, its first token."""

    index: int
    replica: int | None
    prompt_tokens: int
    cached_tokens: int
    ttft_s: float | None
    error: str | None = None


# -- the comparison (no server needed) ------------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0 < q < 1), linearly interpolated between the closest ranks; NaN with no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    position = (len(ordered) - 1) * q
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def ttft_figures(outcomes: Sequence[Outcome]) -> dict[str, float]:
    ttfts = [o.ttft_s for o in outcomes if o.error is None and o.ttft_s is not None]
    return {"ttft_p50_s": percentile(ttfts, 0.5), "ttft_p90_s": percentile(ttfts, 0.9)}


def compare(a: Sequence[Outcome], b: Sequence[Outcome]) -> dict[str, Any]:
    """Side ``a`` against side ``b``, request by request (matched by index) and by TTFT percentiles.

    ``cached_equal`` / ``compared``: requests answered on both sides whose cached tokens are equal;
    ``same_replica``: those routed to the same replica index; ``differences``: each request whose
    cached tokens differ, with both replicas and why (``routed elsewhere`` or ``same replica``);
    ``ttft_p50_ratio`` / ``ttft_p90_ratio``: ``a``'s over ``b``'s; ``ttft_ratio_median``: the median over the
    requests of each one's TTFT on ``a`` over its TTFT on ``b``.
    """
    by_index = {o.index: o for o in b if o.error is None}
    pairs = [(x, by_index[x.index]) for x in a if x.error is None and x.index in by_index]
    differences = []
    for x, y in pairs:
        if x.cached_tokens != y.cached_tokens:
            why = "same replica" if x.replica == y.replica else "routed elsewhere"
            differences.append(
                {"index": x.index, "cached": [x.cached_tokens, y.cached_tokens], "replica": [x.replica, y.replica],
                 "prompt_tokens": [x.prompt_tokens, y.prompt_tokens], "why": why}
            )  # fmt: skip
    fa, fb = ttft_figures(a), ttft_figures(b)
    equal = len(pairs) - len(differences)
    per_request = [x.ttft_s / y.ttft_s for x, y in pairs if x.ttft_s is not None and y.ttft_s]
    return {
        "compared": len(pairs),
        "cached_equal": equal,
        "cached_equal_share": equal / len(pairs) if pairs else math.nan,
        "same_replica": sum(x.replica == y.replica for x, y in pairs),
        "prompt_tokens_equal": sum(x.prompt_tokens == y.prompt_tokens for x, y in pairs),
        "cached_tokens": [sum(x.cached_tokens for x, _ in pairs), sum(y.cached_tokens for _, y in pairs)],
        "ttft_p50_ratio": fa["ttft_p50_s"] / fb["ttft_p50_s"] if fb["ttft_p50_s"] else math.nan,
        "ttft_p90_ratio": fa["ttft_p90_s"] / fb["ttft_p90_s"] if fb["ttft_p90_s"] else math.nan,
        "ttft_ratio_median": percentile(per_request, 0.5),
        "differences": differences,
    }


def answers_to_outcomes(answers: Sequence[bench_fleet.Answer], replica_urls: Sequence[str]) -> list[Outcome]:
    """A live replay's answers as outcomes, each replica named by its index in ``replica_urls``."""
    index = {url.rstrip("/"): i for i, url in enumerate(replica_urls)}
    return [
        Outcome(
            i,
            index.get((a.replica or "").rstrip("/")),
            a.prompt_tokens,
            a.cached_tokens,
            a.ttft_s,
            a.error or (None if a.ttft_s is not None else "no token"),
        )
        for i, a in enumerate(answers)
    ]


# -- the three sides ------------------------------------------------------------------------------------------------


def load_note() -> str:
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.2f} {five:.2f} {fifteen:.2f} ({os.cpu_count()} CPUs)"


def run_sim(
    requests: Sequence[fleet_workload.FleetRequest],
    arrivals: Sequence[float],
    tokenizer: Any,
    args: argparse.Namespace,
    tmp: Path,
) -> tuple[list[Outcome], str, dict[str, Any]]:
    """The simulator's outcomes, the equivalent ``kvpool simulate`` command, and its summary figures."""
    from kvpool.routing import Routing
    from kvpool.sim.options import SimulateOptions
    from kvpool.sim.study import load_requests, run_study
    from kvpool.sim.traces import TokenSegment, TraceRequest, write_trace

    trace = [
        TraceRequest.create(
            f"r{i}", 1000 * at, [TokenSegment.of(tokenizer.encode(r.prompt).ids)], max(1, args.max_tokens)
        )
        for i, (r, at) in enumerate(zip(requests, arrivals))
    ]
    path = tmp / "slice.jsonl"
    write_trace(trace, path)
    options = SimulateOptions(
        trace=str(path),
        kv_blocks=args.num_blocks - 1,  # usable blocks: the pool gets the null block on top, as vLLM's does
        block_size=vllm_fleet.BLOCK_SIZE,
        max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
        max_num_seqs=MAX_NUM_SEQS,
        profile=args.profile,
        replicas=args.replicas,
        routing=(Routing(args.routing),),
        hash_algo="sha256",
    )
    command = (
        f"kvpool simulate {path} --kv-blocks {args.num_blocks - 1} --block-size {vllm_fleet.BLOCK_SIZE} "
        f"--replicas {args.replicas} --routing {args.routing} --profile {args.profile} "
        f"--max-num-batched-tokens {MAX_NUM_BATCHED_TOKENS} --max-num-seqs {MAX_NUM_SEQS} --hash sha256"
    )
    result = run_study(options, load_requests(options)).results[Routing(args.routing)]
    figures = {f.request_id: f for f in result.request_figures}
    outcomes = []
    for i, request in enumerate(trace):
        f = figures.get(request.request_id)
        if f is None:
            outcomes.append(Outcome(i, None, request.prompt_length, 0, None, "not admitted"))
        else:
            outcomes.append(Outcome(i, f.replica, f.prompt_tokens, f.cached_tokens, f.ttft_s))
    summary = {"evictions": result.evictions, "preemptions": result.preemptions, "token_hit_rate": result.token_hit_rate,
               "peak_usage": result.peak_usage, "overloaded": result.overloaded}  # fmt: skip
    return outcomes, command, summary


def _replay(
    router: bench_fleet.Router,
    urls: list[str],
    requests: list[fleet_workload.FleetRequest],
    stretch: float,
    args: argparse.Namespace,
    model: str,
) -> list[bench_fleet.Answer]:
    fleet = bench_fleet.Fleet(None, urls, Path(os.devnull))
    ns = argparse.Namespace(max_tokens=args.max_tokens, sample_every=5.0)
    extra = {"model": model, "ignore_eos": True, "temperature": 0}
    answers, _, _ = asyncio.run(bench_fleet.replay(router, fleet, requests, stretch, ns, body_extra=extra))
    return answers


def run_emulated(
    requests: list[fleet_workload.FleetRequest], stretch: float, args: argparse.Namespace, tmp: Path, model: Path
) -> list[Outcome]:
    ns = argparse.Namespace(profile=args.profile, replicas=args.replicas)
    flags = ["--block-size", str(vllm_fleet.BLOCK_SIZE), "--hash", "sha256", "--num-gpu-blocks-override",
             str(args.num_blocks), "--no-tenant-isolation", "--max-model-len", str(MAX_MODEL_LEN),
             "--max-num-batched-tokens", str(MAX_NUM_BATCHED_TOKENS), "--max-num-seqs", str(MAX_NUM_SEQS),
             "--served-model-name", str(model)]  # fmt: skip
    fleet = bench_fleet.start_fleet(ns, tmp, "emulated", serve_flags=flags)
    router: bench_fleet.Router | None = None
    try:
        router = bench_fleet.start_kvpool_route(
            "emulated", args.routing, fleet.urls, tmp / "router-emulated.log", ["--no-tenant-isolation"],
            model=str(model),
        )  # fmt: skip
        bench_fleet.progress(f"emulated fleet and router ready ({load_note()}); replaying")
        answers = _replay(router, fleet.urls, requests, stretch, args, str(model))
    finally:
        if router is not None:
            bench_fleet._stop(router.proc)
        fleet.stop()
    return answers_to_outcomes(answers, fleet.urls)


def run_vllm(
    requests: list[fleet_workload.FleetRequest], stretch: float, args: argparse.Namespace, tmp: Path, model: Path
) -> list[Outcome]:
    python, why = vllm_fleet.vllm_python()
    if python is None:
        raise RuntimeError(f"no vLLM-CPU: {why}")
    replicas = [
        vllm_fleet.VLLMReplica(python, model, tmp, f"vllm{k}", num_blocks=args.num_blocks) for k in range(args.replicas)
    ]
    router: bench_fleet.Router | None = None
    try:
        for replica in replicas:
            replica.start()
        for replica in replicas:
            replica.wait_ready()
        bench_fleet.progress(f"{len(replicas)} vLLM-CPU replicas ready; starting the router")
        router = bench_fleet.start_kvpool_route(
            "vllm", args.routing, [r.spec for r in replicas], tmp / "router-vllm.log", ["--no-tenant-isolation"],
            model=str(model),
        )  # fmt: skip
        bench_fleet.progress(f"vLLM-CPU fleet and router ready ({load_note()}); replaying")
        answers = _replay(router, [r.url for r in replicas], requests, stretch, args, str(model))
    finally:
        if router is not None:
            bench_fleet._stop(router.proc)
        for replica in replicas:
            replica.kill()
    return answers_to_outcomes(answers, [r.url for r in replicas])


# -- the report -----------------------------------------------------------------------------------------------------


def print_report(
    outcomes: dict[str, list[Outcome]], comparisons: dict[str, dict[str, Any]], loads: dict[str, str]
) -> None:
    print("\n| side | requests | failed | cached tokens | TTFT p50 | TTFT p90 | load at start |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for side, rows in outcomes.items():
        ok = [o for o in rows if o.error is None]
        f = ttft_figures(rows)
        prompt = sum(o.prompt_tokens for o in ok)
        cached = sum(o.cached_tokens for o in ok)
        share = cached / prompt if prompt else 0.0
        print(
            f"| {side} | {len(rows)} | {len(rows) - len(ok)} | {cached:,} of {prompt:,} ({share:.1%}) | "
            f"{f['ttft_p50_s']:.3f} s | {f['ttft_p90_s']:.3f} s | {loads.get(side, '')} |"
        )
    print(
        "\n| pair | cached tokens equal | same replica | TTFT p50 ratio | TTFT p90 ratio | per-request TTFT ratio, median |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    for pair, c in comparisons.items():
        print(
            f"| {pair} | {c['cached_equal']} of {c['compared']} ({c['cached_equal_share']:.1%}) | "
            f"{c['same_replica']} of {c['compared']} | {c['ttft_p50_ratio']:.3f} | {c['ttft_p90_ratio']:.3f} | "
            f"{c['ttft_ratio_median']:.3f} |"
        )
    for pair, c in comparisons.items():
        for d in c["differences"]:
            a, b = pair.split(" / ")
            print(
                f"  {pair}: request {d['index']}: cached {d['cached'][0]} vs {d['cached'][1]}, replica "
                f"{d['replica'][0]} vs {d['replica'][1]} ({d['why']})"
            )
    for side, rows in outcomes.items():
        for o in rows:
            if o.error is not None:
                print(f"  {side}: request {o.index} failed: {o.error}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--first", type=int, default=0, help="the slice's first trace line")
    parser.add_argument("--count", type=int, default=40, help="requests in the slice")
    parser.add_argument("--conversations", type=int, default=40, help="keep one conversation in this many")
    parser.add_argument("--max-prompt-tokens", type=int, default=1536, help="longer trace prompts are cut to this")
    parser.add_argument("--max-tokens", type=int, default=16, help="output tokens per request (ignore_eos)")
    parser.add_argument("--num-blocks", type=int, default=64, help="each replica's pool, block 0 included")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--routing", choices=ROUTING_RULES, default="prefix", help="the rule, on every side")
    parser.add_argument("--load", type=float, default=0.5, help="offered prefill over the fleet's servable rate")
    parser.add_argument("--profile", default="smollm2-135m-vllm-cpu")
    parser.add_argument("--sides", default=",".join(SIDES), help="which sides to run (sim always runs)")
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = parser.parse_args()
    sides = {"sim", *[s for s in args.sides.split(",") if s]}
    if sides - set(SIDES):
        raise SystemExit(f"unknown sides {sorted(sides - set(SIDES))}; the sides are {list(SIDES)}")
    if args.max_prompt_tokens + args.max_tokens > MAX_MODEL_LEN:
        raise SystemExit(f"--max-prompt-tokens plus --max-tokens must fit in {MAX_MODEL_LEN} tokens")

    model = vllm_fleet.model_folder()
    tokenizer: Any = fleet_workload.load_tokenizer(model)
    trace = fleet_workload.read_trace(first=args.first, count=args.count, conversations=args.conversations)
    requests = list(fleet_workload.fleet_requests(tokenizer, trace, max_prompt_tokens=args.max_prompt_tokens))
    ns = argparse.Namespace(
        profile=args.profile, replicas=args.replicas, max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS, time_scale=1.0
    )
    stretch = bench_fleet.stretch_for(args.load, requests, ns)
    arrivals = [r.trace.arrival_s * stretch for r in requests]
    tmp = Path(tempfile.mkdtemp(prefix="bench-validate-"))
    bench_fleet.progress(
        f"{len(requests)} requests (one conversation in {args.conversations} from line {args.first}, prompts cut to "
        f"{args.max_prompt_tokens}, {sum(r.prompt_tokens for r in requests):,} prompt tokens, {args.max_tokens} "
        f"output each) over {arrivals[-1]:.1f} s (trace seconds x {stretch:.4f}, load {args.load:g}); "
        f"{args.replicas} replicas of {args.num_blocks} blocks, routing {args.routing}; logs in {tmp}"
    )
    outcomes: dict[str, list[Outcome]] = {}
    loads: dict[str, str] = {}
    loads["sim"] = load_note()
    outcomes["sim"], command, sim_summary = run_sim(requests, arrivals, tokenizer, args, tmp)
    bench_fleet.progress(f"sim: done ({command}): {sim_summary}")
    failures: dict[str, str] = {}
    for side, run in (("emulated", run_emulated), ("vllm", run_vllm)):
        if side not in sides:
            continue
        loads[side] = load_note()
        bench_fleet.progress(f"{side}: starting ({loads[side]})")
        t0 = time.monotonic()
        try:
            outcomes[side] = run(requests, stretch, args, tmp, model)
        except (RuntimeError, SystemExit) as exc:
            failures[side] = str(exc)
            bench_fleet.progress(f"{side}: failed: {exc}")
            continue
        bench_fleet.progress(f"{side}: done in {time.monotonic() - t0:.0f} s")
    pairs = [("sim", "vllm"), ("emulated", "vllm"), ("sim", "emulated")]
    comparisons = {f"{a} / {b}": compare(outcomes[a], outcomes[b]) for a, b in pairs if a in outcomes and b in outcomes}
    print(
        f"\n{len(requests)} requests: one conversation in {args.conversations} from trace line {args.first}, prompts "
        f"cut to {args.max_prompt_tokens} tokens, {args.max_tokens} output tokens each, arrivals over "
        f"{arrivals[-1]:.1f} s (load {args.load:g}); {args.replicas} replicas x {args.num_blocks} blocks of "
        f"{vllm_fleet.BLOCK_SIZE} tokens, routing {args.routing}, profile {args.profile}\n"
        f"sim: {command}\nsim: {sim_summary}"
    )
    print_report(outcomes, comparisons, loads)
    for side, why in failures.items():
        print(f"\n{side} did not run: {why}")
    if args.json is not None:
        args.json.write_text(
            json.dumps(
                {
                    "args": {k: str(v) for k, v in vars(args).items()},
                    "stretch": stretch,
                    "sim_command": command,
                    "sim_summary": sim_summary,
                    "loads": loads,
                    "failures": failures,
                    "comparisons": comparisons,
                    "outcomes": {s: [asdict(o) for o in rows] for s, rows in outcomes.items()},
                    "arrivals_s": arrivals,
                    "trace_lines": [r.trace.index for r in requests],
                },
                indent=2,
            )  # fmt: skip
        )


if __name__ == "__main__":
    main()
