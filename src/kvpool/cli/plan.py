"""``kvpool plan``: how many KV cache blocks, tokens and requests fit on a GPU."""

from __future__ import annotations

import json
from collections import Counter

import click

from kvpool.cli.params import TOKEN_COUNT, fail
from kvpool.errors import KVPoolError
from kvpool.model_config import load_model_config, shipped_config_names, text_config_view
from kvpool.model_layers import layer_kinds
from kvpool.planner import GB, GiB, KVPlan, MemoryTerm, parse_size, plan_kv_cache

__all__ = ["plan", "render_plan"]

MiB = 2**20


def _binary(n: int) -> str:
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def _layers(ids: tuple[int, ...]) -> str:
    if len(ids) <= 8:
        return ",".join(map(str, ids))
    return ",".join(map(str, ids[:6])) + f",...,{ids[-1]}"


def _memory_row(label: str, n: int, note: str = "") -> str:
    return f"  {label:<34}{n:>18,}{n / GB:>11.2f}{n / GiB:>11.2f}   {note}".rstrip()


def _term_note(term: MemoryTerm) -> str:
    return f"estimate: {term.basis}" if term.estimated else term.basis


def render_plan(plan: KVPlan) -> str:
    """The plan as a readable report ending with the serving-engine capacity line."""
    b = plan.budget
    out = [
        f"Model: {plan.model}   tp {plan.tp_size}   model dtype {plan.model_dtype.value}   "
        f"KV cache dtype {plan.kv_dtype.value}",
        f"Block size: {plan.block_size} tokens"
        + (f" (requested {plan.requested_block_size})" if plan.block_size != plan.requested_block_size else "")
        + f"   max_model_len: {plan.max_model_len:,} tokens",
        "Units: B = bytes; GB = 10^9 B; GiB = 2^30 B; MiB = 2^20 B; KiB = 2^10 B",
        "",
        f"KV cache groups (one pool block = {plan.layers_per_block} layer pages = "
        f"{plan.pool_block_bytes:,} B = {_binary(plan.pool_block_bytes)})",
        f"  {'#':>2}  {'kind':<16}{'window':>8}{'layers':>8}{'tokens/block':>14}"
        f"{'B/layer/block':>15}{'B/block (group)':>17}{'blocks/request':>16}   decoder layers",
    ]
    for g in plan.groups:
        window = g.spec.sliding_window or g.spec.attention_chunk_size
        out.append(
            f"  {g.index:>2}  {g.kind.value:<16}{(f'{window:,}' if window else '-'):>8}{len(g.layer_ids):>8}"
            f"{g.block_size:>14,}{g.page_bytes:>15,}{g.block_bytes:>17,}{g.blocks_per_request:>16,}"
            f"   {_layers(g.decoder_layers)}"
        )
    out += [
        "",
        f"Memory per GPU{'bytes (B)':>42}{'GB':>11}{'GiB':>11}",
        _memory_row("GPU memory", b.gpu_memory_bytes),
        _memory_row(f"x gpu_memory_utilization {b.gpu_memory_utilization:g}", b.usable_bytes, "usable"),
        _memory_row("- weights", b.weights.bytes, _term_note(b.weights)),
        _memory_row("- activations", b.activations.bytes, _term_note(b.activations)),
        _memory_row("- other overhead", b.other.bytes, _term_note(b.other)),
        _memory_row("= KV cache budget", b.kv_budget_bytes),
        f"  {'/ pool block bytes':<34}{plan.pool_block_bytes:>18,}{'':>22}"
        f"   = {plan.num_blocks:,} blocks (rounded down)",
        "",
        "Capacity",
        f"  blocks: {plan.num_blocks:,} x {plan.block_size} tokens = {plan.pool_tokens:,} token slots",
        f"  one {plan.max_model_len:,}-token request needs {plan.blocks_per_request:,} blocks "
        f"(sum over groups): " + ("fits" if plan.fits_max_model_len else "does NOT fit"),
    ]
    if not plan.fits_max_model_len:
        out.append(f"  longest request that fits: {plan.max_fitting_model_len:,} tokens")
    if plan.notes:
        out += ["", "Notes"] + [f"  - {note}" for note in plan.notes]
    out += ["", plan.capacity_line]
    return "\n".join(out)


def _list_configs() -> str:
    lines = []
    for name in shipped_config_names():
        config = load_model_config(name)
        arch = (config.get("architectures") or [config.get("model_type", "?")])[0]
        counts = Counter(k.value if k is not None else "no cache" for k in layer_kinds(config))
        summary = ", ".join(f"{n} {kind}" for kind, n in counts.most_common())
        ctx = text_config_view(config).get("max_position_embeddings")
        lines.append(f"{name:<22}{arch:<34}{sum(counts.values()):>4} layers: {summary}; context {ctx:,}")
    return "\n".join(lines)


@click.command("plan")
@click.option(
    "--config",
    "--model",
    "config_name",
    metavar="NAME_OR_PATH",
    help="Shipped config name (see --list), config.json or its folder (--model is the same option, as simulate "
    "spells it).",
)
@click.option("--gpu-memory", metavar="SIZE", help="Memory of one GPU: 80GB (10^9 B), 80GiB (2^30 B) or bytes.")
@click.option(
    "--gpu-memory-utilization",
    type=float,
    default=0.9,
    show_default=True,
    help="Fraction of GPU memory to use, in (0, 1].",
)
@click.option("--tp", "tp_size", type=int, default=1, show_default=True, help="Tensor parallel size.")
@click.option(
    "--kv-cache-dtype", default="auto", show_default=True, help="auto (the model dtype), bf16, fp16, fp32 or fp8."
)
@click.option(
    "--max-model-len",
    type=TOKEN_COUNT,
    default=None,
    help="Tokens per request, as vLLM reads it: 4096, 4k or 4K [default: max_position_embeddings].",
)
@click.option("--block-size", type=int, default=16, show_default=True, help="Tokens per KV block.")
@click.option(
    "--weights-memory", metavar="SIZE", default=None, help="All weights, split over --tp GPUs [default: estimated]."
)
@click.option(
    "--activation-memory", metavar="SIZE", default=None, help="Peak activations per GPU [default: estimated]."
)
@click.option("--other-memory", metavar="SIZE", default=None, help="Other overhead per GPU [default: 1GiB].")
@click.option("--json", "as_json", is_flag=True, help="Print the whole plan as JSON.")
@click.option("--list", "list_configs", is_flag=True, help="List the shipped configs and exit.")
def plan(
    config_name: str | None,
    gpu_memory: str | None,
    gpu_memory_utilization: float,
    tp_size: int,
    kv_cache_dtype: str,
    max_model_len: int | None,
    block_size: int,
    weights_memory: str | None,
    activation_memory: str | None,
    other_memory: str | None,
    as_json: bool,
    list_configs: bool,
) -> None:
    """Plan the KV cache: groups, the memory budget, blocks, tokens and concurrency.

    \b
    budget = gpu_memory x utilization - weights/tp - activations - other
    blocks = floor(budget / pool block bytes)
    """
    if list_configs:
        click.echo(_list_configs())
        return
    if config_name is None:
        fail("plan", "missing option '--config' (a shipped name from --list, or a config.json path)")
    if gpu_memory is None:
        fail("plan", "missing option '--gpu-memory' (e.g. 80GB or 80GiB)")
    try:
        gpu_bytes = parse_size(gpu_memory, field="--gpu-memory")
        sizes = {
            flag: None if text is None else parse_size(text, field=flag)
            for flag, text in (
                ("--weights-memory", weights_memory),
                ("--activation-memory", activation_memory),
                ("--other-memory", other_memory),
            )
        }
        config = load_model_config(config_name)
        arch = (config.get("architectures") or [config.get("model_type", "model")])[0]
        result = plan_kv_cache(
            config,
            gpu_memory_bytes=gpu_bytes,
            gpu_memory_utilization=gpu_memory_utilization,
            weights_bytes=sizes["--weights-memory"],
            activation_bytes=sizes["--activation-memory"],
            other_overhead_bytes=sizes["--other-memory"],
            tp_size=tp_size,
            kv_dtype=kv_cache_dtype,
            block_size=block_size,
            max_model_len=max_model_len,
            name=f"{config_name} ({arch})",
        )
    except KVPoolError as exc:
        fail("plan", str(exc))
    if as_json:
        click.echo(json.dumps(result.to_dict(), indent=2))
    else:
        click.echo(render_plan(result))
