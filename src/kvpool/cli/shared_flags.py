"""The flags several commands share, defined once, and the one way a command maps flags to options.

* :func:`engine_flags`: the engine's flags (``--model``, ``--kv-cache-memory``,
  ``--kv-tier``...), each an :class:`~kvpool.engine.startup.EngineOptions` field
  under the same name (:data:`ENGINE_FLAGS`); ``generate``, ``chat`` and
  ``serve`` take them, and :func:`engine_options` maps them.
* :func:`tenant_flags`: ``--api-key-file``, ``--tenant-secret-file``,
  ``--no-tenant-isolation`` and ``--admin-key-file``, which ``serve`` and
  ``route`` take (each command says what they mean to it), collected in a
  :class:`TenantFlags`.
* :func:`take`: a group of a command's flags as the typed record they fill,
  so a command reads as a short mapping from flags to library options.

The rules the flags stand for live in the library (:mod:`kvpool.tenancy`,
:mod:`kvpool.kv_events`, :mod:`kvpool.router.replica_config`); nothing here
decides more than which option a flag is.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

import click

from kvpool.checks import DEFAULT_THREADS
from kvpool.cli.params import THREADS, TOKEN_COUNT
from kvpool.hashing import HashAlgo
from kvpool.model_names import DEFAULT_MODEL
from kvpool.tiers.kinds import WritePolicy
from kvpool.tiers.transfer_threads import DEFAULT_LOAD_DEADLINE_S

__all__ = [
    "DEFAULT_KV_CACHE_MEMORY",
    "ENGINE_FLAGS",
    "ENGINE_OPTIONS",
    "TenantFlags",
    "apply_options",
    "engine_flags",
    "engine_options",
    "take",
    "tenant_flags",
]

Decorator = Callable[[Callable[..., Any]], Callable[..., Any]]
R = TypeVar("R")

#: ``--kv-cache-memory`` when it is not given.
DEFAULT_KV_CACHE_MEMORY = "512MiB"

#: The engine's flags, in the order ``--help`` lists them; each is the EngineOptions field of its name.
ENGINE_OPTIONS: dict[str, Decorator] = {
    "model": click.option(
        "--model", "model", metavar="NAME_OR_PATH", default=DEFAULT_MODEL, show_default=True,
        help="A known model name or a local Hugging Face model folder.",
    ),
    "kv_cache_memory": click.option(
        "--kv-cache-memory", metavar="SIZE", default=DEFAULT_KV_CACHE_MEMORY, show_default=True,
        help="KV cache size (e.g. 512MiB, 2GB), or 'auto' to measure the memory left.",
    ),
    "block_size": click.option("--block-size", type=int, default=16, show_default=True, help="Tokens per KV block."),
    "max_model_len": click.option(
        "--max-model-len", type=TOKEN_COUNT, default=None,
        help="Tokens per request, as vLLM reads it: 4096, 4k (4,000) or 4K (4,096) [default: the model's context].",
    ),
    "dtype": click.option(
        "--dtype", default=None,
        help="Weight and cache dtype: auto, float32 (float), bfloat16, float16 (half) "
        "[default: auto, float32 on the CPU and the model's serving dtype on CUDA].",
    ),
    "tensor_parallel_size": click.option(
        "--tensor-parallel-size", "tensor_parallel_size", type=int, default=1, show_default=True,
        help="Devices to split the model over (vLLM's flag): kvpool runs a model on one, so only 1.",
    ),
    "device": click.option("--device", default=None, help="cpu or cuda [default: cuda when available]."),
    "threads": click.option(
        "--threads", type=THREADS, default=DEFAULT_THREADS, show_default=True,
        help="CPU threads of a step: 'auto' uses only the cores other processes leave free (re-measured between "
        "steps, at most torch's count: OMP_NUM_THREADS or the physical cores); a count is fixed for the whole run; "
        "'torch' leaves torch's own setting.",
    ),
    "linear_kernel": click.option(
        "--linear-kernel", metavar="KERNEL", default=None,
        help="Kernel of the weight products: onednn or torch (F.linear) [default: onednn for float32 on a CPU "
        "whose torch has it, else torch].",
    ),
    "hash_algo": click.option(
        "--hash", "hash_algo", type=click.Choice([a.value for a in HashAlgo]), default=HashAlgo.SHA256.value,
        show_default=True, help="Block hash: kvpool's chain, or vLLM's sha256 / sha256_cbor (hashes identical to vLLM's).",
    ),
    "kv_tiers": click.option(
        "--kv-tier", "kv_tiers", metavar="SPEC", multiple=True,
        help="A KV offload tier, repeatable, in lookup order: cpu:4GiB, disk:/path:50GiB, "
        "redis://host:6379/0 (rediss:// for TLS).",
    ),
    "kv_tier_secret_file": click.option(
        "--kv-tier-secret-file", type=click.Path(dir_okay=False), default=None,
        help="File holding the secret that signs KV tier entries (a keyed MAC); replicas sharing a tier share it.",
    ),
    "kv_tier_unauthenticated": click.option(
        "--kv-tier-unauthenticated", "kv_tier_unauthenticated", is_flag=True, default=False,
        help="Open disk and Redis tiers without --kv-tier-secret-file: their entries are then unauthenticated "
        "(a checksum catches damage, not tampering), so whoever can write to the directory or the Redis "
        "can plant KV this engine serves.",
    ),
    "kv_tier_namespace": click.option(
        "--kv-tier-namespace", metavar="NAME", default=None,
        help="Name the weights in disk and Redis tier entries by NAME instead of hashing the model's files "
        "(engines given the same NAME must run the same weights).",
    ),
    "kv_tier_write": click.option(
        "--kv-tier-write", "kv_tier_write", type=click.Choice([p.value for p in WritePolicy]),
        default=WritePolicy.WRITE_THROUGH.value, show_default=True,
        help="When blocks go down to the KV tiers: write-through (when a block fills) or write-back "
        "(when the pool evicts it, which saves bandwidth).",
    ),
    "kv_tier_always_load": click.option(
        "--kv-tier-always-load", "kv_tier_always_load", is_flag=True, default=False,
        help="Load every KV tier hit, even where computing its tokens is measured to be faster "
        "(load or compute is off).",
    ),
    "kv_tier_load_deadline": click.option(
        "--kv-tier-load-deadline", "kv_tier_load_deadline", type=float, metavar="SECONDS",
        default=DEFAULT_LOAD_DEADLINE_S, show_default=True,
        help="Seconds a disk or Redis load may take before its request computes those tokens instead "
        "(tier loads run off the step: only the requests that wait on a slow tier wait).",
    ),
}  # fmt: skip

#: The flags that are :class:`kvpool.engine.startup.EngineOptions` fields, under the same names.
ENGINE_FLAGS = tuple(ENGINE_OPTIONS)


def apply_options(command: Callable[..., Any], options: Iterable[Decorator]) -> Callable[..., Any]:
    """``command`` with ``options``, listed by ``--help`` in their order (as if stacked above it)."""
    for option in reversed(list(options)):
        command = option(command)
    return command


def engine_flags(command: Callable[..., Any]) -> Callable[..., Any]:
    """The engine's flags (:data:`ENGINE_OPTIONS`), all of them, for a command that starts an engine."""
    return apply_options(command, ENGINE_OPTIONS.values())


def engine_options(flags: dict[str, Any]) -> dict[str, Any]:
    """The engine flags among a command's parameters, as :class:`~kvpool.engine.startup.EngineOptions` fields."""
    options = {name: flags[name] for name in ENGINE_FLAGS}  # the flags are EngineOptions fields, by name
    memory = options["kv_cache_memory"]
    if isinstance(memory, str) and memory.strip().lower() == "auto":
        options["kv_cache_memory"] = None
    options["kv_tiers"] = tuple(options["kv_tiers"] or ())
    return options


@dataclass(frozen=True, slots=True, kw_only=True)
class TenantFlags:
    """The tenant flags as given (None: not given); what they mean is :mod:`kvpool.tenancy`'s."""

    api_key_file: str | None
    tenant_secret_file: str | None
    no_tenant_isolation: bool
    admin_key_file: str | None


def tenant_flags(
    *, api_key_file: str, tenant_secret_file: str, no_tenant_isolation: str, admin_key_file: str
) -> Decorator:
    """The four :class:`TenantFlags` flags, each with the help its command gives it."""
    path = click.Path(dir_okay=False)
    return lambda command: apply_options(
        command,
        [
            click.option("--api-key-file", type=path, default=None, help=api_key_file),
            click.option("--tenant-secret-file", type=path, default=None, help=tenant_secret_file),
            click.option("--no-tenant-isolation", is_flag=True, help=no_tenant_isolation),
            click.option("--admin-key-file", type=path, default=None, help=admin_key_file),
        ],
    )


def take(record: Callable[..., R], flags: dict[str, Any], **given: Any) -> R:
    """``record`` (a keyword dataclass) built from ``given`` and the flags named as its other fields.

    Those flags are removed from ``flags``, so what is left is what the command
    has yet to map; a field that is neither given nor a flag keeps its default.
    """
    names = {f.name for f in dataclasses.fields(record)} - set(given)  # type: ignore[arg-type]  # a keyword dataclass, which the Callable type cannot say
    return record(**given, **{name: flags.pop(name) for name in names if name in flags})
