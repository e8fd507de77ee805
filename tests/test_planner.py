"""The planner and the config reader, checked against numbers computed by hand from published configs."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from kvpool.errors import ConfigError
from kvpool.model_config import (
    head_dim,
    load_model_config,
    model_dtype,
    num_kv_heads,
    shipped_config_names,
    text_config_view,
)
from kvpool.model_layers import cache_layer_indices, layer_kinds, layer_sliding_windows, layer_specs_from_config
from kvpool.planner import (
    GB,
    GiB,
    KVPlan,
    TermSource,
    estimate_activation_bytes,
    estimate_parameters,
    estimate_weight_bytes,
    parse_size,
    plan_kv_cache,
)
from kvpool.recurrent_state import state_size
from kvpool.specs import KVDtype, LayerKind, MambaSpec, MLASpec, cdiv, group_layers, pool_block_bytes

KiB, MiB = 2**10, 2**20

LLAMA_8B = load_model_config("llama-3.1-8b")


def exact(config: dict, gpu_memory: int | str, **kw) -> KVPlan:
    """A plan with every memory term given, so the budget is known exactly."""
    kw.setdefault("weights_bytes", 0)
    kw.setdefault("activation_bytes", 0)
    kw.setdefault("other_overhead_bytes", 0)
    kw.setdefault("gpu_memory_utilization", 1.0)
    return plan_kv_cache(config, gpu_memory_bytes=gpu_memory, **kw)


# -- the worked numbers ----------------------------------------------------------------


def test_llama_8b_worked_numbers() -> None:
    plan = exact(LLAMA_8B, 40 * GiB)
    (group,) = plan.groups
    assert group.page_bytes == 65_536  # bytes per layer per block
    assert plan.pool_block_bytes == 2 * MiB  # 32 layers per block
    assert plan.pool_block_bytes // plan.block_size == 128 * KiB  # per token
    assert plan.budget.kv_budget_bytes == 40 * GiB
    assert plan.num_blocks == 20_480
    assert plan.pool_tokens == 327_680
    assert plan.kv_cache_tokens == 327_680
    assert plan.max_concurrency == 2.5
    assert plan.capacity_line == (
        "KV cache size: 327,680 tokens; maximum concurrency for 131,072 tokens per request: 2.50x"
    )


SIXTY_FOUR_LAYERS = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "num_attention_heads": 64,
    "num_hidden_layers": 64,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "torch_dtype": "bfloat16",
}


@pytest.mark.parametrize("gpu_memory", ["80GB", "74.50580596923828125GiB", 80 * 10**9])
def test_64_layer_fp8_worked_example(gpu_memory: str | int) -> None:
    per_token = 64 * 2 * 8 * 128 * 1
    assert per_token == 131_072
    budget = 72 * 10**9 - 20 * 10**9 - 4 * 10**9  # 0.9 x 80e9 - 20e9 - 4e9
    assert budget == 48 * 10**9
    blocks = budget // (16 * per_token)
    assert blocks == 22_888
    plan = plan_kv_cache(
        SIXTY_FOUR_LAYERS,
        gpu_memory_bytes=gpu_memory,
        gpu_memory_utilization=0.9,
        weights_bytes="20GB",
        activation_bytes=0,
        other_overhead_bytes="4GB",
        kv_dtype="fp8",
    )
    assert plan.budget.gpu_memory_bytes == 80 * 10**9
    assert plan.budget.usable_bytes == 72 * 10**9
    assert plan.budget.kv_budget_bytes == budget
    assert plan.kv_dtype is KVDtype.FP8
    assert plan.pool_block_bytes == 16 * per_token
    assert plan.num_blocks == blocks
    assert plan.pool_tokens == 366_208 == blocks * 16
    assert plan.kv_cache_tokens == 366_208


# -- every shipped config against a hand computation ------------------------------------

# (name, max_model_len, tokens per block, bytes per layer per block, layers per pool block,
#  number of groups, blocks one max_model_len request holds), every figure from the published config.
ATTN_BF16 = 2 * 2  # K and V, 2 bytes each
HAND = {
    # 32 layers, 8 KV heads, head dim 128
    "llama-3.1-8b": (131072, 16, 16 * ATTN_BF16 * 8 * 128, 32, 1, 131072 // 16),
    # 80 layers, 8 KV heads, head dim 128
    "llama-3.1-70b": (131072, 16, 16 * ATTN_BF16 * 8 * 128, 80, 1, 131072 // 16),
    # 36 layers, 8 KV heads, head dim 128, 40,960 positions
    "qwen3-8b": (40960, 16, 16 * ATTN_BF16 * 8 * 128, 36, 1, 40960 // 16),
    # 28 layers, 4 KV heads, head dim 3584 / 28 = 128; use_sliding_window false
    "qwen2.5-7b-instruct": (32768, 16, 16 * ATTN_BF16 * 4 * 128, 28, 1, 32768 // 16),
    # 30 layers, 3 KV heads, head dim 64
    "smollm2-135m": (8192, 16, 16 * ATTN_BF16 * 3 * 64, 30, 1, 8192 // 16),
    # 32 sliding layers (window 4096): cdiv(4095, 16) + 1 blocks
    "mistral-7b-v0.1": (32768, 16, 16 * ATTN_BF16 * 8 * 128, 32, 1, 256 + 1),
    # 21 sliding (4096) + 21 full, 8 KV heads, head dim 256; float32 checkpoint served in bf16
    "gemma-2-9b": (8192, 16, 16 * ATTN_BF16 * 8 * 256, 21, 2, 8192 // 16 + (256 + 1)),
    # 40 sliding (1024) + 8 full, 8 KV heads, head dim 256: 5 sliding groups of 8 + 1 full
    "gemma-3-12b": (131072, 16, 16 * ATTN_BF16 * 8 * 256, 8, 6, 131072 // 16 + 5 * (64 + 1)),
    # 12 sliding (128) + 12 full, 8 KV heads, head dim 64
    "gpt-oss-20b": (131072, 16, 16 * ATTN_BF16 * 8 * 64, 12, 2, 131072 // 16 + (8 + 1)),
    # 27 MLA layers, one (512 + 64)-wide latent per token
    "deepseek-v2-lite": (163840, 16, 16 * (512 + 64) * 2, 27, 1, 163840 // 16),
    # 61 MLA layers
    "deepseek-v3": (163840, 16, 16 * (512 + 64) * 2, 61, 1, 163840 // 16),
    # 4 attention (8 KV heads x 128) + 28 Mamba-1 layers; state (8192 x 3 + 8192 x 16) x 2 = 311,296 B;
    # block 16 x cdiv(311296, 16 x 4096) = 80; 7 Mamba groups of 4 (2 state blocks each) + 1 attention group
    "jamba-mini-1.6": (262144, 80, 80 * ATTN_BF16 * 8 * 128, 4, 8, cdiv(262144, 80) + 7 * 2),
    # 4 attention + 24 Mamba-2; state (10240 x 3) x 2 + (128 x 64 x 128) x 4 (fp32 SSM) = 4,255,744 B;
    # block 16 x cdiv(4255744, 65536) = 1040; 6 Mamba groups (2 state blocks each) + 1 attention
    "nemotron-h-8b": (8192, 1040, 1040 * ATTN_BF16 * 8 * 128, 4, 7, cdiv(8192, 1040) + 6 * 2),
    # 4 attention (4 KV heads x 128) + 36 Mamba-2; state ((3072 + 256) x 3 + 48 x 64 x 128) x 2 = 806,400 B;
    # block 16 x cdiv(806400, 32768) = 400; 9 Mamba groups (2 state blocks each) + 1 attention
    "granite-4.0-h-tiny": (131072, 400, 400 * ATTN_BF16 * 4 * 128, 4, 10, cdiv(131072, 400) + 9 * 2),
    # 12 attention (2 KV heads x 256) + 36 gated-delta-net; state ((4096 + 4096) x 3 + 32 x 128 x 128) x 2
    # = 1,097,728 B; block 16 x cdiv(1097728, 32768) = 544; 3 state groups (2 blocks each) + 1 attention
    "qwen3-next-80b-a3b": (262144, 544, 544 * ATTN_BF16 * 2 * 256, 12, 4, cdiv(262144, 544) + 3 * 2),
}


def test_every_shipped_config_has_a_hand_computation() -> None:
    assert set(shipped_config_names()) == set(HAND)
    assert len(HAND) >= 10


@pytest.mark.parametrize("name", sorted(HAND))
def test_shipped_config_plan_matches_hand_computation(name: str) -> None:
    max_len, block_size, page, width, num_groups, per_request = HAND[name]
    gpu = 72 * 10**9  # a fixed budget: every memory term given as 0, utilization 1
    plan = exact(load_model_config(name), gpu)
    assert plan.max_model_len == max_len
    assert plan.block_size == block_size
    assert {g.page_bytes for g in plan.groups} == {page}
    assert plan.layers_per_block == width
    assert len(plan.groups) == num_groups
    assert plan.pool_block_bytes == width * page
    assert plan.blocks_per_request == per_request
    blocks = gpu // (width * page)
    assert plan.num_blocks == blocks
    assert plan.kv_cache_tokens == blocks * max_len // per_request
    assert plan.fits_max_model_len == (per_request <= blocks)


def test_state_sizes_by_hand() -> None:
    assert state_size(load_model_config("jamba-mini-1.6")).total_bytes == (8192 * 3 + 8192 * 16) * 2
    nemotron = state_size(load_model_config("nemotron-h-8b"))
    assert (nemotron.conv_elements, nemotron.ssm_elements) == ((8192 + 2 * 8 * 128) * 3, 128 * 64 * 128)
    assert nemotron.ssm_dtype is KVDtype.FP32  # Nemotron-H's default SSM cache dtype
    assert nemotron.total_bytes == 4_255_744
    assert state_size(load_model_config("granite-4.0-h-tiny")).total_bytes == 806_400
    assert state_size(load_model_config("qwen3-next-80b-a3b")).total_bytes == 1_097_728


def test_gemma3_holds_far_more_requests_than_all_full_attention() -> None:
    gemma = exact(load_model_config("gemma-3-12b"), 72 * 10**9)
    all_full = 48 * 8192  # blocks per request if every layer kept every block (same page)
    per_pool_block = 8192 + 5 * 65  # full group + five sliding groups, each block = 8 layer pages
    assert gemma.blocks_per_request == per_pool_block
    assert gemma.max_concurrency > 4 * (gemma.num_blocks * 8 / all_full)


def test_mamba_block_size_raise_is_noted() -> None:
    plan = exact(load_model_config("jamba-mini-1.6"), 72 * 10**9)
    assert plan.requested_block_size == 16 and plan.block_size == 80
    assert any("raised from 16 to 80" in note for note in plan.notes)
    mamba = [g for g in plan.groups if g.kind is LayerKind.MAMBA]
    assert all(g.blocks_per_request == 2 for g in mamba)  # the state a step reads and the one it writes
    assert isinstance(mamba[0].spec, MambaSpec) and mamba[0].spec.state_bytes == 311_296


# -- the config reader ---------------------------------------------------------------


def test_layer_kinds_of_hybrids() -> None:
    jamba = layer_kinds(load_model_config("jamba-mini-1.6"))
    assert [i for i, k in enumerate(jamba) if k is LayerKind.FULL_ATTENTION] == [4, 12, 20, 28]
    nemotron = load_model_config("nemotron-h-8b")
    kinds = layer_kinds(nemotron)
    assert len(kinds) == 52 and kinds.count(None) == 24 and kinds.count(LayerKind.MAMBA) == 24
    assert [i for i, k in enumerate(kinds) if k is LayerKind.FULL_ATTENTION] == [7, 18, 29, 40]
    assert cache_layer_indices(nemotron)[:3] == (0, 2, 4)
    qwen_next = layer_kinds(load_model_config("qwen3-next-80b-a3b"))
    assert [i for i, k in enumerate(qwen_next) if k is LayerKind.FULL_ATTENTION] == list(range(3, 48, 4))
    gemma2 = layer_kinds(load_model_config("gemma-2-9b"))
    assert gemma2[:2] == (LayerKind.SLIDING_WINDOW, LayerKind.FULL_ATTENTION)
    gpt_oss = layer_kinds(load_model_config("gpt-oss-20b"))
    assert gpt_oss.count(LayerKind.SLIDING_WINDOW) == 12


def test_gemma3_nested_text_config_and_defaults() -> None:
    config = load_model_config("gemma-3-12b")
    assert "head_dim" not in config["text_config"]
    assert head_dim(config) == 256  # Gemma 3's default, not 3840 / 16 = 240
    assert text_config_view(config)["max_position_embeddings"] == 131072
    kinds = layer_kinds(config)
    assert [i for i, k in enumerate(kinds) if k is LayerKind.FULL_ATTENTION] == list(range(5, 48, 6))
    assert model_dtype(config) is KVDtype.BF16  # the outer torch_dtype


def test_float32_checkpoint_is_served_in_bf16() -> None:
    config = load_model_config("gemma-2-9b")
    assert model_dtype(config) is KVDtype.BF16
    assert any("float32" in note for note in exact(config, 72 * 10**9).notes)


def test_qwen_use_sliding_window_false_means_full_attention() -> None:
    config = load_model_config("qwen2.5-7b-instruct")
    assert config["sliding_window"] == 131072
    assert set(layer_kinds(config)) == {LayerKind.FULL_ATTENTION}
    on = {**config, "use_sliding_window": True, "sliding_window": 4096, "max_window_layers": 20}
    assert layer_kinds(on).count(LayerKind.SLIDING_WINDOW) == 8


def test_llama4_style_chunked_attention() -> None:
    config = {
        **SIXTY_FOUR_LAYERS,
        "num_hidden_layers": 8,
        "attention_chunk_size": 8192,
        "no_rope_layers": [],
        "max_position_embeddings": 1_048_576,
    }
    kinds = layer_kinds(config)
    assert [i for i, k in enumerate(kinds) if k is LayerKind.FULL_ATTENTION] == [3, 7]
    plan = exact(config, 72 * 10**9)
    assert [g.kind for g in plan.groups] == [LayerKind.CHUNKED_LOCAL] * 3 + [LayerKind.FULL_ATTENTION]
    assert plan.blocks_per_request == 1_048_576 // 16 + 3 * (8192 // 16)
    explicit = {**config, "no_rope_layers": [1, 1, 1, 0, 1, 1, 1, 0]}
    assert layer_kinds(explicit) == kinds


def test_missing_kv_heads_falls_back_to_attention_heads() -> None:
    config = {k: v for k, v in SIXTY_FOUR_LAYERS.items() if k != "num_key_value_heads"}
    assert num_kv_heads(config) == 64
    assert layer_specs_from_config(config)[0].num_kv_heads == 64


def test_head_dim_from_hidden_size() -> None:
    config = {k: v for k, v in SIXTY_FOUR_LAYERS.items() if k != "head_dim"}
    assert head_dim(config) == 8192 // 64
    with pytest.raises(ConfigError, match="head_dim"):
        head_dim({**config, "num_attention_heads": 3})


@pytest.mark.parametrize("field", ["num_hidden_layers", "torch_dtype", "num_attention_heads"])
def test_missing_required_field_is_named(field: str) -> None:
    config = {k: v for k, v in SIXTY_FOUR_LAYERS.items() if k != field}
    if field == "num_attention_heads":
        config.pop("num_key_value_heads")
    with pytest.raises(ConfigError, match=f"'{field}'"):
        layer_specs_from_config(config)


def test_bad_field_value_is_named() -> None:
    with pytest.raises(ConfigError, match=r"'num_key_value_heads' must be a positive integer, got -8"):
        layer_specs_from_config({**SIXTY_FOUR_LAYERS, "num_key_value_heads": -8})
    with pytest.raises(ConfigError, match="'layer_types'.*'bogus'"):
        layer_kinds({**SIXTY_FOUR_LAYERS, "num_hidden_layers": 1, "layer_types": ["bogus"]})
    qwen2 = {**SIXTY_FOUR_LAYERS, "model_type": "qwen2", "num_hidden_layers": 1}
    with pytest.raises(ConfigError, match="'sliding_window'"):
        layer_specs_from_config({**qwen2, "layer_types": ["sliding_attention"]})


def test_llama_and_mistral_follow_their_model_class_not_layer_types() -> None:
    """LlamaModel never slides and MistralModel slides everywhere, whatever ``layer_types`` lists."""
    two = {**SIXTY_FOUR_LAYERS, "num_hidden_layers": 2, "layer_types": ["sliding_attention", "full_attention"]}
    assert layer_sliding_windows({**two, "sliding_window": 64}) == (None, None)
    assert layer_sliding_windows({**two, "model_type": "mistral", "sliding_window": 64}) == (64, 64)
    assert layer_sliding_windows({**two, "model_type": "mistral", "sliding_window": None}) == (None, None)
    assert layer_sliding_windows({**two, "model_type": "qwen2", "sliding_window": 64}) == (64, None)


def test_tensor_parallel_divides_kv_heads() -> None:
    assert layer_specs_from_config(LLAMA_8B, tp_size=2)[0].page_bytes == 32_768
    assert layer_specs_from_config(LLAMA_8B, tp_size=16)[0].num_kv_heads == 1  # replicated heads
    with pytest.raises(ConfigError, match=r"tensor parallel size 3 .* num_key_value_heads 8"):
        layer_specs_from_config(LLAMA_8B, tp_size=3)


def test_tensor_parallel_keeps_mla_latent_and_splits_mamba_heads() -> None:
    mla = layer_specs_from_config(load_model_config("deepseek-v3"), tp_size=8)[0]
    assert isinstance(mla, MLASpec) and mla.page_bytes == 18_432
    nemotron = load_model_config("nemotron-h-8b")
    half = state_size(nemotron, tp_size=2)
    assert half.sharded and half.ssm_elements == 64 * 64 * 128
    assert half.conv_elements == (4096 + 2 * 4 * 128) * 3
    granite = state_size(load_model_config("granite-4.0-h-tiny"), tp_size=4)  # one group kept per rank
    assert granite.conv_elements == (768 + 2 * 1 * 128) * 3 and granite.ssm_elements == 12 * 64 * 128
    odd = state_size(nemotron, tp_size=3)  # 128 heads do not split three ways
    assert not odd.sharded and odd.ssm_elements == 128 * 64 * 128


def test_load_model_config_paths(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(SIXTY_FOUR_LAYERS))
    assert load_model_config(tmp_path) == SIXTY_FOUR_LAYERS
    assert load_model_config(str(tmp_path / "config.json")) == SIXTY_FOUR_LAYERS
    with pytest.raises(ConfigError, match="llama-3.1-8b"):
        load_model_config("no-such-model")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ConfigError, match="bad.json"):
        load_model_config(tmp_path / "bad.json")


# -- estimates --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "published"),
    [
        ("llama-3.1-8b", 8_030_261_248),
        ("llama-3.1-70b", 70_553_706_496),
        ("mistral-7b-v0.1", 7_241_732_096),
        ("smollm2-135m", 134_515_008),
        ("qwen3-8b", 8.19e9),
        ("gemma-2-9b", 9.24e9),
        ("deepseek-v2-lite", 15.7e9),
        ("deepseek-v3", 671e9),
        ("gpt-oss-20b", 20.9e9),
        ("jamba-mini-1.6", 51.6e9),
        ("nemotron-h-8b", 8.1e9),
        ("qwen3-next-80b-a3b", 80e9),
    ],
)
def test_parameter_estimates_near_published_counts(name: str, published: float) -> None:
    total = estimate_parameters(load_model_config(name)).total
    assert abs(total - published) / published < 0.01


def test_weight_estimate_llama_8b_and_quantized() -> None:
    term = estimate_weight_bytes(LLAMA_8B)
    assert term.source is TermSource.ESTIMATED and term.bytes == 8_030_261_248 * 2
    assert estimate_weight_bytes(LLAMA_8B, tp_size=2).bytes == 8_030_261_248
    gpt_oss = estimate_weight_bytes(load_model_config("gpt-oss-20b")).bytes
    assert 12e9 < gpt_oss < 15e9  # MXFP4 experts: the checkpoint is about 13 GB
    v3 = estimate_weight_bytes(load_model_config("deepseek-v3")).bytes
    assert 670e9 < v3 < 680e9  # fp8: about one byte per parameter


def test_activation_estimate_formula() -> None:
    term = estimate_activation_bytes(LLAMA_8B)
    assert term.bytes == 8192 * (4 * 4096 + 2 * 14336) * 2 + 256 * 128256 * 4


def test_estimates_are_marked() -> None:
    plan = plan_kv_cache(LLAMA_8B, gpu_memory_bytes="80GB")
    b = plan.budget
    assert b.weights.estimated and b.activations.estimated and b.other.estimated
    assert b.other.bytes == GiB
    assert b.kv_budget_bytes == 72 * GB - b.weights.bytes - b.activations.bytes - GiB
    assert plan.num_blocks == b.kv_budget_bytes // (2 * MiB)
    given = exact(LLAMA_8B, "80GB", weights_bytes="16GB")
    assert given.budget.weights.source is TermSource.GIVEN and given.budget.weights.bytes == 16 * GB


# -- sizes, limits and errors -------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("80GB", 80 * 10**9),
        ("80 GiB", 80 * 2**30),
        ("80gib", 80 * 2**30),
        ("1.5GiB", 3 * 2**29),
        ("512MiB", 2**29),
        ("100KB", 100_000),
        ("1TB", 10**12),
        ("12345", 12345),
        ("7B", 7),
        (4096, 4096),
    ],
)
def test_parse_size(text: str | int, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize(
    ("text", "match"),
    [("80G", "ambiguous"), ("eighty", "not a size"), ("-5GB", "negative"), ("5XB", "unknown unit"), ("", "not a size")],
)
def test_parse_size_errors_name_the_field(text: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match) as info:
        parse_size(text, field="gpu_memory")
    assert "gpu_memory" in str(info.value)


@pytest.mark.parametrize("utilization", [0, 1.5, -0.1, float("nan")])
def test_utilization_outside_range(utilization: float) -> None:
    with pytest.raises(ConfigError, match=r"gpu_memory_utilization must be in \(0, 1\]"):
        plan_kv_cache(LLAMA_8B, gpu_memory_bytes="80GB", gpu_memory_utilization=utilization)


def test_weights_larger_than_the_budget() -> None:
    with pytest.raises(ConfigError, match="no memory left for the KV cache: weights"):
        exact(LLAMA_8B, "80GB", weights_bytes="81GB")


def test_budget_smaller_than_one_block() -> None:
    with pytest.raises(ConfigError, match="smaller than one pool block"):
        exact(LLAMA_8B, 2 * MiB - 1)


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"tp_size": 0}, "tp_size"),
        ({"block_size": -16}, "block_size"),
        ({"max_model_len": 0}, "max_model_len"),
        ({"kv_dtype": "int4"}, "kv_cache_dtype"),
        ({"gpu_memory_bytes": -1}, "gpu_memory_bytes"),
    ],
)
def test_invalid_arguments_name_the_field(kw: dict, field: str) -> None:
    args = {"gpu_memory_bytes": "80GB", **kw}
    with pytest.raises(ConfigError, match=field):
        plan_kv_cache(LLAMA_8B, **args)


def test_request_longer_than_the_pool() -> None:
    # 1000 blocks of 16 tokens: a 131,072-token request does not fit, 16,000 tokens do
    plan = exact(LLAMA_8B, 1000 * 2 * MiB)
    assert plan.num_blocks == 1000
    assert not plan.fits_max_model_len
    assert plan.max_fitting_model_len == 16_000
    assert any("16,000" in note for note in plan.notes)
    assert exact(LLAMA_8B, 1000 * 2 * MiB, max_model_len=16_000).fits_max_model_len


def test_longest_fitting_request_with_a_sliding_window() -> None:
    # gemma-2: a request of L tokens holds cdiv(L, 16) full blocks + min(cdiv(L, 16), 257) sliding blocks
    plan = exact(load_model_config("gemma-2-9b"), 600 * 21 * 131_072)
    assert plan.num_blocks == 600 and not plan.fits_max_model_len
    assert plan.max_fitting_model_len == (600 - 257) * 16


def test_plan_is_frozen_and_json_ready() -> None:
    plan = exact(load_model_config("nemotron-h-8b"), 72 * 10**9)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.num_blocks = 1  # type: ignore[misc]
    data = json.loads(json.dumps(plan.to_dict()))
    assert data["num_blocks"] == plan.num_blocks
    assert data["groups"][0]["spec"]["kind"] == "mamba"
    assert data["groups"][-1]["spec"]["page_bytes"] == plan.pool_block_bytes // 4
    assert data["budget"]["weights"]["source"] == "given"
    assert data["capacity_line"] == plan.capacity_line


def test_group_pages_are_shared_by_the_whole_pool() -> None:
    specs = layer_specs_from_config(load_model_config("qwen3-next-80b-a3b"))
    groups = group_layers(specs)
    assert pool_block_bytes(groups) == 12 * 544 * 2048
