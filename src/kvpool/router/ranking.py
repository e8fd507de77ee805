"""Which replica should take a request: its prompt keyed, the replicas' cached prefixes found, ranked by the rule.

Where a replica's cached prefixes come from is the :class:`~kvpool.routing.PrefixMode`:
its KV events (``precise``: the block index), the router's own memory of where it sent
each prefix (``approximate``: a :class:`~kvpool.router.index.MemoryIndex` of the prompts'
blocks, hashed at ``approx_block_size``), or each where it can (``auto``). The ``prefix``
rule (:mod:`kvpool.routing`) weighs cached tokens, counted in blocks of
:data:`LOAD_COST_TOKENS` tokens whatever a replica's block size, against each replica's
load; its ties go round the replicas in turn, so new prefixes spread out. In precise mode
the blocks of the requests a replica is computing now count as held there too: their
events come only once they are computed. A prefix the events say a replica holds only in
a tier below its GPU memory (medium ``CPU``, ``STORAGE``) is credited with the prefill
time loading it saves (:class:`~kvpool.routing.TierCredit`, ``options.credit``); the
router's own memory (approximate mode) knows no media and credits every block in full.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvpool.hashing import BlockHash, BlockHasher
from kvpool.router.index import BlockIndex, HeldMedia
from kvpool.router.load_board import BoardTotals, ComputingDepths
from kvpool.router.monitor import ReplicaMonitor
from kvpool.router.prompt_hashes import block_hashes
from kvpool.router.replicas import Hashing, Replica
from kvpool.router.route_options import RouteOptions
from kvpool.routing import (
    DEFAULT_CHUNK_TOKENS,
    LOAD_COST_TOKENS,
    ExpectedTtft,
    PrefixMode,
    Routing,
    RoutingFigures,
    fleet_chooser,
    held_or_computing,
)

if TYPE_CHECKING:
    from kvpool.openai_http.protocol import GenerationRequest

__all__ = [
    "LOAD_COST_TOKENS",
    "NO_KEYS",
    "REGRET_BUCKETS",
    "PromptKeys",
    "Ranker",
    "RoutingRegret",
    "computing_after",
    "replica_figures",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class PromptKeys:
    """A request's prompt as the router keys it: its length, and its blocks under each hashing in use.

    ``hashes``: per replica hashing, the prompt's full blocks as that replica's events spell
    them; ``approx``: the blocks the router's own memory keys prompts by.
    """

    tokens: int = 0
    hashes: dict[Hashing, list[BlockHash]] = field(default_factory=dict)
    approx: list[BlockHash] = field(default_factory=list)


#: A request that could not be keyed: routed by load.
NO_KEYS = PromptKeys()

#: Upper bounds of the regret histogram's buckets: achieved / best-available cached tokens.
REGRET_BUCKETS = (0.0, 0.25, 0.5, 0.75, 0.9, 0.95, 0.97, 0.99, 1.0)


@dataclass(slots=True)
class RoutingRegret:
    """Per request routed, the cached tokens its replica held against the most any replica up held then.

    Both in tokens the replicas would serve from cache (:meth:`Ranker.predicted_tokens`:
    whole blocks, never the prompt's last token), as the ranker saw them when it chose. A
    request no replica held any of adds to the counts, not to the ratio's histogram.
    ``buckets[j]``: requests whose ratio is at most :data:`REGRET_BUCKETS` ``[j]`` (not cumulative).
    """

    requests: int = 0
    achieved_tokens: int = 0
    best_tokens: int = 0
    ratios: int = 0  # requests with a best above 0: those in the histogram
    ratio_sum: float = 0.0
    buckets: list[int] = field(default_factory=lambda: [0] * len(REGRET_BUCKETS))

    def note(self, achieved: int, best: int) -> None:
        """One request routed: its replica held ``achieved`` cached tokens, the best replica ``best``."""
        self.requests += 1
        self.achieved_tokens += achieved
        self.best_tokens += best
        if best > 0:
            ratio = achieved / best
            self.ratios += 1
            self.ratio_sum += ratio
            self.buckets[next(j for j, bound in enumerate(REGRET_BUCKETS) if ratio <= bound)] += 1


#: The media of a block being computed in a replica's pool (its event, when it comes, names the pool).
_IN_POOL: frozenset[str | None] = frozenset({None})


def computing_after(
    computing: Mapping[BlockHash, int] | None, prompt: Sequence[BlockHash], held: int, shared: int
) -> HeldMedia:
    """The prompt's blocks after the ``held`` ones that a replica is computing now: in its pool once computed.

    ``computing``: this router's requests' blocks being computed there; ``shared``: the
    prompt's leading blocks any router's requests are computing there (the load board's).
    """
    n = max(held_or_computing(prompt, held, computing), min(shared, len(prompt)))
    return ((_IN_POOL, n - held),) if n > held else ()


class Ranker:
    """The replicas in the order to try them for a prompt, and what each is predicted to hold of it.

    ``index`` holds the replicas' published blocks, ``approx`` the router's memory of
    where it sent prefixes, and ``computing`` (read only here; the router's bookkeeping
    writes it) the blocks that requests in flight are computing at each replica now;
    :attr:`prefill_pending` (also written by the bookkeeping) the prompt tokens each
    replica must still compute before the requests in flight there reach their first
    token. Each :meth:`rank` of a keyed prompt is noted in :attr:`regret`.

    The ``expected-ttft`` and ``threshold`` rules see each replica as
    :class:`~kvpool.routing.RoutingFigures`: its credited cached tokens, requests in
    flight, prefill pending, and its rates (``Replica.rates``, what it advertises; the
    router's ``prefill_tokens_per_s`` and no decode term while it advertises none).
    """

    def __init__(
        self,
        options: RouteOptions,
        replicas: Sequence[Replica],
        monitor: ReplicaMonitor,
        index: BlockIndex,
        approx: BlockIndex,
        computing: Mapping[str, Mapping[BlockHash, int]],
    ) -> None:
        self.options = options
        self.replicas = replicas
        self.monitor = monitor
        self.index = index
        self.approx = approx
        self.computing = computing
        self.approx_hasher = BlockHasher(options.approx_block_size)
        self.load_cost = options.load_cost * LOAD_COST_TOKENS  # in cached tokens, as the rule weighs them
        self.rule = fleet_chooser(options.routing, load_cost=options.load_cost)
        self.by_figures = options.routing in (Routing.EXPECTED_TTFT, Routing.THRESHOLD)
        self.prefill_pending: dict[str, int] = {}  # replica URL -> prompt tokens to compute (the bookkeeping's)
        self.regret = RoutingRegret()  # what each choice held against the best one (the router's /metrics)

    # -- where each replica's prefixes come from ---------------------------------------------

    def precise_for(self, replica: Replica) -> bool:
        """Whether ``replica``'s cached prefixes come from its events (else, in approximate modes, from memory)."""
        mode = self.options.prefix_mode
        if mode is PrefixMode.APPROXIMATE or replica.events is None:
            return False
        return replica.events.hashing in self.monitor.hashers()

    def approximate_for(self, replica: Replica) -> bool:
        mode = self.options.prefix_mode
        return mode is PrefixMode.APPROXIMATE or (mode is PrefixMode.AUTO and not self.precise_for(replica))

    @property
    def prefix_mode_now(self) -> str:
        """``precise``, ``approximate``, ``mixed`` (some replicas each way) or ``load only``, for the replicas up."""
        tokenizer = self.options.tokenizer
        if not self.options.routing.cache_aware or tokenizer is None or not tokenizer.loaded:
            return "load only"
        up = [r for r in self.replicas if r.up]
        precise = sum(self.precise_for(r) for r in up)
        approximate = sum(self.approximate_for(r) for r in up)
        if precise and approximate:
            return "mixed"
        return "precise" if precise else "approximate" if approximate else "load only"

    def block_size(self, replica: Replica, keys: PromptKeys) -> int:
        """The tokens of one of ``replica``'s blocks as the router counts them (0: it counts none)."""
        if self.precise_for(replica):
            assert replica.events is not None
            return replica.events.block_size
        return self.options.approx_block_size if keys.approx else 0

    def computing_blocks(self, replica: Replica, keys: PromptKeys) -> list[BlockHash]:
        """The prompt's blocks that count as being computed at ``replica`` while the request is there."""
        if replica.events is None or not self.precise_for(replica):
            return []
        return keys.hashes.get(replica.events.hashing, [])

    # -- keying and ranking ------------------------------------------------------------------

    def prompt_keys(self, request: GenerationRequest, tenant: str) -> PromptKeys:
        """The request's prompt length and block hashes under each hashing in use; :data:`NO_KEYS` until tokenized."""
        tokenizer = self.options.tokenizer
        if tokenizer is None or not tokenizer.loaded or not self.options.routing.cache_aware:
            return NO_KEYS
        if request.messages is not None:
            tokens = tokenizer.chat_tokens(request.messages)
        elif isinstance(request.prompt, str):
            tokens = tokenizer.text_tokens(request.prompt)
        else:
            tokens = list(request.prompt or ())
        salt = self.options.salts.cache_salt(tenant, request.cache_salt)
        mode = self.options.prefix_mode
        in_use = self.monitor.hashers()  # asked once: once per replica made keying O(replicas^2)
        hashes = {
            hashing: hashing[3].published(block_hashes(hasher, tokens, salt))
            for hashing, hasher in in_use.items()
            if mode is not PrefixMode.APPROXIMATE
        }
        # approximate_for, with the hashings in use asked once
        wants_approx = mode is PrefixMode.APPROXIMATE or (
            mode is PrefixMode.AUTO
            and any(r.events is None or r.events.hashing not in in_use for r in self.replicas if r.up)
        )
        approx = block_hashes(self.approx_hasher, tokens, salt) if wants_approx else []
        return PromptKeys(tokens=len(tokens), hashes=hashes, approx=approx)

    def rank(
        self, keys: PromptKeys, seen: BoardTotals | None = None, computing: ComputingDepths | None = None
    ) -> list[tuple[Replica, int]]:
        """The replicas that are up, in the order to try them, each with the blocks of the prompt it holds.

        Best first by the rule; a replica marked down is not in the list. ``seen``: every
        router's loads (the load board's, per URL: in flight, prefill pending) in place of
        this router's own; ``computing``: the prompt's leading blocks every router's requests
        are computing at each URL (the board's), counted as held as this router's own are.
        """
        candidates = [r for r in self.replicas if r.up]
        ranked: list[tuple[Replica, int]] = []
        if candidates:
            cached, tokens, sizes = self._cached(candidates, keys, computing or {})
            if seen is None:
                loads, pending = [r.load for r in candidates], self.prefill_pending
            else:
                loads = [seen.get(r.url, (0, 0))[0] for r in candidates]
                pending = {url: p for url, (_, p) in seen.items()}
            if self.by_figures:
                figures = replica_figures(candidates, tokens, pending, self.options.prefill_tokens_per_s, loads)
                i = self.rule.pick(figures, keys.tokens)  # its ties rotate too
                if isinstance(self.rule, ExpectedTtft):
                    ttft = [self.rule.cost(f, keys.tokens) for f in figures]
                    rest = sorted((j for j in range(len(candidates)) if j != i), key=lambda j: (ttft[j], loads[j]))
                    self._note_regret(keys, cached, sizes, i)
                    return [(candidates[j], cached[j]) for j in [i, *rest]]
            else:
                i = self.rule.choose(tokens, loads)  # its ties rotate: new prefixes spread
            self._note_regret(keys, cached, sizes, i)
            # the fallbacks, for a retry: prefix_aware's order, ties to the smaller load and then to the
            # earlier replica (a stable sort), without moving the chooser's rotation; one sort, not a choice each
            cost = self.load_cost
            rest = sorted(
                (j for j in range(len(candidates)) if j != i), key=lambda j: (cost * loads[j] - tokens[j], loads[j])
            )
            ranked = [(candidates[j], cached[j]) for j in [i, *rest]]
        return ranked

    def _note_regret(self, keys: PromptKeys, cached: Sequence[int], sizes: Sequence[int], chosen: int) -> None:
        if keys is not NO_KEYS:
            usable = max(0, keys.tokens - 1)  # as predicted_tokens counts them
            held = [min(n, usable // size) * size if size else 0 for n, size in zip(cached, sizes)]
            self.regret.note(held[chosen], max(held))

    def _cached(
        self, candidates: Sequence[Replica], keys: PromptKeys, shared: ComputingDepths
    ) -> tuple[list[int], list[int], list[int]]:
        """Per candidate, the prompt's leading blocks it holds, the tokens they are credited with, and its block size.

        The block size is :meth:`block_size`'s; the hashings in use are asked once, not once per replica.
        """
        cached = [0] * len(candidates)
        tokens = [0] * len(candidates)
        in_use = self.monitor.hashers()
        approximate_mode = self.options.prefix_mode is PrefixMode.APPROXIMATE
        hashings = [None if r.events is None else r.events.hashing for r in candidates]  # each built once
        precise = [not approximate_mode and h is not None and h in in_use for h in hashings]
        fallback = self.options.approx_block_size if keys.approx else 0
        sizes = [r.events.block_size if p and r.events is not None else fallback for r, p in zip(candidates, precise)]
        for hashing, prompt in keys.hashes.items():
            group = [i for i, h in enumerate(hashings) if precise[i] and h == hashing]
            if group and prompt:
                media = self.index.match_media(prompt, [candidates[i].url for i in group])
                for i, matched in zip(group, media):
                    url = candidates[i].url
                    held = matched + computing_after(
                        self.computing.get(url), prompt, sum(n for _, n in matched), shared.get(url, 0)
                    )
                    cached[i] = sum(n for _, n in held)
                    tokens[i] = self.options.credit.credited_tokens(held, sizes[i])
        if keys.approx:
            # in the approximate unit; the rule compares tokens, so each replica counts in its own unit
            auto = self.options.prefix_mode is PrefixMode.AUTO
            group = [i for i in range(len(candidates)) if approximate_mode or (auto and not precise[i])]
            found = self.approx.match(keys.approx, [candidates[i].url for i in group])
            for i, n in zip(group, found):
                cached[i] = n
                tokens[i] = n * sizes[i]
        return cached, tokens, sizes

    def predicted_tokens(self, replica: Replica, keys: PromptKeys, cached_blocks: int) -> int:
        """The prompt tokens ``replica`` should serve from its cache: whole blocks, never the prompt's last token."""
        block_size = self.block_size(replica, keys)
        if not block_size:
            return 0
        usable = max(0, keys.tokens - 1) // block_size  # the last token is always computed
        return min(cached_blocks, usable) * block_size


def replica_figures(
    candidates: Sequence[Replica],
    tokens: Sequence[int],
    pending: Mapping[str, int],
    default_rate: float,
    in_flight: Sequence[int] | None = None,
) -> list[RoutingFigures]:
    """Each candidate as the figure rules see it, ``tokens`` its credited cached tokens of the prompt.

    ``pending``: prompt tokens still to prefill per replica URL; ``default_rate``: the prefill
    rate of a replica that advertises none (it then gets no decode term); ``in_flight``: each
    candidate's requests in flight (default: this router's own).
    """
    out = []
    flights = [r.in_flight for r in candidates] if in_flight is None else in_flight
    for replica, held, flight in zip(candidates, tokens, flights):
        rates = replica.rates
        out.append(
            RoutingFigures(
                cached_tokens=held,
                in_flight=flight,
                prefill_pending=pending.get(replica.url, 0),
                prefill_tokens_per_s=default_rate if rates is None else rates.prefill_tokens_per_s,
                decode_step_s=0.0 if rates is None else rates.decode_step_s,
                chunk_tokens=DEFAULT_CHUNK_TOKENS,
            )
        )
    return out
