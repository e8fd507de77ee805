"""``kvpool route``: one OpenAI endpoint in front of several replicas (the light ``route`` extra).

A ``kvpool serve`` replica is named by its URL; any other server (vLLM...) is described
with its events (``--replica URL,events=...,block-size=...`` or ``--config FILE``, see
:mod:`kvpool.router.replica_config`). It takes kvpool replicas' own tenant flags
(``--api-key-file``, ``--tenant-secret-file``, ``--no-tenant-isolation``): the router
derives each request's cache salt as they do (:meth:`kvpool.tenancy.SaltPolicy.from_options`),
so the block hashes it computes are theirs; in front of described replicas only (which
salt by the request's own ``cache_salt``: :func:`~kvpool.router.replica_config.replicas_isolate_tenants`)
no tenant flag is needed. The model's tokenizer is read from the model
folder with ``tokenizers`` and ``jinja2`` alone. What the router can and cannot do with
what it was given, and which prefix mode it runs in and why, is said at start on stderr.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import click

from kvpool.checks import counted
from kvpool.cli.generate import _log
from kvpool.cli.params import FiniteFloatRange, reports_errors, require_extra
from kvpool.cli.shared_flags import TenantFlags, take, tenant_flags
from kvpool.model_names import DEFAULT_MODEL
from kvpool.routing import DEFAULT_LOAD_COST
from kvpool.tenancy import KeyRing, SaltPolicy

__all__ = ["route"]


def _warn(line: str) -> None:
    """A start-up line the operator must not miss (the format of ``_log``, at WARNING)."""
    click.echo(f"WARNING {time.strftime('%H:%M:%S')} {line}", err=True)


@click.command("route")
@click.option("--host", default="127.0.0.1", show_default=True, help="Interface to listen on.")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True, help="TCP port.")
@click.option(
    "--replica",
    "replicas",
    multiple=True,
    metavar="URL[,KEY=VALUE...]",
    help="A replica: a kvpool serve replica's base URL (http://127.0.0.1:8001), or any other server's "
    "with its events described: 'http://127.0.0.1:8101,events=tcp://127.0.0.1:5557,"
    "replay=tcp://127.0.0.1:5558,block-size=128,hash=sha256' (keys: events (or none), replay, "
    "block-size, hash, seed, block-hash int64|bytes, num-blocks; docs/routing.md). Repeat for each.",
)
@click.option(
    "--config",
    "config_file",
    type=click.Path(dir_okay=False),
    default=None,
    help="A TOML file of [[replica]] tables (url and the keys of --replica), completed by a [defaults] table.",
)
@click.option(
    "--model",
    metavar="NAME_OR_PATH",
    default=DEFAULT_MODEL,
    show_default=True,
    help="The replicas' model: a folder with tokenizer.json (and its chat template), or a kvpool model name; "
    "its tokenizer and chat template decide the prompts' tokens, hence their block hashes.",
)
@tenant_flags(
    api_key_file="The replicas' API key file (key -> tenant); without it, one tenant.",
    tenant_secret_file="The replicas' tenant secret. Without it (and without --no-tenant-isolation) routing is by "
    "load only.",
    no_tenant_isolation="The replicas run with --no-tenant-isolation.",
    admin_key_file="A replica admin key (the first line): replicas on other hosts show /kv-events only with one. "
    "Any key in it also opens the router's own /health?verbose=1 off its loopback interface.",
)
@click.option(
    "--kv-events-secret-key",
    type=click.Path(dir_okay=False),
    default=None,
    help="The router's CURVE key pair (a ZeroMQ .key_secret certificate), for replicas whose KV events need CURVE.",
)
@click.option(
    "--kv-events-server-keys",
    type=click.Path(),
    default=None,
    help="The replicas' CURVE public keys (a .key certificate, or a directory of them): "
    "a replica's stream is followed only under one of these.",
)
@click.option(
    "--index-redis",
    metavar="URL",
    default=None,
    help="Keep the block index in this Redis (redis://host:6379/0), shared by every router naming it.",
)
@click.option(
    "--routing",
    type=click.Choice(
        ["auto", "precise", "approximate", "prefix", "expected-ttft", "threshold", "round-robin", "least-loaded"]
    ),
    default="auto",
    show_default=True,
    help="The routing rule. auto, precise, approximate: the default law (docs/routing.md), with the prefixes "
    "learnt from the replicas' KV events (precise), from the router's memory of where it sent each one "
    "(approximate: for servers without events), or each where it can (auto). prefix: cached blocks against "
    "--load-cost x requests in flight (precise); expected-ttft: the earliest expected first token, from each "
    "replica's advertised rates; threshold: SGLang's and vLLM's cache-aware gate (0.3/64/1.5), for "
    "comparison. round-robin and least-loaded ignore prefixes, for comparison.",
)
@click.option(
    "--approx-max-blocks",
    type=click.IntRange(min=1),
    default=2**18,
    show_default=True,
    help="Blocks the approximate mode remembers over all replicas (least recently used dropped first).",
)
@click.option(
    "--approx-block-size",
    type=click.IntRange(min=1),
    default=16,
    show_default=True,
    help="Tokens per block of the approximate mode's memory (its prefixes' granularity).",
)
@click.option(
    "--load-cost",
    type=FiniteFloatRange(min=0, min_open=True),
    default=DEFAULT_LOAD_COST,
    show_default=True,
    help="Cached 16-token blocks that one request in flight at a replica is worth (128 tokens at 8), whatever the replicas' block size.",
)
@click.option(
    "--prefill-rate",
    "--prefill-tokens-per-s",
    "prefill_tokens_per_s",
    type=FiniteFloatRange(min=0, min_open=True),
    default=20_000.0,
    show_default=True,
    help="Prompt tokens per second a replica computes, for a replica that advertises no rates (GET /rates): "
    "the expected-ttft rule's rate, and what a prefix held only below its GPU memory (a CPU or STORAGE tier, "
    "by its KV events' medium) is credited with, the prefill time loading it saves.",
)
@click.option(
    "--kv-bytes-per-token",
    type=click.IntRange(min=1),
    default=131072,
    show_default=True,
    help="KV bytes of one token at a replica (what a tier load moves; 131072: an 8B model with 8 KV heads in bf16).",
)
@click.option(
    "--medium-link",
    "medium_links",
    multiple=True,
    metavar="MEDIUM=BANDWIDTH[,LATENCY]",
    help="How fast a replica loads from a tier medium its events name, in bytes per second and seconds per fetch "
    "(STORAGE=2GB,0.0005); defaults: the tier registry's links (CPU at PCIe speed, STORAGE at the slowest of "
    "disk and Redis). Repeat for each medium.",
)
@click.option(
    "--health-interval",
    type=FiniteFloatRange(min=0.05),
    default=0.5,
    show_default=True,
    help="Seconds between health checks of each replica.",
)
@click.option(
    "--index-max-blocks",
    type=click.IntRange(min=1),
    default=2**24,  # kvpool.router.index.MAX_BLOCKS (the index module is imported only when the router starts)
    show_default=True,
    help="Block claims the in-process index keeps over all replicas; past it the oldest are dropped.",
)
@click.option(
    "--index-max-blocks-per-replica",
    type=click.IntRange(min=1),
    default=2**19,
    show_default=True,
    help="Block claims the in-process index keeps per replica (lower when the replica says it holds fewer).",
)
@click.option(
    "--upstream-timeout",
    type=FiniteFloatRange(min=0, min_open=True),
    default=300.0,
    show_default=True,
    help="Seconds a replica may stay silent (before its answer, or between streamed chunks); "
    "one that does is out of rotation for 30 s.",
)
@click.option(
    "--eject-after",
    type=click.IntRange(min=1),
    default=3,
    show_default=True,
    help="Failed answers in a row (status 500 or more, broken connections) that take a replica out of rotation.",
)
@click.option(
    "--eject-time",
    type=FiniteFloatRange(min=0, min_open=True),
    default=10.0,
    show_default=True,
    help="Seconds out of rotation for a first ejection; each further one in a row lasts twice the last.",
)
@click.option(
    "--eject-max-time",
    type=FiniteFloatRange(min=0, min_open=True),
    default=300.0,
    show_default=True,
    help="The longest ejection, in seconds.",
)
@click.option(
    "--header-timeout",
    type=FiniteFloatRange(min=0, min_open=True),
    default=10.0,
    show_default=True,
    help="Seconds a client connection may take to send a request's headers.",
)
@click.option(
    "--max-connections",
    type=click.IntRange(min=1),
    default=1024,
    show_default=True,
    help="Client connections open at once; one more is answered 503.",
)
@click.option(
    "--shutdown-timeout",
    type=click.IntRange(min=1),
    default=10,
    show_default=True,
    help="Seconds open requests get on SIGTERM before their streams are cut.",
)
@reports_errors("route")
def route(**flags: Any) -> None:
    """Route OpenAI requests to the replica that holds the longest cached prefix, balanced against load.

    The router follows each replica's KV events: a kvpool serve replica's are found at its
    GET /kv-events (start it with --kv-events-endpoint and --kv-events-replay-endpoint); a vLLM
    replica's are described (--replica URL,events=...,block-size=...,hash=...).
    """
    require_extra("route", "route", "starlette", "uvicorn", "httpx", "httptools")
    require_extra("route", "route", "zmq", "msgspec")
    from kvpool.router import RouteOptions, Router
    from kvpool.router.replica_config import replica_specs, replicas_isolate_tenants
    from kvpool.routing import PrefixMode, Routing
    from kvpool.serve.connections import ConnectionLimits

    specs = replica_specs(flags.pop("replicas"), flags.pop("config_file"))  # before anything is opened
    routing = flags.pop("routing")
    rule, mode = _rule(routing, Routing, PrefixMode)
    tenants = take(TenantFlags, flags)
    keys = None if tenants.api_key_file is None else KeyRing.load_json(tenants.api_key_file)
    admin_key, admin_keys = _admin_keys(tenants.admin_key_file)
    event_trust = _event_trust(flags.pop("kv_events_secret_key"), flags.pop("kv_events_server_keys"))
    limits = take(ConnectionLimits, flags)
    files_given = tenants.tenant_secret_file is not None or tenants.api_key_file is not None
    isolate = replicas_isolate_tenants(
        specs, no_tenant_isolation=tenants.no_tenant_isolation, tenant_files_given=files_given
    )
    salts, secret = SaltPolicy.from_options(isolate=isolate, secret_file=tenants.tenant_secret_file)
    tokenizer, why_not = _prefix_tokenizer(flags.pop("model"), rule.cache_aware, secret)
    _log(f"{counted(len(specs), 'replica')}: {', '.join(_describe(spec) for spec in specs)}")
    index = _index(flags)
    (_log if why_not is None else _warn)(_mode_line(routing, rule, mode, specs, why_not))
    given = {"keys": keys, "salts": salts, "admin_key": admin_key, "admin_keys": admin_keys, "event_trust": event_trust}
    options = take(
        RouteOptions, flags, replicas=tuple(specs), tokenizer=tokenizer, routing=rule, prefix_mode=mode, **given
    )
    _serve(Router(options, index), flags["host"], flags["port"], limits)


def _admin_keys(path: str | None) -> tuple[str | None, Any]:
    """The replica admin key the router sends (the file's first) and the keys that open its own /health?verbose."""
    from kvpool.tenancy import KeyRing

    if path is None:
        return None, None
    return _first_key(path), KeyRing.load_lines(path, "admin")


def _index(flags: dict[str, Any]) -> Any:
    """The block index the index flags name (in this process, or shared in Redis), said on stderr."""
    from kvpool.router import index_from_url

    where = flags.pop("index_redis")
    caps = {
        "max_blocks": flags.pop("index_max_blocks"),
        "max_blocks_per_replica": flags.pop("index_max_blocks_per_replica"),
    }
    index = index_from_url(where, **caps)
    _log("block index: " + (f"Redis at {where}; loads shared there (the load board)" if where else "in this process"))
    return index


def _event_trust(secret_key: str | None, server_keys: str | None) -> Any:
    """The router's CURVE keys for replicas' event streams (None: plain streams only)."""
    if (secret_key is None) != (server_keys is None):
        raise click.UsageError("--kv-events-secret-key and --kv-events-server-keys go together")
    if secret_key is None or server_keys is None:
        return None
    from kvpool.kv_events import CurveTrust

    return CurveTrust.load(secret_key, server_keys)


def _prefix_tokenizer(model: str, by_prefix: bool, secret: Any) -> tuple[Any, str | None]:
    """The tokenizer prefix routing hashes prompts with and None, or None and why it routes by load only."""
    from kvpool.tenancy import SecretSource

    if not by_prefix:
        return None, None
    if secret is SecretSource.GENERATED:
        return None, (
            "no --tenant-secret-file: the router cannot derive the kvpool replicas' cache salts "
            "(give it their secret file, or --no-tenant-isolation if they run so)"
        )
    return _tokenizer(model)


def _first_key(path: str) -> str:
    """The first key of a key file (one a line, as the replicas' ``--admin-key-file``)."""
    from kvpool.errors import ConfigError

    try:
        with open(path, encoding="utf-8") as f:
            keys = [line.strip() for line in f if line.strip()]
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read the admin key file {path!r}: {exc}") from None
    if not keys:
        raise ConfigError(f"the admin key file {path!r} holds no key")
    return keys[0]


def _rule(routing: str, routing_type: Any, mode_type: Any) -> tuple[Any, Any]:
    """The routing rule and prefix mode a ``--routing`` name stands for (auto/precise/approximate: the default law)."""
    from kvpool.routing import DEFAULT_ROUTING

    if routing in ("auto", "precise", "approximate"):
        return DEFAULT_ROUTING, mode_type(routing)
    if routing == "prefix":
        return routing_type.PREFIX, mode_type.PRECISE
    return routing_type(routing), mode_type.AUTO


def _describe(spec: Any) -> str:
    if spec.discover:
        return f"{spec.name} (kvpool: events read from its /kv-events)"
    if spec.events is None:
        return f"{spec.name} (no events)"
    info = spec.events
    seed = "" if info.hash_seed is None else f", seed {info.hash_seed}"
    return (
        f"{spec.name} (events {info.endpoint}, replay {info.replay_endpoint or 'none'}, block size {info.block_size}, "
        f"{info.hash_algorithm}{seed}, {info.hash_form.value} hashes)"
    )


def _mode_line(routing: str, rule: Any, mode: Any, specs: list[Any], why_not: str | None) -> str:
    """The start-up line that says which prefix mode runs, and why."""
    if not rule.cache_aware:
        return f"prefix mode: none (--routing {routing}: cached prefixes are ignored, for comparison)"
    if why_not is not None:
        return f"prefix mode: none, routing by load only: {why_not}"
    with_events = [s for s in specs if s.discover or s.events is not None]
    without = [s for s in specs if not s.discover and s.events is None]
    if mode.value == "approximate":
        return "prefix mode: approximate (--routing approximate: the router remembers where it sent each prefix)"
    if mode.value == "precise":
        verbs = "publishes no events and is" if len(without) == 1 else "publish no events and are"
        note = "" if not without else f"; {counted(len(without), 'replica')} {verbs} weighed by load only"
        return f"prefix mode: precise (--routing {routing}: from the replicas' KV events{note})"
    if not with_events:
        return "prefix mode: approximate (auto: no replica publishes KV events, so the router remembers prefixes)"
    if without:
        return (
            f"prefix mode: precise for {counted(len(with_events), 'replica')} with KV events, approximate for the "
            f"{len(without)} without (auto)"
        )
    return (
        "prefix mode: precise (auto: every replica's KV events are followed; a kvpool replica whose "
        "/kv-events does not answer falls back to approximate, logged)"
    )


def _tokenizer(model: str) -> tuple[Any, str | None]:
    """The model's tokenizer (loaded later, in the background) and None, or None and why there is none."""
    from pathlib import Path

    from kvpool.router.prompt_hashes import PromptHasher, missing_packages

    missing = missing_packages()
    if missing:
        return None, f"{' and '.join(missing)} missing: pip install 'kvpool[route]'"
    folder = Path(model).expanduser()
    if not (folder / "tokenizer.json").is_file():
        from kvpool.errors import ConfigError
        from kvpool.gguf_tokenizer import tokenizer_folder_for
        from kvpool.model_names import bundled_model, model_folder

        try:
            bundled = bundled_model(model)  # kvpool's names, without torch: converted, or read from the GGUF
            folder = model_folder(model) if bundled is None else tokenizer_folder_for(bundled)
        except ConfigError as exc:
            if model != DEFAULT_MODEL:
                raise
            return None, f"--model {model}: {exc}"
    return PromptHasher(folder), None


def _serve(router: Any, host: str, port: int, limits: Any) -> None:
    from kvpool.router import build_app
    from kvpool.serve.connections import serve_on, uvicorn_config

    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s %(message)s", datefmt="%H:%M:%S"))
    log = logging.getLogger("kvpool.route")  # the router's own log: replicas up and down, streams repaired
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    config = uvicorn_config(
        build_app(router), host=host, port=port, limits=limits, log_level="warning", access_log=False
    )
    serve_on(config, lambda url: _log(f"routing on {url}/v1"), lambda url: _log(f"stopped routing on {url}/v1"))
