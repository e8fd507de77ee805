"""``kvpool serve``: the engine behind an OpenAI-compatible HTTP API (the ``serve`` extra).

It takes the engine flags of ``kvpool generate`` (their definitions are
``generate``'s, reused here), starts the engine once, and serves it with
uvicorn. Tenants, cache salts and the metrics gate follow
:mod:`kvpool.tenancy` and :mod:`kvpool.serve`; what the server decided about
them (one tenant or many, where the secret comes from, isolation off) is said
at start on stderr.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import click

from kvpool.checks import counted
from kvpool.cli import generate as generate_command
from kvpool.cli.params import POSITIVE_INT, reports_errors, require_extra

__all__ = ["VLLM_API_KEY_ENV", "serve"]

#: vLLM's environment variable for its API key: read when no ``--api-key`` is given.
VLLM_API_KEY_ENV = "VLLM_API_KEY"

_log = generate_command._log


def _engine_flags(command: Callable[..., Any]) -> Callable[..., Any]:
    """``generate``'s own options for the engine fields (``_ENGINE_FLAGS``), not its sampling ones."""
    probe: Any = generate_command._engine_options(lambda **kw: None)
    wanted = set(generate_command._ENGINE_FLAGS)
    params: list[click.Parameter] = [p for p in probe.__click_params__ if p.name in wanted]
    target: Any = command
    target.__click_params__ = [*getattr(command, "__click_params__", []), *params]
    return command


@click.command("serve")
@click.option("--host", default="127.0.0.1", show_default=True, help="Interface to listen on.")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True, help="TCP port.")
@click.option(
    "--served-model-name", default=None, help="The name clients send as 'model' [default: the --model value]."
)
@click.option(
    "--api-key-file",
    type=click.Path(dir_okay=False),
    default=None,
    help="JSON object: API key -> tenant name. Without it the server is single-tenant and needs no key.",
)
@click.option(
    "--tenant-secret-file",
    type=click.Path(dir_okay=False),
    default=None,
    help="The secret tenant cache salts are derived with [default: a fresh one per start].",
)
@click.option(
    "--no-tenant-isolation",
    is_flag=True,
    help="Let every tenant share one prefix cache (the client's cache_salt passes through). Leaks prompts.",
)
@click.option(
    "--admin-key-file",
    type=click.Path(dir_okay=False),
    default=None,
    help="Keys (one a line) that open /metrics, /health?verbose and /kv-events beyond the loopback interface.",
)
@click.option(
    "--max-body-bytes", type=POSITIVE_INT, default=1 << 20, show_default=True, help="Largest request body (413)."
)
@click.option(
    "--max-waiting", type=POSITIVE_INT, default=256, show_default=True, help="Waiting requests per tenant before 429."
)
@click.option(
    "--max-request-tokens",
    type=POSITIVE_INT,
    default=None,
    help="Output tokens one request may ask for: n times max_tokens (where it is omitted, 16 on /v1/completions "
    "and the rest of the context on chat, as in vLLM), and apart its min_tokens; more is a 400. Default: the KV "
    "pool's tokens.",
)
@click.option(
    "--metrics-prefix",
    default="vllm:",  # kvpool.serve.metrics.DEFAULT_PREFIX (tests/serve/test_metrics.py checks they agree)
    show_default=True,
    help="Metric name prefix: vLLM's, so its dashboards read kvpool; 'kvpool:' for names of kvpool's own.",
)
@click.option(
    "--kv-events-endpoint",
    default=None,
    metavar="ENDPOINT",
    help="Publish KV cache events here: bind:tcp://127.0.0.1:5557 listens on the loopback only "
    "(rule: docs/kv_events.md).",
)
@click.option(
    "--kv-events-replay-endpoint",
    default=None,
    metavar="ENDPOINT",
    help="Serve replays of missed KV events here (always bound): tcp://127.0.0.1:5558.",
)
@click.option(
    "--kv-events-secret-key",
    type=click.Path(dir_okay=False),
    default=None,
    help="This replica's CURVE key pair (a ZeroMQ .key_secret certificate): events and replays are "
    "encrypted and open only to --kv-events-client-keys.",
)
@click.option(
    "--kv-events-client-keys",
    type=click.Path(),
    default=None,
    help="CURVE public keys allowed to subscribe: a ZeroMQ .key certificate, or a directory of them.",
)
@click.option(
    "--kv-events-include-token-ids",
    is_flag=True,
    help="Put token IDs, LoRA names and extra keys (tenant cache salts among them) in BlockStored events "
    "although tenants are isolated: for a trusted consumer only.",
)
@click.argument("model_arg", metavar="[MODEL]", required=False, default=None)
@click.option(
    "--api-key",
    "api_key",
    multiple=True,
    help="An API key clients must send (repeatable; vLLM's flag): one tenant. Beside --api-key-file's tenants. "
    f"Without it, ${VLLM_API_KEY_ENV} is the key when set, as in vLLM.",
)
@click.option("--max-num-seqs", type=POSITIVE_INT, default=None, help="Requests running at once at most.")
@click.option("--max-num-batched-tokens", type=POSITIVE_INT, default=None, help="Tokens one step computes at most.")
@click.option(
    "--gpu-memory-utilization",
    type=click.FloatRange(0, 1, min_open=True),
    default=None,
    help="Size the KV cache from this fraction of the device's memory (measured, as vLLM does). On the CPU "
    "the same formula runs over the host memory, capped; --kv-cache-memory SIZE sets the budget directly.",
)
@click.option(
    "--enable-prefix-caching/--no-enable-prefix-caching",
    default=True,
    show_default=True,
    help="Share cached prompt blocks between requests.",
)
@click.option(
    "--kv-events-config",
    metavar="JSON",
    default=None,
    help="vLLM's KV events config: enable_kv_cache_events, publisher (zmq|null), endpoint, replay_endpoint, "
    "topic, buffer_steps, hwm, max_queue_size (--kv-events-* flags are kvpool's names for the same).",
)
@click.option("--header-timeout", type=click.FloatRange(0, min_open=True), default=10.0, show_default=True,
              help="Seconds a connection may take to send complete request headers.")  # fmt: skip
@click.option("--max-connections", type=POSITIVE_INT, default=1024, show_default=True,
              help="Client connections open at once; one more is answered 503 and closed.")  # fmt: skip
@click.option("--enable-log-requests", is_flag=True, help="Log a line per request when admitted and when finished.")
@click.option("--disable-log-stats", is_flag=True, help="No periodic stats line (throughput, queue, KV usage, hits).")
@_engine_flags
@reports_errors("serve")
def serve(
    host: str,
    port: int,
    served_model_name: str | None,
    api_key_file: str | None,
    tenant_secret_file: str | None,
    no_tenant_isolation: bool,
    admin_key_file: str | None,
    max_body_bytes: int,
    max_waiting: int,
    max_request_tokens: int | None,
    metrics_prefix: str,
    kv_events_endpoint: str | None,
    kv_events_replay_endpoint: str | None,
    kv_events_secret_key: str | None,
    kv_events_client_keys: str | None,
    kv_events_include_token_ids: bool,
    model_arg: str | None,
    api_key: tuple[str, ...],
    max_num_seqs: int | None,
    max_num_batched_tokens: int | None,
    gpu_memory_utilization: float | None,
    enable_prefix_caching: bool,
    kv_events_config: str | None,
    header_timeout: float,
    max_connections: int,
    enable_log_requests: bool,
    disable_log_stats: bool,
    **kw: Any,
) -> None:
    """Serve the model over HTTP with the OpenAI API (/v1/completions, /v1/chat/completions, /v1/models).

    Also /health (?verbose=1: requests, owned blocks, the pool's invariants),
    /metrics (Prometheus) and /kv-events when events are configured.
    """
    require_extra("serve", "engine", "torch", "transformers")
    require_extra("serve", "serve", "starlette", "uvicorn", "prometheus_client")
    from kvpool.serve.metrics import check_prefix
    from kvpool.tenancy import KeyRing, SaltPolicy, load_secret

    check_prefix(metrics_prefix)
    if model_arg is not None:
        if kw["model"] not in (model_arg, generate_command._DEFAULT_MODEL):
            raise click.UsageError(f"the model is given twice: {model_arg!r} and --model {kw['model']!r}")
        kw["model"] = model_arg
    if not api_key and os.environ.get(VLLM_API_KEY_ENV):
        api_key = (os.environ[VLLM_API_KEY_ENV],)
        _log(f"API key from ${VLLM_API_KEY_ENV} (no --api-key given)")
    api_keys = _key_ring(api_key_file, api_key)
    from kvpool.serve.connections import ConnectionLimits

    limits = ConnectionLimits(header_timeout=header_timeout, max_connections=max_connections)
    if kv_events_config is not None:
        kv_events_endpoint, kv_events_replay_endpoint, event_extras = _vllm_events_config(
            kv_events_config, kv_events_endpoint, kv_events_replay_endpoint
        )
    else:
        event_extras = {}
    admin_keys = None if admin_key_file is None else KeyRing.load_lines(admin_key_file, "admin")
    generated = False
    if no_tenant_isolation:
        salts = SaltPolicy.shared()
    else:
        secret, generated = load_secret(tenant_secret_file)
        salts = SaltPolicy.isolated(secret)
    events = _events_setup(
        kv_events_endpoint,
        kv_events_replay_endpoint,
        kv_events_secret_key,
        kv_events_client_keys,
        include_token_ids=kv_events_include_token_ids,
        isolated=salts.isolates_tenants,
    )
    if events is not None:
        events.update(event_extras)

    options = generate_command.engine_options(kw)  # generate's mapping of its engine flags
    options["enable_kv_events"] = kv_events_endpoint is not None
    options["enable_prefix_caching"] = enable_prefix_caching
    if max_num_seqs is not None:
        options["max_num_seqs"] = max_num_seqs
    if max_num_batched_tokens is not None:
        options["max_num_batched_tokens"] = max_num_batched_tokens
    if api_keys is not None:
        options["tenant_weights"] = dict(api_keys.weights)
    if gpu_memory_utilization is not None:
        if kw["kv_cache_memory"] != _DEFAULT_KV_CACHE_MEMORY:
            raise click.UsageError("--gpu-memory-utilization sizes the KV cache: leave out --kv-cache-memory")
        options["gpu_memory_utilization"] = gpu_memory_utilization
        options["kv_cache_memory"] = None  # measured, as vLLM does
    engine = _start_engine(options)
    try:
        if api_keys is None:
            _log("single-tenant: no --api-key-file, so every request is one tenant's and needs no API key")
        else:
            _log(f"{counted(len(api_keys.names), 'tenant')}, {counted(len(api_keys), 'API key')}")
        if no_tenant_isolation:
            _log(
                "WARNING: --no-tenant-isolation: all tenants share one prefix cache; a tenant can tell from "
                "cached_tokens or time to first token which prompts another tenant sent"
            )
        elif generated:
            _log("tenant cache salts use a secret generated at start (--tenant-secret-file keeps one across restarts)")
        else:
            _log(f"tenant cache salts use the secret in {tenant_secret_file}")
        from kvpool.serve import ServeConfig

        config = ServeConfig(
            model_name=served_model_name or str(kw["model"]),
            api_keys=api_keys,
            salts=salts,
            admin_keys=admin_keys,
            max_body_bytes=max_body_bytes,
            max_waiting=max_waiting,
            max_request_tokens=max_request_tokens,
            metrics_prefix=metrics_prefix,
            log_requests=enable_log_requests,
            stats_interval=None if disable_log_stats else 10.0,
        )
        _serve(engine, config, host, port, events, limits)
    finally:
        if engine.kv_tiers is not None:
            engine.kv_tiers.close()


_DEFAULT_KV_CACHE_MEMORY = "512MiB"  # generate's --kv-cache-memory default
_VLLM_EVENT_KEYS = frozenset(
    {
        "enable_kv_cache_events",
        "publisher",
        "endpoint",
        "replay_endpoint",
        "topic",
        "buffer_steps",
        "hwm",
        "max_queue_size",
    }
)


def _key_ring(api_key_file: str | None, api_keys: tuple[str, ...]) -> Any:
    """The tenants' keys: ``--api-key-file``'s, and each ``--api-key`` for the default tenant (vLLM's single key)."""
    from kvpool.tenancy import DEFAULT_TENANT, KeyRing

    if api_key_file is None and not api_keys:
        return None
    given = KeyRing.from_mapping(dict.fromkeys(api_keys, DEFAULT_TENANT), source="--api-key") if api_keys else None
    if api_key_file is None:
        return given
    ring = KeyRing.load_json(api_key_file)
    if given is None:
        return ring
    for key in api_keys:
        if ring.name_for(key) not in (None, DEFAULT_TENANT):
            raise click.UsageError(f"an --api-key is also a key of tenant {ring.name_for(key)!r} in --api-key-file")
    return ring.merged(given)


def _vllm_events_config(
    text: str, endpoint: str | None, replay: str | None
) -> tuple[str | None, str | None, dict[str, Any]]:
    """vLLM's ``--kv-events-config`` JSON as kvpool's endpoint, replay endpoint and publisher options."""
    import json

    try:
        config = json.loads(text)
    except ValueError as exc:
        raise click.UsageError(f"--kv-events-config is not JSON: {exc}") from None
    if not isinstance(config, dict):
        raise click.UsageError(f"--kv-events-config must be a JSON object, got {text!r}")
    unknown = sorted(set(config) - _VLLM_EVENT_KEYS)
    if unknown:
        raise click.UsageError(f"--kv-events-config: unknown keys {unknown} (vLLM's are {sorted(_VLLM_EVENT_KEYS)})")
    enabled = config.get("enable_kv_cache_events", False)
    publisher = config.get("publisher", "zmq" if enabled else "null")
    if not isinstance(enabled, bool) or publisher not in ("zmq", "null"):
        raise click.UsageError(
            f"--kv-events-config: enable_kv_cache_events must be true or false and publisher zmq or null, got {config!r}"
        )
    if not enabled or publisher == "null":
        return endpoint, replay, {}
    for flag, given, key in (
        ("--kv-events-endpoint", endpoint, "endpoint"),
        ("--kv-events-replay-endpoint", replay, "replay_endpoint"),
    ):
        if given is not None and key in config and config[key] != given:
            raise click.UsageError(f"{flag} {given!r} and --kv-events-config's {key} {config[key]!r} disagree")
    endpoint = endpoint or config.get("endpoint", "tcp://*:5557")  # vLLM's default: bound on every interface
    replay = replay or config.get("replay_endpoint")
    extras = {key: config[key] for key in ("topic", "buffer_steps", "hwm") if key in config}
    if "max_queue_size" in config:
        _log("--kv-events-config: max_queue_size has no counterpart (events are published after each step)")
    return endpoint, replay, extras


def _events_setup(
    endpoint: str | None,
    replay: str | None,
    secret_key: str | None,
    client_keys: str | None,
    *,
    include_token_ids: bool,
    isolated: bool,
) -> dict[str, Any] | None:
    """The event publisher's arguments, checked before the engine starts; None without ``--kv-events-endpoint``.

    Under isolated tenants events carry block hashes only, unless the operator
    trusts every subscriber with prompts (``--kv-events-include-token-ids``).
    """
    given = {
        "--kv-events-replay-endpoint": replay,
        "--kv-events-secret-key": secret_key,
        "--kv-events-client-keys": client_keys,
        "--kv-events-include-token-ids": include_token_ids or None,
    }
    if endpoint is None:
        for flag, value in given.items():
            if value is not None:
                raise click.UsageError(f"{flag} needs --kv-events-endpoint")
        return None
    if (secret_key is None) != (client_keys is None):
        raise click.UsageError("--kv-events-secret-key and --kv-events-client-keys go together")
    require_extra("serve", "events", "zmq", "msgspec")
    from kvpool.kv_events import CurveServer, EventContent, parse_publisher_endpoint, parse_replay_endpoint

    parse_publisher_endpoint(endpoint, "--kv-events-endpoint")
    if replay is not None:
        parse_replay_endpoint(replay, "--kv-events-replay-endpoint")
    curve = None if secret_key is None or client_keys is None else CurveServer.load(secret_key, client_keys)
    content = EventContent.FULL if include_token_ids or not isolated else EventContent.HASHES
    return {"endpoint": endpoint, "replay_endpoint": replay, "curve": curve, "content": content}


def _serve(engine: Any, config: Any, host: str, port: int, events: dict[str, Any] | None, limits: Any) -> None:
    """Serve until interrupted; with an events endpoint, the app publishes the pool's events after every step."""
    if events is None:
        _run(engine, config, host, port, limits)
        return
    from kvpool.kv_events import EventContent, KVEventPublisher

    publisher = KVEventPublisher(**events)
    try:
        replaying = f", replay on {publisher.replay_endpoint}" if publisher.replay_endpoint else ""
        _log(f"KV events: {publisher.attach.value} {publisher.endpoint}{replaying}")
        if publisher.curve is None:
            _log("KV events are plain TCP: whoever reaches the endpoints reads them (--kv-events-secret-key: CURVE)")
        else:
            _log(f"KV events need CURVE: {counted(len(publisher.curve.clients), 'client key')} may subscribe")
        if publisher.content is EventContent.HASHES:
            _log("KV events carry block hashes only: no token IDs, LoRA names or cache salts")
        elif config.salts.isolates_tenants:
            _log(
                "WARNING: --kv-events-include-token-ids: every subscriber reads every tenant's prompt tokens and salts"
            )
        _run(engine, config, host, port, limits, events=publisher)
    finally:
        publisher.close()  # the app closes it when it stops; this covers a start that failed before


def _start_engine(options: dict[str, Any]) -> Any:
    import transformers

    from kvpool.engine.llm_engine import LLMEngine

    hf_logging: Any = transformers.utils.logging  # its functions carry no annotations
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    engine = LLMEngine(**options, log=_log)
    _log(f"ready in {engine.setup.startup_seconds:.1f} s")
    return engine


def _run(engine: Any, config: Any, host: str, port: int, limits: Any, events: Any = None) -> None:
    import logging

    from kvpool.serve import build_app
    from kvpool.serve.connections import serve_on, uvicorn_config

    if config.log_requests or config.stats_interval is not None:  # the server's own lines, on stderr
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("INFO %(asctime)s %(message)s", "%H:%M:%S"))
        logger = logging.getLogger("kvpool.serve")
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)

    app = build_app(engine, config, events=events)
    settings = uvicorn_config(app, host=host, port=port, limits=limits, log_level="warning", access_log=False)
    serve_on(
        settings,
        lambda url: _log(f"serving {config.model_name!r} on {url}/v1"),
        lambda url: _log(f"stopped serving {config.model_name!r} on {url}/v1"),
    )
