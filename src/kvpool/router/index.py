"""Which replica holds which block: the router's index, in memory or in Redis.

The index is fed by the replicas' KV events and asked one question per request:
for the request's chain of block hashes ``h[0], h[1], ...``, how long a prefix of
it does each replica hold? Because each hash covers its whole prefix, a replica
holds ``k`` leading blocks exactly when it holds ``h[k-1]``; the walk still goes
block by block from ``h[0]``, so an entry left behind by a missed removal cannot
claim a prefix whose earlier blocks are gone.

A block counts as held while at least one medium of the replica holds it: a block
evicted from GPU memory but kept by an offload tier (``medium="CPU"``) still saves
its prefill there. Events name the medium; ``None`` is the replica's main pool.

Hybrid models keep each block once per KV cache group (full attention, sliding window,
Mamba...), and a prefix is reusable only when every group holds what it needs of it.
Each claim records its :class:`Group`: a full-attention group needs every block of the
prefix, a sliding-window group only the blocks its window reaches back over from the
prefix's end, a Mamba group only the last. The in-memory index counts a prefix of ``k``
blocks for a replica with several groups only when each of its groups holds what it
needs (the groups a replica has are those its events named). The Redis index keeps the
group in each claim but counts a block held by any group.

Operations and their cost (``k`` hashes in the call, ``r`` replicas):

* :meth:`store` / :meth:`remove`: O(k) (amortized: a store past a cap drops claims, O(1) each).
* :meth:`clear`: a replica's cache was reset or its events can no longer be
  trusted; O(1) in memory, its claims swept a bounded step at a time by later calls
  (O(blocks it held) in all); O(blocks it held) in Redis.
* :meth:`match`: O(matched blocks + replicas) in memory (one probe and one AND a block); one
  pipelined round trip in Redis.
* :meth:`match_media`: :meth:`match`, and the media holding each matched block, in runs
  of blocks held alike (what the router's tier credit weighs,
  :class:`kvpool.routing.TierCredit`); the same walk, and in Redis the same one round trip.

The in-memory index is bounded: a replica's claims are capped (by default
:data:`MAX_BLOCKS_PER_REPLICA`, or what the replica says it can hold when it says so,
whichever is smaller) and all claims together too (:data:`MAX_BLOCKS`). Past a cap
the replica's oldest claims are dropped, the least recently stored or matched first,
and counted: a dropped claim can only make the router miss a prefix the replica
holds, never believe it holds one it does not. (The Redis variant is bounded by the
Redis server's own memory policy.)

Both variants answer the same contract (``tests/router/test_index.py`` runs it on
each); the Redis one lets several routers share one index (docs/routing.md).
"""

from __future__ import annotations

from array import array
from collections import deque
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from itertools import chain, groupby
from typing import TYPE_CHECKING, Any, Protocol

from kvpool.errors import ConfigError

if TYPE_CHECKING:
    from redis import Redis

__all__ = [
    "MAX_BLOCKS",
    "MAX_BLOCKS_PER_REPLICA",
    "SWEEP_STEP",
    "BlockIndex",
    "Group",
    "HeldMedia",
    "MemoryIndex",
    "RedisIndex",
    "index_from_url",
    "text_key",
]

#: Claims one replica may have in the in-memory index (vLLM's pool on a large GPU; about 30 MiB of index).
MAX_BLOCKS_PER_REPLICA = 2**19
#: Claims all replicas together may have in the in-memory index: 32 replicas at their cap (1 GiB at most).
MAX_BLOCKS = 2**24
#: Retired claims each store or remove sweeps after a :meth:`MemoryIndex.clear`: a few milliseconds at most.
SWEEP_STEP = 4096

#: A block hash as replicas publish it: digest bytes (kvpool, vLLM's sha256 variants) or an int.
ExternalHash = bytes | int
#: The storage medium an event names (``None``: the replica's main pool).
Medium = str | None
#: One replica's matched prefix, in runs of consecutive blocks: (the media holding each block of the run, blocks).
HeldMedia = tuple[tuple[frozenset[Medium], int], ...]


def _runs(claims: Iterable[Collection[tuple[Medium, int]]]) -> HeldMedia:
    """Blocks' claims ``(medium, group)``, in order, as runs of blocks held in the same media. O(blocks)."""
    runs: list[tuple[frozenset[Medium], int]] = []
    for held, same in groupby(claims):  # equal claim sets compared in C: a run costs one frozenset
        count = len(list(same))
        media = frozenset(m for m, _ in held)
        if runs and runs[-1][0] == media:  # other groups, the same media
            runs[-1] = (media, runs[-1][1] + count)
        else:
            runs.append((media, count))
    return tuple(runs)


@dataclass(frozen=True, slots=True)
class Group:
    """A KV cache group of a replica: its index in the replica's groups, and what of a prefix it needs.

    ``tail`` None: every block of a prefix (full attention). ``tail=n``: only the
    prefix's last ``n`` blocks (a sliding window of ``n`` blocks; 1 for Mamba's state).
    """

    id: int = 0
    tail: int | None = None


#: The group of a model with one group, and of events that name none.
WHOLE = Group()


class BlockIndex(Protocol):
    """Block hash -> the replicas that hold it."""

    def store(self, replica: str, hashes: Iterable[ExternalHash], medium: Medium = None, group: Group = WHOLE) -> None:
        """``replica`` now holds these blocks in ``medium``, for ``group``."""

    def remove(self, replica: str, hashes: Iterable[ExternalHash], medium: Medium = None, group: Group = WHOLE) -> None:
        """``replica`` no longer holds these blocks in ``medium`` for ``group`` (unknown ones are ignored)."""

    def clear(self, replica: str) -> None:
        """Forget every block of ``replica`` (a cache reset, a replica gone, a stream that lost events)."""

    def match(self, hashes: Sequence[ExternalHash], replicas: Sequence[str]) -> list[int]:
        """For each of ``replicas``, how many leading blocks of ``hashes`` it holds."""

    def match_media(self, hashes: Sequence[ExternalHash], replicas: Sequence[str]) -> list[HeldMedia]:
        """For each of ``replicas``, the media holding the leading blocks of ``hashes`` it holds, in runs.

        The runs' blocks add up to what :meth:`match` answers.
        """

    def num_blocks(self, replica: str) -> int:
        """How many distinct blocks ``replica`` holds (any medium)."""

    def limit(self, replica: str, num_blocks: int | None) -> None:
        """``replica`` says it can hold ``num_blocks`` blocks at most (None: it does not say)."""

    def figures(self) -> dict[str, object]:
        """What the router's verbose health shows of the index."""


def text_key(h: ExternalHash) -> bytes:
    """:func:`_key` in printable ASCII, for Redis: ``b`` and the bytes in lowercase hex, or ``i`` and the int."""
    if isinstance(h, bytes):
        return b"b" + h.hex().encode()
    return _key(h)


def _key(h: ExternalHash) -> bytes:
    """One canonical byte form per hash, so an int and its bytes never collide with another hash's."""
    if isinstance(h, bytes):
        return b"b" + h
    if isinstance(h, int) and not isinstance(h, bool):
        return b"i" + str(h).encode()
    raise ConfigError(f"a block hash is bytes or an int, got {h!r}")


#: Fingerprints are spread over this many tables, so that growing one re-inserts 1/256 of the blocks.
_SHARD_BITS = 8
_SHARD_MASK = (1 << _SHARD_BITS) - 1
#: Key values no fingerprint takes (:func:`_fingerprint` sets bit 62): a slot never used, a slot let go.
_EMPTY, _GONE = 0, 1
#: Replicas per holder word: a block's holders are bits of one unsigned 32-bit word per 32 replicas.
_BANK = 32
_HOLDER_TYPE = "I"  # C's unsigned int: 4 bytes wherever CPython runs
#: Dead entries a replica's claim log may carry beyond its live claims before it is compacted.
_LOG_SLACK = 1024
#: A store of at least this many blocks sizes the tables for them first (a snapshot, a long prompt's chain).
_BULK = 1 << 14
#: Entries the cap's eviction takes from the head of a replica's log at a time, to sort by their stamps.
_FRONT = 1024


def _fingerprint(h: ExternalHash) -> int:
    """The in-memory index's key for a hash: 64 bits, keyed per process (Python's ``hash``), bit 62 set.

    Bytes and ints hash by different functions (an int as a tagged tuple), so an int and
    bytes spelling the same digits are different blocks.
    """
    if isinstance(h, bytes):
        return hash(h if type(h) is bytes else bytes(h)) | 1 << 62
    if isinstance(h, int) and not isinstance(h, bool):
        return hash(("int", h)) | 1 << 62
    raise ConfigError(f"a block hash is bytes or an int, got {h!r}")


def _words(size: int) -> array[int]:
    """``size`` zeroed stamps (unsigned 64-bit)."""
    return array("Q", bytes(8 * size))


def _holder_words(size: int) -> array[int]:
    """``size`` zeroed holder words (:data:`_BANK` bits each)."""
    return array(_HOLDER_TYPE, bytes(4 * size))


class _ReplicaClaims:
    """One replica's part of a :class:`MemoryIndex`: its holder bit, its claims' order, their media.

    ``log`` / ``log_stamps``: every block it claims, with the clock value its entry was
    written at, oldest first from ``head`` (entries of claims since dropped or removed
    stay until the log is compacted). ``kinds``: the (medium, group) pairs its events
    named, the first one its main kind; ``extra``: fingerprint -> bit mask of kinds, only
    for the blocks not held in the main kind alone.
    """

    __slots__ = (
        "id",
        "bank",
        "bit",
        "count",
        "kinds",
        "kind_ids",
        "extra",
        "log",
        "log_stamps",
        "head",
        "front",
        "front_at",
        "groups",
        "main_media",
    )

    def __init__(self, replica_id: int) -> None:
        self.id = replica_id
        self.bank, offset = divmod(replica_id, _BANK)
        self.bit = 1 << offset
        self.count = 0  # blocks held (claims)
        self.kinds: list[tuple[Medium, int]] = []
        self.kind_ids: dict[tuple[Medium, int], int] = {}
        self.extra: dict[int, int] = {}
        self.log = array("q")
        self.log_stamps = array("Q")
        self.head = 0
        self.front: list[tuple[int, int]] = []  # the oldest entries, taken from the log, by stamp
        self.front_at = 0
        self.groups: dict[int, int | None] = {}  # group id -> its tail (hybrid models)
        self.main_media: frozenset[Medium] = frozenset()  # the medium of its main kind, as match_media names it

    def kind(self, medium: Medium, group: int) -> int:
        found = self.kind_ids.get((medium, group))
        if found is None:
            found = self.kind_ids[(medium, group)] = len(self.kinds)
            self.kinds.append((medium, group))
            if found == 0:
                self.main_media = frozenset({medium})
        return found

    def claims_of(self, fp: int) -> int:
        """The bit mask of kinds holding block ``fp`` (which it holds)."""
        return self.extra.get(fp, 1)


class MemoryIndex:
    """The index in this process: open-addressing tables of 64-bit fingerprints, and bounded.

    Per block, in flat arrays (no Python object per block or claim): its fingerprint (a
    64-bit hash of its hash, keyed per process: two hashes count as one block only when
    their fingerprints agree, a chance of about 2^-63 per pair), a word of holder bits per
    32 replicas, and the logical clock value it was last stored or matched at. The tables
    are linear-probing, 256 of them by the fingerprint's low bits, each grown on its own
    past 80% full, so growing never stalls for more than 1/256 of the blocks.

    Per replica (:class:`_ReplicaClaims`), a log of the blocks it claims in the order they were
    claimed, 16 bytes an entry. A store or a match stamps the blocks it touches with the
    clock, and no more: a touch costs O(1) once, whatever the number of replicas holding the
    block. The cap's eviction takes the log's oldest 1,024 entries at a time, sorts them by
    their blocks' stamps and drops from the least recent; an entry whose block was used after
    the rest of the log was written goes to the log's end instead. So the claims dropped
    first are the least recently stored or matched (exactly, within those 1,024; a claim used
    later than the entries behind it only counts as newer than it is), "recently" counted
    over the fleet: a block another replica stored, or a match touched, counts as used.

    Memory, measured at 32 replicas x 500,000 claims (``benchmarks/bench_router_index.py``):
    60 bytes per claim when no two replicas hold the same block (20 bytes per table slot,
    the tables 40% to 80% full, and 16 per log entry, the log compacted when it reaches twice
    its live claims), about 18 per claim when every replica holds the same blocks.
    Blocks held in a second medium or group add a dict entry each (:attr:`_ReplicaClaims.extra`).

    ``max_blocks_per_replica`` / ``max_blocks``: the caps (see the module's docstring);
    :meth:`limit` lowers one replica's cap to what it says it can hold. ``sweep_step``: the
    claims of cleared replicas each later store or remove unsets (:meth:`clear`).
    """

    __slots__ = (
        "_keys",
        "_masks",
        "_stamps",
        "_holders",
        "_used",
        "_live",
        "_replicas",
        "_free_ids",
        "_retired",
        "_stale",
        "_limits",
        "_claims",
        "_clock",
        "max_blocks",
        "max_blocks_per_replica",
        "sweep_step",
        "dropped",
    )

    def __init__(
        self,
        *,
        max_blocks: int = MAX_BLOCKS,
        max_blocks_per_replica: int = MAX_BLOCKS_PER_REPLICA,
        sweep_step: int = SWEEP_STEP,
    ) -> None:
        for name, value in (
            ("max_blocks", max_blocks),
            ("max_blocks_per_replica", max_blocks_per_replica),
            ("sweep_step", sweep_step),
        ):
            if type(value) is not int or value < 1:
                raise ConfigError(f"{name} must be an integer >= 1, got {value!r}")
        shards = 1 << _SHARD_BITS
        self._keys = [array("q", bytes(8 * 8)) for _ in range(shards)]  # fingerprint per slot
        self._masks = [8 - 1] * shards  # slots per table, less one
        self._stamps = [_words(8) for _ in range(shards)]  # clock value of its last store or match
        self._holders: list[list[array[int]]] = []  # [bank][shard]: holder bits per slot
        self._used = [0] * shards  # slots not empty (live or let go)
        self._live = [0] * shards  # slots holding a block
        self._replicas: dict[str, _ReplicaClaims] = {}
        self._free_ids: list[int] = []  # ids of replicas cleared and swept, for the next new one
        self._retired: deque[_ReplicaClaims] = deque()  # replicas cleared whose holder bits are not all swept
        self._stale = 0  # holder bits of retired replicas still set
        self._limits: dict[str, int] = {}  # replicas that said how many blocks they hold at most
        self._claims = 0  # (replica, block) pairs held, over all replicas
        self._clock = 0
        self.max_blocks = max_blocks
        self.max_blocks_per_replica = max_blocks_per_replica
        self.sweep_step = sweep_step
        self.dropped = 0

    # -- the tables ----------------------------------------------------------------------------

    def _find(self, fp: int) -> tuple[int, int] | None:
        """(shard, slot) of block ``fp``, or None. O(1) expected."""
        s = fp & _SHARD_MASK
        keys = self._keys[s]
        m = len(keys) - 1
        i = (fp >> _SHARD_BITS) & m
        k = keys[i]
        while k != fp:
            if k == _EMPTY:
                return None
            i = (i + 1) & m
            k = keys[i]
        return s, i

    def _insert(self, fp: int) -> tuple[int, int]:
        """(shard, slot) of block ``fp``, added (no holders, stamp 0) when absent. O(1) amortized."""
        s = fp & _SHARD_MASK
        keys = self._keys[s]
        if (self._used[s] + 1) * 5 > len(keys) * 4:
            keys = self._grow(s)
        m = len(keys) - 1
        i = (fp >> _SHARD_BITS) & m
        free = -1
        k = keys[i]
        while k != fp:
            if k == _EMPTY:
                if free < 0:
                    free = i
                    self._used[s] += 1
                keys[free] = fp
                self._live[s] += 1
                return s, free
            if k == _GONE and free < 0:
                free = i
            i = (i + 1) & m
            k = keys[i]
        return s, i

    def _grow(self, s: int, coming: int = 0) -> array[int]:
        """Shard ``s`` re-inserted into a table sized for twice its live blocks and ``coming`` more (at least 8).

        O(its slots).
        """
        old_keys, old_stamps = self._keys[s], self._stamps[s]
        old_holders = [bank[s] for bank in self._holders]
        size = 8
        while size < 2 * (self._live[s] + coming + 1):
            size *= 2
        keys, stamps = array("q", bytes(8 * size)), _words(size)
        holders = [_holder_words(size) for _ in old_holders]
        m = size - 1
        for j, fp in enumerate(old_keys):
            if fp == _EMPTY or fp == _GONE:
                continue
            i = (fp >> _SHARD_BITS) & m
            while keys[i] != _EMPTY:
                i = (i + 1) & m
            keys[i] = fp
            stamps[i] = old_stamps[j]
            for new, old in zip(holders, old_holders):
                new[i] = old[j]
        self._keys[s], self._masks[s], self._stamps[s] = keys, m, stamps
        for bank, new in zip(self._holders, holders):
            bank[s] = new
        self._used[s] = self._live[s]
        return keys

    def _make_room(self, n: int) -> None:
        """Grow, once, each shard that ``n`` new blocks (spread evenly, and a margin) would grow several times.

        A snapshot's half million blocks would otherwise grow every table about ten times over.
        """
        coming = (n >> _SHARD_BITS) + (n >> (_SHARD_BITS + 2))
        for s, keys in enumerate(self._keys):
            if (self._used[s] + coming) * 5 > len(keys) * 4:
                self._grow(s, coming)

    def _let_go(self, s: int, i: int) -> None:
        """Slot ``i`` of shard ``s`` no longer holds a block when no replica holds it."""
        if any(bank[s][i] for bank in self._holders):
            return
        self._keys[s][i] = _GONE
        self._stamps[s][i] = 0
        self._live[s] -= 1

    # -- replicas --------------------------------------------------------------------------------

    def _join(self, replica: str) -> _ReplicaClaims:
        if self._free_ids:
            replica_id = self._free_ids.pop()
        else:
            replica_id = len(self._replicas) + len(self._retired)  # ids 0 .. n-1 are live or retired
        joined = self._replicas[replica] = _ReplicaClaims(replica_id)
        while len(self._holders) <= joined.bank:
            self._holders.append([_holder_words(len(keys)) for keys in self._keys])
        return joined

    def limit(self, replica: str, num_blocks: int | None) -> None:
        """Cap ``replica``'s claims at ``num_blocks`` (what it can hold; None: the default cap only)."""
        if num_blocks is None:
            self._limits.pop(replica, None)
        else:
            self._limits[replica] = max(1, num_blocks)
        held = self._replicas.get(replica)
        if held is not None:
            self._drop_oldest(held, held.count - self._cap(replica))

    def _cap(self, replica: str) -> int:
        return min(self.max_blocks_per_replica, self._limits.get(replica, self.max_blocks_per_replica))

    # -- claims ----------------------------------------------------------------------------------

    def store(self, replica: str, hashes: Iterable[ExternalHash], medium: Medium = None, group: Group = WHOLE) -> None:
        # every hash checked before anything changes
        fps = [hash(h) | 1 << 62 if type(h) is bytes else _fingerprint(h) for h in hashes]
        r = self._replicas.get(replica) or self._join(replica)
        r.groups[group.id] = group.tail
        kind = r.kind(medium, group.id)
        kind_bit = 1 << kind
        bit, bank, extra = r.bit, self._holders[r.bank], r.extra
        main_only = kind == 0 and not extra  # then no block held needs its media noted
        n = len(fps)
        if n >= _BULK:
            self._make_room(n)
        clock = self._clock
        self._clock += n
        keys_of, masks, stamps_of, live = self._keys, self._masks, self._stamps, self._live
        log, log_stamps = r.log, r.log_stamps
        before = len(log)
        claim, claim_stamp = log.append, log_stamps.append
        # a chain's root is the newest claim of the batch: dropped last
        for stamp, fp in enumerate(reversed(fps), clock + 1):
            s = fp & _SHARD_MASK
            keys = keys_of[s]
            m = masks[s]
            i = (fp >> _SHARD_BITS) & m
            if keys[i] != fp:  # not in its first slot: probed on, and added when absent (in the first slot let go)
                k = keys[i]
                gone = -1
                while k != fp and k != _EMPTY:
                    if k == _GONE and gone < 0:
                        gone = i
                    i = (i + 1) & m
                    k = keys[i]
                if k == _EMPTY:
                    if gone >= 0:
                        keys[gone] = fp
                        live[s] += 1
                        i = gone
                    else:
                        s, i = self._insert(fp)
            stamps_of[s][i] = stamp
            holders = bank[s]
            held = holders[i]
            if held & bit:
                if not main_only:
                    mask = extra.get(fp, 1) | kind_bit
                    if mask != 1:
                        extra[fp] = mask
            else:
                holders[i] = held | bit
                if kind:
                    extra[fp] = kind_bit
                claim(fp)
                claim_stamp(stamp)
        added = len(log) - before
        r.count += added
        self._claims += added
        self._drop_oldest(r, r.count - self._cap(replica))
        if self._retired:  # a retired replica's bits hold memory too: swept before any live claim is dropped
            self.sweep(None if self._claims + self._stale > self.max_blocks else self.sweep_step)
        while self._claims > self.max_blocks:  # the global cap takes from the replica with the most claims
            sizes = sorted(((held.count, name) for name, held in self._replicas.items()), reverse=True)
            (most, largest), runner_up = sizes[0], sizes[1][0] if len(sizes) > 1 else 0
            count = min(self._claims - self.max_blocks, most - runner_up + 1)
            self._drop_oldest(self._replicas[largest], count)

    def _unclaim(self, r: _ReplicaClaims, fp: int, s: int, i: int) -> None:
        holders = self._holders[r.bank][s]
        holders[i] &= ~r.bit
        r.extra.pop(fp, None)
        r.count -= 1
        self._claims -= 1
        self._let_go(s, i)

    def _drop_oldest(self, r: _ReplicaClaims, count: int) -> None:
        """Drop ``r``'s ``count`` least recently used claims (see the class). O(count) amortized."""
        if count <= 0:
            return
        dropped = refills = 0
        bank = self._holders[r.bank]
        while dropped < count and r.count:
            if r.front_at >= len(r.front):
                refills += 1  # past two rounds of the log, its order is taken as it is: the loop ends
                self._refill(r, ordered=refills > 2 * (len(r.log) - r.head) // _FRONT + 4)
                continue
            stamp, fp = r.front[r.front_at]
            r.front_at += 1
            found = self._find(fp)
            if found is None or not bank[found[0]][found[1]] & r.bit:
                continue  # a claim since removed, or dropped through another entry
            s, i = found
            now = self._stamps[s][i]
            if now != stamp:  # used since the front was sorted: among the newest now
                r.log.append(fp)
                r.log_stamps.append(now)
                continue
            self._unclaim(r, fp, s, i)
            dropped += 1
        self.dropped += dropped
        self._compact(r)

    def _refill(self, r: _ReplicaClaims, *, ordered: bool = False) -> None:
        """Move the oldest :data:`_FRONT` entries of ``r``'s log to its front, sorted by their blocks' stamps.

        An entry whose block was used after the entry following the chunk was written
        goes to the log's end instead: it is newer than the rest of the log, not older.
        O(_FRONT log _FRONT). ``ordered``: every entry taken goes to the front.
        """
        log, stamps = r.log, r.log_stamps
        if r.head >= len(log):
            raise AssertionError(f"a bug: {r.count} claims held but none left in the claim log")
        bank = self._holders[r.bank]
        end = min(len(log), r.head + _FRONT)
        after = stamps[end] if end < len(log) and not ordered else None
        front: list[tuple[int, int]] = []
        for k in range(r.head, end):
            fp = log[k]
            found = self._find(fp)
            if found is None or not bank[found[0]][found[1]] & r.bit:
                continue
            now = self._stamps[found[0]][found[1]]
            if after is not None and now > after:
                log.append(fp)
                stamps.append(now)
            else:
                front.append((now, fp))
        r.head = end
        front.sort()
        r.front, r.front_at = front, 0

    def _compact(self, r: _ReplicaClaims) -> None:
        """Rewrite ``r``'s log without dead entries once they outnumber its claims (and :data:`_LOG_SLACK`)."""
        log, stamps = r.log, r.log_stamps
        if len(log) - r.head <= 2 * r.count + _LOG_SLACK:
            if r.head > len(log) // 2 and r.head > _LOG_SLACK:
                del log[: r.head]
                del stamps[: r.head]
                r.head = 0
            return
        bank = self._holders[r.bank]
        seen: set[int] = set()
        kept_fps, kept_stamps = array("q"), array("Q")
        for k in range(len(log) - 1, r.head - 1, -1):  # the newest entry of each claim is the one kept
            fp = log[k]
            if fp in seen:
                continue
            found = self._find(fp)
            if found is not None and bank[found[0]][found[1]] & r.bit:
                seen.add(fp)
                kept_fps.append(fp)
                kept_stamps.append(stamps[k])
        kept_fps.reverse()
        kept_stamps.reverse()
        r.log, r.log_stamps, r.head = kept_fps, kept_stamps, 0

    def remove(self, replica: str, hashes: Iterable[ExternalHash], medium: Medium = None, group: Group = WHOLE) -> None:
        fps = [_fingerprint(h) for h in hashes]
        r = self._replicas.get(replica)
        if r is None:
            return
        kind = r.kind_ids.get((medium, group.id))
        if kind is None:
            return  # it never claimed a block there
        kind_bit = 1 << kind
        bank = self._holders[r.bank]
        for fp in fps:
            found = self._find(fp)
            if found is None or not bank[found[0]][found[1]] & r.bit:
                continue
            mask = r.extra.get(fp, 1)
            if not mask & kind_bit:
                continue
            mask &= ~kind_bit
            if not mask:
                self._unclaim(r, fp, *found)
            elif mask == 1:
                del r.extra[fp]
            else:
                r.extra[fp] = mask
        self._compact(r)
        if self._retired:
            self.sweep(self.sweep_step)

    def clear(self, replica: str) -> None:
        """Forget ``replica``'s claims at once: O(1) here, its holder bits swept later (:meth:`sweep`).

        The replica's holder bit is retired with it: nothing reads a retired bit (a lookup
        or a new claim goes by the bits of replicas in the index), so the index answers as
        though every claim were gone. Each later :meth:`store` and :meth:`remove` sweeps up
        to ``sweep_step`` (:data:`SWEEP_STEP`) of the retired claims, letting go the slots no one else holds;
        the bit is given to a new replica once all of them are swept. A snapshot's reload
        clears half a million claims and stores as many: sweeping them first would double it.
        """
        r = self._replicas.pop(replica, None)
        if r is None:
            return
        self._claims -= r.count
        if not r.count:
            self._free_ids.append(r.id)
            return
        pending = array("q", (fp for _, fp in r.front[r.front_at :]))  # the sweep's list: every entry it may hold
        pending.extend(r.log[r.head :] if r.head else r.log)
        r.log, r.log_stamps, r.head, r.front, r.front_at, r.extra = pending, array("Q"), 0, [], 0, {}
        self._retired.append(r)
        self._stale += r.count

    def sweep(self, budget: int | None = None) -> int:
        """Unset up to ``budget`` entries' retired holder bits (None: all), oldest retirement first.

        Returns the retired claims still set. O(budget).
        """
        left = sum(len(r.log) - r.head for r in self._retired) if budget is None else budget
        banks = self._holders
        alone = len(banks) == 1  # then no other bank can hold a slot this one lets go
        keys_of, stamps_of, live = self._keys, self._stamps, self._live
        while self._retired and left > 0:
            r = self._retired[0]
            bank, bit, log = banks[r.bank], r.bit, r.log
            end = min(len(log), r.head + left)
            unset = 0
            for fp in log[r.head : end]:  # _find and _let_go inlined
                s = fp & _SHARD_MASK
                keys = keys_of[s]
                m = len(keys) - 1
                i = (fp >> _SHARD_BITS) & m
                k = keys[i]
                while k != fp and k != _EMPTY:
                    i = (i + 1) & m
                    k = keys[i]
                if k != fp:
                    continue
                holders = bank[s]
                held = holders[i]
                if held & bit:
                    unset += 1
                    held &= ~bit
                    holders[i] = held
                    if not held and (alone or not any(other[s][i] for other in banks)):
                        keys[i] = _GONE
                        stamps_of[s][i] = 0
                        live[s] -= 1
            left -= end - r.head
            r.head = end
            r.count -= unset
            self._stale -= unset
            if end == len(log):
                if r.count:
                    raise AssertionError(f"a bug: {r.count} retired claims of replica id {r.id} not in its log")
                self._retired.popleft()
                self._free_ids.append(r.id)
        return self._stale

    # -- lookups ---------------------------------------------------------------------------------

    def match(self, hashes: Sequence[ExternalHash], replicas: Sequence[str]) -> list[int]:
        return self._match(hashes, replicas, None)

    def match_media(self, hashes: Sequence[ExternalHash], replicas: Sequence[str]) -> list[HeldMedia]:
        media: dict[str, HeldMedia] = {}
        self._match(hashes, replicas, media)
        return [media.get(r, ()) for r in replicas]

    def _walk(self, hashes: Sequence[ExternalHash], bank: int, want: int, top: int) -> list[tuple[int, int]]:
        """The chain walked for the replicas of holder bits ``want`` in ``bank``: (depth, bits whose run ends there).

        Each block walked is stamped ``top - depth`` (a used prefix is dropped last, its
        root last of all). O(blocks walked): one probe and one AND a block.
        """
        keys_of, masks, holders_of, stamps_of = self._keys, self._masks, self._holders[bank], self._stamps
        alive = want
        ends: list[tuple[int, int]] = []
        depth = 0
        for h in hashes:
            fp = hash(h) | 1 << 62 if type(h) is bytes else _fingerprint(h)
            s = fp & _SHARD_MASK
            keys = keys_of[s]
            m = masks[s]
            i = (fp >> _SHARD_BITS) & m
            k = keys[i]
            if k != fp:  # not in its first slot: probed on
                while k != fp and k != _EMPTY:
                    i = (i + 1) & m
                    k = keys[i]
                if k == _EMPTY:
                    break
            held = holders_of[s][i] & alive
            if not held:
                break
            stamps_of[s][i] = top - depth
            if held != alive:
                ends.append((depth, alive & ~held))
                alive = held
            depth += 1
        ends.append((depth, alive))
        return ends

    def _match(
        self, hashes: Sequence[ExternalHash], replicas: Sequence[str], media: dict[str, HeldMedia] | None
    ) -> list[int]:
        """:meth:`match`; with ``media``, each replica's matched blocks' media go into it as well."""
        matched = [0] * len(replicas)
        known = [(n, self._replicas.get(name)) for n, name in enumerate(replicas)]
        banks: dict[int, int] = {}
        for _, r in known:
            if r is not None:
                banks[r.bank] = banks.get(r.bank, 0) | r.bit
        if not hashes or not banks:
            return matched
        top = self._clock + len(hashes)
        self._clock = top
        ends = {bank: self._walk(hashes, bank, want, top) for bank, want in banks.items()}
        depth_of: dict[tuple[int, int], int] = {}  # (bank, holder bit) -> the depth its run ended at
        for bank, runs in ends.items():
            for d, bits in runs:
                while bits:
                    low = bits & -bits
                    depth_of[(bank, low)] = d
                    bits ^= low
        fps: list[int] | None = None
        for n, r in known:
            if r is None:
                continue
            depth = depth_of[(r.bank, r.bit)]
            if not depth:
                continue
            if len(r.groups) > 1 or (media is not None and r.extra):
                if fps is None:
                    fps = [_fingerprint(h) for h in hashes[: max(d for bank in ends.values() for d, _ in bank)]]
                if len(r.groups) > 1:
                    depth = self._usable(r, fps[:depth])
            matched[n] = depth
            if media is not None and depth:
                if r.extra and fps is not None:
                    media[replicas[n]] = _runs(self._claims_of(r, fp) for fp in fps[:depth])
                else:
                    media[replicas[n]] = ((r.main_media, depth),)
        return matched

    @staticmethod
    def _claims_of(r: _ReplicaClaims, fp: int) -> tuple[tuple[Medium, int], ...]:
        """The (medium, group) pairs holding block ``fp`` at ``r`` (which holds it), in kind order."""
        mask = r.claims_of(fp)
        return tuple(kind for j, kind in enumerate(r.kinds) if mask >> j & 1)

    def _usable(self, r: _ReplicaClaims, fps: list[int]) -> int:
        """The longest prefix of ``fps`` every group of a hybrid replica holds what it needs of.

        A full-attention group must hold each block up to the prefix's end; a group with a
        ``tail`` only the last ``tail`` blocks before it. O(len(fps) x groups x tail).
        """
        holding = [{g for _, g in self._claims_of(r, fp)} for fp in fps]
        whole = [g for g, tail in r.groups.items() if tail is None]
        tailed = [(g, tail) for g, tail in r.groups.items() if tail is not None]
        best = 0
        for depth in range(1, len(fps) + 1):
            if not all(g in holding[depth - 1] for g in whole):
                break  # a full-attention group misses a block: no longer prefix can be used
            if all(all(g in holding[j] for j in range(max(0, depth - tail), depth)) for g, tail in tailed):
                best = depth
        return best

    # -- figures and checks ----------------------------------------------------------------------

    def figures(self) -> dict[str, object]:
        return {
            "kind": "memory",
            "claims": self._claims,
            "claims_to_sweep": self._stale,
            "blocks": sum(self._live),
            "dropped": self.dropped,
            "max_blocks": self.max_blocks,
            "max_blocks_per_replica": self.max_blocks_per_replica,
            "array_bytes": self.array_bytes(),
        }

    def array_bytes(self) -> int:
        """Bytes of the index's tables and claim logs (not counting the per-replica dicts of second media)."""
        slots = sum(len(keys) for keys in self._keys)
        logs = sum(len(r.log) for r in chain(self._replicas.values(), self._retired))
        return 8 * slots * (2 + len(self._holders)) + 16 * logs

    def num_blocks(self, replica: str) -> int:
        r = self._replicas.get(replica)
        return 0 if r is None else r.count

    def check(self) -> None:
        """Raise AssertionError (a bug) if the tables, the holder bits, the logs and the counts disagree. O(size)."""
        ids = {r.id: (name, r) for name, r in self._replicas.items()}
        ids.update((r.id, (f"retired replica id {r.id}", r)) for r in self._retired)
        assert len(ids) == len(self._replicas) + len(self._retired), "two replicas share an id"
        assert not set(ids) & set(self._free_ids), "a free replica id in use"
        assert set(ids) | set(self._free_ids) == set(range(len(ids) + len(self._free_ids))), "replica ids lost"
        held: dict[str, set[int]] = {name: set() for name, _ in ids.values()}
        for s, keys in enumerate(self._keys):
            live = used = 0
            for i, fp in enumerate(keys):
                if fp == _EMPTY:
                    continue
                used += 1
                words = [bank[s][i] for bank in self._holders]
                if fp == _GONE:
                    assert not any(words), f"shard {s} slot {i}: a slot let go still has holders"
                    continue
                live += 1
                assert fp & _SHARD_MASK == s and fp & 1 << 62, (
                    f"shard {s} slot {i}: fingerprint {fp} is in the wrong table"
                )
                assert self._find(fp) == (s, i), f"fingerprint {fp} is not found where it is"
                assert any(words), f"shard {s} slot {i}: a block no replica holds"
                for b, word in enumerate(words):
                    while word:
                        low = word & -word
                        word ^= low
                        replica_id = b * _BANK + low.bit_length() - 1
                        assert replica_id in ids, f"block {fp}: holder bit of no replica"
                        held[ids[replica_id][0]].add(fp)
            assert (live, used) == (self._live[s], self._used[s]), f"shard {s}: counts {live}/{used} recorded wrong"
            assert used * 5 <= len(keys) * 4, f"shard {s}: fuller than 80%"
            assert self._masks[s] == len(keys) - 1, f"shard {s}: its mask is not its size less one"
        assert sum(r.count for r in self._replicas.values()) == self._claims, "claims miscounted"
        assert sum(r.count for r in self._retired) == self._stale, "retired claims miscounted"
        for r in self._retired:
            swept = f"retired replica id {r.id}"
            still = held.pop(swept)
            assert r.count == len(still), f"{swept}: {r.count} claims counted, {len(still)} bits still set"
            assert still <= set(r.log[r.head :]), f"{swept}: a bit still set that its sweep has passed"
        for name, r in self._replicas.items():
            assert r.count == len(held[name]), f"{name}: {r.count} claims counted, {len(held[name])} held"
            logged = set(r.log[r.head :]) | {fp for _, fp in r.front[r.front_at :]}
            assert held[name] <= logged, f"{name}: a claim missing from its log"
            assert set(r.extra) <= held[name], f"{name}: media of a block it does not hold"
            assert all(mask > 1 for mask in r.extra.values()), f"{name}: a redundant media entry"
            assert r.count <= self._cap(name), f"{name}: over its cap"
        assert self._claims + self._stale <= self.max_blocks, "over the global cap (retired claims counted)"


# KEYS: the prompt's block keys, in order; ARGV: replica names. Returns the matched depth per replica.
_MATCH_SCRIPT = """
local matched, alive = {}, {}
for i, replica in ipairs(ARGV) do matched[i] = 0; alive[replica] = true end
for depth, key in ipairs(KEYS) do
  local holders = {}
  for _, member in ipairs(redis.call('SMEMBERS', key)) do
    holders[string.match(member, '^(.*)|[^|]*$')] = true
  end
  local running = false
  for i, replica in ipairs(ARGV) do
    if alive[replica] and holders[replica] then matched[i] = depth; running = true else alive[replica] = false end
  end
  if not running then break end
end
return matched
"""


# As _MATCH_SCRIPT; returns per replica its runs of blocks held in the same media, flat:
# {media, blocks, media, blocks, ...}, a run's media sorted and joined by newlines ("" for none named).
_MATCH_MEDIA_SCRIPT = """
local alive, runs = {}, {}
for i, replica in ipairs(ARGV) do alive[replica] = true; runs[i] = {} end
for depth, key in ipairs(KEYS) do
  local holders = {}
  for _, member in ipairs(redis.call('SMEMBERS', key)) do
    local replica, claim = string.match(member, '^(.*)|([^|]*)$')
    local held = holders[replica]
    if not held then held = {}; holders[replica] = held end
    held[string.match(claim, '^([^#]*)')] = true
  end
  local running = false
  for i, replica in ipairs(ARGV) do
    local held = holders[replica]
    if alive[replica] and held then
      running = true
      local names = {}
      for medium in pairs(held) do names[#names + 1] = medium end
      table.sort(names)
      local joined, own = table.concat(names, '\\n'), runs[i]
      if #own > 0 and own[#own - 1] == joined then own[#own] = own[#own] + 1
      else own[#own + 1] = joined; own[#own + 1] = 1 end
    else alive[replica] = false end
  end
  if not running then break end
end
return runs
"""


class RedisIndex:
    """The index in Redis, shared by every router that names the same server and prefix.

    Keys (``P`` is the prefix, default ``kvpool:route``)::

        P:b:<hash>             SET of "<replica>|<medium>"  who holds this block, where
        P:r:<replica>|<medium> SET of <hash>                 what a replica's medium holds
        P:m:<replica>          SET of "<replica>|<medium>"  the replica's media (for clear)

    ``<hash>`` is printable (what ``redis-cli --scan`` shows as is): ``b`` and a digest's bytes
    in lowercase hex, or ``i`` and an integer hash in decimal.

    Every write is a set insertion or deletion, so routers that apply the same event
    stream converge on the same index whatever order their writes interleave in; a
    lookup is one call of a server-side script that walks the request's blocks and
    stops where every replica's run has ended.
    """

    __slots__ = ("_redis", "_prefix", "_match", "_match_media")

    def __init__(self, client: Redis, prefix: str = "kvpool:route") -> None:
        self._redis = client
        self._prefix = prefix.encode()
        self._match = client.register_script(_MATCH_SCRIPT)
        self._match_media = client.register_script(_MATCH_MEDIA_SCRIPT)

    @property
    def client(self) -> Redis:
        """The server's client (the routers' load board shares it)."""
        return self._redis

    @property
    def prefix(self) -> str:
        return self._prefix.decode()

    def _block(self, key: bytes) -> bytes:
        return self._prefix + b":b:" + key

    def _medium(self, member: bytes) -> bytes:
        return self._prefix + b":r:" + member

    def _media(self, replica: str) -> bytes:
        return self._prefix + b":m:" + replica.encode()

    @staticmethod
    def _member(replica: str, medium: Medium, group: Group = WHOLE) -> bytes:
        name = "" if medium is None else medium
        return f"{replica}|{name if group.id == 0 else f'{name}#{group.id}'}".encode()

    def store(self, replica: str, hashes: Iterable[ExternalHash], medium: Medium = None, group: Group = WHOLE) -> None:
        keys = [text_key(h) for h in hashes]
        if not keys:
            return
        member = self._member(replica, medium, group)
        pipe = self._redis.pipeline(transaction=False)
        pipe.sadd(self._media(replica), member)
        pipe.sadd(self._medium(member), *keys)
        for key in keys:
            pipe.sadd(self._block(key), member)
        pipe.execute()

    def remove(self, replica: str, hashes: Iterable[ExternalHash], medium: Medium = None, group: Group = WHOLE) -> None:
        keys = [text_key(h) for h in hashes]
        if not keys:
            return
        member = self._member(replica, medium, group)
        pipe = self._redis.pipeline(transaction=False)
        pipe.srem(self._medium(member), *keys)
        for key in keys:
            pipe.srem(self._block(key), member)
        pipe.execute()

    def clear(self, replica: str) -> None:
        media: set[bytes] = self._redis.smembers(self._media(replica))  # type: ignore[assignment]  # the sync client returns the set itself
        for member in media:
            held: set[bytes] = self._redis.smembers(self._medium(member))  # type: ignore[assignment]  # as above
            pipe = self._redis.pipeline(transaction=False)
            for key in held:
                pipe.srem(self._block(key), member)
            pipe.delete(self._medium(member))
            pipe.srem(self._media(replica), member)
            pipe.execute()

    def match(self, hashes: Sequence[ExternalHash], replicas: Sequence[str]) -> list[int]:
        if not hashes or not replicas:
            return [0] * len(replicas)
        # One script call walks the chain on the server and stops at the first block no
        # replica still in the run holds: one round trip, a reply of one number per replica.
        keys = [self._block(text_key(h)) for h in hashes]
        found: list[Any] = self._match(keys=keys, args=list(replicas))
        return [int(n) for n in found]

    def match_media(self, hashes: Sequence[ExternalHash], replicas: Sequence[str]) -> list[HeldMedia]:
        if not hashes or not replicas:
            return [() for _ in replicas]
        # the walk of match, in one script call as well, each replica's runs of media built on the server
        keys = [self._block(text_key(h)) for h in hashes]
        found: list[Any] = self._match_media(keys=keys, args=list(replicas))
        return [
            tuple(
                (frozenset(m.decode() or None for m in runs[j].split(b"\n")), int(runs[j + 1]))
                for j in range(0, len(runs), 2)
            )
            for runs in found
        ]

    def num_blocks(self, replica: str) -> int:
        media: set[bytes] = self._redis.smembers(self._media(replica))  # type: ignore[assignment]  # the sync client returns the set itself
        if not media:
            return 0
        held: set[bytes] = self._redis.sunion([self._medium(m) for m in media])  # type: ignore[assignment]  # as above
        return len(held)

    def limit(self, replica: str, num_blocks: int | None) -> None:
        pass  # bounded by the Redis server's memory policy

    def figures(self) -> dict[str, object]:
        return {"kind": "redis"}


#: Seconds a call to the index Redis may take (it runs on the router's event loop).
REDIS_TIMEOUT_S = 0.5


def index_from_url(
    url: str | None,
    *,
    prefix: str = "kvpool:route",
    max_blocks: int = MAX_BLOCKS,
    max_blocks_per_replica: int = MAX_BLOCKS_PER_REPLICA,
) -> BlockIndex:
    """A :class:`MemoryIndex` with these caps (``url`` None), or a :class:`RedisIndex` on ``url``.

    The Redis one is checked with a PING; the router guards it
    (:mod:`kvpool.router.index_guard`): when the server fails later, requests are routed
    by load until it answers again.
    """
    if url is None:
        return MemoryIndex(max_blocks=max_blocks, max_blocks_per_replica=max_blocks_per_replica)
    try:
        import redis
    except ImportError:
        raise ConfigError("--index-redis needs the redis client: pip install 'kvpool[tiers]'") from None
    try:
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        client = redis.Redis.from_url(
            url,
            socket_timeout=REDIS_TIMEOUT_S,
            socket_connect_timeout=REDIS_TIMEOUT_S,
            retry=Retry(NoBackoff(), 0),  # one try: the guard decides when to try again
        )
        client.ping()
    except ValueError as exc:
        raise ConfigError(f"--index-redis {url!r} is not a Redis URL: {exc}") from None
    except redis.RedisError as exc:
        raise ConfigError(f"the index Redis at {url!r} does not answer: {exc}") from None
    return RedisIndex(client, prefix)
