"""Every public call of the engine is atomic: a refused call queues nothing, changes nothing, and serving goes on.

The engine is put in the middle of its work (one request decoding, one in
chunked prefill, one waiting), a bad call is made, a snapshot of everything
observable (the engine's requests and next automatic ID, the scheduler's
queues and requests, the manager's blocks, free-queue order and invariants,
the runner's step count) is compared with the one before, and then every
request runs to the end with transformers' own greedy tokens.
"""

from __future__ import annotations

import math

import pytest
import torch

from kvpool.engine.llm import LLM
from kvpool.engine.llm_engine import LLMEngine
from kvpool.engine.sampling import SamplingParams
from kvpool.errors import ConfigError, InvalidTokenError, KVPoolError, RequestFailed, RequestStateError
from kvpool.scheduler import FinishReason
from tests.engine.tiny_models import VOCAB, build_model, random_prompt, reference_tokens, save_model
from tests.test_scheduler_atomic import scheduler_snapshot

pytestmark = pytest.mark.engine

BLOCK = 4
BLOCK_BYTES = 2 * 2 * BLOCK * 2 * 16 * 4  # layers x (K, V) x tokens x KV heads x head dim x float32
MAX_LEN = 32
GOOD = random_prompt(6, seed=1)
CONVERSATION = [{"role": "user", "content": "w1 w2 w3"}]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    model = build_model("llama")
    return save_model(model, tmp_path_factory.mktemp("llama"), tokenizer=True), model


@pytest.fixture(scope="module")
def llm(tiny):
    folder, _ = tiny
    return LLM(
        folder,
        block_size=BLOCK,
        kv_cache_memory=64 * BLOCK_BYTES,
        max_model_len=MAX_LEN,
        max_num_batched_tokens=8,
        max_num_seqs=2,
        threads=1,
        log=lambda line: None,
    )


_REFERENCES: dict[tuple, list[int]] = {}


def reference(model, prompt: list[int], max_tokens: int) -> list[int]:
    key = (tuple(prompt), max_tokens)
    if key not in _REFERENCES:
        _REFERENCES[key] = reference_tokens(model, prompt, max_tokens)
    return _REFERENCES[key]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True)


def engine_snapshot(engine: LLMEngine) -> tuple:
    return (
        sorted(engine._live),
        engine._next_id,
        engine.num_unfinished_requests,
        engine.runner.num_steps,
        scheduler_snapshot(engine.scheduler),
    )


@pytest.fixture
def busy(llm, tiny):
    """The engine mid-work: a decode, a chunked prefill and a waiting request.

    Yields the LLM; afterwards checks that every request still finishes with
    the reference tokens and that every block came back.
    """
    _, model = tiny
    engine = llm.engine
    prompts = {"dec": random_prompt(5, seed=2), "pre": random_prompt(13, seed=3), "wait": random_prompt(4, seed=4)}
    for rid, prompt in prompts.items():
        engine.add_request(prompt, greedy(3), request_id=rid)
    engine.step()
    engine.step()
    assert engine.scheduler.running_ids() == ["dec", "pre"] and engine.scheduler.waiting_ids() == ["wait"]
    yield llm
    done = engine.run_until_done(list(prompts))
    for rid, prompt in prompts.items():
        assert list(done[rid].output_token_ids) == reference(model, prompt, 3), rid
    assert not engine.has_unfinished_requests()
    assert engine.manager.num_free_blocks == engine.num_blocks - 1
    engine.manager.check_invariants()


def refused(engine: LLMEngine, call, error=KVPoolError, match: str | None = None) -> None:
    before = engine_snapshot(engine)
    with pytest.raises(error, match=match):
        call()
    assert engine_snapshot(engine) == before


# -- generate and chat: a bad prompt or option anywhere in the batch --------------------------


@pytest.mark.parametrize(
    ("prompts", "error", "match"),
    [
        ([GOOD, [5, -1]], InvalidTokenError, r"request '\d+': prompt token_ids\[1\] = -1"),
        ([GOOD, [5, True]], InvalidTokenError, r"\[1\] = True"),
        ([GOOD, [5, 2.5]], InvalidTokenError, "2.5"),
        ([GOOD, [5, VOCAB]], InvalidTokenError, rf"\[1\] = {VOCAB} is not a token ID of this model"),
        ([GOOD, [5, 2**32]], InvalidTokenError, "4294967296"),
        ([GOOD, []], RequestStateError, "is empty"),
        ([GOOD, ""], RequestStateError, "the prompt is empty"),
        ([GOOD, b"w1"], RequestStateError, "b'w1'"),
        ([GOOD, 7], RequestStateError, "got 7"),
        ([GOOD, None], RequestStateError, "got None"),
        ([GOOD, random_prompt(MAX_LEN, seed=5)], RequestStateError, f"{MAX_LEN} tokens .* max_model_len={MAX_LEN}"),
        (3.5, RequestStateError, "3.5"),
        ({"w1": 1}, RequestStateError, "w1"),
    ],
    ids=lambda v: repr(v)[:40],
)
def test_generate_refuses_a_batch_with_a_bad_prompt(busy, prompts, error, match):
    refused(busy.engine, lambda: busy.generate(prompts, greedy(3)), error, match)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"sampling_params": "greedy"}, ConfigError, "sampling_params must be a SamplingParams, got 'greedy'"),
        ({"sampling_params": [greedy(3), {"max_tokens": 3}]}, ConfigError, "max_tokens"),
        ({"sampling_params": [greedy(3)]}, ConfigError, "sampling_params has 1 entries for 2 prompts"),
        ({"cache_salt": ""}, RequestStateError, "cache_salt must be None or a non-empty string.*''"),
        ({"cache_salt": 5}, RequestStateError, "cache_salt .* got 5"),
        ({"cache_salt": ["a"]}, ConfigError, "cache_salt has 1 entries for 2 prompts"),
        ({"cache_salt": ["a", b"b"]}, RequestStateError, "b'b'"),
    ],
    ids=lambda v: repr(v)[:40],
)
def test_generate_refuses_bad_options(busy, kwargs, error, match):
    refused(busy.engine, lambda: busy.generate([GOOD, random_prompt(3, seed=6)], **kwargs), error, match)


@pytest.mark.parametrize(
    ("messages", "error", "match"),
    [
        ([CONVERSATION, []], RequestStateError, "at least one message"),
        ([CONVERSATION, [{"role": "user"}]], RequestStateError, r"message 0 .* \{'role': 'user'\}"),
        ([CONVERSATION, [{"role": "user", "content": 5}]], RequestStateError, "'content': 5"),
        ([CONVERSATION, "w1 w2"], RequestStateError, "'w1 w2'"),
        ([CONVERSATION, {"role": "user", "content": "w1"}], RequestStateError, "list of messages"),
        (42, RequestStateError, "got 42"),
        ("w1 w2", RequestStateError, "'w1 w2'"),
    ],
    ids=lambda v: repr(v)[:40],
)
def test_chat_refuses_a_batch_with_a_bad_conversation(busy, messages, error, match):
    refused(busy.engine, lambda: busy.chat(messages, greedy(3)), error, match)


def test_chat_refuses_bad_options(busy):
    refused(busy.engine, lambda: busy.chat(CONVERSATION, "greedy"), ConfigError, "'greedy'")
    refused(busy.engine, lambda: busy.chat([CONVERSATION, CONVERSATION], cache_salt=[None]), ConfigError, "1 entries")


def test_chat_and_text_prompts_run_after_refused_batches(llm, tiny):
    _, model = tiny
    refused(llm.engine, lambda: llm.chat([CONVERSATION, [{"role": "user"}]]), RequestStateError)
    refused(llm.engine, lambda: llm.generate(["w4 w5", ""]), RequestStateError)
    [chatted] = llm.chat(CONVERSATION, greedy(3))
    tokens = llm.engine.encode(chatted.prompt, add_special_tokens=False)
    assert list(chatted.output_token_ids) == reference_tokens(model, tokens, 3)
    [text] = llm.generate("w4 w5 w6", greedy(2))
    assert text.prompt == "w4 w5 w6"
    assert list(text.output_token_ids) == reference_tokens(model, llm.engine.encode("w4 w5 w6"), 2)


# -- SamplingParams ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"max_tokens": True}, ConfigError, "max_tokens .* True"),
        ({"max_tokens": 1.5}, ConfigError, "1.5"),
        ({"max_tokens": 0}, ConfigError, "got 0"),
        ({"temperature": "0"}, ConfigError, "temperature .* '0'"),
        ({"temperature": True}, ConfigError, "temperature .* True"),
        ({"temperature": math.nan}, ConfigError, "nan"),
        ({"temperature": -1.0}, ConfigError, "-1.0"),
        ({"top_p": 0}, ConfigError, "top_p .* 0"),
        ({"top_p": True}, ConfigError, "top_p .* True"),
        ({"top_p": math.nan}, ConfigError, "nan"),
        ({"top_k": 1.5}, ConfigError, "top_k .* 1.5"),
        ({"top_k": False}, ConfigError, "top_k .* False"),
        ({"seed": True}, ConfigError, "seed .* True"),
        ({"seed": -1}, ConfigError, "seed .* -1"),
        ({"seed": 2**63}, ConfigError, str(2**63)),
        ({"stop_token_ids": [True]}, InvalidTokenError, "True"),
        ({"stop_token_ids": [-1]}, InvalidTokenError, "-1"),
        ({"stop_token_ids": "ab"}, InvalidTokenError, "str"),
        ({"stop_token_ids": {1: 2}}, InvalidTokenError, r"\{1: 2\}"),
        ({"ignore_eos": "false"}, ConfigError, "ignore_eos .* 'false'"),
        ({"ignore_eos": 1}, ConfigError, "ignore_eos .* 1"),
    ],
)
def test_sampling_params_are_strict(kwargs, error, match):
    with pytest.raises(error, match=match):
        SamplingParams(**kwargs)


# -- LLMEngine's own methods -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda e: e.add_request(GOOD, request_id="dec"), RequestStateError, "'dec' is already running"),
        (lambda e: e.add_request(GOOD, request_id=5), RequestStateError, "request_id .* got 5"),
        (lambda e: e.add_request(GOOD, request_id=""), RequestStateError, "got ''"),
        (lambda e: e.add_request(GOOD, "greedy"), ConfigError, "'greedy'"),
        (lambda e: e.add_request("w1", add_special_tokens="false"), ConfigError, "add_special_tokens .* 'false'"),
        (lambda e: e.add_request([1, True]), InvalidTokenError, "True"),
        (lambda e: e.add_requests("w1 w2"), RequestStateError, "prompts must be a list"),
        (lambda e: e.add_requests([GOOD, GOOD], request_ids=["x", "x"]), RequestStateError, "'x' appears twice"),
        (lambda e: e.add_requests([GOOD, GOOD], request_ids=["x"]), ConfigError, "request_ids has 1 entries"),
        (lambda e: e.add_requests([GOOD], cache_salts="salt"), ConfigError, "cache_salts .* 'salt'"),
        (lambda e: e.add_requests([GOOD, [VOCAB]]), InvalidTokenError, str(VOCAB)),
        (lambda e: e.abort(5), RequestStateError, "got 5"),
        (lambda e: e.abort(["dec"]), RequestStateError, r"\['dec'\]"),
        (lambda e: e.run_until_done("dec"), RequestStateError, "'dec'"),
        (lambda e: e.run_until_done(["ghost"]), RequestStateError, "'ghost' is not running"),
        (lambda e: e.run_until_done(["dec", 5]), RequestStateError, "5 is not running"),
        (lambda e: e.encode(5), RequestStateError, "got 5"),
        (lambda e: e.encode("w1", add_special_tokens=1), ConfigError, "add_special_tokens .* 1"),
        (lambda e: e.decode([-1]), InvalidTokenError, "-1"),
        (lambda e: e.decode([VOCAB]), InvalidTokenError, str(VOCAB)),
        (lambda e: e.decode("w1"), InvalidTokenError, "str"),
        (lambda e: e.render_chat("w1"), RequestStateError, "'w1'"),
        (lambda e: e.render_chat(CONVERSATION, add_generation_prompt="yes"), ConfigError, "'yes'"),
    ],
    ids=lambda v: v if isinstance(v, str) else getattr(v, "__name__", None),
)
def test_engine_methods_refuse_bad_arguments(busy, call, error, match):
    refused(busy.engine, lambda: call(busy.engine), error, match)


def test_abort_of_an_unknown_id_changes_nothing_and_a_real_abort_frees(busy):
    engine = busy.engine
    before = engine_snapshot(engine)
    assert engine.abort("ghost") is False
    assert engine_snapshot(engine) == before
    rid = engine.add_request(GOOD, greedy(2))
    assert engine.abort(rid) is True and engine.abort(rid) is False


def test_a_refused_batch_uses_no_automatic_id(llm):
    engine = llm.engine
    first = engine.add_request(GOOD, greedy(2))
    refused(engine, lambda: llm.generate([GOOD, GOOD, [-5]], greedy(2)), InvalidTokenError)
    second = engine.add_request(GOOD, greedy(2))
    assert int(second) == int(first) + 1
    engine.run_until_done([first, second])


# -- engine options -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"enable_prefix_caching": "false"}, "enable_prefix_caching must be a bool, got 'false'"),
        ({"enable_prefix_caching": 0}, "enable_prefix_caching .* 0"),
        ({"block_size": True}, "block_size .* True"),
        ({"block_size": 4.0}, "block_size .* 4.0"),
        ({"max_num_seqs": 2.0}, "max_num_seqs .* 2.0"),
        ({"max_num_batched_tokens": "8"}, "max_num_batched_tokens .* '8'"),
        ({"max_model_len": True}, "max_model_len .* True"),
        ({"gpu_memory_utilization": True}, "gpu_memory_utilization .* True"),
        ({"gpu_memory_utilization": "0.5"}, "'0.5'"),
        ({"kv_cache_memory": 1.5}, "kv_cache_memory .* 1.5"),
        ({"kv_cache_memory": True}, "kv_cache_memory .* True"),
        ({"dtype": 5}, "dtype .* 5"),
        ({"device": 0}, "device .* 0"),
        ({"log": "quiet"}, "log must be callable or None, got 'quiet'"),
    ],
)
def test_engine_options_are_strict(tiny, kwargs, match):
    folder, _ = tiny
    options = dict(block_size=BLOCK, kv_cache_memory=64 * BLOCK_BYTES, log=lambda line: None)
    options.update(kwargs)
    with pytest.raises(ConfigError, match=match):
        LLM(folder, **options)


def test_a_failed_step_fails_its_requests_and_the_engine_serves_on(busy, monkeypatch):
    """A forward pass that fails for every chunk fails the step's requests, not the waiting one; serving goes on."""
    engine = busy.engine

    def broken(chunks):
        raise RuntimeError("device lost")

    monkeypatch.setattr(engine.runner, "execute", broken)
    deltas = engine.step()
    assert sorted(d.request_id for d in deltas) == ["dec", "pre"]
    for delta in deltas:
        assert delta.finished and delta.token_ids == () and delta.output is not None
        assert delta.output.finish_reason is FinishReason.ERROR
        assert isinstance(delta.output.error, RequestFailed) and "device lost" in str(delta.output.error)
        assert delta.output.error.request_id == delta.request_id
    assert engine.scheduler.waiting_ids() == ["wait"] and engine.scheduler.running_ids() == []
    engine.manager.check_invariants()
    monkeypatch.undo()
    for rid, seed in (("dec", 2), ("pre", 3)):  # requeue them for the fixture's final check
        engine.add_request(random_prompt({2: 5, 3: 13, 4: 4}[seed], seed=seed), greedy(3), request_id=rid)
    assert torch.isfinite(engine.kv_caches.key_caches[0]).all()
