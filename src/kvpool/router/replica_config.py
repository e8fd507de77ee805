"""Replicas as ``kvpool route`` is told about them: on its command line or in a TOML file.

A ``kvpool serve`` replica needs only its URL: the router reads where it publishes its
KV events, and how it hashes blocks, from its ``GET /kv-events``. Any other server
(vLLM, SGLang, llama.cpp, a managed endpoint) is described instead, with the same
facts written down::

    --replica 'http://10.0.0.5:8000,events=tcp://10.0.0.5:5557,replay=tcp://10.0.0.5:5558,block-size=128,hash=sha256'
    --replica 'http://10.0.0.6:8000,events=none'

or, in a file given with ``--config``::

    [defaults]                      # applied to every [[replica]] below
    block_size = 128
    hash = "sha256"

    [[replica]]
    url = "http://10.0.0.5:8000"
    events = "tcp://10.0.0.5:5557"
    replay = "tcp://10.0.0.5:5558"

The keys (``-`` and ``_`` are the same in a key):

``events``
    the ZeroMQ endpoint the replica publishes KV events on (``tcp://*:5557`` names the
    replica URL's host), or ``none`` for a server that publishes none (its prefixes are
    then remembered by the router, in ``approximate`` mode).
``replay``
    its replay endpoint (vLLM's ``replay_endpoint``); without it a lost batch clears
    the replica's entries until new events rebuild them.
``block-size``
    tokens per block (vLLM's ``--block-size``; 128 on vLLM's CPU backend, 16 on GPUs).
``hash``
    the block hash algorithm: vLLM's ``sha256`` (its default) or ``sha256_cbor``, or
    kvpool's ``kvpool_sha256``.
``seed``
    the ``PYTHONHASHSEED`` the replica runs with, when it runs with one (vLLM derives its
    hash chain's root from it).
``block-hash``
    ``int64`` (vLLM's default: a block hash is the digest's low 64 bits, an integer) or
    ``bytes`` (the whole digest; vLLM with ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``, and
    kvpool). Defaults to ``int64`` for vLLM's algorithms, ``bytes`` for kvpool's.
``num-blocks``
    the most blocks the replica holds (caps its entries in the index).
``profile``
    a cost profile (a built-in name such as ``llama-3.1-8b-h100``, or the path of
    ``kvpool calibrate``'s JSON output): the replica's rates (prefill tokens a second, decode
    step) as the router weighs it, for a server that does not answer ``GET /rates`` (vLLM).
    Allowed on any replica; a ``kvpool serve`` replica's own ``/rates`` replace it once read.

Every mistake (an unknown key or one given twice, a block size that is not an integer
from 1 to :data:`~kvpool.router.replicas.MAX_BLOCK_SIZE`, an algorithm the router cannot
compute, an endpoint that is not ZeroMQ's or whose port is not in 1-65535, a TOML file
nested too deeply) is a :class:`~kvpool.errors.ConfigError` naming the replica (its URL
redacted: credentials in it are never shown) and the value, raised before the router
starts.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvpool.cost_model import load_profile
from kvpool.errors import ConfigError
from kvpool.hashing import HashAlgo
from kvpool.kv_events.transport import parse_subscriber_endpoint
from kvpool.replica_rates import ReplicaRates
from kvpool.router.replicas import (
    EventsInfo,
    HashForm,
    check_block_size,
    check_distinct,
    check_replica_url,
    connectable_endpoint,
    redact_url,
    shown,
)

__all__ = ["ReplicaSpec", "load_config", "parse_replica", "replica_specs", "replicas_isolate_tenants"]

_KEYS = ("events", "replay", "block_size", "hash", "seed", "block_hash", "num_blocks", "profile")


@dataclass(frozen=True, slots=True, kw_only=True, repr=False)
class ReplicaSpec:
    """One replica: its URL and, for one that is described rather than discovered, its events.

    ``url`` is where requests go, credentials included; :attr:`name` is how it is shown.
    ``discover``: read ``GET /kv-events`` (a ``kvpool serve`` replica). Otherwise
    ``events`` is what the replica was described with (None: it publishes no events).
    ``rates``: from the ``profile`` key (None: none named).
    """

    url: str
    discover: bool = True
    events: EventsInfo | None = None
    rates: ReplicaRates | None = None

    @property
    def name(self) -> str:
        """The URL as it is shown: credentials redacted."""
        return redact_url(self.url)

    @property
    def described(self) -> bool:
        return not self.discover

    def __repr__(self) -> str:
        return (
            f"ReplicaSpec(name={self.name!r}, discover={self.discover!r}, events={self.events!r}, rates={self.rates!r})"
        )


def _number(value: object) -> object:
    """A command line's ``"128"`` as 128 (ASCII digits, at most 19 of them); anything else as it came."""
    if isinstance(value, str) and value.strip().isascii() and value.strip().isdigit() and len(value.strip()) <= 19:
        return int(value.strip())
    return value


def _int(value: object, key: str, name: str) -> int:
    value = _number(value)
    if type(value) is not int or value < 1:
        raise ConfigError(f"replica {name}: {key.replace('_', '-')} must be a positive integer, got {shown(value)}")
    return value


def _endpoint(value: object, key: str, name: str) -> str:
    if not isinstance(value, str) or not value.startswith(("tcp://", "ipc://")):
        raise ConfigError(f"replica {name}: {key} must be a tcp:// or ipc:// ZeroMQ endpoint, got {shown(value)}")
    endpoint = connectable_endpoint(value, name)
    # the subscriber's rule (kv_events.transport): a host, and a port in 1-65535
    return parse_subscriber_endpoint(endpoint, f"replica {name}: {key}")


def _normalized(fields: Mapping[str, object], name: str) -> dict[str, object]:
    """``fields`` with each key spelled with ``_``; a key given twice (``block-size`` and ``block_size``) is refused."""
    norm: dict[str, object] = {}
    for key, value in fields.items():
        spelled = str(key).replace("-", "_")
        if spelled in norm:
            raise ConfigError(f"replica {name}: {shown(key)} is given twice")
        norm[spelled] = value
    return norm


def build_spec(url: str, fields: Mapping[str, object]) -> ReplicaSpec:
    """A replica from its URL and the keys described above (none: a ``kvpool serve`` replica)."""
    url = check_replica_url(url)
    name = redact_url(url)
    norm = _normalized(fields, name)
    unknown = sorted(set(norm) - set(_KEYS))
    if unknown:
        raise ConfigError(
            f"replica {name}: unknown key {shown(unknown[0])}; "
            f"the keys are {', '.join(k.replace('_', '-') for k in _KEYS)}"
        )
    rates = _rates(norm.pop("profile"), name) if "profile" in norm else None
    if not norm:
        return ReplicaSpec(url=url, rates=rates)
    events = norm.get("events")
    if events is None:
        raise ConfigError(f"replica {name}: a described replica needs events=ENDPOINT (or events=none)")
    if events == "none":
        extra = sorted(set(norm) - {"events"})
        if extra:
            raise ConfigError(f"replica {name}: events=none publishes no events, so {shown(extra[0])} means nothing")
        return ReplicaSpec(url=url, discover=False, rates=rates)
    if "block_size" not in norm:
        raise ConfigError(f"replica {name}: block-size is needed with events (vLLM's CPU backend: 128, GPUs: 16)")
    block_size = check_block_size(_number(norm["block_size"]), f"replica {name}")
    algo_name = norm.get("hash", HashAlgo.VLLM_SHA256.value)
    names = ", ".join(a.value for a in HashAlgo)
    try:
        algo = HashAlgo.parse(algo_name) if isinstance(algo_name, str) else None
    except (ConfigError, ValueError):
        algo = None
    if algo is None:
        raise ConfigError(f"replica {name}: unknown hash algorithm {shown(algo_name)}; one of {names}")
    seed = norm.get("seed")
    if seed is not None and (not isinstance(seed, str | int) or isinstance(seed, bool) or str(seed) == ""):
        raise ConfigError(f"replica {name}: seed must be the replica's PYTHONHASHSEED, got {shown(seed)}")
    default_form = HashForm.INT64 if algo.is_vllm else HashForm.BYTES
    form_name = norm.get("block_hash", default_form.value)
    forms = {form.value: form for form in HashForm}
    if not isinstance(form_name, str) or form_name not in forms:
        raise ConfigError(f"replica {name}: block-hash must be int64 or bytes, got {shown(form_name)}")
    form = forms[form_name]
    replay = norm.get("replay")
    return ReplicaSpec(
        url=url,
        discover=False,
        rates=rates,
        events=EventsInfo(
            endpoint=_endpoint(events, "events", name),
            replay_endpoint=None if replay is None else _endpoint(replay, "replay", name),
            hash_algorithm=algo.value,
            hash_seed=None if seed is None else str(seed),
            block_size=block_size,
            num_blocks=None if "num_blocks" not in norm else _int(norm["num_blocks"], "num_blocks", name),
            hash_form=form,
            configured=True,
        ),
    )


def _rates(value: object, name: str) -> ReplicaRates:
    """The rates of the cost profile ``value`` names (a built-in name or a JSON file); ConfigError naming both."""
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"replica {name}: profile must name a cost profile or its JSON file, got {shown(value)}")
    try:
        return ReplicaRates.from_profile(load_profile(value))
    except ConfigError as exc:
        raise ConfigError(f"replica {name}: profile {shown(value)}: {exc}") from None


def parse_replica(text: str) -> ReplicaSpec:
    """``URL`` or ``URL,key=value,...`` (the ``--replica`` option)."""
    url, *pairs = [part.strip() for part in text.split(",")]
    name = shown(redact_url(url))
    fields: dict[str, object] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"replica {name}: {shown(pair)} is not key=value")
        if key.strip() in fields:
            raise ConfigError(f"replica {name}: {shown(key.strip())} is given twice")
        fields[key.strip()] = value.strip()
    return build_spec(url, fields)


def load_config(path: str | os.PathLike[str]) -> list[ReplicaSpec]:
    """The replicas of a TOML file: ``[[replica]]`` tables, each completed by the ``[defaults]`` table."""
    import tomllib

    try:
        with open(path, "rb") as f:
            data: dict[str, Any] = tomllib.load(f)
    except OSError as exc:
        raise ConfigError(f"cannot read the router config {os.fspath(path)!r}: {exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"the router config {os.fspath(path)!r} is not TOML: {exc}") from None
    except RecursionError:  # tomllib recurses once per level of nested arrays and inline tables
        raise ConfigError(f"the router config {os.fspath(path)!r} is nested too deeply") from None
    unknown = sorted(set(data) - {"defaults", "replica"})
    if unknown:
        raise ConfigError(
            f"the router config {os.fspath(path)!r}: unknown table {shown(unknown[0])} (defaults, replica)"
        )
    defaults = data.get("defaults", {})
    replicas = data.get("replica", [])
    if not isinstance(defaults, dict) or not isinstance(replicas, list):
        raise ConfigError(f"the router config {os.fspath(path)!r}: [defaults] is a table, [[replica]] a list of tables")
    specs = []
    for i, entry in enumerate(replicas):
        if not isinstance(entry, dict) or not isinstance(entry.get("url"), str):
            raise ConfigError(f"the router config {os.fspath(path)!r}: replica {i} has no url")
        name = shown(redact_url(entry["url"]))
        own = _normalized({k: v for k, v in entry.items() if k != "url"}, name)
        fields = own if own.get("events") == "none" else {**_normalized(defaults, "defaults"), **own}
        specs.append(build_spec(entry["url"], fields))
    return specs


def replica_specs(replicas: Iterable[str], config_file: str | os.PathLike[str] | None = None) -> list[ReplicaSpec]:
    """The router's replicas: each ``--replica`` text, then the ``--config`` file's, each named once.

    No replica at all, or one replica named twice (the same scheme, host and port,
    however spelt: :func:`~kvpool.router.replicas.check_distinct`), is a
    :class:`ConfigError` raised before anything is opened.
    """
    specs = [parse_replica(text) for text in replicas]
    if config_file is not None:
        specs += load_config(config_file)
    if not specs:
        raise ConfigError("no replica: name one with --replica URL (repeat it) or list them in --config FILE")
    check_distinct([spec.url for spec in specs])
    return specs


def replicas_isolate_tenants(
    specs: Sequence[ReplicaSpec], *, no_tenant_isolation: bool, tenant_files_given: bool
) -> bool:
    """Whether the replicas derive tenant cache salts, so that the router must derive the same ones.

    A ``kvpool serve`` replica does, unless it runs with ``--no-tenant-isolation``. A
    described server (vLLM) salts a prompt by the request's own ``cache_salt``, as
    kvpool's ``--no-tenant-isolation`` does: in front of described replicas alone the
    salts are shared, unless the router is given a tenant secret or an API key file
    (``tenant_files_given``), which says the replicas behind it isolate tenants.
    """
    if no_tenant_isolation:
        return False
    return tenant_files_given or any(spec.discover for spec in specs)
