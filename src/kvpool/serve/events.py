"""KV cache events from a served engine: the step hook that publishes them and the ``GET /kv-events`` body.

:func:`~kvpool.serve.openai_server.build_app` takes a
:class:`~kvpool.kv_events.KVEventPublisher` as ``events=`` and wires it with
:func:`event_wiring`: after every engine step the pool's new events go out as
one batch, and ``GET /kv-events`` tells a router where they are and how the
replica hashes its blocks. ``GET /kv-events/snapshot`` answers what the pool
caches, taken on the engine thread between steps
(:mod:`kvpool.kv_events.snapshot`), for a router that missed more batches than
the replay buffer holds. Any program that builds the app gets the same
events as ``kvpool serve --kv-events-endpoint``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvpool.errors import ConfigError

if TYPE_CHECKING:
    from kvpool.engine.outputs import RequestDelta
    from kvpool.kv_events import KVEventPublisher
    from kvpool.serve.served_engine import ServedEngine

__all__ = ["EventWiring", "event_wiring"]


@dataclass(frozen=True, slots=True, kw_only=True)
class EventWiring:
    """What a server needs to publish an engine's KV events.

    Attributes:
        hook: the step hook (run on the engine thread after every step):
            sends the events recorded since the last step as one batch.
        describe: the ``GET /kv-events`` body (a JSON-able mapping).
        snapshot: run on the engine thread between steps: publishes what the
            pool recorded since the last batch, then answers the snapshot
            message (:func:`~kvpool.kv_events.snapshot.encode_snapshot`) taken
            after that batch.
        close: sends what is queued and closes the publisher's sockets.
    """

    hook: Callable[[ServedEngine, Sequence[RequestDelta]], None]
    describe: Callable[[], object]
    close: Callable[[], None]
    snapshot: Callable[[ServedEngine], bytes]


def event_wiring(engine: ServedEngine, publisher: KVEventPublisher) -> EventWiring:
    """The hook, the ``/kv-events`` body and the closing of ``publisher`` for ``engine``.

    The engine must record events (``enable_kv_events=True``); an engine that
    does not would publish empty batches forever, so it is refused with a
    :class:`~kvpool.errors.ConfigError`. With KV tiers the replica holds more
    than its pool, in stores without a block count, so ``num_blocks`` is
    left out of the description then.
    """
    from kvpool.kv_events import KVEventPublisher, describe_events
    from kvpool.kv_events.snapshot import SNAPSHOT_PATH, encode_snapshot

    if not isinstance(publisher, KVEventPublisher):
        raise ConfigError(f"events must be a KVEventPublisher, got {publisher!r}")
    if not engine.setup.options.enable_kv_events:
        raise ConfigError(
            f"events={publisher!r} needs an engine that records KV events (enable_kv_events=True), "
            f"got enable_kv_events={engine.setup.options.enable_kv_events!r}"
        )
    body = describe_events(
        engine.manager.hasher,
        endpoint=publisher.endpoint,
        replay_endpoint=publisher.replay_endpoint,
        topic=publisher.topic,
        data_parallel_rank=publisher.data_parallel_rank,
        content=publisher.content,
        curve_public_key=publisher.curve_public_key,
        num_blocks=engine.num_blocks if engine.kv_tiers is None else None,
        snapshot=SNAPSHOT_PATH,
    )

    def publish(engine: ServedEngine, deltas: Sequence[RequestDelta]) -> None:
        taken = engine.manager.take_events()
        if taken:
            publisher.publish(taken)

    def snapshot(engine: ServedEngine) -> bytes:
        publish(engine, ())  # the events since the last step: the snapshot follows them
        events = engine.manager.snapshot_events()
        return encode_snapshot(events, publisher.next_seq - 1, data_parallel_rank=publisher.data_parallel_rank)

    return EventWiring(hook=publish, describe=lambda: body, close=publisher.close, snapshot=snapshot)
