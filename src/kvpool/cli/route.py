"""``kvpool route``: one OpenAI endpoint in front of several ``kvpool serve`` replicas (the ``serve`` and ``events`` extras).

It takes the replicas' own tenant flags (``--api-key-file``, ``--tenant-secret-file``,
``--no-tenant-isolation``): the router derives each request's cache salt as they do,
so the block hashes it computes are theirs. The model's tokenizer comes from the
same model store the engine uses (the converted folder, read by transformers). What
the router can and cannot do with what it was given is said at start on stderr.
"""

from __future__ import annotations

import logging
from typing import Any

import click

from kvpool.cli.generate import _log
from kvpool.cli.params import FiniteFloatRange, reports_errors, require_extra

__all__ = ["route"]

_DEFAULT_MODEL = "smollm2-135m"  # kvpool.engine.model_store.DEFAULT_MODEL (that module loads torch)


@click.command("route")
@click.option("--host", default="127.0.0.1", show_default=True, help="Interface to listen on.")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True, help="TCP port.")
@click.option(
    "--replica",
    "replicas",
    multiple=True,
    required=True,
    metavar="URL",
    help="A kvpool serve replica's base URL (http://127.0.0.1:8001); repeat for each.",
)
@click.option(
    "--model",
    metavar="NAME_OR_PATH",
    default=_DEFAULT_MODEL,
    show_default=True,
    help="The replicas' model: its tokenizer computes the prompts' block hashes.",
)
@click.option(
    "--api-key-file",
    type=click.Path(dir_okay=False),
    default=None,
    help="The replicas' API key file (key -> tenant); without it, one tenant.",
)
@click.option(
    "--tenant-secret-file",
    type=click.Path(dir_okay=False),
    default=None,
    help="The replicas' tenant secret. Without it (and without --no-tenant-isolation) routing is by load only.",
)
@click.option("--no-tenant-isolation", is_flag=True, help="The replicas run with --no-tenant-isolation.")
@click.option(
    "--admin-key-file",
    type=click.Path(dir_okay=False),
    default=None,
    help="A replica admin key (the first line): replicas on other hosts show /kv-events only with one. "
    "Any key in it also opens the router's own /health?verbose=1 off its loopback interface.",
)
@click.option(
    "--index-redis",
    metavar="URL",
    default=None,
    help="Keep the block index in this Redis (redis://host:6379/0), shared by every router naming it.",
)
@click.option(
    "--routing",
    type=click.Choice(["prefix", "round-robin", "least-loaded"]),
    default="prefix",
    show_default=True,
    help="The routing rule (kvpool.routing); the other two ignore cached prefixes, for comparison.",
)
@click.option(
    "--load-cost",
    type=FiniteFloatRange(min=0, min_open=True),
    default=8.0,
    show_default=True,
    help="Cached blocks that one request in flight at a replica is worth.",
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
    default=2**20,
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
def route(
    host: str,
    port: int,
    replicas: tuple[str, ...],
    model: str,
    api_key_file: str | None,
    tenant_secret_file: str | None,
    no_tenant_isolation: bool,
    admin_key_file: str | None,
    index_redis: str | None,
    routing: str,
    load_cost: float,
    health_interval: float,
    index_max_blocks: int,
    index_max_blocks_per_replica: int,
    upstream_timeout: float,
    header_timeout: float,
    max_connections: int,
    shutdown_timeout: int,
) -> None:
    """Route OpenAI requests to the replica that holds the longest cached prefix, balanced against load.

    The router follows each replica's KV events (found at its GET /kv-events), so
    start the replicas with --kv-events-endpoint (and --kv-events-replay-endpoint).
    """
    require_extra("route", "serve", "starlette", "uvicorn", "httpx")
    require_extra("route", "events", "zmq", "msgspec")
    from kvpool.router import RouteOptions, Router, index_from_url
    from kvpool.router.replicas import check_replica_url
    from kvpool.routing import Routing
    from kvpool.serve.connections import ConnectionLimits
    from kvpool.tenancy import KeyRing, SaltPolicy, load_secret

    urls = tuple(dict.fromkeys(check_replica_url(url) for url in replicas))
    keys = None if api_key_file is None else KeyRing.load_json(api_key_file)
    admin_key = None if admin_key_file is None else _first_key(admin_key_file)
    admin_keys = None if admin_key_file is None else KeyRing.load_lines(admin_key_file, "admin")
    limits = ConnectionLimits(
        header_timeout=header_timeout, max_connections=max_connections, shutdown_timeout=shutdown_timeout
    )
    if no_tenant_isolation:
        salts, salts_known = SaltPolicy.shared(), True
    else:
        secret, generated = load_secret(tenant_secret_file)
        salts, salts_known = SaltPolicy.isolated(secret), not generated
    index = index_from_url(
        index_redis, max_blocks=index_max_blocks, max_blocks_per_replica=index_max_blocks_per_replica
    )
    tokenizer = _tokenizer(model) if salts_known else None
    if not salts_known:
        _log(
            "WARNING: no --tenant-secret-file: the router cannot derive the replicas' cache salts, "
            "so it routes by load only (give it the replicas' secret file, or --no-tenant-isolation if they run so)"
        )
    _log(f"{len(urls)} replicas: {', '.join(urls)}")
    _log("block index: " + (f"Redis at {index_redis}" if index_redis else "in this process"))
    options = RouteOptions(
        replicas=urls,
        tokenizer=tokenizer,
        keys=keys,
        salts=salts,
        admin_key=admin_key,
        admin_keys=admin_keys,
        routing=Routing(routing),
        load_cost=load_cost,
        health_interval=health_interval,
        upstream_timeout=upstream_timeout,
    )
    _serve(Router(options, index), host, port, limits)


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


def _tokenizer(model: str) -> Any:
    """The model's tokenizer (loaded later, in the background), or None where the engine extra is missing."""
    try:
        from kvpool.engine.model_store import resolve_model
    except ImportError:
        _log("WARNING: without the engine extra there is no tokenizer: routing by load only")
        return None
    from kvpool.router.prompts import PromptTokenizer

    return PromptTokenizer(resolve_model(model))


def _serve(router: Any, host: str, port: int, limits: Any) -> None:
    import uvicorn

    from kvpool.router import build_app
    from kvpool.serve.connections import uvicorn_config

    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s %(message)s", datefmt="%H:%M:%S"))
    log = logging.getLogger("kvpool.route")  # the router's own log: replicas up and down, streams repaired
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    _log(f"routing on http://{host}:{port}/v1")
    config = uvicorn_config(
        build_app(router), host=host, port=port, limits=limits, log_level="warning", access_log=False
    )
    uvicorn.Server(config).run()
