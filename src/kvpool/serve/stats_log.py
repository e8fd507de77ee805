"""The periodic stats line of a serving log, with the figures vLLM's server logs.

::

    Avg prompt throughput: 812.4 tokens/s, Avg generation throughput: 96.0 tokens/s, Running: 4 reqs,
    Waiting: 0 reqs, KV cache usage: 12.5%, Prefix cache hit rate: 63.2%

:meth:`StatsLog.after_step` runs on the engine thread after every step and
only adds to counters; :meth:`StatsLog.line` (called from the event loop every
interval) turns what was added since the previous line into rates. Prompt
tokens count a request's prompt when it gets its first token; the hit rate is
over the prompt tokens looked up in the interval (the pool's own counters).
Nothing is logged while nothing has happened since the last line.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvpool.engine.outputs import RequestDelta
    from kvpool.serve.served_engine import ServedEngine

__all__ = ["StatsLog"]


class StatsLog:
    """Counters the engine thread adds to; a line of rates per interval for the log."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._started: set[str] = set()
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.running = 0
        self.waiting = 0
        self.kv_usage = 0.0
        self.queries = 0
        self.hits = 0
        self._last = (self._clock(), 0, 0, 0, 0)
        self._last_state = (0, 0)

    def after_step(self, engine: ServedEngine, deltas: Sequence[RequestDelta]) -> None:
        """A step hook (engine thread): counts its tokens and reads the engine's figures."""
        scheduler = engine.scheduler
        for delta in deltas:
            if delta.token_ids:
                self.generation_tokens += len(delta.token_ids)
                if delta.request_id not in self._started:
                    self._started.add(delta.request_id)
                    self.prompt_tokens += self._prompt_size(engine, delta)
            if delta.finished:
                self._started.discard(delta.request_id)
        self.running = scheduler.num_running
        self.waiting = scheduler.num_waiting
        manager = engine.manager
        self.kv_usage = manager.usage
        stats = manager.prefix_cache_stats
        self.queries, self.hits = stats.queries, stats.hits

    @staticmethod
    def _prompt_size(engine: ServedEngine, delta: RequestDelta) -> int:
        if delta.output is not None:
            return delta.output.num_prompt_tokens
        try:
            return int(engine.scheduler.request(delta.request_id).num_prompt_tokens)
        except Exception:  # noqa: BLE001 - a figure for the log: an unknown request counts nothing
            return 0

    def line(self) -> str | None:
        """The figures since the previous line, or None when nothing has happened since."""
        now = self._clock()
        then, prompt, generated, queries, hits = self._last
        state = (self.running, self.waiting)
        if self.prompt_tokens == prompt and self.generation_tokens == generated and state == self._last_state == (0, 0):
            return None
        elapsed = max(now - then, 1e-9)
        asked = self.queries - queries
        rate = 100.0 * (self.hits - hits) / asked if asked > 0 else 0.0
        self._last = (now, self.prompt_tokens, self.generation_tokens, self.queries, self.hits)
        self._last_state = state
        return (
            f"Avg prompt throughput: {(self.prompt_tokens - prompt) / elapsed:.1f} tokens/s, "
            f"Avg generation throughput: {(self.generation_tokens - generated) / elapsed:.1f} tokens/s, "
            f"Running: {self.running} reqs, Waiting: {self.waiting} reqs, "
            f"KV cache usage: {100.0 * self.kv_usage:.1f}%, Prefix cache hit rate: {rate:.1f}%"
        )
