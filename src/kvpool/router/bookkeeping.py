"""What the router notes of each request it routes, from the moment it is sent until it ends.

* **in flight**: each replica's count of requests sent and not yet ended (its load in the rule);
* **prefill pending**: per replica, the uncached prompt tokens of the requests there that have
  not reached their first token (the ``expected-ttft`` rule's queue; ``Ranker.prefill_pending``).
  A request's tokens are reserved when it is sent with its keys (else when it is accepted)
  and released at its first token (else when it ends or fails);
* **computing**: per replica, how many requests in flight there hold each block of their
  prompt (precise mode: blocks whose events are not out yet, counted as held there);
* **memory**: where each prefix was sent (approximate mode);
* **predictions**: the cached tokens predicted for each request against those the replica
  reports, and whether the replica's events ever name the blocks of the prompts sent to it
  (said once, loudly, when they do not).

Where routers share a Redis index, the first three are also this router's share of the load
board (:mod:`kvpool.router.load_board`): :meth:`Bookkeeping.choose` ranks with every
router's loads and blocks computing and reserves its choice there at once, and each change
here writes this router's new counts.

Everything here changes on the router's event loop only, so nothing locks.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from kvpool.hashing import BlockHash
from kvpool.router.index import BlockIndex
from kvpool.router.load_board import CLAIM_TRIES, LoadBoard, NoBoard
from kvpool.router.monitor import ReplicaMonitor
from kvpool.router.ranking import NO_KEYS, PromptKeys, Ranker
from kvpool.router.replicas import Replica
from kvpool.router.stats import HashVerdict

__all__ = ["Bookkeeping", "count_computing"]

log = logging.getLogger("kvpool.route")


def count_computing(computing: dict[BlockHash, int], blocks: Sequence[BlockHash], step: int) -> list[BlockHash]:
    """Add ``step`` (1: a request took them, -1: it ended) to the count of requests computing each block.

    Returns the blocks whose count went from 0 (a block computing anew) or to 0 (no longer computed).
    """
    changed = []
    for h in blocks:
        n = computing.get(h, 0) + step
        if n > 0:
            computing[h] = n
            if n == step:
                changed.append(h)
        elif computing.pop(h, None) is not None:
            changed.append(h)
    return changed


class Bookkeeping:
    """The per-request notes of one router: in-flight counts, blocks computing, memory, predictions.

    ``computing`` maps a replica URL to its blocks being computed now, each with the number
    of requests in flight there that hold it; this writes it, ``ranker`` reads it.
    """

    def __init__(
        self,
        ranker: Ranker,
        monitor: ReplicaMonitor,
        index: BlockIndex,
        approx: BlockIndex,
        computing: dict[str, dict[BlockHash, int]],
    ) -> None:
        self.ranker = ranker
        self.monitor = monitor
        self.index = index
        self.approx = approx
        self.computing = computing
        self.board: LoadBoard = NoBoard()  # the router's, when it shares its loads
        self._prefilling: dict[int, tuple[str, int]] = {}  # id(keys) -> (replica URL, tokens reserved there)
        self._claimed: dict[int, str] = {}  # id(keys) -> the replica its choice reserved on the board

    # -- select and reserve: the only place a choice is made -----------------------------------

    def choose(self, keys: PromptKeys) -> list[tuple[Replica, int]]:
        """The ranking for ``keys`` (:meth:`Ranker.rank`) by every router's loads, its first choice reserved at once.

        When another router reserved in between, ranked again on the loads now (:data:`CLAIM_TRIES` times at most).
        """
        up = [r for r in self.ranker.replicas if r.up]
        prompts = {} if keys is NO_KEYS else {r.url: b for r in up if (b := self.ranker.computing_blocks(r, keys))}
        survey = self.board.survey([r.url for r in up], prompts)
        # every router's blocks computing at each replica: read once, not again on a retry
        seen, shared = (None, None) if survey is None else survey
        for _ in range(CLAIM_TRIES):
            ranked = self.ranker.rank(keys, seen, shared)
            if not ranked or seen is None:
                return ranked
            replica, cached = ranked[0]
            mine = self.own_counts(replica.url, 1, self._pending_of(replica, keys, cached))
            seen = self.board.claim(seen, replica.url, mine)
            if seen is None:
                self._claimed[id(keys)] = replica.url
                return ranked
        return ranked

    def own_counts(self, url: str, more_in: int = 0, more_pending: int = 0) -> tuple[int, int]:
        """This router's requests in flight and prefill pending at ``url`` (plus those about to be sent)."""
        flight = next((r.in_flight for r in self.ranker.replicas if r.url == url), 0)
        return flight + more_in, self.ranker.prefill_pending.get(url, 0) + more_pending

    def all_counts(self) -> dict[str, tuple[int, int]]:  # what this router's key on the board holds
        return {r.url: self.own_counts(r.url) for r in self.ranker.replicas}

    def _pending_of(self, replica: Replica, keys: PromptKeys, cached_blocks: int) -> int:
        if keys is NO_KEYS or id(keys) in self._prefilling:
            return 0
        return max(0, keys.tokens - self.ranker.predicted_tokens(replica, keys, cached_blocks))

    def _publish(self, url: str) -> None:
        self.board.write(url, self.own_counts(url))

    # -- in flight: the only methods that count a replica's load -------------------------------

    def sent(self, replica: Replica, keys: PromptKeys | None = None, cached_blocks: int = 0) -> None:
        """A request is on its way to ``replica``: it counts in its load until :meth:`unsent` or :meth:`ended`.

        With its ``keys``, its uncached prompt tokens are reserved in the replica's prefill pending at once.
        """
        replica.in_flight += 1
        if keys is not None:
            self.reserve_prefill(replica, keys, cached_blocks, publish=False)
        claimed = self._claimed.pop(id(keys), None)
        if claimed != replica.url:  # else its choice wrote these counts already
            self._publish(replica.url)
            if claimed is not None:  # chosen, then marked down before it was sent: not there after all
                self._publish(claimed)

    def unsent(self, replica: Replica, keys: PromptKeys | None = None) -> None:
        """A request :meth:`sent` to ``replica`` failed before it was :meth:`accepted` there."""
        replica.in_flight -= 1
        if keys is not None:
            self._release_prefill(keys)
        self._publish(replica.url)

    def reserve_prefill(self, replica: Replica, keys: PromptKeys, cached_blocks: int, *, publish: bool = True) -> None:
        """The request's uncached prompt tokens count as pending at ``replica`` (once per request)."""
        if keys is NO_KEYS or id(keys) in self._prefilling:
            return
        tokens = self._pending_of(replica, keys, cached_blocks)
        pending = self.ranker.prefill_pending
        pending[replica.url] = pending.get(replica.url, 0) + tokens
        self._prefilling[id(keys)] = (replica.url, tokens)
        if publish:
            self._publish(replica.url)

    def first_token(self, keys: PromptKeys) -> None:
        """The request keyed ``keys`` reached its first token (or left): its prompt tokens are no longer pending."""
        url = self._release_prefill(keys)
        if url is not None:
            self._publish(url)

    def _release_prefill(self, keys: PromptKeys) -> str | None:
        reserved = self._prefilling.pop(id(keys), None)
        if reserved is None:
            return None
        url, tokens = reserved
        pending = self.ranker.prefill_pending
        left = pending.get(url, 0) - tokens
        if left > 0:
            pending[url] = left
        else:
            pending.pop(url, None)
        return url

    def accepted(self, replica: Replica, keys: PromptKeys, cached_blocks: int) -> int:
        """``replica`` answered a request (its answer goes to the client): counted, and its prefix noted.

        Returns the cached tokens predicted for it.
        """
        replica.routed += 1
        self.reserve_prefill(replica, keys, cached_blocks)  # if it was sent without its keys
        predicted = self.ranker.predicted_tokens(replica, keys, cached_blocks)
        replica.stats.requests += 1
        replica.stats.prompt_tokens += keys.tokens
        replica.stats.predicted_cached_tokens += predicted
        self.routed(replica, keys)
        return predicted

    def ended(self, replica: Replica, keys: PromptKeys) -> None:
        """A request :meth:`accepted` at ``replica`` ended (answered, failed or cut): out of flight, settled."""
        replica.in_flight -= 1
        self._release_prefill(keys)
        self._publish(replica.url)
        self.settled(replica, keys)

    # -- blocks and prefixes ---------------------------------------------------------------------

    def routed(self, replica: Replica, keys: PromptKeys) -> None:
        """``replica`` accepted a request: the approximate memory notes where its prefix now lives.

        In precise mode its blocks count as being computed there until :meth:`settled`.
        """
        if keys.approx and self.ranker.approximate_for(replica):
            self.approx.store(replica.url, keys.approx)
        blocks = self.ranker.computing_blocks(replica, keys)
        if blocks:
            started = count_computing(self.computing.setdefault(replica.url, {}), blocks, 1)
            self.board.write_computing(replica.url, started, held=True)

    def settled(self, replica: Replica, keys: PromptKeys) -> None:
        """A request :meth:`routed` to ``replica`` ended (answered, failed or cut): its blocks are no longer computing."""
        blocks = self.ranker.computing_blocks(replica, keys)
        computing = self.computing.get(replica.url)
        if not blocks or computing is None:
            return
        self.board.write_computing(replica.url, count_computing(computing, blocks, -1), held=False)

    # -- predictions -----------------------------------------------------------------------------

    def answered(self, replica: Replica, keys: PromptKeys, predicted: int, cached_tokens: int | None) -> None:
        """``replica`` answered to the end, reporting ``cached_tokens`` (None: no usage in the answer)."""
        if cached_tokens is not None:
            replica.stats.report(predicted, cached_tokens)
        if replica.events is not None:
            prompt = keys.hashes.get(replica.events.hashing)
            if prompt:
                replica.stats.check.note(prompt[0])

    def check_hashes(self, replica: Replica) -> None:
        """Update ``replica``'s hash check; say once, loudly, when its events never match the prompts sent there."""
        stats = replica.stats
        feed = self.monitor.feeds.get(replica.url)
        if not self.ranker.precise_for(replica) or feed is None:
            return
        before = stats.verdict
        stats.verdict = stats.check.verify(lambda h: self.index.match([h], [replica.url])[0] > 0, feed.stored)
        if stats.verdict is not before and stats.verdict in (HashVerdict.UNMATCHED, HashVerdict.SILENT):
            info = replica.events
            assert info is not None
            what = (
                "its KV events never name the blocks of the prompts sent to it"
                if stats.verdict is HashVerdict.UNMATCHED
                else "no KV event arrived from it"
            )
            log.warning(
                "%s: %s (%d prompts answered; described as block-size=%d, hash=%s, seed=%s, block-hash=%s): "
                "its settings, or the router's --model, are not the replica's; it is routed by load meanwhile",
                replica.url,
                what,
                stats.check.answered,
                info.block_size,
                info.hash_algorithm,
                info.hash_seed,
                info.hash_form.value,
            )
