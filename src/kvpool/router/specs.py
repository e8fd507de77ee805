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

Every mistake (an unknown key, a block size that is not a positive integer, an
algorithm the router cannot compute, an endpoint that is not ZeroMQ's) is a
:class:`~kvpool.errors.ConfigError` naming the replica and the value, raised before the
router starts.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvpool.errors import ConfigError
from kvpool.hashing import HashAlgo
from kvpool.router.replicas import EventsInfo, HashForm, check_replica_url, connectable_endpoint

__all__ = ["ReplicaSpec", "load_config", "parse_replica"]

_KEYS = ("events", "replay", "block_size", "hash", "seed", "block_hash", "num_blocks")


@dataclass(frozen=True, slots=True, kw_only=True)
class ReplicaSpec:
    """One replica: its URL and, for one that is described rather than discovered, its events.

    ``discover``: read ``GET /kv-events`` (a ``kvpool serve`` replica). Otherwise
    ``events`` is what the replica was described with (None: it publishes no events).
    """

    url: str
    discover: bool = True
    events: EventsInfo | None = None

    @property
    def described(self) -> bool:
        return not self.discover


def _int(value: object, key: str, url: str) -> int:
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if type(value) is not int or value < 1:
        raise ConfigError(f"replica {url}: {key.replace('_', '-')} must be a positive integer, got {value!r}")
    return value


def _endpoint(value: object, key: str, url: str) -> str:
    if not isinstance(value, str) or not value.startswith(("tcp://", "ipc://")):
        raise ConfigError(f"replica {url}: {key} must be a tcp:// or ipc:// ZeroMQ endpoint, got {value!r}")
    endpoint = connectable_endpoint(value, url)
    if endpoint.startswith("tcp://") and not endpoint.rpartition(":")[2].isdigit():
        raise ConfigError(f"replica {url}: {key} {value!r} has no port")
    return endpoint


def build_spec(url: str, fields: Mapping[str, object]) -> ReplicaSpec:
    """A replica from its URL and the keys described above (none: a ``kvpool serve`` replica)."""
    url = check_replica_url(url)
    norm = {str(k).replace("-", "_"): v for k, v in fields.items()}
    unknown = sorted(set(norm) - set(_KEYS))
    if unknown:
        raise ConfigError(
            f"replica {url}: unknown key {unknown[0]!r}; the keys are {', '.join(k.replace('_', '-') for k in _KEYS)}"
        )
    if not norm:
        return ReplicaSpec(url=url)
    events = norm.get("events")
    if events is None:
        raise ConfigError(f"replica {url}: a described replica needs events=ENDPOINT (or events=none)")
    if events == "none":
        extra = sorted(set(norm) - {"events"})
        if extra:
            raise ConfigError(f"replica {url}: events=none publishes no events, so {extra[0]!r} means nothing")
        return ReplicaSpec(url=url, discover=False)
    if "block_size" not in norm:
        raise ConfigError(f"replica {url}: block-size is needed with events (vLLM's CPU backend: 128, GPUs: 16)")
    block_size = _int(norm["block_size"], "block_size", url)
    algo_name = norm.get("hash", HashAlgo.VLLM_SHA256.value)
    try:
        algo = HashAlgo.parse(str(algo_name))
    except (ConfigError, ValueError):
        names = ", ".join(a.value for a in HashAlgo)
        raise ConfigError(f"replica {url}: unknown hash algorithm {algo_name!r}; one of {names}") from None
    seed = norm.get("seed")
    if seed is not None and (not isinstance(seed, str | int) or isinstance(seed, bool) or str(seed) == ""):
        raise ConfigError(f"replica {url}: seed must be the replica's PYTHONHASHSEED, got {seed!r}")
    default_form = HashForm.INT64 if algo.is_vllm else HashForm.BYTES
    form_name = norm.get("block_hash", default_form.value)
    try:
        form = HashForm(form_name)
    except ValueError:
        raise ConfigError(f"replica {url}: block-hash must be int64 or bytes, got {form_name!r}") from None
    replay = norm.get("replay")
    return ReplicaSpec(
        url=url,
        discover=False,
        events=EventsInfo(
            endpoint=_endpoint(events, "events", url),
            replay_endpoint=None if replay is None else _endpoint(replay, "replay", url),
            hash_algorithm=algo.value,
            hash_seed=None if seed is None else str(seed),
            block_size=block_size,
            num_blocks=None if "num_blocks" not in norm else _int(norm["num_blocks"], "num_blocks", url),
            hash_form=form,
            configured=True,
        ),
    )


def parse_replica(text: str) -> ReplicaSpec:
    """``URL`` or ``URL,key=value,...`` (the ``--replica`` option)."""
    url, *pairs = [part.strip() for part in text.split(",")]
    fields: dict[str, object] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"replica {url!r}: {pair!r} is not key=value")
        if key.strip() in fields:
            raise ConfigError(f"replica {url!r}: {key.strip()!r} is given twice")
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
    unknown = sorted(set(data) - {"defaults", "replica"})
    if unknown:
        raise ConfigError(f"the router config {os.fspath(path)!r}: unknown table {unknown[0]!r} (defaults, replica)")
    defaults = data.get("defaults", {})
    replicas = data.get("replica", [])
    if not isinstance(defaults, dict) or not isinstance(replicas, list):
        raise ConfigError(f"the router config {os.fspath(path)!r}: [defaults] is a table, [[replica]] a list of tables")
    specs = []
    for i, entry in enumerate(replicas):
        if not isinstance(entry, dict) or not isinstance(entry.get("url"), str):
            raise ConfigError(f"the router config {os.fspath(path)!r}: replica {i} has no url")
        own = {k: v for k, v in entry.items() if k != "url"}
        fields = own if own.get("events") == "none" else {**defaults, **own}
        specs.append(build_spec(entry["url"], fields))
    return specs
