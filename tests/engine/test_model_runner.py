"""ModelRunner against transformers' own generate, token for token (greedy).

Tiny random models (2 layers, hidden 64, 4 heads, 2 KV heads, vocab 256) with a
wide initializer so that logits are far from flat. Block size 4 throughout, so
that even short prompts span several blocks.
"""

from __future__ import annotations

import pytest
import torch

from kvpool.engine.batch import SequenceChunk
from kvpool.engine.kv_cache import KVCacheSpec, allocate_kv_caches
from kvpool.engine.model_runner import ModelRunner
from kvpool.engine.sampling import SamplingParams, make_generator, sample_tokens
from kvpool.errors import ConfigError, InvalidTokenError, KVPoolError, RequestStateError

pytestmark = pytest.mark.engine

VOCAB = 256
BLOCK = 4
WINDOW = 8


def tiny_model(kind: str, **overrides):
    """A deterministic random-initialised causal LM of the given architecture."""
    import transformers as tf

    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        initializer_range=0.2,
        max_position_embeddings=512,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    impl = "sdpa"
    if kind == "llama":
        config = tf.LlamaConfig(**common)
        cls = tf.LlamaForCausalLM
    elif kind == "qwen2":
        config = tf.Qwen2Config(**common)
        cls = tf.Qwen2ForCausalLM
    elif kind == "qwen2-hybrid":  # layer 0 full attention, layer 1 sliding window
        config = tf.Qwen2Config(**common, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)
        cls = tf.Qwen2ForCausalLM
    elif kind == "qwen3":
        config = tf.Qwen3Config(**common, head_dim=16)
        cls = tf.Qwen3ForCausalLM
    elif kind == "mistral":
        config = tf.MistralConfig(**common, sliding_window=WINDOW)
        cls = tf.MistralForCausalLM
    elif kind == "gemma2":
        config = tf.Gemma2Config(
            **common,
            head_dim=16,
            query_pre_attn_scalar=16,
            sliding_window=WINDOW,
            attn_logit_softcapping=5.0,
            final_logit_softcapping=3.0,
        )
        cls = tf.Gemma2ForCausalLM
        impl = "eager"  # sdpa cannot soft-cap scores
    elif kind == "gemma3":
        config = tf.Gemma3TextConfig(
            **common,
            head_dim=16,
            query_pre_attn_scalar=16,
            sliding_window=WINDOW,
            layer_types=["sliding_attention", "full_attention"],
        )
        cls = tf.Gemma3ForCausalLM
    else:
        raise AssertionError(kind)
    for key, value in overrides.items():
        setattr(config, key, value)
    torch.manual_seed(0)
    model = cls(config).eval()
    model.config._attn_implementation = impl
    return model


def random_prompt(length: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (length,), generator=gen).tolist()


def assert_matches_generate(model, seqs, reference):
    for seq in seqs:
        expected = reference(model, seq.tokens[: seq.prompt_len], seq.max_new_tokens)
        assert seq.generated == expected, seq.request_id


def assert_logits_match_full_forward(model, seq, atol=1e-4):
    """Every sampled logits row equals a cache-free forward over the whole prefix."""
    with torch.inference_mode():
        full = model(torch.tensor([seq.tokens])).logits[0].float()
    for i, logits in enumerate(seq.logits):
        torch.testing.assert_close(logits, full[seq.prompt_len - 1 + i], atol=atol, rtol=1e-4)


# --- greedy equality with generate --------------------------------------------------------

ALL_KINDS = ["llama", "qwen2", "qwen3", "mistral", "qwen2-hybrid", "gemma2", "gemma3"]


def _layer_to_group(model):
    """Full-attention layers in group 0, sliding-window layers in group 1 (when both exist)."""
    runner_types = [
        "sliding" if getattr(layer.self_attn, "sliding_window", None) else "full" for layer in model.model.layers
    ]
    if getattr(model.config, "model_type", "") == "mistral":
        return None, [WINDOW]
    if len(set(runner_types)) == 2:
        return [0 if t == "full" else 1 for t in runner_types], [None, WINDOW]
    return None, [WINDOW if runner_types[0] == "sliding" else None]


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_single_prompt_matches_generate(kind, make_runner, driver_cls, seq_cls, reference):
    model = tiny_model(kind)
    layer_to_group, windows = _layer_to_group(model)
    runner, allocator = make_runner(model, layer_to_group=layer_to_group)
    driver = driver_cls(runner, allocator, group_windows=windows)
    seq = seq_cls("a", random_prompt(13, seed=1), max_new_tokens=12)
    driver.run([seq])
    assert_matches_generate(model, [seq], reference)
    assert_logits_match_full_forward(model, seq)
    assert runner.num_computed_tokens == 13 + 11
    assert runner.num_steps == 12
    if any(w is not None for w in windows):
        assert driver.num_nulled > 0  # the window really dropped blocks


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_batch_of_prompts_decoded_together(kind, make_runner, driver_cls, seq_cls, reference):
    model = tiny_model(kind)
    runner, allocator = make_runner(model, num_blocks=96)
    driver = driver_cls(runner, allocator)
    lengths = [1, 5, 9, 16, 23]
    seqs = [seq_cls(f"r{i}", random_prompt(n, seed=10 + i), max_new_tokens=8) for i, n in enumerate(lengths)]
    driver.run(seqs)
    assert runner.num_steps == 8  # one forward per step for the whole batch
    assert runner.num_computed_tokens == sum(lengths) + 5 * 7
    assert_matches_generate(model, seqs, reference)
    for seq in seqs:
        assert_logits_match_full_forward(model, seq)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral"])
def test_chunked_prefill_mixed_with_decode(kind, make_runner, driver_cls, seq_cls, reference):
    model = tiny_model(kind)
    _, windows = _layer_to_group(model)
    runner, allocator = make_runner(model, num_blocks=96)
    driver = driver_cls(runner, allocator, group_windows=windows)
    seqs = [
        seq_cls("c3", random_prompt(22, seed=20), max_new_tokens=6, chunk_size=3),
        seq_cls("c5", random_prompt(17, seed=21), max_new_tokens=6, chunk_size=5),
        seq_cls("c4", random_prompt(9, seed=22), max_new_tokens=10, chunk_size=4),
        seq_cls("whole", random_prompt(4, seed=23), max_new_tokens=12),
    ]
    driver.run(seqs)
    # 22 tokens in chunks of 3 take 8 steps, then 5 more decode steps.
    assert runner.num_steps == 13
    assert runner.num_computed_tokens == sum(s.prompt_len + s.max_new_tokens - 1 for s in seqs)
    assert_matches_generate(model, seqs, reference)
    for seq in seqs:
        assert_logits_match_full_forward(model, seq)


def test_prefix_cache_hit_computes_only_the_tail(make_runner, driver_cls, seq_cls, reference):
    model = tiny_model("llama")
    runner, allocator = make_runner(model)
    driver = driver_cls(runner, allocator)
    shared = random_prompt(2 * BLOCK, seed=30)
    a = seq_cls("a", shared + random_prompt(5, seed=31), max_new_tokens=6)
    driver.run([a])
    computed_before = runner.num_computed_tokens

    tail = random_prompt(3, seed=32)
    b = seq_cls(
        "b",
        shared + tail,
        max_new_tokens=6,
        block_tables=[a.block_tables[0][:2]],  # A's first two (full) blocks
        num_computed=2 * BLOCK,
    )
    # Poison every cache block A owns beyond the shared ones: B must not read them.
    for block_id in a.block_tables[0][2:]:
        for layer in range(len(runner.layers)):
            key_cache, value_cache = runner.kv_caches.layer(layer)
            key_cache[block_id] = float("nan")
            value_cache[block_id] = float("nan")
    driver.run([b])
    assert b.block_tables[0][:2] == a.block_tables[0][:2]
    assert runner.num_computed_tokens - computed_before == len(tail) + 5  # tail + decode inputs only
    assert_matches_generate(model, [b], reference)
    assert_logits_match_full_forward(model, b)


def test_prefix_hit_in_the_same_batch_as_its_owner(make_runner, driver_cls, seq_cls, reference):
    model = tiny_model("qwen2")
    runner, allocator = make_runner(model)
    driver = driver_cls(runner, allocator)
    shared = random_prompt(3 * BLOCK, seed=40)
    a = seq_cls("a", shared + random_prompt(2, seed=41), max_new_tokens=8)
    driver.step([a])  # A's prefill fills the shared blocks
    b = seq_cls(
        "b",
        shared + random_prompt(6, seed=42),
        max_new_tokens=5,
        block_tables=[a.block_tables[0][:3]],
        num_computed=3 * BLOCK,
    )
    before = runner.num_computed_tokens
    driver.run([a, b])
    assert runner.num_computed_tokens - before == (8 - 1) + (6 + 5 - 1)
    assert_matches_generate(model, [a, b], reference)


def test_sliding_window_matters(make_runner, driver_cls, seq_cls):
    """The same weights without the window give other logits: the test above is not vacuous."""
    windowed = tiny_model("mistral")
    unwindowed = tiny_model("mistral", sliding_window=None)
    prompt = random_prompt(20, seed=50)
    results = []
    for model, windows in ((windowed, [WINDOW]), (unwindowed, [None])):
        runner, allocator = make_runner(model)
        seq = seq_cls("a", list(prompt), max_new_tokens=1)
        driver_cls(runner, allocator, group_windows=windows).run([seq])
        results.append(seq.logits[0])
    assert not torch.allclose(results[0], results[1], atol=1e-3)


def test_hybrid_groups_use_their_own_block_tables(make_runner, driver_cls, seq_cls, reference):
    model = tiny_model("qwen2-hybrid")
    runner, allocator = make_runner(model, num_blocks=96, layer_to_group=[0, 1])
    assert [info.sliding_window for info in runner.layers] == [None, WINDOW]
    driver = driver_cls(runner, allocator, group_windows=[None, WINDOW])
    seqs = [
        seq_cls(f"h{i}", random_prompt(n, seed=60 + i), max_new_tokens=10, chunk_size=5) for i, n in enumerate((18, 7))
    ]
    driver.run(seqs)
    assert driver.num_nulled > 0
    assert all(b != 0 for s in seqs for b in s.block_tables[0])  # full-attention group keeps all
    assert_matches_generate(model, seqs, reference)


# --- validation -----------------------------------------------------------------------------


def _chunk(request_id="r", tokens=(5, 6, 7), start=0, tables=((1,),), sample=True):
    return SequenceChunk(request_id, tuple(tokens), start, tuple(tables), sample)


@pytest.fixture(scope="module")
def llama_runner():
    model = tiny_model("llama")
    spec = KVCacheSpec.from_model_config(model.config, block_size=BLOCK)
    return ModelRunner(model, allocate_kv_caches(spec, 16))


@pytest.mark.parametrize(
    ("chunks", "error", "match"),
    [
        pytest.param([], KVPoolError, "at least one", id="empty-batch"),
        pytest.param([_chunk(tokens=(5, 999))], InvalidTokenError, "999", id="token-outside-vocab"),
        pytest.param([_chunk(), _chunk(tables=((2,),))], RequestStateError, "twice", id="duplicate-request"),
        pytest.param([_chunk(tables=((1,), (2,)))], RequestStateError, "2 block table", id="wrong-group-count"),
        pytest.param([_chunk(tokens=(5, 6, 7, 8, 9))], RequestStateError, "'r'.*need 2", id="table-too-short"),
        pytest.param([_chunk(start=4, tables=((0, 3),))], RequestStateError, "null block", id="null-block-visible"),
        pytest.param([_chunk(tables=((16,),))], RequestStateError, "block ID 16", id="block-outside-cache"),
        pytest.param([_chunk(), _chunk("s")], RequestStateError, "same KV cache slot", id="shared-write-slot"),
    ],
)
def test_bad_batches_are_rejected_before_any_write(llama_runner, chunks, error, match):
    caches_before = [k.clone() for k in llama_runner.kv_caches.key_caches]
    computed_before = llama_runner.num_computed_tokens
    with pytest.raises(error, match=match):
        llama_runner.execute(chunks)
    assert llama_runner.num_computed_tokens == computed_before
    for before, after in zip(caches_before, llama_runner.kv_caches.key_caches):
        assert torch.equal(before, after)


def test_no_sampled_chunk_returns_empty_logits(llama_runner):
    logits = llama_runner.execute([_chunk("x", tables=((5,),), sample=False)])
    assert logits.shape == (0, VOCAB) and logits.dtype == torch.float32


def test_logits_come_back_in_chunk_order(llama_runner):
    chunks = [
        _chunk("p", tokens=(9, 8), tables=((7,),), sample=True),
        _chunk("q", tokens=(4,), tables=((8,),), sample=False),
        _chunk("s", tokens=(3, 2, 1), tables=((9,),), sample=True),
    ]
    logits = llama_runner.execute(chunks)
    alone = [llama_runner.execute([_chunk(c.request_id, c.token_ids, 0, ((10 + i,),))]) for i, c in enumerate(chunks)]
    assert logits.shape == (2, VOCAB)
    torch.testing.assert_close(logits[0], alone[0][0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits[1], alone[2][0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        pytest.param(dict(request_id=""), "request_id", id="empty-id"),
        pytest.param(dict(token_ids=()), "no tokens", id="no-tokens"),
        pytest.param(dict(token_ids=(1, -3)), "-3", id="negative-token"),
        pytest.param(dict(start_position=-1), "-1", id="negative-start"),
        pytest.param(dict(block_tables=()), "block_tables is empty", id="no-tables"),
        pytest.param(dict(block_tables=((1, -2),)), "-2", id="negative-block"),
    ],
)
def test_sequence_chunk_validation(kwargs, match):
    base = dict(request_id="r", token_ids=(1, 2), start_position=0, block_tables=((1,),), sample=True)
    base.update(kwargs)
    with pytest.raises(KVPoolError, match=match):
        SequenceChunk(**base)


def test_sequence_chunk_normalises_to_tuples():
    chunk = SequenceChunk("r", [1, 2, 3], 4, [[1, 2]], True)
    assert chunk.token_ids == (1, 2, 3) and chunk.block_tables == ((1, 2),)
    assert chunk.end_position == 7 and chunk.num_tokens == 3
    hash(chunk)


def test_runner_rejects_mismatched_setup():
    import transformers as tf

    model = tiny_model("llama")
    good = KVCacheSpec.from_model_config(model.config, block_size=BLOCK)
    wrong_heads = KVCacheSpec(num_layers=2, num_kv_heads=4, head_dim=16, block_size=BLOCK)
    with pytest.raises(ConfigError, match="do not match"):
        ModelRunner(model, allocate_kv_caches(wrong_heads, 4))
    with pytest.raises(ConfigError, match="layer_to_group"):
        ModelRunner(model, allocate_kv_caches(good, 4), layer_to_group=[0, 2])
    with pytest.raises(ConfigError, match="layer_to_group"):
        ModelRunner(model, allocate_kv_caches(good, 4), layer_to_group=[0])
    gpt2 = tf.GPT2LMHeadModel(tf.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    with pytest.raises(ConfigError, match="'gpt2' is not supported"):
        ModelRunner(gpt2, allocate_kv_caches(good, 4))


# --- sampling -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        pytest.param(dict(max_tokens=0), "max_tokens.*0", id="max-tokens"),
        pytest.param(dict(temperature=-0.5), "temperature.*-0.5", id="temperature"),
        pytest.param(dict(temperature=float("nan")), "temperature.*nan", id="temperature-nan"),
        pytest.param(dict(top_p=0.0), "top_p.*0.0", id="top-p-zero"),
        pytest.param(dict(top_p=1.5), "top_p.*1.5", id="top-p-big"),
        pytest.param(dict(top_k=-1), "top_k.*-1", id="top-k"),
        pytest.param(dict(seed=-7), "seed.*-7", id="seed"),
        pytest.param(dict(stop_token_ids=(3, 2**32)), "4294967296", id="stop-token"),
        pytest.param(dict(ignore_eos="yes"), "ignore_eos.*'yes'", id="ignore-eos"),
    ],
)
def test_sampling_params_validation(kwargs, match):
    with pytest.raises(KVPoolError, match=match):
        SamplingParams(**kwargs)


def test_sampling_params_defaults():
    params = SamplingParams(stop_token_ids=[7, 8])
    assert (params.max_tokens, params.temperature, params.top_p, params.top_k) == (16, 0.0, 1.0, 0)
    assert params.seed is None and params.ignore_eos is False and params.greedy
    assert params.stop_token_ids == (7, 8)


def test_greedy_sampling_is_argmax():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams()] * 3
    assert make_generator(params[0]) is None
    assert sample_tokens(logits, params, [None] * 3) == logits.argmax(-1).tolist()


def test_seeded_sampling_is_reproducible_and_batch_independent():
    logits = torch.randn(2, 100, generator=torch.Generator().manual_seed(1))
    params = SamplingParams(temperature=1.0, seed=123)

    def draw(rows):
        generators = [make_generator(params) for _ in rows]
        out = []
        for _ in range(20):
            out.append(sample_tokens(logits[rows], [params] * len(rows), generators)[0])
        return out

    alone = draw([0])
    assert draw([0]) == alone
    assert draw([0, 1]) == alone  # a neighbour in the batch does not shift the stream
    assert len(set(alone)) > 1  # it really samples
    other = [
        sample_tokens(logits[:1], [SamplingParams(temperature=1.0, seed=124)], [g])[0]
        for g in [make_generator(SamplingParams(temperature=1.0, seed=124))]
        for _ in range(20)
    ]
    assert other != alone


def test_top_k_and_top_p_restrict_the_support():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0, -1.0]])
    top_k = SamplingParams(temperature=1.0, top_k=2, seed=0)
    gen = make_generator(top_k)
    drawn = {sample_tokens(logits, [top_k], [gen])[0] for _ in range(200)}
    assert drawn == {0, 1}
    # softmax([4,3,2,...]) ~ [0.64, 0.23, 0.09, ...]: top_p=0.8 keeps exactly the first two.
    top_p = SamplingParams(temperature=1.0, top_p=0.8, seed=0)
    gen = make_generator(top_p)
    drawn = {sample_tokens(logits, [top_p], [gen])[0] for _ in range(200)}
    assert drawn == {0, 1}
    tiny_p = SamplingParams(temperature=1.0, top_p=0.01, seed=0)
    gen = make_generator(tiny_p)
    assert {sample_tokens(logits, [tiny_p], [gen])[0] for _ in range(50)} == {0}


def test_low_temperature_concentrates_on_the_argmax():
    logits = torch.tensor([[1.0, 1.2, 0.9]])
    params = SamplingParams(temperature=0.01, seed=5)
    gen = make_generator(params)
    assert {sample_tokens(logits, [params], [gen])[0] for _ in range(50)} == {1}


def test_sampler_argument_checks():
    logits = torch.zeros(2, 5)
    with pytest.raises(ConfigError, match="len"):
        sample_tokens(logits, [SamplingParams()], [None])
    with pytest.raises(ConfigError, match="no generator"):
        sample_tokens(logits, [SamplingParams(), SamplingParams(temperature=0.5)], [None, None])


# --- construction helpers -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "expected"),
    [
        ("llama", (None, None)),
        ("mistral", (WINDOW, WINDOW)),
        ("qwen2", (None, None)),
        ("qwen2-hybrid", (None, WINDOW)),
        ("gemma3", (WINDOW, None)),
    ],
)
def test_layer_sliding_windows(kind, expected):
    """The core's one rule, read from the config transformers built, and what the runner computes with."""
    from kvpool.model_layers import layer_sliding_windows

    model = tiny_model(kind)
    assert layer_sliding_windows(model.config.to_dict()) == expected
    spec = KVCacheSpec.from_model_config(model.config, block_size=8)
    runner = ModelRunner(model, allocate_kv_caches(spec, 4))
    assert tuple(info.sliding_window for info in runner.layers) == expected


def test_runner_refuses_windows_that_do_not_fit_the_layers():
    model = tiny_model("llama")
    spec = KVCacheSpec.from_model_config(model.config, block_size=8)
    for bad in [(None,), (None, 0), (None, True), (None, None, None)]:
        with pytest.raises(ConfigError, match="sliding_windows"):
            ModelRunner(model, allocate_kv_caches(spec, 4), sliding_windows=bad)


def test_create_sizes_caches_from_a_budget():
    model = tiny_model("llama")
    spec = KVCacheSpec.from_model_config(model.config, block_size=8)
    runner = ModelRunner.create(model, kv_cache_bytes=spec.block_bytes * 10 + 3, block_size=8)
    assert runner.num_blocks == 10 and runner.block_size == 8
    assert runner.kv_caches.key_caches[0].shape == (10, 8, 2, 16)
    logits = runner.execute([_chunk(tokens=(5, 6, 7), tables=((3,),))])
    assert logits.shape == (1, VOCAB)
    with pytest.raises(ConfigError, match="exactly one"):
        ModelRunner.create(model)
    with pytest.raises(ConfigError, match="exactly one"):
        ModelRunner.create(model, num_blocks=4, kv_cache_bytes=1 << 20)


def test_fused_projections_share_the_models_weights():
    """q/k/v and gate/up become one matrix each; the model's modules read views of it, so memory is not doubled."""
    model = tiny_model("llama")
    layer = model.model.layers[0]
    before = [m.weight.detach().clone() for m in (layer.self_attn.q_proj, layer.mlp.gate_proj, layer.mlp.up_proj)]
    spec = KVCacheSpec.from_model_config(model.config, block_size=BLOCK)
    runner = ModelRunner(model, allocate_kv_caches(spec, 16))
    fused = runner._fused[0]
    assert fused is not None and fused.gate_up_weight is not None
    attn = layer.self_attn
    assert attn.q_proj.weight.data_ptr() == fused.qkv_weight.data_ptr()
    assert attn.k_proj.weight.untyped_storage().data_ptr() == fused.qkv_weight.untyped_storage().data_ptr()
    assert layer.mlp.up_proj.weight.untyped_storage().data_ptr() == fused.gate_up_weight.untyped_storage().data_ptr()
    after = [m.weight for m in (attn.q_proj, layer.mlp.gate_proj, layer.mlp.up_proj)]
    for old, new in zip(before, after):
        torch.testing.assert_close(new, old, rtol=0, atol=0)
