"""``kvpool serve``: the engine behind an OpenAI-compatible HTTP API (the ``serve`` extra).

It takes the engine flags of ``kvpool generate`` (:mod:`kvpool.cli.shared_flags`),
starts the engine once, and serves it with uvicorn. Tenants, cache salts and
the metrics gate follow :mod:`kvpool.tenancy` and :mod:`kvpool.serve`, what the
events carry :mod:`kvpool.kv_events`; what the server decided about them (one
tenant or many, where the secret comes from, isolation off) is said at start
on stderr.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import click

from kvpool.checks import DEFAULT_THREADS, counted
from kvpool.cli import shared_flags
from kvpool.cli.generate import _log
from kvpool.cli.params import NON_NEGATIVE_INT, POSITIVE_INT, FiniteFloatRange, reports_errors, require_extra
from kvpool.cli.shared_flags import DEFAULT_KV_CACHE_MEMORY, TenantFlags, take, tenant_flags
from kvpool.model_names import DEFAULT_MODEL
from kvpool.tenancy import KeyRing, SaltPolicy

if TYPE_CHECKING:
    from kvpool.serve.served_engine import ServedEngine

__all__ = ["VLLM_API_KEY_ENV", "serve"]

#: vLLM's environment variable for its API key: read when no ``--api-key`` is given.
VLLM_API_KEY_ENV = "VLLM_API_KEY"


@click.command("serve")
@click.option("--host", default="127.0.0.1", show_default=True, help="Interface to listen on.")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True, help="TCP port.")
@click.option(
    "--served-model-name", default=None, help="The name clients send as 'model' [default: the --model value]."
)
@tenant_flags(
    api_key_file="JSON object: API key -> tenant name. Without it the server is single-tenant and needs no key.",
    tenant_secret_file="The secret tenant cache salts are derived with [default: a fresh one per start].",
    no_tenant_isolation="Let every tenant share one prefix cache (the client's cache_salt passes through). "
    "Leaks prompts.",
    admin_key_file="Keys (one a line) that open /metrics, /health?verbose and /kv-events beyond the loopback "
    "interface.",
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
@click.option(
    "--emulate",
    metavar="PROFILE",
    default=None,
    help="Serve an emulated replica: no weights and no torch, the model's tokenizer only; the real scheduler and "
    "KV cache manager decide, and each step takes the time this cost profile gives (a built-in name or a JSON "
    "file; docs/emulator.md).",
)
@click.option("--replicas", type=POSITIVE_INT, default=1, show_default=True,
              help="With --emulate: this many replicas in one process, on consecutive ports (--port 0: a free port "
              "each) and consecutive KV event ports; every address is printed.")  # fmt: skip
@click.option("--time-scale", type=FiniteFloatRange(min=0, min_open=True), default=1.0, show_default=True,
              help="With --emulate: real seconds per modelled second (2 runs the replicas at half speed).")  # fmt: skip
@click.option("--num-gpu-blocks-override", type=click.IntRange(min=2), default=None,
              help="With --emulate: the KV pool's blocks, block 0 included (vLLM's flag) [default: --kv-cache-memory "
              "over the profile's KV bytes per token].")  # fmt: skip
@click.option("--seed", type=NON_NEGATIVE_INT, default=0, show_default=True,
              help="With --emulate: mixed into every request's draw of output tokens.")  # fmt: skip
@shared_flags.engine_flags
@reports_errors("serve")
def serve(model_arg: str | None, **flags: Any) -> None:
    """Serve the model over HTTP with the OpenAI API (/v1/completions, /v1/chat/completions, /v1/models).

    Also /health (?verbose=1: requests, owned blocks, the pool's invariants),
    /metrics (Prometheus) and /kv-events when events are configured. With --emulate PROFILE,
    emulated replicas (no weights, no torch) instead of the model.
    """
    emulation = _emulation(flags)
    require_extra("serve", "serve", "starlette", "uvicorn", "prometheus_client")
    from kvpool.serve import ServeConfig
    from kvpool.serve.connections import ConnectionLimits
    from kvpool.serve.metrics import check_prefix

    check_prefix(flags["metrics_prefix"])
    _one_model(model_arg, flags)
    tenants = take(TenantFlags, flags)
    api_keys = KeyRing.from_options(tenants.api_key_file, _api_keys(flags.pop("api_key")))
    limits = take(ConnectionLimits, flags)
    event_flags = take(EventFlags, flags)
    admin_keys = None if tenants.admin_key_file is None else KeyRing.load_lines(tenants.admin_key_file, "admin")
    salts, secret = SaltPolicy.from_options(
        isolate=not tenants.no_tenant_isolation, secret_file=tenants.tenant_secret_file
    )
    events = event_flags.publisher_options(isolated=salts.isolates_tenants)
    engines = _start_engines(emulation, flags, events=events is not None, api_keys=api_keys)
    try:
        _log_tenants(api_keys, secret, tenants.tenant_secret_file)
        config = take(
            ServeConfig,
            flags,
            model_name=flags.pop("served_model_name") or str(flags["model"]),
            api_keys=api_keys,
            salts=salts,
            admin_keys=admin_keys,
            log_requests=flags.pop("enable_log_requests"),
            stats_interval=None if flags.pop("disable_log_stats") else 10.0,
        )
        _serve(engines, config, flags["host"], flags["port"], events, limits)
    finally:
        _close_tiers(engines)


def _one_model(model_arg: str | None, flags: dict[str, Any]) -> None:
    """The model named as the argument (vLLM's way) or with ``--model``, not both unless they agree."""
    if model_arg is None:
        return
    if flags["model"] not in (model_arg, DEFAULT_MODEL):
        raise click.UsageError(f"the model is given twice: {model_arg!r} and --model {flags['model']!r}")
    flags["model"] = model_arg


def _api_keys(given: tuple[str, ...]) -> tuple[str, ...]:
    """The ``--api-key`` values, or vLLM's ``$VLLM_API_KEY`` where none is given."""
    if not given and os.environ.get(VLLM_API_KEY_ENV):
        _log(f"API key from ${VLLM_API_KEY_ENV} (no --api-key given)")
        return (os.environ[VLLM_API_KEY_ENV],)
    return given


def _engine_options(flags: dict[str, Any], *, events: bool, api_keys: Any) -> dict[str, Any]:
    """The engine flags, and serve's own engine options, as EngineOptions fields."""
    options = shared_flags.engine_options(flags)
    options["enable_kv_events"] = events
    options["enable_prefix_caching"] = flags["enable_prefix_caching"]
    for name in ("max_num_seqs", "max_num_batched_tokens"):
        if flags[name] is not None:
            options[name] = flags[name]
    if api_keys is not None:
        options["tenant_weights"] = dict(api_keys.weights)
    if flags["gpu_memory_utilization"] is not None:
        if flags["kv_cache_memory"] != DEFAULT_KV_CACHE_MEMORY:
            raise click.UsageError("--gpu-memory-utilization sizes the KV cache: leave out --kv-cache-memory")
        options["gpu_memory_utilization"] = flags["gpu_memory_utilization"]
        options["kv_cache_memory"] = None  # measured, as vLLM does
    return options


@dataclass(frozen=True, slots=True, kw_only=True)
class EmulationFlags:
    """``serve``'s flags of an emulated replica (``--emulate PROFILE``; None: the real engine)."""

    emulate: str | None
    replicas: int
    time_scale: float
    num_gpu_blocks_override: int | None
    seed: int

    def refuse_without_emulate(self) -> None:
        """The flags that only mean something with ``--emulate`` are refused without it."""
        given = {
            "--replicas": self.replicas != 1,
            "--time-scale": self.time_scale != 1.0,
            "--num-gpu-blocks-override": self.num_gpu_blocks_override is not None,
            "--seed": self.seed != 0,
        }
        for flag, set_ in given.items():
            if set_:
                raise click.UsageError(f"{flag} needs --emulate PROFILE (kvpool's engine runs one real replica)")


#: Engine flags an emulated replica has no use for, with the value that means "not given".
_NOT_EMULATED = {
    "kv_tiers": (), "kv_tier_secret_file": None, "kv_tier_namespace": None, "kv_tier_unauthenticated": False,
    "kv_tier_always_load": False, "device": None, "dtype": None, "threads": DEFAULT_THREADS, "gpu_memory_utilization": None,
    "tensor_parallel_size": 1, "linear_kernel": None,
}  # fmt: skip


def _emulation(flags: dict[str, Any]) -> EmulationFlags:
    """The emulation flags; without ``--emulate``, the engine extra is needed and they must be left out."""
    emulation = take(EmulationFlags, flags)
    if emulation.emulate is None:
        emulation.refuse_without_emulate()
        require_extra("serve", "engine", "torch", "transformers")
    return emulation


def _start_engines(
    emulation: EmulationFlags, flags: dict[str, Any], *, events: bool, api_keys: Any
) -> list[ServedEngine]:
    """kvpool's engine (one), or ``--replicas`` emulated ones."""
    if emulation.emulate is None:
        return [_start_engine(_engine_options(flags, events=events, api_keys=api_keys))]
    return _start_emulated(emulation, flags, events=events, api_keys=api_keys)


def _start_emulated(
    emulation: EmulationFlags, flags: dict[str, Any], *, events: bool, api_keys: Any
) -> list[ServedEngine]:
    """``--replicas`` emulated engines over one tokenizer, their pool from the flags (no torch is imported)."""
    require_extra("serve", "route", "tokenizers", "jinja2")
    from kvpool.checks import parse_size
    from kvpool.cost_model import load_profile
    from kvpool.emulator import EmulatedEngine, EmulatorOptions, blocks_for_memory
    from kvpool.emulator.fleet import context_length, tokenizer_folder
    from kvpool.fair_share import TenantWeights
    from kvpool.tokenizer_files import FolderTokenizer

    for name, unset in _NOT_EMULATED.items():
        if (tuple(flags[name]) if name == "kv_tiers" else flags[name]) != unset:
            raise click.UsageError(f"--{name.replace('_', '-')} is not emulated: leave it out with --emulate")
    if str(flags["kv_cache_memory"]).strip().lower() == "auto":
        raise click.UsageError("--kv-cache-memory auto measures a device: give a size or --num-gpu-blocks-override")
    profile = load_profile(emulation.emulate or "")
    folder = tokenizer_folder(flags["model"])
    tokenizer = FolderTokenizer(folder)
    num_blocks = emulation.num_gpu_blocks_override or blocks_for_memory(
        profile, parse_size(flags["kv_cache_memory"], field="--kv-cache-memory"), flags["block_size"]
    )
    limits = {name: flags[name] for name in ("max_num_seqs", "max_num_batched_tokens") if flags[name] is not None}
    options = EmulatorOptions(
        profile=profile, num_blocks=num_blocks, block_size=flags["block_size"],
        max_model_len=flags["max_model_len"] or context_length(folder), **limits,
        enable_prefix_caching=flags["enable_prefix_caching"], enable_kv_events=events, hash_algo=flags["hash_algo"],
        time_scale=emulation.time_scale, seed=emulation.seed, model_name=str(flags["model"]),
        tenant_weights=TenantWeights(dict(api_keys.weights) if api_keys is not None else {}),
    )  # fmt: skip
    engines: list[ServedEngine] = [EmulatedEngine(options, tokenizer) for _ in range(emulation.replicas)]
    _log(
        f"emulated: {counted(emulation.replicas, 'replica')} of {options.model_name} (tokenizer from {folder}), "
        f"cost profile {profile.name!r} x time scale {options.time_scale:g}; each {options.num_blocks:,} blocks "
        f"of {options.block_size} tokens, max_model_len {options.max_model_len:,}, {options.max_num_seqs} "
        f"sequences and {options.max_num_batched_tokens} tokens a step"
    )
    return engines


def _close_tiers(engines: list[ServedEngine]) -> None:
    for engine in engines:
        if engine.kv_tiers is not None:
            engine.kv_tiers.close()


def _log_tenants(api_keys: Any, secret: Any, secret_file: str | None) -> None:
    """Say at start how many tenants there are and where their salts come from."""
    from kvpool.tenancy import SecretSource

    if api_keys is None:
        _log("single-tenant: no --api-key-file, so every request is one tenant's and needs no API key")
    else:
        _log(f"{counted(len(api_keys.names), 'tenant')}, {counted(len(api_keys), 'API key')}")
    if secret is SecretSource.NONE:
        _log(
            "WARNING: --no-tenant-isolation: all tenants share one prefix cache; a tenant can tell from "
            "cached_tokens or time to first token which prompts another tenant sent"
        )
    elif secret is SecretSource.GENERATED:
        _log("tenant cache salts use a secret generated at start (--tenant-secret-file keeps one across restarts)")
    else:
        _log(f"tenant cache salts use the secret in {secret_file}")


@dataclass(frozen=True, slots=True, kw_only=True)
class EventFlags:
    """``serve``'s KV event flags as given (None: not given)."""

    kv_events_endpoint: str | None
    kv_events_replay_endpoint: str | None
    kv_events_secret_key: str | None
    kv_events_client_keys: str | None
    kv_events_include_token_ids: bool
    kv_events_config: str | None

    def publisher_options(self, *, isolated: bool) -> dict[str, Any] | None:
        """The event publisher's arguments (vLLM's ``--kv-events-config`` folded in); None: no events."""
        endpoint, replay, extras = self.kv_events_endpoint, self.kv_events_replay_endpoint, {}
        if self.kv_events_config is not None:
            from kvpool.kv_events.vllm_config import from_vllm_config

            vllm = from_vllm_config(self.kv_events_config, endpoint=endpoint, replay_endpoint=replay)
            endpoint, replay, extras = vllm.endpoint, vllm.replay_endpoint, dict(vllm.publisher_options)
            for key in vllm.ignored:
                _log(f"--kv-events-config: {key} has no counterpart (events are published after each step)")
        events = _events_setup(
            endpoint,
            replay,
            self.kv_events_secret_key,
            self.kv_events_client_keys,
            include_token_ids=self.kv_events_include_token_ids,
            isolated=isolated,
        )
        if events is not None:
            events.update(extras)
        return events


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

    What they carry is :meth:`~kvpool.kv_events.EventContent.for_tenants`'s rule.
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
    content = EventContent.for_tenants(isolated=isolated, include_token_ids=include_token_ids)
    return {"endpoint": endpoint, "replay_endpoint": replay, "curve": curve, "content": content}


def _serve(engines: list[Any], config: Any, host: str, port: int, events: dict[str, Any] | None, limits: Any) -> None:
    """Serve until interrupted; with an events endpoint, each app publishes its pool's events after every step.

    Several (emulated) engines serve on consecutive ports and publish on consecutive event ports
    (:mod:`kvpool.emulator.fleet`).
    """
    publishers: list[Any] = []
    try:
        if events is not None:
            from kvpool.emulator.fleet import replica_endpoint

            for i in range(len(engines)):
                replay = events["replay_endpoint"]
                endpoints = {
                    "endpoint": replica_endpoint(events["endpoint"], i),
                    "replay_endpoint": None if replay is None else replica_endpoint(replay, i),
                }
                publishers.append(_publisher({**events, **endpoints}, config))
        _run(engines, config, host, port, limits, publishers or [None] * len(engines))
    finally:
        for publisher in publishers:
            publisher.close()  # the app closes it when it stops; this covers a start that failed before


def _publisher(events: dict[str, Any], config: Any) -> Any:
    """The event publisher of one replica, and what it does said on stderr."""
    from kvpool.kv_events import EventContent, KVEventPublisher

    publisher = KVEventPublisher(**events)
    replaying = f", replay on {publisher.replay_endpoint}" if publisher.replay_endpoint else ""
    _log(f"KV events: {publisher.attach.value} {publisher.endpoint}{replaying}")
    if publisher.curve is None:
        _log("KV events are plain TCP: whoever reaches the endpoints reads them (--kv-events-secret-key: CURVE)")
    else:
        _log(f"KV events need CURVE: {counted(len(publisher.curve.clients), 'client key')} may subscribe")
    if publisher.content is EventContent.HASHES:
        _log("KV events carry block hashes only: no token IDs, LoRA names or cache salts")
    elif config.salts.isolates_tenants:
        _log("WARNING: --kv-events-include-token-ids: every subscriber reads every tenant's prompt tokens and salts")
    return publisher


def _start_engine(options: dict[str, Any]) -> ServedEngine:
    import transformers

    from kvpool.engine.llm_engine import LLMEngine

    hf_logging: Any = transformers.utils.logging  # its functions carry no annotations
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    engine = LLMEngine(**options, log=_log)
    _log(f"ready in {engine.setup.startup_seconds:.1f} s")
    served: ServedEngine = engine  # what the server asks of an engine, checked here
    return served


def _run(engines: list[Any], config: Any, host: str, port: int, limits: Any, publishers: list[Any]) -> None:
    import logging

    from kvpool.emulator.fleet import replica_port
    from kvpool.serve import build_app
    from kvpool.serve.connections import serve_many, serve_on, uvicorn_config

    if config.log_requests or config.stats_interval is not None:  # the server's own lines, on stderr
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("INFO %(asctime)s %(message)s", "%H:%M:%S"))
        logger = logging.getLogger("kvpool.serve")
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)

    settings = [
        uvicorn_config(
            build_app(engine, config, events=publisher), host=host, port=replica_port(port, i), limits=limits,
            log_level="warning", access_log=False,
        )
        for i, (engine, publisher) in enumerate(zip(engines, publishers))
    ]  # fmt: skip

    def announce(url: str) -> None:
        _log(f"serving {config.model_name!r} on {url}/v1")

    def stopped(url: str) -> None:
        _log(f"stopped serving {config.model_name!r} on {url}/v1")

    if len(settings) == 1:
        serve_on(settings[0], announce, stopped)
    else:
        serve_many(settings, announce, stopped)
