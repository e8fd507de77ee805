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

Tier credit (:class:`TierCredit`): a replica's cached prefix is not all alike. Its
leading blocks in the replica's own pool (GPU memory) are served as they are; the
blocks after them that only a tier below holds (host memory, storage) must be loaded
first, which saves only what loading is faster than computing. For those blocks the
credit is the prefill time the best load saves, in tokens at the replica's prefill
rate: loading the first ``k`` of them costs one latency per medium touched plus their
tokens at each medium's per-token time, computing them costs their tokens at the
prefill rate, and the credit is the largest ``compute(k) - load(k)`` over ``k`` (none
when it is never positive). With no latency and one medium that is, per block,
``block_size * max(0, 1 - load_time / prefill_time)``. The rule ranks by these
credited tokens; which blocks a replica holds is unchanged.

Every rule is O(n) in the number of replicas.
Bad figures (no replicas, lengths that differ, a negative or non-finite number) raise
:class:`~kvpool.errors.ConfigError` naming the value.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvpool.errors import ConfigError

__all__ = [
    "LeastLoaded",
    "MediumCost",
    "PrefixAware",
    "PrefixMode",
    "ReplicaChooser",
    "RoundRobin",
    "Routing",
    "TierCredit",
    "chooser",
    "least_loaded",
    "most_saved",
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


# -- tier credit ---------------------------------------------------------------------------


def _check_seconds(name: str, value: object, *, positive: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        raise ConfigError(f"{name} must be a finite number >= 0, got {value!r}")
    if positive and value == 0:
        raise ConfigError(f"{name} must be > 0, got {value!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class MediumCost:
    """What loading blocks from one medium costs a replica: one latency per fetch, then seconds per token.

    ``seconds_per_token`` is a token's KV bytes over the medium's bandwidth.
    """

    latency_s: float
    seconds_per_token: float

    def __post_init__(self) -> None:
        _check_seconds("a medium's latency_s", self.latency_s)
        _check_seconds("a medium's seconds_per_token", self.seconds_per_token)

    @classmethod
    def of_link(cls, bandwidth_bytes_per_s: float, latency_s: float, *, kv_bytes_per_token: int) -> MediumCost:
        """The cost over a link of ``bandwidth_bytes_per_s`` and ``latency_s``, for tokens of ``kv_bytes_per_token``."""
        _check_seconds("a medium's bandwidth", bandwidth_bytes_per_s, positive=True)
        if isinstance(kv_bytes_per_token, bool) or not isinstance(kv_bytes_per_token, int) or kv_bytes_per_token < 1:
            raise ConfigError(f"kv_bytes_per_token must be an integer >= 1, got {kv_bytes_per_token!r}")
        return cls(latency_s=latency_s, seconds_per_token=kv_bytes_per_token / bandwidth_bytes_per_s)

    def seconds(self, num_tokens: int) -> float:
        """One fetch of ``num_tokens`` tokens (0.0 for none)."""
        return 0.0 if num_tokens == 0 else self.latency_s + num_tokens * self.seconds_per_token


def most_saved(
    runs: Sequence[tuple[str, MediumCost, int]], block_size: int, prefill_tokens_per_s: float, *, margin: float = 1.0
) -> tuple[int, float]:
    """The leading blocks worth loading, and their ``compute - margin x load`` in seconds: the best ``k``.

    ``runs``: consecutive blocks as ``(medium, its cost, how many)``, in prefix order; each
    medium the first ``k`` blocks touch pays its latency once (one fetch per medium).
    ``margin`` (> 0): how many times faster than computing a load must be (1: just faster).
    Returns ``(0, 0.0)`` when loading never wins. Within a run the saving is linear in
    ``k``, so only a run's ends can be best: O(runs x media).
    """
    if isinstance(margin, bool) or not isinstance(margin, int | float) or not 0 < margin < math.inf:
        raise ConfigError(f"margin must be a finite number > 0, got {margin!r}")
    best_k, best = 0, 0.0
    k, saved = 0, 0.0
    touched: set[str] = set()
    compute_per_block = block_size / prefill_tokens_per_s
    for medium, cost, count in runs:
        if count <= 0:
            continue
        gain = compute_per_block - margin * block_size * cost.seconds_per_token  # each block, past the latency
        if medium not in touched:
            touched.add(medium)
            saved -= margin * cost.latency_s
        for at, value in ((k + 1, saved + gain), (k + count, saved + count * gain)):
            if value > best:
                best_k, best = at, value
        k, saved = k + count, saved + count * gain
    return best_k, best


@dataclass(frozen=True, slots=True, kw_only=True)
class TierCredit:
    """How many tokens of a cached prefix a replica is credited with, by where it holds each block.

    ``main_pool``: the media of the replica's own pool (its GPU blocks; ``None`` for claims that
    name none), credited in full while they run from the prefix's start. ``media``: each tier
    medium's :class:`MediumCost`; ``other``: the cost of a medium not in ``media`` (None: such a
    block is not credited, as a miss). ``prefill_tokens_per_s``: the replica's prefill rate.

    Past the pool's leading run, each block loads from the cheapest tier medium holding it (a
    block only the pool holds there cannot be used: the pool's hit stops at its first miss, and
    so the credit stops there too); the credit for those blocks is :func:`most_saved`'s seconds
    at the prefill rate, rounded down to whole tokens.
    """

    prefill_tokens_per_s: float
    main_pool: frozenset[str | None]
    media: Mapping[str, MediumCost] = field(default_factory=dict)
    other: MediumCost | None = None

    def __post_init__(self) -> None:
        _check_seconds("prefill_tokens_per_s", self.prefill_tokens_per_s, positive=True)
        for medium, cost in self.media.items():
            if not isinstance(medium, str) or not isinstance(cost, MediumCost):
                raise ConfigError(f"a tier credit maps a medium's name to its MediumCost, got {medium!r}: {cost!r}")
            if medium in self.main_pool:
                raise ConfigError(f"medium {medium!r} is the replica's own pool; it has no load cost")

    def figures(self) -> dict[str, object]:
        """The figures, for a router's verbose health: the prefill rate and each medium's cost.

        ``worth``: what a block loaded from it is worth against one in the pool, latency aside
        (``max(0, 1 - load_time / prefill_time)``).
        """
        rate = self.prefill_tokens_per_s

        def shown(cost: MediumCost) -> dict[str, float]:
            worth = max(0.0, 1 - cost.seconds_per_token * rate)
            return {"latency_s": cost.latency_s, "seconds_per_token": cost.seconds_per_token, "worth": round(worth, 4)}

        return {
            "prefill_tokens_per_s": rate,
            "media": {medium: shown(cost) for medium, cost in sorted(self.media.items())},
            "other": None if self.other is None else shown(self.other),
        }

    def _cost(self, held: Collection[str | None]) -> tuple[str, MediumCost] | None:
        """The cheapest tier medium of ``held`` with a cost, and its cost; None when there is none."""
        best: tuple[str, MediumCost] | None = None
        for medium in held:
            if medium is None or medium in self.main_pool:
                continue
            cost = self.media.get(medium, self.other)
            if cost is not None and (
                best is None
                or (cost.seconds_per_token, cost.latency_s) < (best[1].seconds_per_token, best[1].latency_s)
            ):
                best = (medium, cost)
        return best

    def credited_tokens(self, held: Sequence[tuple[Collection[str | None], int]], block_size: int) -> int:
        """The tokens a cached prefix is worth. O(runs x media).

        ``held``: the prefix's blocks in runs, ``(the media holding each block of the run, how many)``.
        """
        on_pool, first_tier = 0, len(held)
        for i, (media, count) in enumerate(held):
            if self.main_pool.isdisjoint(media):
                first_tier = i
                break
            on_pool += count
        loads: list[tuple[str, MediumCost, int]] = []
        for media, count in held[first_tier:]:
            cheapest = self._cost(media)
            if cheapest is None:
                break
            loads.append((*cheapest, count))
        _, saved_s = most_saved(loads, block_size, self.prefill_tokens_per_s)
        return on_pool * block_size + int(saved_s * self.prefill_tokens_per_s + 1e-6)  # not 63.999... for 64
