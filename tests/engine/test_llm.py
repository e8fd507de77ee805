"""The engine end to end (LLM + Scheduler + KVCacheManager + ModelRunner) against transformers' generate.

Greedy decoding through the whole stack must give exactly the tokens of
transformers' own ``generate``, whatever the scheduler does on the way:
batching, chunked prefill, preemption with recompute, prefix-cache hits.
"""

from __future__ import annotations

import pytest

from kvpool.engine.llm import LLM
from kvpool.engine.sampling import SamplingParams
from kvpool.errors import ConfigError, InvalidTokenError, RequestStateError
from kvpool.groups import manager_class_for
from kvpool.scheduler import FinishReason
from kvpool.specs import KVDtype, SlidingWindowSpec
from tests.engine.tiny_models import VOCAB, build_model, random_prompt, reference_tokens, save_model

pytestmark = pytest.mark.engine

BLOCK = 4
BLOCK_BYTES = 2 * 2 * BLOCK * 2 * 16 * 4  # layers x (K, V) x tokens x KV heads x head dim x float32


def _sliding_window_supported() -> bool:
    spec = SlidingWindowSpec(block_size=BLOCK, num_kv_heads=2, head_dim=16, dtype=KVDtype.FP32, sliding_window=8)
    try:
        manager_class_for(spec)
    except ConfigError:
        return False
    return True


needs_sliding_window = pytest.mark.skipif(
    not _sliding_window_supported(), reason="kvpool.groups has no sliding-window group manager yet"
)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """``tiny(kind)`` -> (folder, in-memory model with the same weights), built once per kind."""
    built: dict[str, tuple] = {}

    def get(kind: str):
        if kind not in built:
            model = build_model(kind)
            folder = save_model(model, tmp_path_factory.mktemp(kind))
            built[kind] = (folder, model)
        return built[kind]

    return get


def make_llm(folder, **kwargs) -> LLM:
    options = dict(block_size=BLOCK, kv_cache_memory=256 * BLOCK_BYTES, threads=1, log=lambda line: None)
    options.update(kwargs)
    return LLM(folder, **options)


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True)


def assert_matches_reference(model, prompts, outputs, max_tokens):
    assert len(outputs) == len(prompts)
    for prompt, out in zip(prompts, outputs):
        assert out.prompt_token_ids == tuple(prompt)
        assert list(out.output_token_ids) == reference_tokens(model, prompt, max_tokens), out.request_id
        assert out.finish_reason is FinishReason.LENGTH


# -- greedy equality through the whole stack -------------------------------------------------


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_batch_of_different_lengths_matches_generate(kind, tiny):
    folder, model = tiny(kind)
    llm = make_llm(folder)
    lengths = [1, 5, 9, 16, 23]
    prompts = [random_prompt(n, seed=10 + i) for i, n in enumerate(lengths)]
    outputs = llm.generate(prompts, greedy(10))
    assert_matches_reference(model, prompts, outputs, 10)
    runner = llm.engine.runner
    assert runner.num_steps == 10  # every prompt fits one step; then nine batched decode steps
    assert runner.num_computed_tokens == sum(lengths) + 5 * 9
    for out in outputs:
        assert out.num_computed_tokens == out.num_prompt_tokens + 9
        assert out.num_cached_tokens == 0 and out.num_preemptions == 0
        assert out.time_to_first_token is not None and 0 <= out.queue_time <= out.time_to_first_token <= out.latency


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_chunked_prefill_matches_generate(kind, tiny):
    folder, model = tiny(kind)
    llm = make_llm(folder, max_num_batched_tokens=6)
    prompts = [random_prompt(n, seed=20 + i) for i, n in enumerate([22, 17, 9, 3])]
    outputs = llm.generate(prompts, greedy(8))
    assert_matches_reference(model, prompts, outputs, 8)
    runner = llm.engine.runner
    # 51 prompt tokens at 6 per step need at least 9 steps before the decode steps.
    assert runner.num_steps >= 9 + 7
    assert runner.num_computed_tokens == sum(len(p) + 7 for p in prompts)


@pytest.mark.parametrize("caching", [True, False])
def test_preemption_and_recompute_mid_decode_match_generate(caching, tiny):
    folder, model = tiny("llama")
    # 12 blocks of 4 tokens (11 usable): four requests that each grow to 30 tokens cannot all stay.
    llm = make_llm(folder, kv_cache_memory=12 * BLOCK_BYTES, max_model_len=40, enable_prefix_caching=caching)
    assert llm.engine.num_blocks == 12
    prompts = [random_prompt(10, seed=30 + i) for i in range(4)]
    outputs = llm.generate(prompts, greedy(20))
    assert_matches_reference(model, prompts, outputs, 20)
    assert sum(out.num_preemptions for out in outputs) > 0
    preempted = [out for out in outputs if out.num_preemptions]
    if not caching:  # nothing to hit: a preempted request computes its tokens again
        assert all(out.num_computed_tokens > out.num_prompt_tokens + 19 for out in preempted)
    assert llm.engine.scheduler.num_preemptions == sum(out.num_preemptions for out in outputs)


def test_prefix_cache_hit_is_not_recomputed(tiny):
    folder, model = tiny("llama")
    llm = make_llm(folder)
    runner = llm.engine.runner
    shared = random_prompt(6 * BLOCK, seed=40)
    first = shared + random_prompt(5, seed=41)
    [a] = llm.generate(first, greedy(6))
    assert a.num_cached_tokens == 0

    second = shared + random_prompt(3, seed=42)
    before = runner.num_computed_tokens
    [b] = llm.generate(second, greedy(6))
    assert b.num_cached_tokens == len(shared)  # the six full shared blocks
    assert b.num_computed_tokens == 3 + 5  # the tail, then one input per decode step
    assert runner.num_computed_tokens - before == 3 + 5
    assert list(b.output_token_ids) == reference_tokens(model, second, 6)

    # The same prompt under another salt shares nothing, and still decodes the same.
    before = runner.num_computed_tokens
    [c] = llm.generate(second, greedy(6), cache_salt="tenant-b")
    assert c.num_cached_tokens == 0
    assert runner.num_computed_tokens - before == len(second) + 5
    assert c.output_token_ids == b.output_token_ids


def test_prefix_caching_off_recomputes_everything(tiny):
    folder, _ = tiny("llama")
    llm = make_llm(folder, enable_prefix_caching=False)
    prompt = random_prompt(20, seed=43)
    outs = [llm.generate(prompt, greedy(3))[0] for _ in range(2)]
    assert [o.num_cached_tokens for o in outs] == [0, 0]
    assert [o.num_computed_tokens for o in outs] == [22, 22]
    assert outs[0].output_token_ids == outs[1].output_token_ids


# -- stopping and sampling -----------------------------------------------------------------


def test_stop_token_and_eos_stop_like_generate(tiny, tmp_path):
    folder, model = tiny("llama")
    prompt = random_prompt(7, seed=50)
    reference = reference_tokens(model, prompt, 12)
    k = next(i for i in range(2, 12) if reference[i] not in reference[:i])  # first occurrence at k >= 2
    llm = make_llm(folder)
    [stopped] = llm.generate(prompt, SamplingParams(max_tokens=12, stop_token_ids=(reference[k],), ignore_eos=True))
    assert list(stopped.output_token_ids) == reference[: k + 1]
    assert stopped.finish_reason is FinishReason.STOP

    # The same weights with that token as the model's EOS: generate and the engine stop there.
    model.config.eos_token_id = model.generation_config.eos_token_id = reference[k]
    eos_folder = save_model(model, tmp_path / "eos")
    model.config.eos_token_id = model.generation_config.eos_token_id = 2
    llm = make_llm(eos_folder)
    [out] = llm.generate(prompt, SamplingParams(max_tokens=12))
    assert list(out.output_token_ids) == reference_tokens(model, prompt, 12, eos_token_id=reference[k])
    assert list(out.output_token_ids) == reference[: k + 1]
    assert out.finish_reason is FinishReason.EOS
    [ignored] = llm.generate(prompt, SamplingParams(max_tokens=12, ignore_eos=True))
    assert list(ignored.output_token_ids) == reference


def test_seeded_sampling_is_reproducible_and_batch_independent(tiny):
    folder, _ = tiny("qwen2")
    llm = make_llm(folder)
    prompt = random_prompt(9, seed=60)
    params = SamplingParams(max_tokens=16, temperature=1.0, seed=7, ignore_eos=True)
    [alone] = llm.generate(prompt, params)
    others = [random_prompt(n, seed=61 + n) for n in (4, 13)]
    batch = llm.generate([others[0], prompt, others[1]], [greedy(16), params, greedy(16)])
    assert batch[1].output_token_ids == alone.output_token_ids
    reseeded = [
        llm.generate(prompt, SamplingParams(max_tokens=16, temperature=1.0, seed=s, ignore_eos=True))[0] for s in (8, 9)
    ]
    assert {r.output_token_ids for r in reseeded} != {alone.output_token_ids}
    greedy_out = llm.generate(prompt, greedy(16))[0]
    assert alone.output_token_ids != greedy_out.output_token_ids  # it really sampled


# -- the cache is allocated once -------------------------------------------------------------


def test_kv_memory_is_allocated_once(tiny):
    folder, model = tiny("llama")
    llm = make_llm(folder, kv_cache_memory=24 * BLOCK_BYTES, max_model_len=64, max_num_batched_tokens=16)
    caches = llm.engine.kv_caches
    plan = llm.engine.setup.plan
    assert caches.nbytes == plan.num_blocks * plan.pool_block_bytes == 24 * BLOCK_BYTES
    assert all(k.shape == (24, BLOCK, 2, 16) for k in caches.key_caches + caches.value_caches)
    pointers = [t.data_ptr() for t in caches.key_caches + caches.value_caches]
    for round_ in range(4):
        prompts = [random_prompt(5 + 3 * i, seed=70 + 10 * round_ + i) for i in range(6)]
        outputs = llm.generate(prompts, greedy(12))
        assert_matches_reference(model, prompts, outputs, 12)
    assert llm.engine.scheduler.num_preemptions > 0  # the pool really ran full
    assert llm.engine.kv_caches is caches
    assert [t.data_ptr() for t in caches.key_caches + caches.value_caches] == pointers
    assert caches.nbytes == 24 * BLOCK_BYTES
    assert llm.engine.runner.kv_caches is caches


# -- bad input --------------------------------------------------------------------------------


def test_bad_requests_raise_before_queuing_and_the_engine_keeps_serving(tiny):
    folder, model = tiny("llama")
    llm = make_llm(folder, max_model_len=32)
    engine = llm.engine
    good = random_prompt(8, seed=80)
    expected = reference_tokens(model, good, 5)
    assert list(llm.generate(good, greedy(5))[0].output_token_ids) == expected

    cases = [
        ([], RequestStateError, "is empty"),
        ("", RequestStateError, "empty"),
        ("some text", ConfigError, "no tokenizer"),
        (random_prompt(32, seed=81), RequestStateError, "32 tokens"),
        ([5, VOCAB + 3], InvalidTokenError, str(VOCAB + 3)),
        ([5, -1], InvalidTokenError, "-1"),
    ]
    for prompt, error, needle in cases:
        with pytest.raises(error, match=needle):
            llm.generate([good, prompt], greedy(5))  # the good one must not be queued either
        assert not engine.has_unfinished_requests()
        assert engine.manager.running_request_ids() == []
    with pytest.raises(ConfigError, match="max_tokens must be a positive integer, got 0"):
        llm.generate(good, SamplingParams(max_tokens=0))
    with pytest.raises(RequestStateError, match="cache_salt"):
        llm.generate(good, greedy(5), cache_salt="")
    with pytest.raises(ConfigError, match="sampling_params has 1 entries for 2 prompts"):
        llm.generate([good, good], [greedy(5)])
    with pytest.raises(ConfigError, match="no tokenizer"):
        llm.chat([{"role": "user", "content": "hi"}])

    outputs = llm.generate([good, random_prompt(3, seed=82)], greedy(5))
    assert list(outputs[0].output_token_ids) == expected
    assert list(outputs[1].output_token_ids) == reference_tokens(model, random_prompt(3, seed=82), 5)
    assert engine.manager.num_free_blocks == engine.num_blocks - 1  # every block came back


def test_bad_engine_options_name_the_value(tiny, tmp_path):
    folder, _ = tiny("llama")
    with pytest.raises(ConfigError, match="'no-such-model-xyz'"):
        LLM("no-such-model-xyz", log=lambda line: None)
    with pytest.raises(ConfigError, match="no config.json"):
        LLM(tmp_path, log=lambda line: None)
    with pytest.raises(ConfigError, match="block_size must be a positive integer, got 0"):
        make_llm(folder, block_size=0)
    with pytest.raises(ConfigError, match="kv_cache_memory '12XB'"):
        make_llm(folder, kv_cache_memory="12XB")
    with pytest.raises(ConfigError, match="max_model_len 1000 exceeds"):
        make_llm(folder, max_model_len=1000)
    with pytest.raises(ConfigError, match="not enough for one request of max_model_len=256"):
        make_llm(folder, kv_cache_memory=8 * BLOCK_BYTES)


def test_a_failed_step_drops_its_requests_and_the_engine_recovers(tiny, monkeypatch):
    folder, model = tiny("llama")
    llm = make_llm(folder)
    engine = llm.engine
    prompt = random_prompt(13, seed=95)
    real_execute = engine.runner.execute

    def interrupted(chunks):
        raise KeyboardInterrupt("stopped mid-step")

    monkeypatch.setattr(engine.runner, "execute", interrupted)
    with pytest.raises(KeyboardInterrupt):
        llm.generate([prompt, random_prompt(5, seed=96)], greedy(4))
    assert not engine.has_unfinished_requests()
    assert engine.manager.running_request_ids() == []
    monkeypatch.setattr(engine.runner, "execute", real_execute)
    [out] = llm.generate(prompt, greedy(4))
    assert out.num_cached_tokens == 0  # the never-computed blocks were not kept as a prefix
    assert list(out.output_token_ids) == reference_tokens(model, prompt, 4)


# -- streaming ------------------------------------------------------------------------------


def test_engine_steps_stream_one_token_per_request(tiny):
    folder, model = tiny("llama")
    engine = make_llm(folder).engine
    prompts = [random_prompt(6, seed=100), random_prompt(11, seed=101)]
    ids = [engine.add_request(p, greedy(4)) for p in prompts]
    streamed: dict[str, list[int]] = {rid: [] for rid in ids}
    finished = {}
    steps = 0
    while engine.has_unfinished_requests():
        deltas = engine.step()
        steps += 1
        assert len({d.request_id for d in deltas}) == len(deltas)
        for d in deltas:
            streamed[d.request_id].extend(d.token_ids)
            if d.finished:
                finished[d.request_id] = d.output
    assert steps == 4
    for rid, prompt in zip(ids, prompts):
        assert streamed[rid] == reference_tokens(model, prompt, 4)
        assert list(finished[rid].output_token_ids) == streamed[rid]
    assert engine.step() == []


# -- sliding windows (needs the sliding-window group manager) ----------------------------------


@needs_sliding_window
def test_mistral_sliding_window_matches_generate(tiny):
    folder, model = tiny("mistral")
    llm = make_llm(folder, max_num_batched_tokens=7)
    assert [g.kind.value for g in llm.engine.setup.groups] == ["sliding_window"]
    engine = llm.engine
    prompts = [random_prompt(n, seed=110 + n) for n in (5, 13, 22)]
    ids = [engine.add_request(p, greedy(14)) for p in prompts]
    saw_null = False
    outputs = {}
    while engine.has_unfinished_requests():
        for d in engine.step():
            if d.output is not None:
                outputs[d.request_id] = d.output
        for rid in engine.manager.running_request_ids():
            saw_null |= 0 in engine.manager.get_block_ids(rid)[0]
    assert saw_null  # blocks that left the window were given back
    assert_matches_reference(model, prompts, [outputs[rid] for rid in ids], 14)


@needs_sliding_window
@pytest.mark.parametrize(
    ("kind", "kinds"),
    [("qwen2-hybrid", ["full_attention", "sliding_window"]), ("gemma2", ["sliding_window", "full_attention"])],
)
def test_two_groups_share_one_tensor_per_slot_and_match_generate(kind, kinds, tiny):
    folder, model = tiny(kind)
    llm = make_llm(folder, max_num_batched_tokens=9)
    setup = llm.engine.setup
    assert [g.kind.value for g in setup.groups] == kinds
    caches = llm.engine.kv_caches
    assert caches.num_tensor_pairs == 1  # layer 0 of each group shares slot 0
    assert caches.key_caches[0].data_ptr() == caches.key_caches[1].data_ptr()
    prompts = [random_prompt(n, seed=120 + n) for n in (4, 12, 19)]
    outputs = llm.generate(prompts, greedy(12))
    assert_matches_reference(model, prompts, outputs, 12)
    shared = random_prompt(12, seed=130)
    llm.generate(shared + [7, 8, 9], greedy(3))
    [hit] = llm.generate(shared + [10, 11], greedy(6))
    assert hit.num_cached_tokens > 0
    assert list(hit.output_token_ids) == reference_tokens(model, shared + [10, 11], 6)


def test_a_batch_may_be_bounded_by_the_tokens_it_asks_for(tiny):
    """max_output_tokens bounds one call (a server's request): refused whole, naming the figures; an
    offline batch has no bound by default."""
    from kvpool.errors import RequestTooLarge

    folder, _ = tiny("llama")
    llm = make_llm(folder, max_model_len=64)
    engine = llm.engine
    prompts = [random_prompt(8, seed=90 + i) for i in range(3)]
    with pytest.raises(RequestTooLarge, match="3 sequences x 20 tokens = 60") as refused:
        engine.add_requests(prompts, [SamplingParams(max_tokens=20)] * 3, max_output_tokens=59)
    assert refused.value.param == "max_tokens"
    assert not engine.has_unfinished_requests()
    with pytest.raises(RequestTooLarge, match="min_tokens") as refused:  # max_tokens: the rest, 56 tokens
        engine.add_requests(prompts[:1], [SamplingParams(max_tokens=None, min_tokens=1000)], max_output_tokens=60)
    assert refused.value.param == "min_tokens"
    assert not engine.has_unfinished_requests()
    with pytest.raises(RequestTooLarge, match="rest of the context"):
        engine.add_requests(prompts[:1], [SamplingParams(max_tokens=None)], max_output_tokens=10)
    ids = engine.add_requests(prompts, [SamplingParams(max_tokens=20)] * 3, max_output_tokens=60)
    assert len(ids) == 3
    for rid in ids:
        engine.abort(rid)
