"""vLLM's ``--kv-events-config`` JSON in kvpool's terms: the endpoints and the publisher's options.

vLLM configures its KV events with one JSON object::

    {"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557",
     "replay_endpoint": "tcp://*:5558", "topic": "", "buffer_steps": 10000, "hwm": 100000}

:func:`from_vllm_config` reads it as what ``kvpool serve`` names separately: the
publisher endpoint (``--kv-events-endpoint``), the replay endpoint
(``--kv-events-replay-endpoint``) and :class:`~kvpool.kv_events.KVEventPublisher`'s
``topic``, ``buffer_steps`` and ``hwm``. Events off (``enable_kv_cache_events``
false, or the ``null`` publisher) leave the endpoints as given. An endpoint named
both ways must be the same; an endpoint vLLM's config leaves out is vLLM's
default, ``tcp://*:5557`` (every interface). ``max_queue_size`` has no counterpart
(kvpool publishes after each step, from the engine's thread) and is reported
back as ignored. Any other key, or a value of the wrong kind, is a
:class:`~kvpool.errors.ConfigError` naming it. Standard library only.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvpool.errors import ConfigError

__all__ = ["VLLM_DEFAULT_ENDPOINT", "VLLM_EVENT_KEYS", "VllmEventsConfig", "from_vllm_config"]

#: The keys of vLLM's ``KVEventsConfig``.
VLLM_EVENT_KEYS = frozenset(
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
#: vLLM's publisher endpoint when its config names none: bound on every interface.
VLLM_DEFAULT_ENDPOINT = "tcp://*:5557"
#: The config keys that are :class:`~kvpool.kv_events.KVEventPublisher` options under the same names.
_PUBLISHER_KEYS = ("topic", "buffer_steps", "hwm")
#: The config keys kvpool reads and has no use for.
_IGNORED_KEYS = ("max_queue_size",)


@dataclass(frozen=True, slots=True, kw_only=True)
class VllmEventsConfig:
    """vLLM's events config with kvpool's own flags folded in."""

    #: Where events are published; None: no events.
    endpoint: str | None
    #: Where replays are served; None: none.
    replay_endpoint: str | None
    #: ``topic``, ``buffer_steps`` and ``hwm`` where the config gives them, for the publisher.
    publisher_options: Mapping[str, Any] = field(default_factory=dict)
    #: The config's keys that have no counterpart in kvpool (given, and ignored).
    ignored: tuple[str, ...] = ()


def from_vllm_config(text: str, *, endpoint: str | None = None, replay_endpoint: str | None = None) -> VllmEventsConfig:
    """vLLM's ``--kv-events-config`` ``text`` beside kvpool's own endpoint flags (None: not given)."""
    try:
        config = json.loads(text)
    except ValueError as exc:
        raise ConfigError(f"--kv-events-config is not JSON: {exc}") from None
    if not isinstance(config, dict):
        raise ConfigError(f"--kv-events-config must be a JSON object, got {text!r}")
    unknown = sorted(set(config) - VLLM_EVENT_KEYS)
    if unknown:
        raise ConfigError(f"--kv-events-config: unknown keys {unknown} (vLLM's are {sorted(VLLM_EVENT_KEYS)})")
    enabled = config.get("enable_kv_cache_events", False)
    publisher = config.get("publisher", "zmq" if enabled else "null")
    if not isinstance(enabled, bool) or publisher not in ("zmq", "null"):
        raise ConfigError(
            f"--kv-events-config: enable_kv_cache_events must be true or false and publisher zmq or null, got {config!r}"
        )
    if not enabled or publisher == "null":
        return VllmEventsConfig(endpoint=endpoint, replay_endpoint=replay_endpoint)
    for flag, given, key in (
        ("--kv-events-endpoint", endpoint, "endpoint"),
        ("--kv-events-replay-endpoint", replay_endpoint, "replay_endpoint"),
    ):
        if given is not None and key in config and config[key] != given:
            raise ConfigError(f"{flag} {given!r} and --kv-events-config's {key} {config[key]!r} disagree")
    return VllmEventsConfig(
        endpoint=endpoint or config.get("endpoint", VLLM_DEFAULT_ENDPOINT),
        replay_endpoint=replay_endpoint or config.get("replay_endpoint"),
        publisher_options={key: config[key] for key in _PUBLISHER_KEYS if key in config},
        ignored=tuple(key for key in _IGNORED_KEYS if key in config),
    )
