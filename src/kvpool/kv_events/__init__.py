"""KV cache events on the wire, in vLLM 0.33's format, for routers that follow a fleet.

* :mod:`.wire`: one batch as msgpack bytes and back (vLLM's layout), and
  :class:`EventContent`, what a stored-block event says about its request;
* :mod:`.transport`: the endpoint rule (``bind:``/``connect:`` markers, else
  vLLM's) and ZeroMQ CURVE keys;
* :mod:`.stream`: :class:`KVEventPublisher` (PUB socket with replay) and
  :class:`KVEventSubscriber` (in order, gaps repaired or reported);
* :mod:`.vllm_config`: vLLM's ``--kv-events-config`` JSON as kvpool's endpoints
  and publisher options.

A subscriber written for vLLM decodes kvpool's stream with vLLM's own
classes. ``msgspec`` and ``pyzmq`` come with the ``events`` extra and are
imported only when used.
"""

from kvpool.kv_events.stream import (
    END_OF_REPLAY,
    KVEventPublisher,
    KVEventSubscriber,
    LostBatches,
    PublisherRestarted,
    Received,
    SequencedBatch,
    describe_events,
)
from kvpool.kv_events.transport import (
    Attach,
    CurveClient,
    CurveKeyPair,
    CurveServer,
    CurveTrust,
    Endpoint,
    load_public_keys,
    parse_publisher_endpoint,
    parse_replay_endpoint,
    parse_subscriber_endpoint,
)
from kvpool.kv_events.vllm_config import VllmEventsConfig, from_vllm_config
from kvpool.kv_events.wire import EventBatch, EventContent, EventStreamError, decode_batch, encode_batch

__all__ = [
    "END_OF_REPLAY",
    "Attach",
    "CurveClient",
    "CurveKeyPair",
    "CurveServer",
    "CurveTrust",
    "Endpoint",
    "EventBatch",
    "EventContent",
    "EventStreamError",
    "KVEventPublisher",
    "KVEventSubscriber",
    "LostBatches",
    "PublisherRestarted",
    "Received",
    "SequencedBatch",
    "VllmEventsConfig",
    "decode_batch",
    "describe_events",
    "encode_batch",
    "from_vllm_config",
    "load_public_keys",
    "parse_publisher_endpoint",
    "parse_replay_endpoint",
    "parse_subscriber_endpoint",
]
