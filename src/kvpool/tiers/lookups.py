"""Tier lookups off the step: a slow store makes a request wait, never the step.

A scheduler asks its connector about each waiting request at every step until it is
admitted. vLLM takes an answer of ``None``, and kvpool's scheduler a pending match
(:data:`kvpool.connector.PENDING`), as "not known yet": that request is skipped this step
and the others are scheduled. :class:`OffStepLookups` uses that: the first time a request
is asked, the stores' ``contains_prefix`` calls go to a load thread and the answer is
``None``; once they are back, the match is made on the scheduler's thread from their
answers. The engine's tier hierarchy and the vLLM connector's planner both use it.

The match is :meth:`kvpool.tiers.policy.TierPolicy.match`'s, run twice over stand-ins:

* on the load thread, over a snapshot of the host tier (which blocks it held when the
  request was asked, taken on the scheduler's thread, so the thread never reads the
  scheduler's bookkeeping) and the stores, recording each store's answer by where it was
  asked (the length of the keys it was given);
* on the scheduler's thread, over the live host tier and the recorded answers. Where the
  host tier changed in between, a store is asked somewhere it was not, and answers a miss.

A store's answer is a hint either way (an entry listed and then gone is a failed load, which
vLLM computes). A lookup past the load deadline answers a miss from every store: the request
then computes what the host tier does not hold.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvpool.tiers.policy import ByteTier, HostTier, TierPolicy
from kvpool.tiers.transfer_threads import TransferThreads

__all__ = ["OffStepLookups"]

_log = logging.getLogger("kvpool.tiers")

# Per store, where it was asked (the number of keys it was given) -> how many of them it holds.
_Answers = dict[str, dict[int, int]]
Runs = tuple[tuple[str, int], ...]


class _Recording:
    """A store tier whose answers are noted down (on the load thread)."""

    def __init__(self, tier: ByteTier, answers: dict[int, int]) -> None:
        self.name = tier.name
        self._tier = tier
        self._answers = answers

    def contains_prefix(self, keys: Sequence[bytes]) -> int:
        found = self._tier.contains_prefix(keys)
        self._answers[len(keys)] = found
        return found


class _Answered:
    """A store tier answering from what it said on the load thread; a miss wherever it was not asked."""

    def __init__(self, name: str, answers: dict[int, int]) -> None:
        self.name = name
        self._answers = answers

    def contains_prefix(self, keys: Sequence[bytes]) -> int:
        return self._answers.get(len(keys), 0)


class _Snapshot:
    """The host tier as it was when the request was asked: which of its keys it held."""

    def __init__(self, name: str, held: Sequence[bool]) -> None:
        self.name = name
        self._held = held

    def contains_prefix(self, keys: Sequence[bytes]) -> int:
        count = 0
        for held in self._held[len(self._held) - len(keys) :]:
            if not held:
                break
            count += 1
        return count


@dataclass(slots=True)
class _Lookup:
    keys: tuple[bytes, ...]
    ticket: int
    started: float
    answers: _Answers | None = None  # None until the load thread is back


class OffStepLookups:
    """The lookups of ``policy``'s stores on ``threads``' load threads (see the module docstring).

    O(keys) per call on the scheduler's thread, plus the match over recorded answers.
    """

    def __init__(
        self,
        policy: TierPolicy,
        threads: TransferThreads,
        on_lookup: Callable[[int, float], None] | None = None,
    ) -> None:
        self.policy = policy
        self.threads = threads
        #: Told each lookup's keys and seconds (its deadline, for one not back in time) as it comes back.
        self.on_lookup = on_lookup
        self._lookups: dict[str, _Lookup] = {}
        self._tickets: dict[int, tuple[str, int]] = {}  # ticket -> (request, keys looked up)
        #: Lookups that ran past the deadline (every store answered a miss).
        self.timed_out = 0
        #: Lookups given up on before they were back (``give_up_after``): the stores counted as misses.
        self.gave_up = 0

    def match(self, request_id: str, keys: Sequence[bytes], *, give_up_after: float | None = None) -> Runs | None:
        """``policy.match(keys)``, or None while the stores' answers for ``request_id`` are not back. Never blocks.

        ``give_up_after``: seconds after which a lookup not yet back counts its stores as misses (the
        host tier still answers): a caller that knows computing the tokens takes less than that stops
        waiting for the stores (the load deadline still bounds every other lookup).
        """
        if not keys:
            return ()
        self._collect()
        keys = tuple(keys)
        lookup = self._lookups.get(request_id)
        if lookup is None or lookup.keys != keys:
            self._submit(request_id, keys)
            return None
        if lookup.answers is None:
            if give_up_after is None or self.threads.clock() - lookup.started < give_up_after:
                return None
            lookup.answers = {}
            self.gave_up += 1
        answers = lookup.answers
        tiers = [
            tier if isinstance(tier, HostTier) else ByteTier(_Answered(tier.name, answers.get(tier.name, {})))
            for tier in self.policy.tiers
        ]
        return TierPolicy(tiers).match(keys)

    def asked(self, request_id: str, keys: Sequence[bytes]) -> bool:
        """Whether a lookup of these very ``keys`` for ``request_id`` is on its way or back."""
        lookup = self._lookups.get(request_id)
        return lookup is not None and lookup.keys == tuple(keys)

    def forget(self, request_id: str) -> None:
        """Drop what was looked up for ``request_id`` (admitted, finished): a later match asks again."""
        self._lookups.pop(request_id, None)  # its ticket stays until it comes back: measured, then dropped

    @property
    def num_pending(self) -> int:
        """Lookups not yet back."""
        return sum(1 for lookup in self._lookups.values() if lookup.answers is None)

    def _submit(self, request_id: str, keys: tuple[bytes, ...]) -> None:
        self.forget(request_id)
        host = self.policy.host
        held = [host.contains_prefix((key,)) == 1 for key in keys] if host is not None else []
        ticket = self.threads.submit_load(functools.partial(self._ask, keys, held))
        self._lookups[request_id] = _Lookup(keys, ticket, self.threads.clock())
        self._tickets[ticket] = (request_id, len(keys))

    def _ask(self, keys: tuple[bytes, ...], held: list[bool]) -> _Answers:
        """On a load thread: the match over the host tier's snapshot and the stores, each store's answers noted."""
        answers: _Answers = {}
        tiers = [
            ByteTier(_Snapshot(tier.name, held))
            if isinstance(tier, HostTier)
            else ByteTier(_Recording(tier, answers.setdefault(tier.name, {})))
            for tier in self.policy.tiers
        ]
        TierPolicy(tiers).match(keys)
        return answers

    def _collect(self) -> None:
        for outcome in self.threads.finished_loads():
            asked = self._tickets.pop(outcome.ticket, None)
            if asked is None:
                continue
            request_id, num_keys = asked
            if self.on_lookup is not None:
                self.on_lookup(num_keys, outcome.seconds)  # measured even when its request stopped waiting
            lookup = self._lookups.get(request_id)
            if lookup is None or lookup.ticket != outcome.ticket:
                continue  # forgotten meanwhile
            if outcome.timed_out:
                self.timed_out += 1
                _log.warning(
                    "KV tiers: the lookup for request %s is not back in %.3g s; its stores count as misses",
                    request_id,
                    outcome.seconds,
                )
            value = outcome.value if outcome.ok else None
            lookup.answers = value if isinstance(value, dict) else {}
