"""Tier loads off the step, through the whole engine: a request whose blocks are loading waits, the batch steps on.

The disk tier's store is gated by an Event: while the gate is shut, the request
that loads from it stays WAITING_FOR_KV and every other request runs to the
end; its own tokens, once the gate opens (or its deadline passes), are the
ones an engine computing everything samples. Every wait is on an event or a
step, never on a length of time.
"""

# ruff: noqa: F811  # the fixtures folder and reference are test_tiers.py's, imported by name

from __future__ import annotations

import threading

import pytest

from kvpool.engine.llm_engine import LLMEngine
from kvpool.errors import ConfigError
from tests.engine.test_tiers import (  # noqa: F401
    LOADABLE,
    PARAMS,
    TIERS_AS_TESTED,
    TINY_POOL,
    folder,
    prompts,
    reference,
)

pytestmark = [pytest.mark.engine, pytest.mark.slow]


class Gate:
    """Holds every fetch of one store until opened; counts the fetches that reached it."""

    def __init__(self, store) -> None:
        self.store = store
        self.inner = store.get_many_into
        self.open = threading.Event()
        self.reached = threading.Event()
        store.get_many_into = self._get_many_into

    def _get_many_into(self, keys, out):
        self.reached.set()
        self.open.wait(60)  # a test that fails opens it; the 60 s only bound a broken one
        return self.inner(keys, out)


def step_until_fetching(engine: LLMEngine, gate: Gate) -> None:
    """Step (each step waits for the tiers' lookup or fetch a little) until the gated fetch has begun."""
    while not gate.reached.is_set():
        assert engine.step() == []  # nothing else to run: nothing computed
    assert engine.scheduler.num_loading == 1


def _write_then_gate(folder, tmp_path, prompt, **options):
    """An engine whose disk tier holds ``prompt``'s blocks, with an empty pool and its store gated."""
    engine = LLMEngine(folder, **TINY_POOL, kv_tiers=[f"disk:{tmp_path}:1MiB"], **TIERS_AS_TESTED, log=None, **options)
    rid = engine.add_request(prompt, PARAMS)
    engine.run_until_done([rid])
    assert engine.kv_tiers.flush_saves(timeout=60)  # saves are queued: a lookup before they land finds fewer blocks
    assert engine.manager.reset_prefix_cache()
    return engine, Gate(engine.kv_tiers.worker.stores["disk"])


def test_a_request_loading_from_a_stalled_tier_waits_while_others_finish(folder, reference, tmp_path):
    loaded, other = prompts(21, 2)
    engine, gate = _write_then_gate(folder, tmp_path, loaded, kv_tier_load_deadline=600.0)
    try:
        waiting = engine.add_request(loaded, PARAMS)
        step_until_fetching(engine, gate)  # looked up off the step, then admitted to load: nothing computed
        assert engine.scheduler.num_loading == 1
        free = engine.add_request(other, PARAMS)
        out = engine.run_until_done([free])[free]  # steps on while the tier stalls
        assert tuple(out.output_token_ids) == reference(other)
        assert engine.scheduler.num_loading == 1 and engine.scheduler.request(waiting).num_output_tokens == 0
        engine.manager.check_invariants()
    finally:
        gate.open.set()
    done = engine.run_until_done([waiting])[waiting]
    assert tuple(done.output_token_ids) == reference(loaded)
    assert done.cached_tokens_by_tier == {"gpu": 0, "disk": LOADABLE}
    engine.kv_tiers.close()


def test_a_load_past_its_deadline_is_computed_and_counted(folder, reference, tmp_path):
    (prompt,) = prompts(22, 1)
    engine, gate = _write_then_gate(folder, tmp_path, prompt, kv_tier_load_deadline=0.05)
    try:
        rid = engine.add_request(prompt, PARAMS)
        out = engine.run_until_done([rid])[rid]  # the stalled fetch never returns in time
        assert tuple(out.output_token_ids) == reference(prompt)
        assert out.cached_tokens_by_tier.get("disk", 0) == 0  # the promised disk tokens were computed
        figures = engine.kv_tier_figures()["disk"]
        assert figures["timed_out_loads"] == LOADABLE // TINY_POOL["block_size"]
        assert figures["failed_loads"] == figures["timed_out_loads"]
        engine.manager.check_invariants()
    finally:
        gate.open.set()
    engine.kv_tiers.close()


def test_an_aborted_loading_request_gives_its_blocks_back_only_when_its_fetch_ends(folder, tmp_path):
    (prompt,) = prompts(23, 1)
    engine, gate = _write_then_gate(folder, tmp_path, prompt, kv_tier_load_deadline=600.0)
    manager = engine.manager
    free_before = manager.num_free_blocks
    try:
        rid = engine.add_request(prompt, PARAMS)
        step_until_fetching(engine, gate)
        assert engine.abort(rid)
        assert not engine.has_unfinished_requests()
        assert manager.num_free_blocks < free_before  # the fetch may still write them: held
    finally:
        gate.open.set()
    while engine.kv_tiers.worker.num_fetching:
        engine.kv_tiers.wait_for_loads(1.0)
        engine.kv_tiers.poll(engine.scheduler)
    assert manager.num_free_blocks == free_before
    manager.check_invariants()
    engine.kv_tiers.close()


@pytest.mark.parametrize("deadline", [0, -1.0, float("nan"), float("inf"), True, "2s"])
def test_a_bad_load_deadline_is_refused_by_name(folder, deadline):
    with pytest.raises(ConfigError, match="kv_tier_load_deadline"):
        LLMEngine(folder, **TINY_POOL, kv_tier_load_deadline=deadline, log=None)


class LookupGate:
    """Holds every lookup of one store until opened."""

    def __init__(self, store) -> None:
        self.inner = store.contains_prefix
        self.open = threading.Event()
        self.reached = threading.Event()
        store.contains_prefix = self._contains_prefix

    def _contains_prefix(self, keys):
        self.reached.set()
        self.open.wait(60)
        return self.inner(keys)


def test_a_stalled_lookup_holds_only_its_request_and_misses_at_the_deadline(folder, reference, tmp_path):
    stalled, other = prompts(24, 2)
    engine, _ = _write_then_gate(folder, tmp_path, stalled, kv_tier_load_deadline=0.05)
    gate = LookupGate(engine.kv_tiers.worker.stores["disk"])
    try:
        first = engine.add_request(stalled, PARAMS)
        while not gate.reached.is_set():
            engine.step()
        second = engine.add_request(other, PARAMS)  # its own lookup waits behind the stalled one, then misses
        outs = engine.run_until_done([first, second])
        assert tuple(outs[first].output_token_ids) == reference(stalled)
        assert tuple(outs[second].output_token_ids) == reference(other)
        assert outs[first].cached_tokens_by_tier.get("disk", 0) == 0  # the deadline passed: computed
        engine.manager.check_invariants()
    finally:
        gate.open.set()
    engine.kv_tiers.close()
