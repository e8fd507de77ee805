"""A tier that trickles or stalls, through the whole engine: a request waits only as long as computing takes.

The disk tier's reads are gated piece by piece (each store call is one piece of a
fetch): the test releases the ones it wants and holds the rest. The transfer
threads run on a fake clock that the test moves, so every deadline is reached by
moving the clock, never by waiting for time; the prefill rate load or compute
weighs is set by hand (10 ms a token), so the decisions do not depend on this
machine's speed.
"""

# ruff: noqa: F811  # the fixtures folder and reference are test_tiers.py's, imported by name

from __future__ import annotations

import threading

import pytest

from kvpool.engine.llm_engine import LLMEngine
from kvpool.tiers.transfer_threads import TransferThreads
from tests.engine.test_tiers import (  # noqa: F401
    BLOCK,
    LOADABLE,
    PARAMS,
    TINY_POOL,
    folder,
    prompts,
    reference,
)

pytestmark = [pytest.mark.engine, pytest.mark.slow]

SECONDS_PER_TOKEN = 0.01
FIXED_DEADLINE = 600.0  # far above anything the compute bound gives: reaching it would fail the test's clock moves


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Trickle:
    """The store's reads: the first ``free`` pass at once, each later one waits until the test releases it."""

    def __init__(self, store, free: int) -> None:
        self.inner = store.get_many_into
        self.free = free
        self.calls = 0
        self.sizes: list[int] = []
        self.release = threading.Event()
        store.get_many_into = self._read

    def _read(self, keys, out):
        index = self.calls
        self.calls += 1
        self.sizes.append(len(keys))
        if index >= self.free:
            self.release.wait(60)  # a test that fails releases it; the 60 s only bound a broken one
        return self.inner(keys, out)


def _engine(folder, tmp_path, saved):
    """An engine whose disk tier holds ``saved`` prompts' blocks, its pool emptied, its loads on a fake clock."""
    engine = LLMEngine(
        folder, **TINY_POOL, kv_tiers=[f"disk:{tmp_path}:1MiB"], kv_tier_unauthenticated=True,
        kv_tier_load_deadline=FIXED_DEADLINE, log=None,
    )  # fmt: skip
    for prompt in saved:
        rid = engine.add_request(prompt, PARAMS)
        engine.run_until_done([rid])
    tiers = engine.kv_tiers
    assert tiers.flush_saves(timeout=60)
    assert engine.manager.reset_prefix_cache()
    clock = FakeClock()
    tiers.worker.threads.close()
    tiers.worker.threads = TransferThreads("test-loads", load_deadline_s=FIXED_DEADLINE, clock=clock)
    costs = tiers.chooser.costs
    for n in range(1, 31):  # a line of slope 10 ms a token outweighs this machine's steps so far
        costs.note_prefill(BLOCK * n, BLOCK * n * SECONDS_PER_TOKEN)
    return engine, clock


def _step_until(engine, done) -> None:
    while not done():
        assert engine.step() == []  # nothing else to run: nothing computed


def test_a_trickling_tier_gives_the_blocks_that_arrived_and_the_rest_is_computed(folder, reference, tmp_path):
    (prompt,) = prompts(41, 1)
    engine, clock = _engine(folder, tmp_path, [prompt])
    costs = engine.kv_tiers.chooser.costs
    wait = costs.load_wait([("disk", LOADABLE // BLOCK)], block_size=BLOCK, cap_s=FIXED_DEADLINE)
    first = wait.pieces[0][1]
    assert first < LOADABLE // BLOCK  # read in pieces: a trickle can give its first blocks
    trickle = Trickle(engine.kv_tiers.worker.stores["disk"], free=1)
    try:
        rid = engine.add_request(prompt, PARAMS)
        _step_until(engine, lambda: trickle.calls == 2)  # the first piece is in; the second is held
        clock.now = wait.deadline_s(first) * 0.99
        engine.step()
        assert engine.scheduler.num_loading == 1  # before the deadline the compute of its blocks gives: waits
        clock.now = wait.deadline_s(first) * 1.01  # far below the fixed deadline
        out = engine.run_until_done([rid])[rid]
        assert tuple(out.output_token_ids) == reference(prompt)
        assert out.cached_tokens_by_tier == {"gpu": 0, "disk": first * BLOCK}  # the arrived prefix, used
        figures = engine.kv_tier_figures()["disk"]
        abandoned = LOADABLE // BLOCK - first
        assert (figures["deadline_misses"], figures["kept_at_deadline"]) == (1, first)
        assert figures["timed_out_loads"] == figures["failed_loads"] == abandoned
        measured = costs.figures()["tiers"]["disk"]
        assert (measured["deadline_misses"], measured["blocks_abandoned"]) == (1, abandoned)
        engine.manager.check_invariants()  # no block whose KV did not arrive is cached under its hash
    finally:
        trickle.release.set()
    engine.kv_tiers.close()


def test_a_stalled_tier_costs_its_request_one_piece_of_compute_and_the_next_request_computes_at_once(
    folder, reference, tmp_path
):
    stalled, later, other = prompts(42, 3)
    engine, clock = _engine(folder, tmp_path, [stalled, later])
    chooser = engine.kv_tiers.chooser
    wait = chooser.costs.load_wait([("disk", LOADABLE // BLOCK)], block_size=BLOCK, cap_s=FIXED_DEADLINE)
    trickle = Trickle(engine.kv_tiers.worker.stores["disk"], free=0)  # never answers
    try:
        rid = engine.add_request(stalled, PARAMS)
        _step_until(engine, lambda: trickle.calls == 1)
        free = engine.add_request(other, PARAMS)  # in no tier: it runs while the stalled load waits
        assert tuple(engine.run_until_done([free])[free].output_token_ids) == reference(other)
        assert engine.scheduler.num_loading == 1
        clock.now = wait.deadline_s(0) * 1.01  # one piece's compute, not the fixed deadline
        out = engine.run_until_done([rid])[rid]
        assert tuple(out.output_token_ids) == reference(stalled)
        assert out.cached_tokens_by_tier.get("disk", 0) == 0
        assert engine.kv_tier_figures()["disk"]["deadline_misses"] == 1
        engine.manager.check_invariants()
        # The miss taught the measurement: the next request computes at once, the store not even asked.
        submitted = engine.kv_tiers.worker.threads.figures.loads_submitted
        skipped = chooser.lookups["skipped"]
        nxt = engine.add_request(later, PARAMS)
        out = engine.run_until_done([nxt])[nxt]
        assert tuple(out.output_token_ids) == reference(later)
        assert out.cached_tokens_by_tier.get("disk", 0) == 0
        assert chooser.lookups["skipped"] == skipped + 1  # a tier that owes a piece could not be loaded from
        assert engine.kv_tiers.worker.threads.figures.loads_submitted == submitted
        assert trickle.calls == 1  # the store was not read again
        engine.manager.check_invariants()
    finally:
        trickle.release.set()
    engine.kv_tiers.close()
