"""Which replica takes a request: three routing rules over plain per-replica figures.

A router (``kvpool route``) and the simulator (``kvpool simulate --replicas``) ask the
same rules. Each rule sees, for one request and every candidate replica ``i``:

* ``cached_blocks[i]``: how many of the request's leading blocks replica ``i`` holds
  (the length of its cached prefix, in blocks);
* ``loads[i]``: a load figure, non-negative, in one unit across all replicas
  (requests queued and running, or tokens still to prefill: the caller picks).

and returns the index of the chosen replica. The rules:

``least-loaded``
    the smallest ``loads[i]``.

``round-robin``
    ``0, 1, ..., n-1, 0, ...`` over the candidates, whatever the figures; the position
    lives in the :class:`RoundRobin` object, one per router.

``prefix`` (:class:`PrefixAware`)
    the largest score ``cached_blocks[i] - load_cost * loads[i]``; ties go to the
    smaller load. ``load_cost`` (> 0) says how many cached blocks one unit of load
    is worth. With loads in tokens still to prefill and
    ``load_cost = 1 / block_size`` the score is minus the tokens a replica must
    compute before this request's first token: the rule picks the earliest first
    token under a uniform prefill rate.

    Why it never piles everything onto one hot replica: replica ``i`` beats ``j``
    only while ``load_cost * (loads[i] - loads[j]) <= cached_blocks[i] -
    cached_blocks[j]``, and that difference is at most the request's length in
    blocks. So the load gap a prefix can buy is bounded by ``prompt_blocks /
    load_cost``; past it, the request goes to the less loaded replica (which then
    caches the prefix too). With no cached prefix anywhere the rule is exactly
    least-loaded.

Ties left after that: the pure functions (:func:`least_loaded`, :func:`prefix_aware`)
take the lowest index; the chooser objects (:class:`LeastLoaded`, :class:`PrefixAware`)
take the first tied index at or after the one after their previous choice, so that
an idle fleet still spreads new prefixes (and their cache) over every replica
instead of filling replica 0. A router keeps one chooser object.

Where ``cached_blocks`` comes from is the router's :class:`PrefixMode`: ``precise``
(the replicas' own KV events say which blocks each holds), ``approximate`` (the router
remembers which replica it sent each prefix to, in a bounded LRU: for servers that
publish no events), or ``auto`` (precise for every replica whose events the router
follows, approximate for the others; the default).

Every rule is O(n) in the number of replicas.
Bad figures (no replicas, lengths that differ, a negative or non-finite number) raise
:class:`~kvpool.errors.ConfigError` naming the value.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from typing import Protocol

from kvpool.errors import ConfigError

__all__ = [
    "LeastLoaded",
    "PrefixAware",
    "PrefixMode",
    "ReplicaChooser",
    "RoundRobin",
    "Routing",
    "chooser",
    "least_loaded",
    "prefix_aware",
]


class Routing(enum.Enum):
    """The routing rules, by their command-line names."""

    PREFIX = "prefix"
    ROUND_ROBIN = "round-robin"
    LEAST_LOADED = "least-loaded"


class PrefixMode(enum.Enum):
    """Where a router's ``prefix`` rule learns which replica holds a prompt's blocks."""

    AUTO = "auto"  # the replica's events where it publishes them, the router's memory elsewhere
    PRECISE = "precise"  # the replicas' KV events only; a replica without events is weighed by load
    APPROXIMATE = "approximate"  # the router's memory of where it sent each prefix (LRU-bounded)


class ReplicaChooser(Protocol):
    """One routing rule: the index of the replica that takes the next request."""

    def choose(self, cached_blocks: Sequence[int], loads: Sequence[float]) -> int: ...


def _check_loads(loads: Sequence[float]) -> None:
    if not loads:
        raise ConfigError("routing needs at least one replica, got none")
    for i, load in enumerate(loads):
        if isinstance(load, bool) or not isinstance(load, int | float) or not math.isfinite(load) or load < 0:
            raise ConfigError(f"replica {i}'s load must be a finite number >= 0, got {load!r}")


def _check_cached(cached_blocks: Sequence[int], num_replicas: int) -> None:
    if len(cached_blocks) != num_replicas:
        raise ConfigError(
            f"routing needs one cached-prefix length per replica: got {len(cached_blocks)} for {num_replicas} loads"
        )
    for i, blocks in enumerate(cached_blocks):
        if isinstance(blocks, bool) or not isinstance(blocks, int) or blocks < 0:
            raise ConfigError(f"replica {i}'s cached prefix must be a non-negative number of blocks, got {blocks!r}")


def least_loaded(loads: Sequence[float]) -> int:
    """Index of the smallest load; the lowest index among equals."""
    _check_loads(loads)
    return min(range(len(loads)), key=loads.__getitem__)


def prefix_aware(cached_blocks: Sequence[int], loads: Sequence[float], *, load_cost: float) -> int:
    """Index of the largest ``cached_blocks[i] - load_cost * loads[i]``; ties to the smaller load, then lower index."""
    _check_load_cost(load_cost)
    _check_loads(loads)
    _check_cached(cached_blocks, len(loads))
    return min(range(len(loads)), key=lambda i: (load_cost * loads[i] - cached_blocks[i], loads[i]))


def _check_load_cost(load_cost: float) -> None:
    if isinstance(load_cost, bool) or not isinstance(load_cost, int | float) or not (0 < load_cost < math.inf):
        raise ConfigError(f"load_cost must be a finite number > 0, got {load_cost!r}")


def _rotate(best: list[int], start: int) -> int:
    """The first of ``best`` (ascending indexes) at or after ``start``, wrapping around."""
    for i in best:
        if i >= start:
            return i
    return best[0]


class PrefixAware:
    """The ``prefix`` rule with its ``load_cost`` (cached blocks one unit of load is worth); ties rotate."""

    __slots__ = ("load_cost", "_next")

    def __init__(self, load_cost: float = 1.0) -> None:
        _check_load_cost(load_cost)
        self.load_cost = float(load_cost)
        self._next = 0

    def choose(self, cached_blocks: Sequence[int], loads: Sequence[float]) -> int:
        first = prefix_aware(cached_blocks, loads, load_cost=self.load_cost)
        cost = self.load_cost
        key = (cost * loads[first] - cached_blocks[first], loads[first])
        tied = [i for i in range(len(loads)) if (cost * loads[i] - cached_blocks[i], loads[i]) == key]
        choice = _rotate(tied, self._next % len(loads))
        self._next = choice + 1
        return choice

    def __repr__(self) -> str:
        return f"PrefixAware(load_cost={self.load_cost!r})"


class LeastLoaded:
    """The ``least-loaded`` rule; it ignores cached prefixes; ties rotate."""

    __slots__ = ("_next",)

    def __init__(self) -> None:
        self._next = 0

    def choose(self, cached_blocks: Sequence[int], loads: Sequence[float]) -> int:
        _check_loads(loads)
        _check_cached(cached_blocks, len(loads))
        least = min(loads)
        choice = _rotate([i for i, load in enumerate(loads) if load == least], self._next % len(loads))
        self._next = choice + 1
        return choice


class RoundRobin:
    """The ``round-robin`` rule: its own position, advanced by one on every choice.

    When the number of candidates changes (a replica leaves or returns), the position
    wraps over the new count: ``position % n``.
    """

    __slots__ = ("position",)

    def __init__(self) -> None:
        self.position = 0

    def next(self, num_replicas: int) -> int:
        """The next index in ``range(num_replicas)``."""
        if isinstance(num_replicas, bool) or not isinstance(num_replicas, int) or num_replicas < 1:
            raise ConfigError(f"routing needs at least one replica, got {num_replicas!r}")
        index = self.position % num_replicas
        self.position = index + 1
        return index

    def choose(self, cached_blocks: Sequence[int], loads: Sequence[float]) -> int:
        _check_loads(loads)
        _check_cached(cached_blocks, len(loads))
        return self.next(len(loads))


def chooser(rule: Routing, *, load_cost: float = 1.0) -> ReplicaChooser:
    """A fresh chooser for ``rule`` (``load_cost`` matters to :attr:`Routing.PREFIX` only)."""
    if rule is Routing.PREFIX:
        return PrefixAware(load_cost)
    if rule is Routing.ROUND_ROBIN:
        return RoundRobin()
    if rule is Routing.LEAST_LOADED:
        return LeastLoaded()
    raise ConfigError(f"unknown routing rule {rule!r}; choose one of {[r.value for r in Routing]}")
