"""What the router counts per replica: requests, predicted against reported cached tokens, and the hash check.

Two questions an operator asks of a prefix router, answered from these figures (its
``/metrics`` shows them):

* *Does prefix routing predict what the replicas then find?* For each request the
  router predicts the prompt tokens the chosen replica will serve from its cache; the
  replica's answer reports ``usage.prompt_tokens_details.cached_tokens``. Both are
  summed over the requests whose answer carried a report, and the requests where the
  two agreed exactly are counted.
* *Are the replica's settings right?* A replica described with the wrong block size,
  hash algorithm, seed, hash form or model publishes events that never name the blocks
  the router computes for the prompts it sends there. :class:`HashCheck` notices: once
  :data:`CHECK_AFTER` prompts with a full block were answered by a replica whose events
  arrive, and none of those prompts' first blocks ever appeared in its events, the
  replica is ``unmatched`` (logged once, and shown in ``/metrics``); if no event arrived
  at all by then, it is ``silent``.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from kvpool.hashing import BlockHash

__all__ = ["CHECK_AFTER", "HashCheck", "HashVerdict", "ReplicaStats"]

#: Answered prompts (with at least one full block) before a replica's events are judged.
CHECK_AFTER = 4


class HashVerdict(enum.Enum):
    """What the hash check concluded about one replica."""

    UNCHECKED = "unchecked"  # too few prompts yet, or no events expected
    MATCHING = "matching"  # its events named a block the router computed
    UNMATCHED = "unmatched"  # its events arrive, but never name the router's blocks: wrong settings
    SILENT = "silent"  # no event arrived although prompts with full blocks were served: wrong endpoint?


@dataclass(slots=True)
class HashCheck:
    """Whether a replica's events ever name the first block of prompts sent to it (see the module)."""

    answered: int = 0  # prompts with a full block that it answered
    matched: int = 0  # checks that found one of them in its events
    pending: deque[BlockHash] = field(default_factory=lambda: deque(maxlen=64))

    def note(self, first_block: BlockHash) -> None:
        """A prompt whose first block is ``first_block`` (as the replica publishes it) was answered."""
        self.answered += 1
        self.pending.append(first_block)

    def verify(self, held: Callable[[BlockHash], bool], stored: int) -> HashVerdict:
        """Look the pending first blocks up (``held``: in the replica's entries); ``stored``: blocks its events stored."""
        if self.matched:  # settled: nothing left to look up
            self.pending.clear()
            return HashVerdict.MATCHING
        if self.pending and any(held(h) for h in self.pending):
            self.matched += 1
            self.pending.clear()
        if self.matched:
            return HashVerdict.MATCHING
        if self.answered < CHECK_AFTER:
            return HashVerdict.UNCHECKED
        return HashVerdict.UNMATCHED if stored else HashVerdict.SILENT

    def reset(self) -> None:
        """Start over (the replica came back: maybe another process, with other settings)."""
        self.answered = self.matched = 0
        self.pending.clear()


@dataclass(slots=True)
class ReplicaStats:
    """Counters of one replica, as the router saw it; they only grow."""

    requests: int = 0  # requests it answered (any status)
    transport_errors: int = 0  # requests that failed to reach it, or broke before an answer
    server_errors: int = 0  # answers with a status of 500 or more (retried elsewhere, or passed on)
    prompt_tokens: int = 0  # prompt tokens of the requests routed to it (the router's tokenization)
    predicted_cached_tokens: int = 0  # what the router predicted it would serve from cache
    reports: int = 0  # answers that reported cached_tokens
    reported_cached_tokens: int = 0  # what those answers reported
    predicted_reported: int = 0  # the prediction, summed over those same answers
    exact: int = 0  # answers whose cached_tokens equalled the prediction
    verdict: HashVerdict = HashVerdict.UNCHECKED
    check: HashCheck = field(default_factory=HashCheck)

    def report(self, predicted: int, cached_tokens: int) -> None:
        """A replica's answer reported ``cached_tokens`` for a request predicted at ``predicted``."""
        self.reports += 1
        self.reported_cached_tokens += cached_tokens
        self.predicted_reported += predicted
        self.exact += predicted == cached_tokens
