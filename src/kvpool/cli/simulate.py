"""``kvpool simulate``: replay a trace through the real manager and scheduler."""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable
from dataclasses import replace
from itertools import islice
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from kvpool.cli.params import (
    NON_NEGATIVE_FLOAT,
    NON_NEGATIVE_INT,
    POSITIVE_INT,
    FiniteFloatRange,
    fail,
    reports_errors,
    require_extra,
)
from kvpool.errors import KVPoolError
from kvpool.hashing import HashAlgo
from kvpool.routing import Routing

if TYPE_CHECKING:
    from kvpool.sim.simulator import SimulationConfig, SimulationResult
    from kvpool.sim.sizing import SizingResult
    from kvpool.sim.traces import TraceRequest
    from kvpool.sim.transfers import TierLink
    from kvpool.tiers.store import TierTarget

SYNTHETIC_PREFIX = "synthetic:"
SYNTHETIC_REQUESTS = 500


def _load(trace: str, requests: int | None, seed: int) -> list[TraceRequest]:
    if trace.startswith(SYNTHETIC_PREFIX):
        from kvpool.sim.workloads import generate_workload

        count = SYNTHETIC_REQUESTS if requests is None else requests
        return generate_workload(trace[len(SYNTHETIC_PREFIX) :], num_requests=count, seed=seed)
    from kvpool.sim.traces import iter_trace

    return list(islice(iter_trace(trace), requests))  # reads no further than the requests replayed


def _plot_folder(plot_dir: Path, flag: str) -> None:
    """Make the folder a plot goes to before any work, so a folder that cannot exist fails fast."""
    require_extra("simulate", "sim", "matplotlib")
    try:
        plot_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        fail("simulate", f"{flag} {str(plot_dir)!r} cannot be created: {exc.strerror or exc}")


def _num_blocks(kv_blocks: int | None, kv_memory: str | None, model: str | None, block_size: int) -> int:
    if kv_blocks is not None:
        return kv_blocks + 1  # plus the null block
    if kv_memory is None or model is None:
        raise KVPoolError("give --kv-blocks N, or --kv-memory SIZE with --model CONFIG")
    from kvpool.planner import parse_size

    budget = parse_size(kv_memory, field="--kv-memory")
    block_bytes = _block_bytes(model, block_size)
    blocks = budget // block_bytes
    if blocks < 2:
        raise KVPoolError(f"--kv-memory {kv_memory} holds {blocks} blocks of {block_bytes:,} B for {model}")
    return blocks


class Duration(FiniteFloatRange):
    """A positive duration in seconds: ``2``, ``2s``, ``500ms``."""

    name = "duration"

    def __init__(self) -> None:
        super().__init__(min=0, min_open=True)

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, str):
            text = value.strip().lower()
            scale = 1.0
            if text.endswith("ms"):
                text, scale = text[:-2], 1e-3
            elif text.endswith("s"):
                text = text[:-1]
            try:
                number = float(text)
            except ValueError:
                self.fail(f"{value!r} is not a duration (e.g. 2s, 500ms or 2).", param, ctx)
            return super().convert(number * scale, param, ctx)
        return super().convert(value, param, ctx)


PERCENTILE = FiniteFloatRange(min=0, max=100, min_open=True, max_open=True)


def _kind_values(flag: str, items: tuple[str, ...], kinds: set[str]) -> dict[str, float]:
    """``("cpu=25", ...)`` as ``{"cpu": 25.0}``: a configured tier kind, a finite number > 0 (latency: >= 0)."""
    values: dict[str, float] = {}
    for item in items:
        kind, sep, number = item.partition("=")
        kind = kind.strip()
        try:
            value = float(number) if sep else math.nan
        except ValueError:
            value = math.nan
        floor_ok = value >= 0 if flag == "--tier-latency" else value > 0
        if not (math.isfinite(value) and floor_ok):
            bound = ">= 0" if flag == "--tier-latency" else "> 0"
            raise KVPoolError(f"{flag} {item!r}: give KIND=NUMBER with a finite number {bound}, e.g. cpu=25")
        if kind not in kinds:
            raise KVPoolError(f"{flag} {item!r}: no --tier of kind {kind!r} is given")
        values[kind] = value
    return values


def _tiers(
    tier: tuple[str, ...], bandwidths: tuple[str, ...], latencies: tuple[str, ...]
) -> tuple[tuple[TierTarget, ...], dict[Any, TierLink]]:
    """The tier specs (the engine's grammar, parsed once) and each kind's link, defaults overridden by the flags."""
    from kvpool.sim.transfers import DEFAULT_LINKS, TierLink
    from kvpool.tiers.store import parse_specs

    targets = parse_specs(tier)
    kinds = {t.kind.value for t in targets}
    bandwidth = _kind_values("--tier-bandwidth", bandwidths, kinds)
    latency = _kind_values("--tier-latency", latencies, kinds)
    links = {}
    for target in targets:
        default = DEFAULT_LINKS[target.kind]
        name = target.kind.value
        links[target.kind] = TierLink(
            bandwidth_bytes_per_s=bandwidth[name] * 1e9 if name in bandwidth else default.bandwidth_bytes_per_s,
            latency_s=latency[name] / 1e6 if name in latency else default.latency_s,
        )
    return targets, links


def _block_bytes(model: str, block_size: int) -> int:
    """Bytes of one pool block of ``model`` (every layer group) at ``block_size``."""
    from kvpool.model_config import load_model_config
    from kvpool.model_layers import layer_specs_from_config
    from kvpool.specs import group_layers, pool_block_bytes

    return pool_block_bytes(group_layers(layer_specs_from_config(load_model_config(model), block_size=block_size)))


def _kv_bytes_per_token(model: str | None, block_size: int) -> int | None:
    """KV bytes per token of ``model`` (all layers), or None without a model."""
    return None if model is None else max(1, _block_bytes(model, block_size) // block_size)


def _deltas(update: Callable[[int], object]) -> Callable[[int], None]:
    """Turn a running count into the increments a progress bar wants."""
    done = [0]

    def report(total: int) -> None:
        update(total - done[0])
        done[0] = total

    return report


def _percent(x: float) -> str:
    return f"{100 * x:.2f}%"


def _load_line(result: SimulationResult) -> str:
    servable = f"{result.servable_prefill_tokens_per_s:,.0f} prefill tokens/s servable"
    offered = result.offered_prefill_tokens_per_s
    if offered is None:
        return f"every request arrives at once; {servable}"
    rates = f"{offered:,.0f} prefill tokens/s offered (after cache hits), {servable}"
    if result.overloaded:
        return (
            f"OVERLOADED: {rates} by {result.replicas} replica(s) at most; the queue grows while this lasts, "
            "and time to first token measures the backlog, not the model"
        )
    return rates


def _print_table(result: SimulationResult, label: str) -> None:
    rows = [
        ("requests", f"{result.requests:,}"),
        ("rejected", f"{result.rejected:,} (larger than the whole pool, never admitted)"),
        ("pool", f"{result.num_blocks - 1:,} blocks x {result.block_size} tokens, policy {result.policy}"),
        ("token hit rate", _percent(result.token_hit_rate)),
        ("block hit rate", _percent(result.block_hit_rate)),
        ("prefill tokens saved", f"{result.prefill_tokens_saved:,} of {result.prompt_tokens:,} prompt tokens"),
        ("prefill tokens computed", f"{result.prefill_tokens_computed:,} (recompute included)"),
        ("evictions", f"{result.evictions:,}"),
        ("preemptions", f"{result.preemptions:,}"),
        ("peak KV usage", _percent(result.peak_usage)),
        (
            "time to first token",
            f"p50 {result.ttft_p50_s:.3f} s, p90 {result.ttft_p90_s:.3f} s, p99 {result.ttft_p99_s:.3f} s",
        ),
        ("queue time", f"p50 {result.queue_p50_s:.3f} s, p90 {result.queue_p90_s:.3f} s"),
        (
            "throughput",
            f"{result.output_tokens_per_s:,.0f} output tok/s, {result.prompt_tokens_per_s:,.0f} prompt tok/s",
        ),
        ("simulated time", f"{result.simulated_seconds:,.1f} s (replayed in {result.wall_seconds:.1f} s)"),
    ]
    if len(result.hit_tokens_by_tier) > 1:
        share = ", ".join(
            f"{name} {_percent(n / result.prompt_tokens if result.prompt_tokens else 0.0)}"
            for name, n in result.hit_tokens_by_tier.items()
        )
        rows.insert(4, ("hits by tier", f"{share} of prompt tokens"))
        rows.insert(5, ("tier load time", f"{result.tier_load_seconds:,.1f} s in all (added to the steps that load)"))
        rows.insert(6, ("tier save time", f"{result.tier_save_seconds:,.1f} s in all (not on the steps' path)"))
    if result.replicas > 1:
        rows.insert(1, ("replicas", f"{result.replicas}, routing {result.routing}"))
        rows.append(
            (
                "load imbalance",
                f"busiest replica / mean: {result.request_imbalance:.2f} in requests, "
                f"{result.work_imbalance:.2f} in prefill tokens computed",
            )
        )
    rows.append(("load", _load_line(result)))
    if not result.overloaded and result.queue_p90_s > 1.0 and result.peak_usage >= 0.99:
        rows.append(
            (
                "queueing",
                f"requests wait for KV blocks, not compute: the pool filled up (peak usage "
                f"{_percent(result.peak_usage)}, {result.preemptions:,} preemptions)",
            )
        )
    click.echo(label)
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        click.echo(f"  {key:<{width}}  {value}")


@click.command()
@click.argument("trace")
@click.option("--kv-blocks", type=POSITIVE_INT, help="Usable KV blocks (the pool gets one more, the null block).")
@click.option("--kv-memory", help="KV memory, e.g. 40GiB or 40GB; needs --model.")
@click.option("--model", help="Shipped config name or config.json path, to size blocks from --kv-memory.")
@click.option("--block-size", type=POSITIVE_INT, default=16, show_default=True)
@click.option("--policy", default="lru", show_default=True, help="Eviction policy (lru is vLLM's order).")
@click.option("--sequential", is_flag=True, help="One request at a time in file order, freed before the next.")
@click.option(
    "--requests", "max_requests", type=POSITIVE_INT, help="Replay only the first N requests (synthetic: how many)."
)
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of synthetic workloads.")
@click.option("--max-num-batched-tokens", type=POSITIVE_INT, default=8192, show_default=True)
@click.option("--max-num-seqs", type=POSITIVE_INT, default=256, show_default=True)
@click.option(
    "--step-overhead-ms",
    type=NON_NEGATIVE_FLOAT,
    default=10.0,
    show_default=True,
    help="Cost model: fixed time per step.",
)
@click.option(
    "--prefill-us-per-token",
    type=NON_NEGATIVE_FLOAT,
    default=50.0,
    show_default=True,
    help="Cost model: prefill time per token.",
)
@click.option(
    "--decode-us-per-seq",
    type=NON_NEGATIVE_FLOAT,
    default=100.0,
    show_default=True,
    help="Cost model: decode time per sequence per step.",
)
@click.option(
    "--tier",
    "tier_flags",
    multiple=True,
    metavar="SPEC",
    help="A KV tier below each replica's pool, as the engine's --kv-tier takes it (cpu:4GiB, disk:PATH:50GiB, "
    "redis://HOST:PORT/DB; sizes become blocks through the block's bytes); repeat, in lookup order.",
)
@click.option(
    "--kv-tier-write",
    "tier_write",
    type=click.Choice(["write-through", "write-back"]),
    default="write-through",
    show_default=True,
    help="When blocks go down to the tiers: when they fill, or when the pool evicts them (as the engine's flag).",
)
@click.option(
    "--tier-bandwidth",
    multiple=True,
    metavar="KIND=GB/S",
    help="A tier's load bandwidth in GB/s (defaults: cpu 25, disk 4, redis 1.25).",
)
@click.option(
    "--tier-latency",
    multiple=True,
    metavar="KIND=US",
    help="A tier's latency per load in microseconds (defaults: cpu 10, disk 100, redis 300).",
)
@click.option(
    "--kv-bytes-per-token",
    type=POSITIVE_INT,
    help="KV bytes per token, to size tier loads (default: from --model, else 131072, Llama-3.1-8B in bf16).",
)
@click.option(
    "--replicas", type=POSITIVE_INT, default=1, show_default=True, help="Simulated replicas, each its own pool."
)
@click.option(
    "--routing",
    "routing_rules",
    multiple=True,
    type=click.Choice([r.value for r in Routing]),
    help="How arrivals are spread over replicas; repeat to compare (default: all three with --replicas > 1).",
)
@click.option("--ttft-slo", type=Duration(), help="Size the deployment: the fewest replicas whose TTFT meets this.")
@click.option(
    "--ttft-slo-percentile",
    type=PERCENTILE,
    default=90.0,
    show_default=True,
    help="The TTFT percentile --ttft-slo bounds.",
)
@click.option(
    "--max-replicas", type=POSITIVE_INT, default=64, show_default=True, help="Largest count --ttft-slo tries."
)
@click.option(
    "--hash",
    "hash_algo",
    type=click.Choice(sorted({a.value for a in HashAlgo} | {"xxh3_128"})),
    default="xxh3_128",
    show_default=True,
    help="Block hash; xxh3_128 verifies every hit, so hit rates are the same, only faster.",
)
@click.option(
    "--curve", help="Comma-separated cache sizes in blocks: also compute the hit-rate curve (sequential model)."
)
@click.option("--curve-policies", default="lru", show_default=True, help="Comma-separated policies for --curve.")
@click.option(
    "--lookahead",
    type=NON_NEGATIVE_INT,
    default=0,
    show_default=True,
    help="Sequential runs: announce the next N requests as waiting (for the 'waiting' policy).",
)
@click.option("--plot-dir", type=click.Path(file_okay=False, path_type=Path), help="Write PNG plots here.")
@click.option(
    "--plot",
    "plot_path",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Write the timeline (KV usage, requests waiting, time to first token) to this PNG.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the figures as JSON.")
@reports_errors("simulate")
def simulate(
    trace: str,
    kv_blocks: int | None,
    kv_memory: str | None,
    model: str | None,
    block_size: int,
    policy: str,
    sequential: bool,
    max_requests: int | None,
    seed: int,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    step_overhead_ms: float,
    prefill_us_per_token: float,
    decode_us_per_seq: float,
    tier_flags: tuple[str, ...],
    tier_write: str,
    tier_bandwidth: tuple[str, ...],
    tier_latency: tuple[str, ...],
    kv_bytes_per_token: int | None,
    replicas: int,
    routing_rules: tuple[str, ...],
    ttft_slo: float | None,
    ttft_slo_percentile: float,
    max_replicas: int,
    hash_algo: str,
    curve: str | None,
    curve_policies: str,
    lookahead: int,
    plot_dir: Path | None,
    plot_path: Path | None,
    as_json: bool,
) -> None:
    """Replay TRACE (a trace file, or synthetic:KIND) through kvpool's manager and scheduler.

    TRACE is a Mooncake JSONL trace, kvpool's token-level JSONL format, or
    synthetic:shared_prefix | multi_turn | agent | multi_tenant | mixed. Times
    are simulated with the cost model (defaults: 10 ms per step, 50 us per
    prefill token, 100 us per decoding sequence). Requests larger than the
    whole pool are counted as rejected and skipped. --tier adds offload tiers
    (a load costs its latency plus the blocks' bytes over the tier's bandwidth);
    --replicas N with --routing spreads the trace over N replicas; --ttft-slo
    searches for the fewest replicas that meet it. --curve needs numpy, and
    --plot-dir and --plot matplotlib (the sim extra).
    """
    from kvpool.sim.simulator import CostModel, SimulationConfig, policy_factory

    if curve is not None:
        require_extra("simulate", "sim", "numpy")
    if plot_dir is not None:
        _plot_folder(plot_dir, "--plot-dir")
    if plot_path is not None:
        _plot_folder(plot_path.parent, "--plot")
    from kvpool.tiers.spec import WritePolicy

    tiers, links = _tiers(tier_flags, tier_bandwidth, tier_latency)
    write = WritePolicy.parse(tier_write)
    rules = [Routing(r) for r in dict.fromkeys(routing_rules)] or (
        list(Routing) if replicas > 1 or ttft_slo is not None else [Routing.PREFIX]
    )
    if ttft_slo is not None and replicas > 1:
        raise KVPoolError(f"--ttft-slo searches for the number of replicas; drop --replicas {replicas}")
    if sequential and (replicas > 1 or routing_rules or ttft_slo is not None or tiers):
        raise KVPoolError(
            "--sequential replays one pool alone; drop it to use --tier, --replicas, --routing or --ttft-slo"
        )
    requests = _load(trace, max_requests, seed)
    if not requests:
        raise KVPoolError(f"trace {trace} holds no requests")
    curve_only = curve is not None and kv_blocks is None and kv_memory is None
    num_blocks = 0 if curve_only else _num_blocks(kv_blocks, kv_memory, model, block_size)
    policy_factory(policy)  # an unknown name fails before any work
    label = f"{trace}: {len(requests):,} requests"
    show = not as_json
    output: dict[str, Any] = {"trace": trace, "requests": len(requests)}
    if kv_bytes_per_token is None:
        kv_bytes_per_token = _kv_bytes_per_token(model, block_size)
    cost = CostModel(
        step_overhead_s=step_overhead_ms / 1e3,
        prefill_s_per_token=prefill_us_per_token / 1e6,
        decode_s_per_seq=decode_us_per_seq / 1e6,
        **({} if kv_bytes_per_token is None else {"kv_bytes_per_token": kv_bytes_per_token}),
    )
    if tiers:
        output["tiers"] = _describe_tiers(tiers, links, write, cost, block_size, show)

    if curve_only:
        pass
    elif sequential:
        from kvpool.sim.sequential import replay_sequential

        with click.progressbar(length=len(requests), label="replaying", file=sys.stderr, hidden=not show) as bar:
            seq_result = replay_sequential(
                requests,
                num_blocks - 1,
                block_size=block_size,
                policy=policy,
                hash_algo=hash_algo,
                lookahead=lookahead,
                progress=_deltas(bar.update),
            )
        from dataclasses import asdict

        output["sequential"] = {
            **asdict(seq_result),
            "token_hit_rate": seq_result.token_hit_rate,
            "block_hit_rate": seq_result.block_hit_rate,
        }
        if show:
            click.echo(f"{label} (sequential)")
            for key, value in output["sequential"].items():
                click.echo(f"  {key:<22} {value}")
    else:
        config = SimulationConfig(
            num_blocks=num_blocks,
            block_size=block_size,
            policy=policy,
            hash_algo=hash_algo,
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
            cost=cost,
            tiers=tiers,
            tier_write=write,
            tier_links=links,
            replicas=replicas,
            routing=rules[0],
        )
        if ttft_slo is not None:
            output["sizing"] = _size(requests, config, rules, ttft_slo, ttft_slo_percentile, max_replicas, show)
        else:
            results = {rule: _replay(requests, replace(config, routing=rule), show) for rule in rules}
            first = results[rules[0]]
            output["simulation"] = first.to_dict()
            if len(results) > 1:
                output["routing"] = {rule.value: r.to_dict() for rule, r in results.items()}
            if show:
                for result in results.values():
                    _print_table(result, label)
                if len(results) > 1:
                    _print_routing(results)
            _plots(first, plot_dir, plot_path, label, output, show)

    if curve:
        output["curve"] = _curve(
            requests, curve, curve_policies, block_size, hash_algo, lookahead, plot_dir, label, show
        )

    if as_json:
        click.echo(json.dumps(output, indent=2))


def _replay(requests: list[TraceRequest], config: SimulationConfig, show: bool) -> SimulationResult:
    from kvpool.sim.simulator import simulate as run_simulation

    label = "replaying" if config.replicas == 1 else f"replaying ({config.routing.value}, {config.replicas} replicas)"
    with click.progressbar(length=len(requests), label=label, file=sys.stderr, hidden=not show) as bar:
        return run_simulation(requests, config, progress=bar.update)


def _describe_tiers(
    tiers: tuple[TierTarget, ...], links: dict[Any, TierLink], write: Any, cost: Any, block_size: int, show: bool
) -> list[dict[str, Any]]:
    from kvpool.sim.transfers import capacity_blocks
    from kvpool.tiers.spec import TierKind

    block_bytes = block_size * cost.kv_bytes_per_token
    recompute = block_size * cost.prefill_s_per_token
    described = []
    for target in tiers:
        link = links[target.kind]
        blocks = capacity_blocks(target, block_bytes)
        shared = target.kind is TierKind.REDIS
        load = link.seconds(1, block_bytes)
        described.append(
            {
                "kind": target.kind.value,
                "capacity_blocks": blocks,
                "write": write.value,
                "bandwidth_gb_per_s": link.bandwidth_bytes_per_s / 1e9,
                "latency_us": link.latency_s * 1e6,
                "shared": shared,
                "load_ms_per_block": load * 1e3,
                "recompute_ms_per_block": recompute * 1e3,
            }
        )
        if show:
            verdict = "faster" if load < recompute else "SLOWER"
            size = "unbounded" if blocks is None else f"{blocks:,} blocks"
            click.echo(
                f"tier {target.kind.value} ({write.value}): {size}{' (shared by every replica)' if shared else ''}, "
                f"{link.bandwidth_bytes_per_s / 1e9:g} GB/s, {link.latency_s * 1e6:g} us; loading a block takes "
                f"{load * 1e3:.2f} ms, {verdict} than recomputing it ({recompute * 1e3:.2f} ms)"
            )
    return described


def _print_routing(results: dict[Routing, SimulationResult]) -> None:
    replicas = next(iter(results.values())).replicas
    click.echo(f"routing over {replicas} replicas")
    click.echo(f"  {'rule':<14}{'hit rate':>10}{'TTFT p50':>11}{'p90':>10}{'p99':>10}{'req imb.':>10}{'work imb.':>11}")
    for rule, r in results.items():
        click.echo(
            f"  {rule.value:<14}{_percent(r.token_hit_rate):>10}{r.ttft_p50_s:>10.2f}s{r.ttft_p90_s:>9.2f}s"
            f"{r.ttft_p99_s:>9.2f}s{r.request_imbalance:>10.2f}{r.work_imbalance:>11.2f}"
        )
    prefix, rr = results.get(Routing.PREFIX), results.get(Routing.ROUND_ROBIN)
    if prefix is not None and rr is not None:
        click.echo(
            f"  prefix over round-robin: hit rate {100 * (prefix.token_hit_rate - rr.token_hit_rate):+.2f} points, "
            f"prefill tokens computed x{prefix.prefill_tokens_computed / max(rr.prefill_tokens_computed, 1):.3f}, "
            f"TTFT p50 x{prefix.ttft_p50_s / rr.ttft_p50_s if rr.ttft_p50_s else float('nan'):.3f}"
        )


def _size(
    requests: list[TraceRequest],
    config: SimulationConfig,
    rules: list[Routing],
    slo: float,
    percentile: float,
    max_replicas: int,
    show: bool,
) -> dict[str, Any]:
    from dataclasses import asdict

    from kvpool.sim.simulator import ttft_quantile
    from kvpool.sim.sizing import fewest_replicas

    answers: dict[str, SizingResult] = {}
    for rule in rules:

        def run(c: SimulationConfig) -> SimulationResult:
            result = _replay(requests, c, show)
            click.echo(
                f"sizing {c.routing.value}: {c.replicas} replicas -> p{percentile:g} TTFT "
                f"{ttft_quantile(result, percentile):.3f} s{' (overloaded)' if result.overloaded else ''}",
                err=True,
            )
            return result

        answers[rule.value] = fewest_replicas(
            requests,
            replace(config, routing=rule),
            slo_s=slo,
            percentile=percentile,
            max_replicas=max_replicas,
            run=run,
        )
    if show:
        click.echo(f"fewest replicas with p{percentile:g} time to first token <= {slo:g} s")
        for name, answer in answers.items():
            found = f"{answer.replicas}" if answer.replicas is not None else f"none up to {max_replicas}"
            tried = ", ".join(f"{n}: {t:.2f} s" for n, t in answer.ttft_by_replicas.items())
            click.echo(f"  {name:<14}{found:>8}   (tried {tried})")
    return {name: asdict(answer) for name, answer in answers.items()}


def _plots(
    result: SimulationResult,
    plot_dir: Path | None,
    plot_path: Path | None,
    label: str,
    output: dict[str, Any],
    show: bool,
) -> None:
    from kvpool.sim.plots import plot_timeline

    title = f"{label}, {result.replicas} replica(s)" if result.replicas > 1 else label
    targets = [p for p in (plot_dir / "usage.png" if plot_dir is not None else None, plot_path) if p is not None]
    for path in targets:
        plot_timeline(result.usage_timeline, result.queue_timeline, result.ttft_points, path, title=title)
    if targets:
        output["usage_plot"] = str(targets[0])
        if show:
            click.echo(f"  timeline plot          {', '.join(str(p) for p in targets)}")


def _curve(
    requests: list[TraceRequest],
    curve: str,
    curve_policies: str,
    block_size: int,
    hash_algo: str,
    lookahead: int,
    plot_dir: Path | None,
    label: str,
    show: bool,
) -> dict[str, Any]:
    from kvpool.sim.optimum import optimal_hit_rate
    from kvpool.sim.sequential import replay_sequential

    try:
        sizes = [int(x) for x in curve.split(",") if x.strip()]
    except ValueError:
        raise KVPoolError(f"--curve must be comma-separated integers, got {curve!r}") from None
    if not sizes or min(sizes) < 1:
        raise KVPoolError(f"--curve sizes must be positive, got {curve!r}")
    policies = [p.strip() for p in curve_policies.split(",") if p.strip()]
    rates: dict[str, list[float]] = {p: [] for p in policies}
    rates["optimum"] = []
    total = len(sizes) * (len(policies) + 1)
    with click.progressbar(length=total, label="hit-rate curve", file=sys.stderr, hidden=not show) as bar:
        for size in sizes:
            for p in policies:
                rates[p].append(
                    replay_sequential(
                        requests, size, block_size=block_size, policy=p, hash_algo=hash_algo, lookahead=lookahead
                    ).token_hit_rate
                )
                bar.update(1)
            rates["optimum"].append(optimal_hit_rate(requests, size, block_size).token_hit_rate)
            bar.update(1)
    if show:
        click.echo("hit-rate curve (sequential model, token hit rate)")
        click.echo("  " + f"{'blocks':>10}" + "".join(f"{name:>12}" for name in rates))
        for i, size in enumerate(sizes):
            click.echo("  " + f"{size:>10,}" + "".join(f"{_percent(r[i]):>12}" for r in rates.values()))
    result: dict[str, Any] = {"sizes": sizes, "lookahead": lookahead, "token_hit_rate": rates}
    if plot_dir is not None:
        from kvpool.sim.plots import plot_hit_rate_curve

        path = plot_hit_rate_curve(
            sizes, rates, plot_dir / "hit_rate_curve.png", title=f"Hit rate vs cache size, {label}"
        )
        result["plot"] = str(path)
        if show:
            click.echo(f"  curve plot             {path}")
    return result
