"""One request cannot hurt the others: a hostile temperature, NaN logits, a forward pass that fails on one chunk.

Honest requests in the same steps produce the tokens they produce alone, the
prefix cache keeps their blocks, the failing request finishes with a
``RequestFailed`` naming it and the cause, the bookkeeping holds and every
block comes back.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from kvpool.engine.llm import LLM
from kvpool.engine.sampling import SamplingParams
from kvpool.errors import RequestFailed
from kvpool.scheduler import FinishReason
from tests.engine.tiny_models import build_model, random_prompt, reference_tokens, save_model

pytestmark = pytest.mark.engine

BLOCK = 4
BLOCK_BYTES = 2 * 2 * BLOCK * 2 * 16 * 4  # layers x (K, V) x tokens x KV heads x head dim x float32


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any]:
    model = build_model("llama")
    return save_model(model, tmp_path_factory.mktemp("llama"), tokenizer=True), model


@pytest.fixture
def llm(tiny: tuple[Any, Any]) -> Iterator[LLM]:
    folder, _ = tiny
    llm = LLM(
        folder,
        block_size=BLOCK,
        kv_cache_memory=96 * BLOCK_BYTES,
        max_model_len=64,
        max_num_batched_tokens=64,
        max_num_seqs=4,
        threads=1,
        log=lambda line: None,
    )
    yield llm
    engine = llm.engine
    assert not engine.has_unfinished_requests()
    assert engine.manager.num_free_blocks == engine.num_blocks - 1  # no block owned
    engine.manager.check_invariants()


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True)


HONEST = {"h0": random_prompt(9, seed=10), "h1": random_prompt(11, seed=11)}


def _check_honest(model: Any, done: dict[str, Any], max_tokens: int) -> None:
    for rid, prompt in HONEST.items():
        assert done[rid].error is None and done[rid].finish_reason is FinishReason.LENGTH
        assert list(done[rid].output_token_ids) == reference_tokens(model, prompt, max_tokens), rid


def _cached(llm: LLM, prompt: list[int]) -> int:
    [out] = llm.generate([prompt], greedy(1))
    return out.num_cached_tokens


def test_a_tiny_temperature_is_greedy_beside_honest_requests(llm: LLM, tiny: tuple[Any, Any]) -> None:
    _, model = tiny
    hostile = random_prompt(7, seed=12)
    engine = llm.engine
    ids = engine.add_requests(
        [*HONEST.values(), hostile],
        [greedy(4), greedy(4), SamplingParams(max_tokens=4, temperature=1e-300, ignore_eos=True)],
        request_ids=[*HONEST, "hostile"],
    )
    done = engine.run_until_done(ids)
    _check_honest(model, done, 4)
    assert list(done["hostile"].output_token_ids) == reference_tokens(model, hostile, 4)  # greedy
    assert _cached(llm, HONEST["h0"]) == 8  # two full prompt blocks kept in the prefix cache


def test_a_row_of_nan_logits_fails_only_its_request(
    llm: LLM, tiny: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    _, model = tiny
    engine = llm.engine
    real = engine.runner.execute

    def poisoned(chunks: Any) -> torch.Tensor:
        logits = real(chunks).clone()  # an inference tensor: written only as a copy
        sampled = [c.request_id for c in chunks if c.sample]
        if "nan" in sampled:
            logits[sampled.index("nan")] = float("nan")
        return logits

    monkeypatch.setattr(engine.runner, "execute", poisoned)
    bad = random_prompt(9, seed=13)
    ids = engine.add_requests([*HONEST.values(), bad], [greedy(4)] * 3, request_ids=[*HONEST, "nan"])
    done = engine.run_until_done(ids)
    _check_honest(model, done, 4)
    failed = done["nan"]
    assert failed.finish_reason is FinishReason.ERROR and failed.output_token_ids == ()
    assert isinstance(failed.error, RequestFailed) and failed.error.request_id == "nan"
    assert "cannot be sampled" in str(failed.error) and "NaN" in str(failed.error)
    monkeypatch.undo()
    assert _cached(llm, bad) == 8  # its forward pass wrote its K/V: its blocks stay cached


def test_a_forward_pass_failing_on_one_chunk_fails_only_that_request(
    llm: LLM, tiny: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    _, model = tiny
    engine = llm.engine
    real = engine.runner.execute
    calls: list[int] = []

    def faulty(chunks: Any) -> torch.Tensor:
        calls.append(len(chunks))
        if any(c.request_id == "bad" for c in chunks):
            raise RuntimeError("an injected fault")
        return real(chunks)

    monkeypatch.setattr(engine.runner, "execute", faulty)
    # It shares h0's first two blocks (a prefix hit in the same step) and fills a third of its own.
    bad = HONEST["h0"][:8] + random_prompt(5, seed=14)
    ids = engine.add_requests([*HONEST.values(), bad], [greedy(4)] * 3, request_ids=[*HONEST, "bad"])
    first = engine.step()
    assert calls[:4] == [3, 1, 1, 1]  # the batch, then each chunk alone
    [failure] = [d for d in first if d.request_id == "bad"]
    assert failure.finished and failure.token_ids == () and failure.output is not None
    error = failure.output.error
    assert isinstance(error, RequestFailed) and error.request_id == "bad" and "an injected fault" in error.cause
    assert failure.output.finish_reason is FinishReason.ERROR
    engine.manager.check_invariants()
    done = engine.run_until_done([rid for rid in ids if rid != "bad"])
    _check_honest(model, done, 4)
    monkeypatch.undo()
    assert _cached(llm, bad) == 8  # h0's blocks stay cached; the block "bad" never wrote left the cache
    assert _cached(llm, HONEST["h1"]) == 8


def test_an_interrupted_step_fails_its_requests_and_keeps_earlier_blocks_cached(
    llm: LLM, tiny: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = llm.engine
    [_] = llm.generate([HONEST["h0"]], greedy(2))  # its blocks are cached by a step that succeeded

    def interrupted(chunks: Any) -> torch.Tensor:
        raise KeyboardInterrupt

    monkeypatch.setattr(engine.runner, "execute", interrupted)
    rid = engine.add_request(HONEST["h1"], greedy(2))
    with pytest.raises(KeyboardInterrupt):
        engine.step()
    assert not engine.has_unfinished_requests()
    engine.manager.check_invariants()
    monkeypatch.undo()
    assert rid not in engine._live
    assert _cached(llm, HONEST["h0"]) == 8  # the prefix cache was not emptied
    assert _cached(llm, HONEST["h1"]) == 0  # the interrupted request's blocks were never written
