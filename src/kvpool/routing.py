"""Which replica takes a request: five routing rules over plain per-replica figures.

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
    is worth. A fleet (``kvpool route`` and ``kvpool simulate --replicas``, both
    through :func:`fleet_chooser`) scores cached *tokens* against requests in flight,
    with ``load_cost`` blocks of :data:`LOAD_COST_TOKENS` tokens per request
    (:data:`DEFAULT_LOAD_COST`: 8, i.e. 128 cached tokens), and counts as cached the
    blocks a replica's requests in flight are computing now
    (:func:`held_or_computing`): their events come only once they are computed.

    Why it never piles everything onto one hot replica: replica ``i`` beats ``j``
    only while ``load_cost * (loads[i] - loads[j]) <= cached_blocks[i] -
    cached_blocks[j]``, and that difference is at most the request's length in
    blocks. So the load gap a prefix can buy is bounded by ``prompt_blocks /
    load_cost``; past it, the request goes to the less loaded replica (which then
    caches the prefix too). With no cached prefix anywhere the rule is exactly
    least-loaded.

Two more laws see a request's whole figures (:class:`RoutingFigures` per replica: cached
tokens of this prompt, requests in flight, prompt tokens still to prefill there, prefill
rate, the seconds a step spends outside prefill) and the prompt's length:

``expected-ttft`` (:class:`ExpectedTtft`, :func:`expected_ttft_s`)
    the smallest expected seconds to this request's first token. A replica computes, in
    order, the prompt tokens already waiting there (``prefill_pending``) and then this
    request's uncached ones, ``work = prefill_pending + prompt_tokens - cached_tokens``, at
    its ``prefill_tokens_per_s``; it does so in steps of at most ``chunk_tokens`` prompt
    tokens, and while it has requests in flight every step also runs their decode batch,
    ``decode_step_s`` (the replica's own figure: its step overhead plus its recent batch's
    decode work), which the prefill loses::

        ttft = work / prefill_tokens_per_s + ceil(work / chunk_tokens) * decode_step_s   (in flight > 0)
        ttft = work / prefill_tokens_per_s                                               (idle)

    The rule ranks by that plus ``own_weight`` times the request's own prefill seconds
    there (``(prompt_tokens - cached_tokens) / prefill_tokens_per_s``, default weight 2):
    the time this prefill adds to the requests that arrive after it at that replica. A
    request alone sees only its own first token and copies a hot prefix as soon as the
    queue there equals a fresh prefill, which spends the fleet's compute on copies; with
    the weight, it copies when the queue costs three times the prefill saved (weight 2
    kept 39-41% of prompt tokens cached on the 8-replica shootout, weight 1 36-41%,
    weight 0 30-36%, at the same TTFT p90).

    Every figure is the replica's own, so a faster replica earns its share and a cached
    prefix is worth exactly the prefill time it saves *there*; no exchange rate is set by
    hand. A hot prefix stays where it is cached while the queue there costs less than
    the prefill it saves elsewhere, then goes to the replica where it finishes first
    (which then caches it too): the shared system prompt is copied on purpose, once its
    queue says so.

``threshold`` (:class:`ThresholdGate`, :func:`threshold_gate`)
    the gate SGLang's and vLLM's cache-aware routers use, for comparison, with their
    defaults (:class:`Thresholds`: 0.3, 64, 1.5). When the fleet is out of balance
    (``max - min > balance_abs`` requests in flight and ``max > balance_rel * min``),
    the least loaded; else the replica holding the most of the prompt, if that is more
    than ``cache`` of its tokens; else the least loaded. (SGLang sends a poor match to the
    replica whose cache tree is smallest; kvpool has no tree size per replica and sends it
    to the least loaded.)

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
from collections.abc import Collection, Container, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvpool.errors import ConfigError

__all__ = [
    "DEFAULT_CHUNK_TOKENS",
    "DEFAULT_LOAD_COST",
    "DEFAULT_ROUTING",
    "ExpectedTtft",
    "LOAD_COST_TOKENS",
    "LeastLoaded",
    "MediumCost",
    "PrefixAware",
    "PrefixMode",
    "ReplicaChooser",
    "RoundRobin",
    "Routing",
    "RoutingFigures",
    "ThresholdGate",
    "Thresholds",
    "TierCredit",
    "chooser",
    "expected_ttft_s",
    "fleet_chooser",
    "held_or_computing",
    "least_loaded",
    "most_saved",
    "prefix_aware",
    "threshold_gate",
]


class Routing(enum.Enum):
    """The routing rules, by their command-line names."""

    PREFIX = "prefix"
    ROUND_ROBIN = "round-robin"
    LEAST_LOADED = "least-loaded"
    EXPECTED_TTFT = "expected-ttft"
    THRESHOLD = "threshold"

    @property
    def cache_aware(self) -> bool:
        """Whether the rule weighs cached prefixes (the others, for comparison, see load only)."""
        return self in (Routing.PREFIX, Routing.EXPECTED_TTFT, Routing.THRESHOLD)


#: The rule a router and the simulator use when told none: chosen by ``benchmarks/bench_fleet.py``'s
#: table (docs/routing.md, "The laws").
DEFAULT_ROUTING = Routing.PREFIX

#: The prompt tokens a replica prefills in one step when its figures say none (vLLM V1's default token budget).
DEFAULT_CHUNK_TOKENS = 8192

#: The tokens of one "block" in a fleet's ``prefix`` exchange rate, whatever a replica's block size:
#: ``load_cost`` such blocks cached are worth one request in flight.
LOAD_COST_TOKENS = 16

#: A fleet's ``prefix`` exchange rate when told none (blocks of :data:`LOAD_COST_TOKENS` per request in
#: flight): a hand-set weight, 128 cached tokens a request (docs/routing.md, "The laws").
DEFAULT_LOAD_COST = 8.0


class PrefixMode(enum.Enum):
    """Where a router's ``prefix`` rule learns which replica holds a prompt's blocks."""

    AUTO = "auto"  # the replica's events where it publishes them, the router's memory elsewhere
    PRECISE = "precise"  # the replicas' KV events only; a replica without events is weighed by load
    APPROXIMATE = "approximate"  # the router's memory of where it sent each prefix (LRU-bounded)


class ReplicaChooser(Protocol):
    """One routing rule: the index of the replica that takes the next request.

    :meth:`choose` sees cached blocks (or tokens) and one load figure per replica;
    :meth:`pick` sees each replica's :class:`RoutingFigures` and the prompt's length.
    Every rule answers both; the rules that need more than a load (``expected-ttft``,
    ``threshold``) refuse :meth:`choose`.
    """

    def choose(self, cached_blocks: Sequence[int], loads: Sequence[float]) -> int: ...

    def pick(self, figures: Sequence[RoutingFigures], prompt_tokens: int) -> int: ...


def _whole(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"{name} must be an integer >= 0, got {value!r}")
    return value


@dataclass(frozen=True, slots=True, kw_only=True)
class RoutingFigures:
    """What a rule sees of one replica for one request; checked at construction, ConfigError naming the field.

    ``cached_tokens``: this prompt's leading tokens the replica holds (credited, as
    :class:`TierCredit` counts them); ``in_flight``: requests sent there and not ended;
    ``prefill_pending``: prompt tokens it must still compute for the requests in flight
    there that have not reached their first token; ``prefill_tokens_per_s`` (> 0): how
    fast it computes prompt tokens; ``decode_step_s`` (>= 0): the seconds each of its steps
    spends outside prefill while requests run there; ``chunk_tokens`` (>= 1): the most
    prompt tokens one step computes.
    """

    cached_tokens: int
    in_flight: int
    prefill_pending: int = 0
    prefill_tokens_per_s: float = 1.0
    decode_step_s: float = 0.0
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS

    def __post_init__(self) -> None:
        for name in ("cached_tokens", "in_flight", "prefill_pending"):
            _whole(f"a replica's {name}", getattr(self, name))
        _check_seconds("a replica's prefill_tokens_per_s", self.prefill_tokens_per_s, positive=True)
        _check_seconds("a replica's decode_step_s", self.decode_step_s)
        if _whole("a replica's chunk_tokens", self.chunk_tokens) < 1:
            raise ConfigError(f"a replica's chunk_tokens must be an integer >= 1, got {self.chunk_tokens!r}")


def _check_figures(figures: Sequence[RoutingFigures], prompt_tokens: int) -> None:
    if not figures:
        raise ConfigError("routing needs at least one replica, got none")
    for i, f in enumerate(figures):
        if not isinstance(f, RoutingFigures):
            raise ConfigError(f"replica {i}'s figures must be RoutingFigures, got {f!r}")
    _whole("prompt_tokens", prompt_tokens)


def expected_ttft_s(figures: RoutingFigures, prompt_tokens: int) -> float:
    """Expected seconds to a ``prompt_tokens`` prompt's first token at the replica ``figures`` describe.

    The prompt tokens waiting there plus this prompt's uncached ones, at the replica's
    prefill rate, plus one ``decode_step_s`` a step while it has requests in flight
    (docs at the top of this module). O(1).
    """
    work = figures.prefill_pending + max(0, prompt_tokens - figures.cached_tokens)
    seconds = work / figures.prefill_tokens_per_s
    if figures.in_flight and work:
        seconds += math.ceil(work / figures.chunk_tokens) * figures.decode_step_s
    return seconds


def _check_seconds(name: str, value: object, *, positive: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        raise ConfigError(f"{name} must be a finite number >= 0, got {value!r}")
    if positive and value == 0:
        raise ConfigError(f"{name} must be > 0, got {value!r}")


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

    def pick(self, figures: Sequence[RoutingFigures], prompt_tokens: int) -> int:
        """:meth:`choose` over each replica's cached tokens against its requests in flight."""
        _check_figures(figures, prompt_tokens)
        return self.choose([f.cached_tokens for f in figures], [f.in_flight for f in figures])

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

    def pick(self, figures: Sequence[RoutingFigures], prompt_tokens: int) -> int:
        """:meth:`choose` over each replica's requests in flight."""
        _check_figures(figures, prompt_tokens)
        return self.choose([0] * len(figures), [f.in_flight for f in figures])


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

    def pick(self, figures: Sequence[RoutingFigures], prompt_tokens: int) -> int:
        _check_figures(figures, prompt_tokens)
        return self.next(len(figures))


class _FiguresOnly:
    """A rule that needs each replica's whole figures: :meth:`choose` (cached blocks and one load) is refused."""

    __slots__ = ()

    def choose(self, cached_blocks: Sequence[int], loads: Sequence[float]) -> int:
        raise ConfigError(f"{self!r} needs each replica's RoutingFigures: call pick(figures, prompt_tokens)")


class ExpectedTtft(_FiguresOnly):
    """The ``expected-ttft`` rule: the smallest :meth:`cost`; ties to fewer in flight, then rotate.

    ``own_weight`` (>= 0): how many later requests' wait the request's own prefill counts for
    (0: the request's first token alone).
    """

    __slots__ = ("own_weight", "_next")

    def __init__(self, own_weight: float = 2.0) -> None:
        _check_seconds("own_weight", own_weight)
        self.own_weight = float(own_weight)
        self._next = 0

    def cost(self, figures: RoutingFigures, prompt_tokens: int) -> float:
        """:func:`expected_ttft_s` plus ``own_weight`` times the request's own prefill seconds there. O(1)."""
        own = max(0, prompt_tokens - figures.cached_tokens) / figures.prefill_tokens_per_s
        return expected_ttft_s(figures, prompt_tokens) + self.own_weight * own

    def pick(self, figures: Sequence[RoutingFigures], prompt_tokens: int) -> int:
        _check_figures(figures, prompt_tokens)
        keys = [(self.cost(f, prompt_tokens), f.in_flight) for f in figures]
        best = min(keys)
        choice = _rotate([i for i, k in enumerate(keys) if k == best], self._next % len(figures))
        self._next = choice + 1
        return choice

    def __repr__(self) -> str:
        return f"ExpectedTtft(own_weight={self.own_weight!r})"


@dataclass(frozen=True, slots=True, kw_only=True)
class Thresholds:
    """The ``threshold`` gate's knobs, SGLang's router's defaults (vLLM's router takes the same).

    ``cache`` (0..1): the share of the prompt the best replica must hold to be chosen for it;
    ``balance_abs`` (>= 0) and ``balance_rel`` (>= 1): the fleet is out of balance when the
    most requests in flight exceed the fewest by more than ``balance_abs`` *and* are more
    than ``balance_rel`` times them.
    """

    cache: float = 0.3
    balance_abs: float = 64.0
    balance_rel: float = 1.5

    def __post_init__(self) -> None:
        if isinstance(self.cache, bool) or not isinstance(self.cache, int | float) or not 0 <= self.cache <= 1:
            raise ConfigError(f"the threshold gate's cache share must be a number in [0, 1], got {self.cache!r}")
        _check_seconds("the threshold gate's balance_abs", self.balance_abs)
        _check_seconds("the threshold gate's balance_rel", self.balance_rel)
        if self.balance_rel < 1:
            raise ConfigError(f"the threshold gate's balance_rel must be >= 1, got {self.balance_rel!r}")


def threshold_gate(
    figures: Sequence[RoutingFigures], prompt_tokens: int, thresholds: Thresholds | None = None
) -> list[int]:
    """The replicas the ``threshold`` gate would take, ascending (several when tied). O(n).

    Out of balance: the least loaded. Else the best match when it holds more than
    ``thresholds.cache`` of the prompt. Else the least loaded.
    """
    _check_figures(figures, prompt_tokens)
    thresholds = Thresholds() if thresholds is None else thresholds
    loads = [f.in_flight for f in figures]
    most, least = max(loads), min(loads)
    least_loaded_ones = [i for i, n in enumerate(loads) if n == least]
    if most - least > thresholds.balance_abs and most > thresholds.balance_rel * least:
        return least_loaded_ones
    cached = [f.cached_tokens for f in figures]
    best = max(cached)
    if prompt_tokens and best / prompt_tokens > thresholds.cache:
        matched = [i for i, n in enumerate(cached) if n == best]
        fewest = min(loads[i] for i in matched)  # among equal matches, the less loaded
        return [i for i in matched if loads[i] == fewest]
    return least_loaded_ones


class ThresholdGate(_FiguresOnly):
    """The ``threshold`` rule (:func:`threshold_gate`) with its :class:`Thresholds`; ties rotate."""

    __slots__ = ("thresholds", "_next")

    def __init__(self, thresholds: Thresholds | None = None) -> None:
        thresholds = Thresholds() if thresholds is None else thresholds
        if not isinstance(thresholds, Thresholds):
            raise ConfigError(f"thresholds must be Thresholds, got {thresholds!r}")
        self.thresholds = thresholds
        self._next = 0

    def pick(self, figures: Sequence[RoutingFigures], prompt_tokens: int) -> int:
        tied = threshold_gate(figures, prompt_tokens, self.thresholds)
        choice = _rotate(tied, self._next % len(figures))
        self._next = choice + 1
        return choice

    def __repr__(self) -> str:
        return f"ThresholdGate({self.thresholds!r})"


def chooser(rule: Routing, *, load_cost: float = 1.0) -> ReplicaChooser:
    """A fresh chooser for ``rule`` (``load_cost`` matters to :attr:`Routing.PREFIX` only)."""
    if rule is Routing.PREFIX:
        return PrefixAware(load_cost)
    if rule is Routing.ROUND_ROBIN:
        return RoundRobin()
    if rule is Routing.LEAST_LOADED:
        return LeastLoaded()
    if rule is Routing.EXPECTED_TTFT:
        return ExpectedTtft()
    if rule is Routing.THRESHOLD:
        return ThresholdGate()
    raise ConfigError(f"unknown routing rule {rule!r}; choose one of {[r.value for r in Routing]}")


def fleet_chooser(rule: Routing, *, load_cost: float = DEFAULT_LOAD_COST) -> ReplicaChooser:
    """A fresh chooser for ``rule`` as a fleet asks it, ``kvpool route`` and ``kvpool simulate`` alike.

    Its :meth:`~ReplicaChooser.choose` takes each replica's cached tokens (held, then being
    computed: :func:`held_or_computing`) and its requests in flight; ``load_cost`` is in blocks of
    :data:`LOAD_COST_TOKENS` tokens per request in flight (``--load-cost``, ``--routing-load-cost``).
    """
    _check_load_cost(load_cost)
    return chooser(rule, load_cost=load_cost * LOAD_COST_TOKENS)


def held_or_computing(prompt: Sequence[Hashable], held: int, computing: Container[Hashable] | None) -> int:
    """The prompt's leading blocks a replica holds or will hold: ``held``, then each next one it is computing now.

    ``prompt``: the prompt's full blocks, keyed as ``computing`` is; ``held``: how many of them
    the replica's cache holds; ``computing``: the blocks its requests in flight are computing
    (a block one of them has too is in the replica's pool once computed). O(blocks added).
    """
    n = held
    if computing:
        while n < len(prompt) and prompt[n] in computing:
            n += 1
    return n


# -- tier credit ---------------------------------------------------------------------------


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
