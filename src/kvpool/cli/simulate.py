"""``kvpool simulate``: replay a trace through the real manager and scheduler."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from itertools import islice
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from kvpool.cli.params import NON_NEGATIVE_FLOAT, NON_NEGATIVE_INT, POSITIVE_INT, fail, reports_errors, require_extra
from kvpool.errors import KVPoolError

if TYPE_CHECKING:
    from kvpool.sim.simulator import SimulationResult
    from kvpool.sim.traces import TraceRequest

SYNTHETIC_PREFIX = "synthetic:"
SYNTHETIC_REQUESTS = 500


def _load(trace: str, requests: int | None, seed: int) -> list[TraceRequest]:
    if trace.startswith(SYNTHETIC_PREFIX):
        from kvpool.sim.workloads import generate_workload

        count = SYNTHETIC_REQUESTS if requests is None else requests
        return generate_workload(trace[len(SYNTHETIC_PREFIX) :], num_requests=count, seed=seed)
    from kvpool.sim.traces import iter_trace

    return list(islice(iter_trace(trace), requests))  # reads no further than the requests replayed


def _plot_folder(plot_dir: Path) -> None:
    """Make ``--plot-dir`` before any work, so a folder that cannot exist fails fast."""
    require_extra("simulate", "sim", "matplotlib")
    try:
        plot_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        fail("simulate", f"--plot-dir {str(plot_dir)!r} cannot be created: {exc.strerror or exc}")


def _num_blocks(kv_blocks: int | None, kv_memory: str | None, model: str | None, block_size: int) -> int:
    if kv_blocks is not None:
        return kv_blocks + 1  # plus the null block
    if kv_memory is None or model is None:
        raise KVPoolError("give --kv-blocks N, or --kv-memory SIZE with --model CONFIG")
    from kvpool.model_config import load_model_config
    from kvpool.model_layers import layer_specs_from_config
    from kvpool.planner import parse_size
    from kvpool.specs import group_layers, pool_block_bytes

    budget = parse_size(kv_memory, field="--kv-memory")
    groups = group_layers(layer_specs_from_config(load_model_config(model), block_size=block_size))
    block_bytes = pool_block_bytes(groups)
    blocks = budget // block_bytes
    if blocks < 2:
        raise KVPoolError(f"--kv-memory {kv_memory} holds {blocks} blocks of {block_bytes:,} B for {model}")
    return blocks


def _deltas(update: Callable[[int], object]) -> Callable[[int], None]:
    """Turn a running count into the increments a progress bar wants."""
    done = [0]

    def report(total: int) -> None:
        update(total - done[0])
        done[0] = total

    return report


def _percent(x: float) -> str:
    return f"{100 * x:.2f}%"


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
    "--hash",
    "hash_algo",
    type=click.Choice(["sha256", "xxh3_128"]),
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
    hash_algo: str,
    curve: str | None,
    curve_policies: str,
    lookahead: int,
    plot_dir: Path | None,
    as_json: bool,
) -> None:
    """Replay TRACE (a trace file, or synthetic:KIND) through kvpool's manager and scheduler.

    TRACE is a Mooncake JSONL trace, kvpool's token-level JSONL format, or
    synthetic:shared_prefix | multi_turn | agent | multi_tenant | mixed. Times
    are simulated with the cost model (defaults: 10 ms per step, 50 us per
    prefill token, 100 us per decoding sequence). Requests larger than the
    whole pool are counted as rejected and skipped. --curve needs numpy and
    --plot-dir matplotlib (the sim extra).
    """
    from kvpool.sim.simulator import CostModel, SimulationConfig, policy_factory
    from kvpool.sim.simulator import simulate as run_simulation

    if curve is not None:
        require_extra("simulate", "sim", "numpy")
    if plot_dir is not None:
        _plot_folder(plot_dir)
    requests = _load(trace, max_requests, seed)
    if not requests:
        raise KVPoolError(f"trace {trace} holds no requests")
    curve_only = curve is not None and kv_blocks is None and kv_memory is None
    num_blocks = 0 if curve_only else _num_blocks(kv_blocks, kv_memory, model, block_size)
    policy_factory(policy)  # an unknown name fails before any work
    label = f"{trace}: {len(requests):,} requests"
    show = not as_json
    output: dict[str, Any] = {"trace": trace, "requests": len(requests)}

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
            cost=CostModel(
                step_overhead_s=step_overhead_ms / 1e3,
                prefill_s_per_token=prefill_us_per_token / 1e6,
                decode_s_per_seq=decode_us_per_seq / 1e6,
            ),
        )
        with click.progressbar(length=len(requests), label="replaying", file=sys.stderr, hidden=not show) as bar:
            result = run_simulation(requests, config, progress=bar.update)
        output["simulation"] = result.to_dict()
        if show:
            _print_table(result, label)
        if plot_dir is not None:
            from kvpool.sim.plots import plot_usage

            path = plot_usage(result.usage_timeline, plot_dir / "usage.png", title=f"KV usage, {label}")
            output["usage_plot"] = str(path)
            if show:
                click.echo(f"  usage plot             {path}")

    if curve:
        output["curve"] = _curve(
            requests, curve, curve_policies, block_size, hash_algo, lookahead, plot_dir, label, show
        )

    if as_json:
        click.echo(json.dumps(output, indent=2))


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
