"""``kvpool simulate``: replay a trace through the real manager and scheduler.

The command maps its flags onto :class:`kvpool.sim.options.SimulateOptions`
(which checks them), reads the trace once (:func:`kvpool.sim.study.load_requests`),
runs the study (:func:`kvpool.sim.study.run_study`) and prints, plots or
writes as JSON the report it gets back.
"""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Callable, Iterator
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from kvpool.checks import counted
from kvpool.cli.params import (
    NON_NEGATIVE_FLOAT,
    NON_NEGATIVE_INT,
    POSITIVE_INT,
    FiniteFloatRange,
    fail,
    reports_errors,
    require_extra,
)
from kvpool.hashing import HashAlgo
from kvpool.routing import Routing

if TYPE_CHECKING:
    from kvpool.sim.progress import Progress
    from kvpool.sim.simulator import SimulationResult
    from kvpool.sim.study import CurveResult, StudyReport


def _plot_folder(plot_dir: Path, flag: str) -> None:
    """Make the folder a plot goes to before any work, so a folder that cannot exist fails fast."""
    require_extra("simulate", "sim", "matplotlib")
    try:
        plot_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        fail("simulate", f"{flag} {str(plot_dir)!r} cannot be created: {exc.strerror or exc}")


def _report_folder(report_dir: Path) -> None:
    """The page's folder, made before any work: a file there, or a folder that cannot be made, fails fast."""
    from kvpool.sim.report import prepare_report_dir

    require_extra("simulate", "sim", "matplotlib")
    prepare_report_dir(report_dir)  # a ConfigError: one line naming the path, exit status 2


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
            f"OVERLOADED: {rates} by {counted(result.replicas, 'replica')} at most; the queue grows while this lasts, "
            "and time to first token measures the backlog, not the model"
        )
    return rates


def _queueing_line(result: SimulationResult) -> str | None:
    """Why requests queue when the replay is not overloaded but they wait: the pool is full; else None."""
    if result.overloaded or result.queue_p90_s <= 1.0 or result.peak_usage < 0.99:
        return None
    return (
        f"requests wait for KV blocks, not compute: the pool filled up (peak usage "
        f"{_percent(result.peak_usage)}, {result.preemptions:,} preemptions)"
    )


def _decisions_line(result: SimulationResult) -> str:
    """What the load-or-compute rule decided: requests each way, and the tier blocks computed instead of loaded."""
    ways = ", ".join(f"{n:,} {way}" for way, n in result.load_decisions.items() if n)
    computed = ", ".join(f"{tier} {n:,}" for tier, n in result.tier_blocks_computed.items() if n)
    return f"requests {ways or 'none'}; blocks computed instead of loaded: {computed or 'none'}"


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
        if result.load_decisions:
            rows.insert(7, ("load or compute", _decisions_line(result)))
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
    queueing = _queueing_line(result)
    if queueing is not None:
        rows.append(("queueing", queueing))
    click.echo(label)
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        click.echo(f"  {key:<{width}}  {value}")


def _progress() -> Progress:
    """The study's progress on stderr: bars on a terminal, else plain lines every 10%.

    ``--json`` keeps it: the figures go to stdout alone, so a script that reads them still sees how far
    a long replay has come in its log. The sizing search's lines are written either way.
    """
    from kvpool.sim.progress import Progress, ProgressLines

    if not sys.stderr.isatty():
        return ProgressLines(sys.stderr)

    class Bars(Progress):
        @contextlib.contextmanager
        def bar(self, label: str, total: int) -> Iterator[Callable[[int], None]]:
            with click.progressbar(length=total, label=label, file=sys.stderr) as bar:
                yield bar.update

        def note(self, text: str) -> None:
            click.echo(text, err=True)

    return Bars()


@click.command()
@click.argument("trace")
@click.option("--kv-blocks", type=POSITIVE_INT, help="Usable KV blocks (the pool gets one more, the null block).")
@click.option("--kv-memory", help="KV memory, e.g. 40GiB or 40GB; needs --model.")
@click.option(
    "--model",
    "--config",
    "model",
    help="Shipped config name or config.json path, to size blocks from --kv-memory (--config is the same option, "
    "as plan spells it).",
)
@click.option("--block-size", type=POSITIVE_INT, default=16, show_default=True)
@click.option("--policy", default="lru", show_default=True, help="Eviction policy (lru is vLLM's order).")
@click.option("--sequential", is_flag=True, help="One request at a time in file order, freed before the next.")
@click.option(
    "--requests", "max_requests", type=POSITIVE_INT, help="Replay only the first N requests (synthetic: how many)."
)
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of synthetic workloads.")
@click.option(
    "--arrival-rate-scale",
    type=FiniteFloatRange(min=0, min_open=True),
    default=1.0,
    show_default=True,
    help="Requests arrive this many times as fast as the trace says (2: arrival times halved).",
)
@click.option("--max-num-batched-tokens", type=POSITIVE_INT, default=8192, show_default=True)
@click.option("--max-num-seqs", type=POSITIVE_INT, default=256, show_default=True)
@click.option(
    "--profile",
    default=None,
    metavar="NAME|FILE",
    help="Cost profile: a built-in name or a JSON file (kvpool.cost_model; default round-8b-h100: 10 ms a step, "
    "50 us a prefill token, 100 us a decoding sequence).",
)
@click.option(
    "--step-overhead-ms",
    type=NON_NEGATIVE_FLOAT,
    default=None,
    help="Override the profile's fixed time per step (its own: 10 for the default).",
)
@click.option(
    "--prefill-us-per-token",
    type=NON_NEGATIVE_FLOAT,
    default=None,
    help="Override the profile's prefill time per token, at every chunk size (default profile: 50).",
)
@click.option(
    "--decode-us-per-seq",
    type=NON_NEGATIVE_FLOAT,
    default=None,
    help="Override the profile's decode time per sequence per step (default profile: 100).",
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
    "--layer-groups",
    "layer_groups",
    is_flag=True,
    help="Simulate the --model's layer groups (a hybrid model's full-attention and sliding-window groups, each "
    "block a pool block) instead of one full-attention group.",
)
@click.option(
    "--kv-tier-window-aware-saves",
    "window_aware_saves",
    is_flag=True,
    help="With --layer-groups: window groups save only the blocks a request can still read (fewer bytes saved, "
    "fewer hits on prefixes shared short of a request's last window); the default saves every full block.",
)
@click.option(
    "--kv-tier-always-load",
    "always_load",
    is_flag=True,
    help="Load every tier hit, even where computing its tokens is faster (the engine's load-or-compute rule is off).",
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
    help="How arrivals are spread over replicas (kvpool.routing's laws); repeat to compare (default: every rule "
    "with --replicas > 1).",
)
@click.option(
    "--routing-load-cost",
    type=FiniteFloatRange(min=0, min_open=True),
    help="The prefix rule's weight: cached 16-token blocks one request in flight is worth, as kvpool route's "
    "--load-cost (default 8: 128 tokens).",
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
    help="Block hash (default: xxh3_128 with the fast extra, else kvpool_sha256); xxh3_128 verifies every hit, "
    "so hit rates are the same, only faster.",
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
@click.option(
    "--report",
    "report_dir",
    type=click.Path(path_type=Path),
    help="Write one HTML page of the study to DIR/index.html (charts inline, readable offline), each chart's data "
    "beside it as CSV and JSON.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the figures as JSON.")
@click.option(
    "--sweep",
    "sweep_file",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Run the grid this TOML file names (docs/simulator.md, 'Sweeps'): one simulation per configuration, "
    "over the other flags' options.",
)
@click.option(
    "--sweep-out",
    type=click.Path(dir_okay=False, path_type=Path),
    help="The sweep's results, one JSON line per configuration as it finishes (default: SWEEP.results.jsonl "
    "beside the sweep file); a rerun skips the configurations it holds.",
)
@click.option(
    "--workers",
    type=POSITIVE_INT,
    help="Sweep: processes running configurations (default: the CPU count; 1 runs them here, one by one); "
    "with --ray local, the CPUs of the Ray it starts.",
)
@click.option(
    "--ray",
    "ray_address",
    metavar="ADDRESS",
    help="Sweep: run the configurations as Ray tasks on this cluster (auto: the one this machine is in; local: "
    "start one here). Needs the ray extra.",
)
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
    profile: str | None,
    step_overhead_ms: float | None,
    prefill_us_per_token: float | None,
    decode_us_per_seq: float | None,
    tier_flags: tuple[str, ...],
    tier_write: str,
    always_load: bool,
    tier_bandwidth: tuple[str, ...],
    tier_latency: tuple[str, ...],
    kv_bytes_per_token: int | None,
    replicas: int,
    routing_rules: tuple[str, ...],
    routing_load_cost: float | None,
    ttft_slo: float | None,
    ttft_slo_percentile: float,
    max_replicas: int,
    hash_algo: str | None,
    curve: str | None,
    curve_policies: str,
    lookahead: int,
    layer_groups: bool,
    window_aware_saves: bool,
    plot_dir: Path | None,
    plot_path: Path | None,
    report_dir: Path | None,
    as_json: bool,
    arrival_rate_scale: float,
    sweep_file: Path | None,
    sweep_out: Path | None,
    workers: int | None,
    ray_address: str | None,
) -> None:
    """Replay TRACE (a trace file, or synthetic:KIND) through kvpool's manager and scheduler.

    TRACE is a Mooncake JSONL trace, kvpool's token-level JSONL format, or
    synthetic:shared_prefix | multi_turn | agent | multi_tenant | mixed. Times
    are simulated with a cost profile (--profile; the default, round-8b-h100:
    10 ms per step, 50 us per prefill token, 100 us per decoding sequence).
    Requests larger than the
    whole pool are counted as rejected and skipped. --tier adds offload tiers
    (a load costs its latency plus the blocks' bytes over the tier's bandwidth,
    and a hit is loaded only where that is faster than computing it);
    --replicas N with --routing spreads the trace over N replicas; --ttft-slo
    searches for the fewest replicas that meet it; --sweep runs a grid of
    configurations (in a process pool, or on Ray with --ray). --curve needs
    numpy, and --plot-dir and --plot matplotlib (the sim extra).
    """
    from kvpool.sim.options import FAST_HASH, SimulateOptions
    from kvpool.sim.study import load_requests, run_study

    if curve is not None:
        require_extra("simulate", "sim", "numpy")
    if plot_dir is not None:
        _plot_folder(plot_dir, "--plot-dir")
    if plot_path is not None:
        _plot_folder(plot_path.parent, "--plot")
    if report_dir is not None:
        _report_folder(report_dir)
    fields: dict[str, Any] = dict(
        trace=trace,
        kv_blocks=kv_blocks,
        kv_memory=kv_memory,
        model=model,
        block_size=block_size,
        policy=policy,
        sequential=sequential,
        requests=max_requests,
        seed=seed,
        arrival_rate_scale=arrival_rate_scale,
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        profile=profile,
        step_overhead_ms=step_overhead_ms,
        prefill_us_per_token=prefill_us_per_token,
        decode_us_per_seq=decode_us_per_seq,
        tier=tier_flags,
        kv_tier_write=tier_write,  # a name: SimulateOptions parses it
        load_or_compute=not always_load,
        tier_bandwidth=tier_bandwidth,
        tier_latency=tier_latency,
        kv_bytes_per_token=kv_bytes_per_token,
        replicas=replicas,
        routing=tuple(Routing(r) for r in routing_rules),
        routing_load_cost=routing_load_cost,
        ttft_slo=ttft_slo,
        ttft_slo_percentile=ttft_slo_percentile,
        max_replicas=max_replicas,
        hash_algo=hash_algo,
        curve=curve or (),  # "100,200": SimulateOptions parses it
        curve_policies=tuple(p.strip() for p in curve_policies.split(",") if p.strip()),
        lookahead=lookahead,
        layer_groups=layer_groups,
        window_aware_saves=window_aware_saves,
    )
    if sweep_file is not None:
        if plot_dir is not None or plot_path is not None:
            fail("simulate", "--sweep writes each configuration's figures to --sweep-out; drop --plot and --plot-dir")
        _sweep(sweep_file, fields, sweep_out, workers, ray_address, show=not as_json, report_dir=report_dir)
        return
    if workers is not None or ray_address is not None:
        fail("simulate", "--workers and --ray run the configurations of a --sweep; give --sweep FILE")
    options = SimulateOptions(**fields)
    if options.hash_algo is None and options.block_hash != FAST_HASH:
        click.echo(
            f"kvpool simulate: warning: blocks are hashed with {options.block_hash}, as xxhash is not installed; "
            f"the figures are the same, and pip install 'kvpool[fast]' gives the faster {FAST_HASH}",
            err=True,
        )
    show = not as_json
    requests = load_requests(options)
    report = run_study(options, requests, _progress())
    label = f"{trace}: {len(requests):,} requests"
    output = _render(report, label, show)
    if report.curve is not None:
        output["curve"] = _render_curve(report.curve, options.block_size, show)
    if plot_dir is not None or plot_path is not None or report_dir is not None:
        from kvpool.cli.simulate_charts import Drawn, draw

        first = report.results[options.rules[0]] if report.results else None
        lines = [] if first is None else [("load", _load_line(first)), ("queueing", _queueing_line(first))]
        load = tuple((k, v) for k, v in lines if v is not None)
        overloaded = first is not None and first.overloaded
        draw(report, options, label, output, Drawn(plot_dir, plot_path, report_dir, load, overloaded), show)
    if as_json:
        click.echo(json.dumps({"trace": trace, **output}, indent=2))


def _sweep(
    sweep_file: Path,
    fields: dict[str, Any],
    sweep_out: Path | None,
    workers: int | None,
    ray: str | None,
    show: bool,
    report_dir: Path | None = None,
) -> None:
    """Run the sweep ``sweep_file`` names over ``fields``, its results to ``sweep_out`` (or its default).

    With ``report_dir``, the page of every result in the file is written there (:mod:`kvpool.sim.sweep_charts`).
    """
    from kvpool.sim.progress import ProgressLines
    from kvpool.sim.sweep import Sweep
    from kvpool.sim.sweep_executors import executor_for
    from kvpool.sim.sweep_results import DEFAULT_SWEEP_OUT, SweepResults, read_results
    from kvpool.sim.sweep_runner import run_sweep

    sweep = Sweep.from_file(sweep_file, fields)  # the whole grid checked before anything runs
    if ray is not None:
        require_extra("simulate", "ray", "ray")
    out = sweep_out or sweep_file.with_name(DEFAULT_SWEEP_OUT.format(stem=sweep_file.stem))
    executor = executor_for(workers=workers, ray=ray)
    results = SweepResults(out)
    progress = ProgressLines(sys.stderr, every_s=30.0, remaining=True) if not sys.stderr.isatty() else _progress()
    summary = run_sweep(sweep, executor, results, progress)
    if show:
        click.echo(
            f"sweep {sweep_file}: {summary.total:,} configurations, {summary.ran:,} run now, "
            f"{summary.skipped:,} already done; results in {out}"
        )
    else:
        click.echo(json.dumps({"sweep": str(sweep_file), "results": read_results(out)}, indent=2))
    if report_dir is not None:
        from kvpool.sim.sweep_charts import records_of_results, write_sweep_report

        page = write_sweep_report(records_of_results(read_results(out)), report_dir, title=f"kvpool sweep {sweep_file}")
        click.echo(f"report: {page}", err=not show)


def _render(report: StudyReport, label: str, show: bool) -> dict[str, Any]:
    """The report as the JSON object's figures; printed as tables unless ``show`` is off."""
    output: dict[str, Any] = {"requests": report.requests}
    if report.tiers:
        output["tiers"] = report.tiers
        if show:
            _print_tiers(report.tiers)
    if report.sequential is not None:
        seq = report.sequential
        output["sequential"] = {
            **asdict(seq),
            "token_hit_rate": seq.token_hit_rate,
            "block_hit_rate": seq.block_hit_rate,
        }
        if show:
            click.echo(f"{label} (sequential)")
            for key, value in output["sequential"].items():
                click.echo(f"  {key:<22} {value}")
    if report.sizing is not None:
        output["sizing"] = {name: asdict(answer) for name, answer in report.sizing.items()}
        if show:
            _print_sizing(report)
    if report.results:
        results = report.results
        output["simulation"] = next(iter(results.values())).to_dict()
        if len(results) > 1:
            output["routing"] = {rule.value: r.to_dict() for rule, r in results.items()}
        if show:
            for result in results.values():
                _print_table(result, label)
            if len(results) > 1:
                _print_routing(results)
    return output


def _print_tiers(tiers: list[dict[str, Any]]) -> None:
    for tier in tiers:
        load, recompute = tier["load_ms_per_block"], tier["recompute_ms_per_block"]
        blocks = tier["capacity_blocks"]
        verdict = "faster" if load < recompute else "SLOWER"
        size = "unbounded" if blocks is None else f"{blocks:,} blocks"
        click.echo(
            f"tier {tier['kind']} ({tier['write']}): {size}{' (shared by every replica)' if tier['shared'] else ''}, "
            f"{tier['bandwidth_gb_per_s']:g} GB/s, {tier['latency_us']:g} us; loading a block takes "
            f"{load:.2f} ms, {verdict} than recomputing it ({recompute:.2f} ms)"
        )


def _print_sizing(report: StudyReport) -> None:
    assert report.sizing is not None
    first = next(iter(report.sizing.values()))  # every rule is sized against the same objective
    click.echo(f"fewest replicas with p{first.percentile:g} time to first token <= {first.slo_s:g} s")
    for name, answer in report.sizing.items():
        found = f"{answer.replicas}" if answer.replicas is not None else f"none up to {answer.max_replicas}"
        tried = ", ".join(f"{n}: {t:.2f} s" for n, t in answer.ttft_by_replicas.items())
        click.echo(f"  {name:<14}{found:>8}   (tried {tried})")


def _print_routing(results: dict[Routing, SimulationResult]) -> None:
    replicas = next(iter(results.values())).replicas
    click.echo(f"routing over {counted(replicas, 'replica')}")
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


def _render_curve(curve: CurveResult, block_size: int, show: bool) -> dict[str, Any]:
    rates = curve.token_hit_rate
    if show:
        click.echo(f"hit-rate curve (sequential model, token hit rate, blocks of {block_size} tokens)")
        click.echo("  " + f"{'blocks':>10}" + "".join(f"{name:>12}" for name in rates))
        for i, size in enumerate(curve.sizes):
            click.echo("  " + f"{size:>10,}" + "".join(f"{_percent(r[i]):>12}" for r in rates.values()))
    return curve.to_dict()
