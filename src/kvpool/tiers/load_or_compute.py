"""Load or compute: take a tier hit only where loading it is faster than computing its tokens.

A tier that holds a request's blocks is not always worth reading: a busy Redis, a
disk behind a slow link, or a long prompt on a fast accelerator can make the load
slower than the prefill it saves. Two pieces decide, both torch-free and owned by
whoever drives the tiers (the engine, each simulated replica, the vLLM connector):

* :class:`TransferCosts` measures, as the driver runs, each tier's load latency
  (seconds per fetch) and bandwidth (bytes per second), and the driver's prefill
  rate (tokens per second). The driver reports each fetch
  (:meth:`~TransferCosts.note_load`, :meth:`~TransferCosts.note_failed_load`) and
  each step's prefill (:meth:`~TransferCosts.note_prefill`).
* :class:`LoadOrCompute` (a :class:`~kvpool.tiers.hierarchy.MatchChooser`) trims
  each match the tiers offer to the leading blocks whose load beats computing
  them, and counts every decision.

The estimate: a fetch of ``x`` bytes takes ``latency + x / bandwidth`` seconds,
one equation in two unknowns. A line fitted over fetches of different sizes
separates them, so each tier keeps an **exponentially weighted least-squares fit**
of seconds on bytes (the newest fetch weighs ``decay`` of the total, 0.1 by
default: about the last ten fetches count). It follows a tier that slows down
within a few fetches, where a windowed median lags half its window behind and
cannot split latency from bandwidth at all; one stall moves it by at most a
tenth and then fades, and a failed or timed-out fetch counts its seconds, so a
tier that stalls looks slow. The prefill rate is the same fit of a step's
seconds on its prefill tokens: its slope is the marginal cost of a token (the
intercept takes the step's fixed cost and its decodes, which computing a few
more tokens does not add). Each fit answers its prior (the tier's registry link,
the caller's prefill rate) until the first measurement; while the measurements
are all about one size, the line is not determined, and the prior's split
between latency and bandwidth is kept, scaled to what was measured. Nothing reads a clock: time comes in through the
notes, so a replay is repeatable.

A load once started is waited for only as long as the compute it saves
(:meth:`TransferCosts.load_wait`): it reads its blocks in pieces, growing from
the smallest worth its latency, and the request waits for the next piece only
until ``wait_margin`` times the time computing every block up to that piece's
end would take; past it the request takes the blocks that arrived and computes
the rest, so a load that trickles costs at most about one piece's compute. A
piece that missed its deadline is measured at once as "not there after this
long" (:meth:`TransferCosts.note_deadline_miss`), and again with its real time
if it ever arrives, so the next request's decision sees the slow tier.

Limits: the cost of computing is linear in the tokens (attention's growth with
context is not modelled), and a tier the rule declines is no longer measured;
every ``probe_every``-th admitted request it declines loads anyway, so a tier
that recovers is seen again.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvpool.checks import check_int
from kvpool.connector import ExternalMatch
from kvpool.errors import ConfigError
from kvpool.routing import MediumCost, most_saved

__all__ = [
    "DEFAULT_DECAY",
    "DEFAULT_MARGIN",
    "DEFAULT_PROBE_EVERY",
    "DEFAULT_WAIT_MARGIN",
    "LinkPrior",
    "LoadOrCompute",
    "LoadWait",
    "TransferCosts",
    "registry_links",
]

#: A load is taken when it is at least this many times faster than computing its tokens.
DEFAULT_MARGIN = 1.25
#: A load is waited for up to this many times the modelled compute of the blocks up to the end of its next
#: piece: 1.0 loses at most one piece's compute to a load that never comes; the tenth above absorbs a
#: healthy tier's jitter (load or compute took the load expecting it DEFAULT_MARGIN times faster).
DEFAULT_WAIT_MARGIN = 1.1
#: The pieces of a fetch grow (doubling) until a piece's latency is at most this share of its transfer.
_PIECE_LATENCY_SHARE = 0.1
#: A load is also waited for at most this many times what the tier's estimate says it takes, plus
#: _EXPECTED_SLACK_S a piece (a loaded machine's thread wake-ups): a tier far slower than its estimate (the
#: first load from a tier, decided on the registry's prior) is given up early, before it costs a piece's compute.
_EXPECTED_TOLERANCE = 4.0
_EXPECTED_SLACK_S = 0.02
#: The newest measurement's share of each running fit (about the last 1 / decay count).
DEFAULT_DECAY = 0.1
#: A tier declined for this many admitted requests in a row is loaded once anyway, to be measured again.
DEFAULT_PROBE_EVERY = 256
#: A store lookup's prior: its fixed seconds and seconds per key (a loopback Redis round trip, a pipeline).
_LOOKUP_PRIOR_S = 300e-6
_LOOKUP_PRIOR_PER_KEY_S = 2e-6
#: A lookup expected to take this share of its deadline or more is not asked (it would likely answer nothing).
_DEADLINE_SHARE = 0.9
#: Below this spread of sizes (standard deviation over mean) the fit keeps the prior's split.
_MIN_SPREAD = 0.1
#: The smallest seconds per byte (or token) a fit answers: a zero-second fetch is not infinitely fast.
_MIN_SLOPE = 1e-18


def _finite(name: str, value: object, *, positive: bool = False) -> float:
    """``value`` as a float when it is a finite number >= 0 (> 0 if ``positive``); ConfigError naming it otherwise."""
    ok = not isinstance(value, bool) and isinstance(value, int | float) and math.isfinite(value)
    if not ok or value < 0 or (positive and value == 0):  # type: ignore[operator]  # a number once ok
        raise ConfigError(f"{name} must be a finite number {'> 0' if positive else '>= 0'}, got {value!r}")
    return float(value)  # type: ignore[arg-type]  # a number once ok


@dataclass(frozen=True, slots=True, kw_only=True)
class LinkPrior:
    """What a tier's fetches are assumed to cost before any is measured (the registry's ``link`` fact)."""

    bandwidth_bytes_per_s: float
    latency_s: float

    def __post_init__(self) -> None:
        _finite("a tier's prior bandwidth (bytes/s)", self.bandwidth_bytes_per_s, positive=True)
        _finite("a tier's prior latency (s)", self.latency_s)


def registry_links(tiers: Iterable[str]) -> dict[str, LinkPrior]:
    """Each tier's default link from the backend registry (:data:`kvpool.tiers.store.BACKENDS`), by tier name."""
    from kvpool.tiers.kinds import TierKind
    from kvpool.tiers.store import BACKENDS

    priors: dict[str, LinkPrior] = {}
    for name in tiers:
        try:
            kind = TierKind(name)
        except ValueError:
            raise ConfigError(f"no tier kind is named {name!r}; known: {[k.value for k in TierKind]}") from None
        bandwidth, latency = BACKENDS[kind].link
        priors[name] = LinkPrior(bandwidth_bytes_per_s=bandwidth, latency_s=latency)
    return priors


class _LineFit:
    """``seconds = intercept + slope * size``, fitted by exponentially weighted least squares. O(1) per point.

    Kept centred (weighted means and co-moments, West's update), so sizes of a
    gigabyte lose no precision. The prior answers until a point is added, and
    lends its shape (its split between intercept and slope) while the points do
    not fix a line; it never enters the sums, where a prior point far from the
    sizes measured would bend the line long after it stopped mattering.
    """

    __slots__ = ("_keep", "_weight", "_mean_x", "_mean_y", "_cxx", "_cxy", "_prior", "count")

    def __init__(self, intercept: float, slope: float, *, decay: float) -> None:
        self._keep = 1.0 - decay
        self._weight = self._mean_x = self._mean_y = self._cxx = self._cxy = 0.0
        self._prior = (intercept, slope)
        self.count = 0  # points added

    def add(self, size: float, seconds: float) -> None:
        keep = self._keep
        self._weight = keep * self._weight + 1.0
        dx = size - self._mean_x
        self._mean_x += dx / self._weight
        self._mean_y += (seconds - self._mean_y) / self._weight
        self._cxx = keep * self._cxx + dx * (size - self._mean_x)
        self._cxy = keep * self._cxy + dx * (seconds - self._mean_y)
        self.count += 1

    def fit(self) -> tuple[float, float]:
        """(intercept >= 0, slope > 0): the line through the points, or the prior's shape where they do not fix one."""
        intercept, slope = self._prior
        if not self.count:
            return intercept, slope
        mx, my = self._mean_x, self._mean_y
        if math.sqrt(max(self._cxx, 0.0) / self._weight) > _MIN_SPREAD * mx:
            fitted = self._cxy / self._cxx
            if fitted > 0:
                if my - fitted * mx >= 0:
                    return my - fitted * mx, fitted
                return 0.0, max(my / mx, _MIN_SLOPE)  # a negative intercept is noise: the line through 0
        scale = my / (intercept + slope * mx)  # one size, or bigger ones no dearer: the prior's split, to scale
        return intercept * scale, max(slope * scale, _MIN_SLOPE)


@dataclass(slots=True)
class _TierCosts:
    fit: _LineFit
    failed: int = 0
    deadline_misses: int = 0
    blocks_abandoned: int = 0
    late_pieces: int = 0  # pieces past their deadline whose read has not ended: the tier owes them


@dataclass(frozen=True, slots=True)
class LoadWait:
    """How one fetch of blocks is read, and how long its request waits for it.

    ``pieces``: ``(tier, blocks)`` in the order they are read, each one call
    to the store; ``expected_s``: when each piece is expected to have
    arrived, by the tiers' estimates, from the fetch's start;
    ``block_compute_s``: the wait margin times the modelled compute of one
    block; ``cap_s``: the fixed deadline. After ``landed`` blocks have
    arrived (always at a piece's end), the request waits until
    :meth:`deadline_s` from the fetch's start for the next piece: never
    longer than computing every block up to that piece's end would take, nor
    than four times its expected arrival and 20 ms for each piece to it.
    """

    pieces: tuple[tuple[str, int], ...]
    expected_s: tuple[float, ...]
    block_compute_s: float
    cap_s: float

    @property
    def num_blocks(self) -> int:
        return sum(blocks for _, blocks in self.pieces)

    def deadline_s(self, landed: int) -> float:
        """Seconds from the fetch's start its request waits, once its first ``landed`` blocks arrived. O(pieces)."""
        end = count = 0
        expected = 0.0
        for (_, blocks), arrival in zip(self.pieces, self.expected_s):
            end += blocks
            count += 1
            expected = arrival
            if end > landed:
                break
        bound = min(self.block_compute_s * end, _EXPECTED_TOLERANCE * expected + _EXPECTED_SLACK_S * count)
        return min(self.cap_s, bound)


class TransferCosts:
    """Measured costs of one driver: each tier's load latency and bandwidth, and its prefill rate.

    ``links``: each tier's prior by name (:func:`registry_links` gives the
    registry's); ``block_bytes``: one block's bytes in a fetch;
    ``prefill_tokens_per_s``: the prior prefill rate; ``decay``: the newest
    measurement's share of a running fit, in (0, 1).

    Every method is O(1) per tier; none reads a clock. A wrong argument raises
    :class:`~kvpool.errors.ConfigError` naming it, with nothing changed.
    """

    def __init__(
        self,
        links: Mapping[str, LinkPrior],
        *,
        block_bytes: int,
        prefill_tokens_per_s: float,
        decay: float = DEFAULT_DECAY,
    ) -> None:
        if not isinstance(links, Mapping) or not links:
            raise ConfigError(f"links must map each tier's name to its LinkPrior, got {links!r}")
        for name, link in links.items():
            if not isinstance(name, str) or not isinstance(link, LinkPrior):
                raise ConfigError(f"links must map tier names to LinkPrior, got {name!r}: {link!r}")
        check_int("block_bytes", block_bytes)
        rate = _finite("prefill_tokens_per_s", prefill_tokens_per_s, positive=True)
        decay = _finite("decay", decay, positive=True)
        if decay >= 1:
            raise ConfigError(f"decay must be below 1, got {decay!r}")
        self.block_bytes = block_bytes
        self.decay = decay
        self._tiers = {
            name: _TierCosts(_LineFit(link.latency_s, 1 / link.bandwidth_bytes_per_s, decay=decay))
            for name, link in links.items()
        }
        self._prefill = _LineFit(0.0, 1 / rate, decay=decay)

    @property
    def tiers(self) -> tuple[str, ...]:
        return tuple(self._tiers)

    def _tier(self, tier: object) -> _TierCosts:
        costs = self._tiers.get(tier) if isinstance(tier, str) else None
        if costs is None:
            raise ConfigError(f"tier {tier!r} is not one of the measured tiers {list(self._tiers)}")
        return costs

    # -- measurements ---------------------------------------------------------------

    def note_load(self, tier: str, num_blocks: int, num_bytes: int, seconds: float) -> None:
        """One fetch from ``tier``: ``num_blocks`` blocks, ``num_bytes`` bytes, in ``seconds``."""
        costs = self._tier(tier)
        check_int("num_blocks", num_blocks)
        check_int("num_bytes", num_bytes)
        seconds = _finite("seconds", seconds)
        costs.fit.add(num_bytes, seconds)

    def note_failed_load(self, tier: str, num_blocks: int, seconds: float) -> None:
        """A fetch of ``num_blocks`` blocks from ``tier`` that failed or timed out after ``seconds``.

        It counts as a fetch of those blocks' bytes that took ``seconds``: a tier
        whose loads stall until their deadline looks as slow as that.
        """
        costs = self._tier(tier)
        check_int("num_blocks", num_blocks)
        seconds = _finite("seconds", seconds)
        costs.fit.add(num_blocks * self.block_bytes, seconds)
        costs.failed += 1

    def note_deadline_miss(
        self, tier: str, *, late_blocks: int, abandoned_blocks: int, seconds: float, reading: bool = True
    ) -> None:
        """A fetch from ``tier`` ran past its deadline: its piece of ``late_blocks`` blocks had not arrived
        after ``seconds``, and ``abandoned_blocks`` of the tier's blocks were computed instead.

        The piece counts as a fetch of its bytes that took ``seconds`` (it took at least that), and
        until its read ends (:meth:`note_late_piece_done`, then its real time is a :meth:`note_load`)
        the tier :meth:`owes` it: load or compute loads nothing from a tier that owes a piece, so a
        tier that stalls is not waited on again, and one that trickles is decided on its real time.
        ``reading`` False: the piece was never started (it queued behind other loads), nothing is owed.
        """
        costs = self._tier(tier)
        check_int("late_blocks", late_blocks)
        check_int("abandoned_blocks", abandoned_blocks, minimum=0)
        seconds = _finite("seconds", seconds)
        costs.fit.add(late_blocks * self.block_bytes, seconds)
        costs.failed += 1
        costs.deadline_misses += 1
        costs.blocks_abandoned += abandoned_blocks
        costs.late_pieces += reading

    def note_late_piece_done(self, tier: str) -> None:
        """A piece of ``tier`` that had missed its deadline has been read (or failed) at last."""
        costs = self._tier(tier)
        if costs.late_pieces <= 0:
            raise ConfigError(f"tier {tier!r} owes no late piece")
        costs.late_pieces -= 1

    def owes(self, tier: str) -> bool:
        """Whether a piece of ``tier`` that missed its deadline is still being read."""
        return self._tier(tier).late_pieces > 0

    def note_prefill(self, num_tokens: int, seconds: float) -> None:
        """One step computed ``num_tokens`` prompt tokens in ``seconds`` (the whole step; 0 tokens: nothing to learn)."""
        check_int("num_tokens", num_tokens, minimum=0)
        seconds = _finite("seconds", seconds)
        if num_tokens:
            self._prefill.add(num_tokens, seconds)

    # -- estimates ------------------------------------------------------------------

    def load_seconds(self, tier: str, num_blocks: int) -> float:
        """One fetch of ``num_blocks`` blocks from ``tier``: its latency, then the bytes (0.0 for none)."""
        costs = self._tier(tier)
        check_int("num_blocks", num_blocks, minimum=0)
        if num_blocks == 0:
            return 0.0
        latency, per_byte = costs.fit.fit()
        return latency + num_blocks * self.block_bytes * per_byte

    def compute_seconds(self, num_tokens: int) -> float:
        """What computing ``num_tokens`` more prompt tokens adds to a step (the marginal cost)."""
        check_int("num_tokens", num_tokens, minimum=0)
        return num_tokens * self._prefill.fit()[1]

    def load_wait(
        self,
        runs: Sequence[tuple[str, int]],
        *,
        block_size: int,
        cap_s: float,
        margin: float = DEFAULT_WAIT_MARGIN,
    ) -> LoadWait:
        """The pieces and deadlines of one fetch of ``runs`` (``(tier, blocks)`` in order) of ``block_size`` tokens.

        Each run is read in pieces: the first the smallest whose expected load
        beats computing it by ``margin`` (the whole run where none does),
        doubling until a piece's latency is at most a tenth of its transfer.
        ``cap_s``: the fixed deadline. O(pieces).
        """
        check_int("block_size", block_size)
        cap_s = _finite("cap_s", cap_s, positive=True)
        margin = _finite("margin", margin, positive=True)
        block_s = self.compute_seconds(block_size)
        pieces: list[tuple[str, int]] = []
        expected: list[float] = []
        arrival = 0.0
        for tier, blocks in runs:
            costs = self._tier(tier)
            check_int("blocks", blocks)
            latency, per_byte = costs.fit.fit()
            per_block = per_byte * self.block_bytes
            gain = block_s / margin - per_block  # what each block of a piece earns against its latency
            if latency <= 0:
                first = 1
            elif gain > 0:
                first = math.ceil(latency / gain)
            else:
                first = blocks  # expected slower than computing (a probe): one piece, the whole wait
            largest = max(first, math.ceil(latency / (_PIECE_LATENCY_SHARE * per_block)))
            size, left = first, blocks
            while left:
                take = min(size, left)
                pieces.append((tier, take))
                arrival += latency + take * per_block
                expected.append(arrival)
                left -= take
                size = min(2 * size, largest)
        return LoadWait(tuple(pieces), tuple(expected), margin * block_s, cap_s)

    def load_cost(self, tier: str, block_size: int) -> MediumCost:
        """``tier``'s measured cost per fetch and per token of blocks of ``block_size`` tokens."""
        costs = self._tier(tier)
        check_int("block_size", block_size)
        latency, per_byte = costs.fit.fit()
        return MediumCost(latency_s=latency, seconds_per_token=per_byte * self.block_bytes / block_size)

    def prefill_tokens_per_s(self) -> float:
        """The measured prefill rate: prompt tokens per second one more token of a step costs."""
        return 1 / self._prefill.fit()[1]

    def figures(self) -> dict[str, Any]:
        """The estimates, as plain numbers: ``prefill_tokens_per_s``, ``prefill_steps``, and per tier
        ``load_bandwidth_bytes_per_s``, ``load_latency_s``, ``loads`` (fetches measured), ``failed_loads``,
        ``deadline_misses`` (fetches past their deadline, in ``failed_loads`` too) and ``blocks_abandoned``
        (their blocks computed instead), ``late_pieces`` (pieces past their deadline still being read)."""
        tiers = {}
        for name, costs in self._tiers.items():
            latency, per_byte = costs.fit.fit()
            tiers[name] = {
                "load_bandwidth_bytes_per_s": 1 / per_byte,
                "load_latency_s": latency,
                "loads": costs.fit.count,
                "failed_loads": costs.failed,
                "deadline_misses": costs.deadline_misses,
                "blocks_abandoned": costs.blocks_abandoned,
                "late_pieces": costs.late_pieces,
            }
        return {
            "prefill_tokens_per_s": self.prefill_tokens_per_s(),
            "prefill_steps": self._prefill.count,
            "tiers": tiers,
        }


@dataclass(slots=True)
class _Decisions:
    blocks_loaded: int = 0
    blocks_computed: int = 0
    declined_in_a_row: int = 0  # admitted requests whose blocks of this tier were all computed, since one loaded


class LoadOrCompute:
    """Trims a tier match to the leading blocks worth loading: a :class:`~kvpool.tiers.hierarchy.MatchChooser`.

    Loading the first ``k`` blocks of a match costs one fetch per tier they
    touch (a tier's blocks come in one batch: its latency once, then their
    bytes); computing them costs their tokens at the prefill rate. The rule
    loads the ``k`` with the largest saving ``compute(k) - margin x load(k)``,
    none when no saving is positive. Within one tier's run both costs grow
    linearly in ``k``, so the best ``k`` is at the end of a run (or 0): the
    match is cut between runs, which takes O(runs x tiers) per match. The
    rule's one home is :func:`kvpool.routing.most_saved` (the router credits a
    replica's tier-held prefix by it too); this class prices the runs with
    the measured costs and asks it.

    ``margin`` (> 0, :data:`DEFAULT_MARGIN`): a load must be this many times
    faster than computing. Above 1 it absorbs the estimate's error and a
    load's risk of failing (then the blocks are computed after all); below 1
    it loads even where that is slower for the request, to spare the batch
    the compute. ``probe_every`` (None: never): a tier declined for that many
    admitted requests in a row is loaded once anyway, so that it is measured
    again (a tier that recovered is not declined forever on old figures).
    """

    def __init__(
        self,
        costs: TransferCosts,
        *,
        block_size: int,
        margin: float = DEFAULT_MARGIN,
        probe_every: int | None = DEFAULT_PROBE_EVERY,
    ) -> None:
        if not isinstance(costs, TransferCosts):
            raise ConfigError(f"costs must be a TransferCosts, got {costs!r}")
        check_int("block_size", block_size)
        if probe_every is not None:
            check_int("probe_every", probe_every)
        self.costs = costs
        self.block_size = block_size
        self.margin = _finite("margin", margin, positive=True)
        self.probe_every = probe_every
        self._decisions = {name: _Decisions() for name in costs.tiers}
        self.requests = {"loaded": 0, "cut": 0, "computed": 0, "probed": 0}
        # Off-step lookups of the disk and Redis tiers, all stores together: seconds on keys looked up.
        self._lookup = _LineFit(_LOOKUP_PRIOR_S, _LOOKUP_PRIOR_PER_KEY_S, decay=costs.decay)
        self._skipped_in_a_row = 0
        #: Lookups asked of the stores, and skipped because waiting for them costs more than computing.
        self.lookups = {"asked": 0, "skipped": 0}

    def note_lookup(self, num_keys: int, seconds: float) -> None:
        """One lookup of ``num_keys`` keys in the stores took ``seconds`` (its deadline, for one not back)."""
        check_int("num_keys", num_keys)
        self._lookup.add(num_keys, _finite("seconds", seconds))

    def lookup_seconds(self, num_keys: int) -> float:
        """What a lookup of ``num_keys`` keys in the stores is expected to take."""
        check_int("num_keys", num_keys, minimum=0)
        intercept, per_key = self._lookup.fit()
        return intercept + per_key * num_keys

    def worth_looking_up(
        self, num_keys: int, num_tokens: int, deadline_s: float | None = None, tiers: Iterable[str] | None = None
    ) -> bool:
        """Whether to ask the stores at all: a lookup expected to outlast computing the ``num_tokens``, or its
        ``deadline_s`` (past which it answers nothing), is skipped (the request computes, or takes the host
        tier's blocks), save every ``probe_every``-th, which measures the stores again. Counted.

        ``tiers``: the stores a lookup asks; when given, a lookup is skipped too where none of them could be
        loaded from even if it held every key (each owes a late piece, or loading ``num_keys`` blocks from it
        would not beat computing them): its answer could only be computed, and waiting for it would not be.
        """
        limit = self.compute_seconds(num_tokens)
        if deadline_s is not None:
            # a lookup that timed out measures its deadline: expecting nine tenths of it is expecting nothing back
            limit = min(limit, _DEADLINE_SHARE * _finite("deadline_s", deadline_s, positive=True))
        useful = True
        if tiers is not None:
            names = list(tiers)
            for name in names:
                self.costs.load_seconds(name, 0)  # ConfigError naming an unknown tier, before anything is counted
            useful = any(self._could_load(name, num_keys) for name in names)
        if useful and self.lookup_seconds(num_keys) < limit:
            self._skipped_in_a_row = 0
        elif self.probe_every is None or self._skipped_in_a_row + 1 < self.probe_every:
            self._skipped_in_a_row += 1
            self.lookups["skipped"] += 1
            return False
        else:
            self._skipped_in_a_row = 0
        self.lookups["asked"] += 1
        return True

    def _could_load(self, tier: str, num_keys: int) -> bool:
        """Whether a hit of ``num_keys`` blocks in ``tier`` alone would be loaded (in part at least)."""
        if self.costs.owes(tier) or not num_keys:
            return False
        bs = self.block_size
        blocks, _ = most_saved(
            [(tier, self.costs.load_cost(tier, bs), num_keys)],
            bs,
            self.costs.prefill_tokens_per_s(),
            margin=self.margin,
        )
        return blocks > 0

    def _blocks(self, match: object) -> list[tuple[str, int]]:
        """``(tier, blocks)`` of each run; ConfigError naming what is wrong with ``match``."""
        if not isinstance(match, ExternalMatch):
            raise ConfigError(f"a match must be an ExternalMatch, got {match!r}")
        runs = []
        for run in match.runs:
            if run.tier not in self._decisions:
                raise ConfigError(f"tier {run.tier!r} of the match is not one of {list(self._decisions)}")
            if type(run.num_tokens) is not int or run.num_tokens <= 0 or run.num_tokens % self.block_size:
                raise ConfigError(f"a run of {run.num_tokens!r} tokens is not whole blocks of {self.block_size}")
            runs.append((run.tier, run.num_tokens // self.block_size))
        return runs

    def choose(self, match: ExternalMatch) -> ExternalMatch:
        """The leading part of ``match`` (whole runs) worth loading; the rest is computed. Changes nothing."""
        runs = self._blocks(match)
        if not runs or self._probing(runs):
            return match
        costs, bs = self.costs, self.block_size
        owing = next((i for i, (tier, _) in enumerate(runs) if costs.owes(tier)), None)
        if owing is not None:  # a tier still reading a piece past its deadline: nothing from it, nor after it
            runs = runs[:owing]
            if not runs:
                return match.truncated(0)
        priced = [(tier, costs.load_cost(tier, bs), blocks) for tier, blocks in runs]
        blocks, _ = most_saved(priced, bs, costs.prefill_tokens_per_s(), margin=self.margin)
        return match if blocks * bs == match.num_tokens else match.truncated(blocks * bs)

    def _probing(self, runs: list[tuple[str, int]]) -> bool:
        every = self.probe_every
        return every is not None and any(self._decisions[t].declined_in_a_row >= every for t, _ in runs)

    def compute_seconds(self, num_tokens: int) -> float:
        """What computing ``num_tokens`` prompt tokens is estimated to take (:meth:`TransferCosts.compute_seconds`)."""
        return self.costs.compute_seconds(num_tokens)

    def count(self, offered: ExternalMatch, chosen: ExternalMatch) -> None:
        """An admitted request was offered ``offered`` and loads ``chosen``, its leading part; counted per tier.

        ConfigError, with nothing counted, when ``chosen`` is not a leading part of ``offered``.
        """
        offered_runs = self._blocks(offered)
        self._blocks(chosen)
        if offered.truncated(chosen.num_tokens).runs != chosen.runs:  # runs only: how they load is not the rule's
            raise ConfigError(f"the chosen match {chosen!r} is not a leading part of the offered {offered!r}")
        if not offered_runs:
            return
        loaded = {tier: tokens // self.block_size for tier, tokens in chosen.tokens_by_tier().items()}
        whole = chosen.runs == offered.runs
        probe = self._probing(offered_runs) and whole
        for tier, blocks in offered.tokens_by_tier().items():
            decisions = self._decisions[tier]
            took = loaded.get(tier, 0)
            decisions.blocks_loaded += took
            decisions.blocks_computed += blocks // self.block_size - took
            decisions.declined_in_a_row = 0 if took else decisions.declined_in_a_row + 1
        if probe:
            self.requests["probed"] += 1
        elif whole:
            self.requests["loaded"] += 1
        elif chosen.runs:
            self.requests["cut"] += 1
        else:
            self.requests["computed"] += 1

    def figures(self) -> dict[str, Any]:
        """The measurement (:meth:`TransferCosts.figures`) with the decisions: per tier ``blocks_loaded`` and
        ``blocks_computed``; ``requests`` by how they were decided (``loaded`` all offered, ``cut`` to a
        leading part, ``computed`` all, ``probed``: loaded to measure a declined tier); and ``margin``."""
        figures = self.costs.figures()
        for name, decisions in self._decisions.items():
            figures["tiers"][name]["blocks_loaded"] = decisions.blocks_loaded
            figures["tiers"][name]["blocks_computed"] = decisions.blocks_computed
        figures["requests"] = dict(self.requests)
        figures["lookups"] = dict(self.lookups, expected_s_per_64_keys=self.lookup_seconds(64))
        figures["margin"] = self.margin
        return figures
