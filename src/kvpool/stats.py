"""Prefix-cache statistics, counted at each lookup."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PrefixCacheStats"]


@dataclass(frozen=True, slots=True, kw_only=True)
class PrefixCacheStats:
    """Lookups since the manager was built.

    ``queries`` are the tokens looked up and ``hits`` the tokens found cached.
    Lookups of requests that were preempted before (a recompute) are counted
    apart in the ``preempted_*`` fields, so they do not inflate the hit rate of
    fresh traffic.
    """

    requests: int = 0
    queries: int = 0
    hits: int = 0
    preempted_requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0

    @property
    def hit_rate(self) -> float:
        """Token hit rate of fresh (not preempted) lookups; 0.0 before any lookup."""
        return self.hits / self.queries if self.queries else 0.0


class StatsCounter:
    """Mutable counters behind :class:`PrefixCacheStats`."""

    __slots__ = ("requests", "queries", "hits", "preempted_requests", "preempted_queries", "preempted_hits")

    def __init__(self) -> None:
        self.requests = self.queries = self.hits = 0
        self.preempted_requests = self.preempted_queries = self.preempted_hits = 0

    def record(self, num_tokens: int, num_hits: int, preempted: bool) -> None:
        if preempted:
            self.preempted_requests += 1
            self.preempted_queries += num_tokens
            self.preempted_hits += num_hits
        else:
            self.requests += 1
            self.queries += num_tokens
            self.hits += num_hits

    def snapshot(self) -> PrefixCacheStats:
        return PrefixCacheStats(**{name: getattr(self, name) for name in self.__slots__})
