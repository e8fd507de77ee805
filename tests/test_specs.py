"""Layer specs: exact page sizes, blocks kept per request, and grouping into one shared pool."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.errors import ConfigError
from kvpool.specs import (
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheGroup,
    KVDtype,
    LayerKind,
    MambaSpec,
    MLASpec,
    SlidingWindowSpec,
    cdiv,
    group_layers,
    layers_per_pool_block,
    pool_block_bytes,
    unify_page_sizes,
)

BF16 = KVDtype.BF16


def full(block_size: int = 16, heads: int = 8, head_dim: int = 128, dtype: KVDtype = BF16) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=block_size, num_kv_heads=heads, head_dim=head_dim, dtype=dtype)


def sliding(window: int, block_size: int = 16, heads: int = 8, head_dim: int = 128) -> SlidingWindowSpec:
    return SlidingWindowSpec(
        block_size=block_size, num_kv_heads=heads, head_dim=head_dim, dtype=BF16, sliding_window=window
    )


# -- dtypes ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("bf16", KVDtype.BF16),
        ("bfloat16", KVDtype.BF16),
        ("torch.bfloat16", KVDtype.BF16),
        ("float16", KVDtype.FP16),
        ("half", KVDtype.FP16),
        ("FP16", KVDtype.FP16),
        ("fp8", KVDtype.FP8),
        ("fp8_e4m3", KVDtype.FP8),
        ("fp8_e5m2", KVDtype.FP8),
        ("float32", KVDtype.FP32),
        ("float", KVDtype.FP32),
    ],
)
def test_dtype_spellings(text: str, expected: KVDtype) -> None:
    assert KVDtype.parse(text) is expected


def test_dtype_itemsizes() -> None:
    assert [d.itemsize for d in (KVDtype.FP32, KVDtype.BF16, KVDtype.FP16, KVDtype.FP8)] == [4, 2, 2, 1]


def test_dtype_auto_means_the_model_dtype() -> None:
    assert KVDtype.parse("auto", auto=KVDtype.FP16) is KVDtype.FP16
    with pytest.raises(ConfigError, match="auto"):
        KVDtype.parse("auto")


def test_unknown_dtype_names_field_and_text() -> None:
    with pytest.raises(ConfigError, match=r"kv_cache_dtype 'int4'"):
        KVDtype.parse("int4", field="kv_cache_dtype")


# -- page bytes ----------------------------------------------------------------------


def test_full_attention_page_bytes_llama_8b() -> None:
    spec = full()
    assert spec.kind is LayerKind.FULL_ATTENTION
    assert spec.bytes_per_token == 2 * 8 * 128 * 2 == 4096
    assert spec.page_bytes == 2 * 16 * 8 * 128 * 2 == 65_536
    assert spec.sliding_window is None and spec.attention_chunk_size is None
    assert spec.prefix_cacheable


def test_fp8_halves_the_page() -> None:
    assert full(dtype=KVDtype.FP8).page_bytes == 32_768


def test_sliding_window_has_the_full_attention_page() -> None:
    spec = sliding(4096)
    assert spec.kind is LayerKind.SLIDING_WINDOW
    assert spec.page_bytes == full().page_bytes
    assert spec.sliding_window == 4096
    assert not isinstance(spec, FullAttentionSpec)  # runtimes may dispatch on the class


def test_mla_page_is_one_latent_without_factor_two() -> None:
    spec = MLASpec(block_size=16, kv_lora_rank=512, qk_rope_head_dim=64, dtype=BF16)
    assert spec.kind is LayerKind.MLA
    assert spec.page_bytes == 16 * (512 + 64) * 2 == 18_432


def test_mamba_page_is_the_state_and_padding() -> None:
    spec = MambaSpec(state_bytes=311_296, block_size=16)
    assert spec.page_bytes == 311_296
    padded = dataclasses.replace(spec, padded_page_bytes=327_680)
    assert padded.page_bytes == 327_680
    with pytest.raises(ConfigError, match="padded_page_bytes"):
        MambaSpec(state_bytes=10, block_size=16, padded_page_bytes=9)


def test_cross_attention_is_never_prefix_cached() -> None:
    spec = CrossAttentionSpec(block_size=16, num_kv_heads=8, head_dim=64, dtype=BF16)
    assert spec.kind is LayerKind.CROSS_ATTENTION
    assert spec.page_bytes == 2 * 16 * 8 * 64 * 2
    assert not spec.prefix_cacheable


def test_mamba_states_are_cacheable_at_block_boundaries() -> None:
    # The Mamba group manager caches whole states where a step starts on a block boundary.
    assert MambaSpec(state_bytes=1, block_size=16).prefix_cacheable


@pytest.mark.parametrize("bad", [0, -1, True, 1.5, "16"])
def test_invalid_sizes_name_the_field(bad: object) -> None:
    with pytest.raises(ConfigError, match=r"FullAttentionSpec\.num_kv_heads"):
        FullAttentionSpec(block_size=16, num_kv_heads=bad, head_dim=128, dtype=BF16)  # type: ignore[arg-type]


def test_dtype_must_be_an_enum() -> None:
    with pytest.raises(ConfigError, match="dtype"):
        FullAttentionSpec(block_size=16, num_kv_heads=8, head_dim=128, dtype="bf16")  # type: ignore[arg-type]


def test_specs_are_frozen_keyword_only_and_slotted() -> None:
    spec = full()
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.block_size = 32  # type: ignore[misc]
    assert not hasattr(spec, "__dict__")
    with pytest.raises(TypeError):
        FullAttentionSpec(16, 8, 128, BF16)  # type: ignore[misc]
    assert spec.with_block_size(32) == full(block_size=32)


# -- blocks per request --------------------------------------------------------------


def test_full_attention_keeps_every_block() -> None:
    assert full().blocks_per_request(131_072) == 8192
    assert full().blocks_per_request(17) == 2


def test_sliding_window_keeps_only_the_window() -> None:
    spec = sliding(1024)
    # (1024 - 1) previous tokens need 64 blocks, plus one for a window that straddles a boundary
    assert spec.blocks_per_request(131_072) == 65
    assert spec.blocks_per_request(100) == 7  # a short request holds all its blocks
    assert sliding(128).blocks_per_request(131_072) == 9


def test_chunked_local_keeps_one_chunk() -> None:
    spec = ChunkedLocalAttentionSpec(block_size=16, num_kv_heads=8, head_dim=128, dtype=BF16, attention_chunk_size=8192)
    assert spec.kind is LayerKind.CHUNKED_LOCAL
    assert spec.attention_chunk_size == 8192 and spec.sliding_window is None
    assert spec.blocks_per_request(1_000_000) == 512
    assert spec.blocks_per_request(1000) == 63
    odd = dataclasses.replace(spec, attention_chunk_size=100)
    assert odd.blocks_per_request(10_000) == 8  # 7 blocks, plus one since chunks start mid-block


def test_mamba_keeps_the_state_a_step_reads_and_the_one_it_writes() -> None:
    state = MambaSpec(state_bytes=1000, block_size=16)
    assert state.blocks_per_request(1_000_000) == 2  # the state a step reads and the one it writes
    assert state.blocks_per_request(16) == 1  # no step crosses a block
    assert state.blocks_per_request(17) == 2


# -- grouping ------------------------------------------------------------------------


def test_uniform_model_is_one_group() -> None:
    groups = group_layers([full()] * 32)
    assert len(groups) == 1
    assert groups[0].layer_ids == tuple(range(32))
    assert groups[0].block_bytes == 32 * 65_536
    assert pool_block_bytes(groups) == 2 * 1024 * 1024


def test_gemma3_style_five_to_one() -> None:
    specs = [full(head_dim=256) if (i + 1) % 6 == 0 else sliding(1024, head_dim=256) for i in range(48)]
    groups = group_layers(specs)
    assert [g.kind for g in groups] == [LayerKind.SLIDING_WINDOW] * 5 + [LayerKind.FULL_ATTENTION]
    assert all(g.num_layers == 8 for g in groups)
    # the 40 sliding layers are dealt round-robin into 5 groups
    assert groups[0].layer_ids == (0, 6, 12, 18, 24, 30, 36, 42)
    assert groups[5].layer_ids == (5, 11, 17, 23, 29, 35, 41, 47)
    assert layers_per_pool_block(groups) == 8
    assert pool_block_bytes(groups) == 8 * 131_072


def test_near_equal_collections_are_padded_not_split() -> None:
    # 12 sliding + 13 full: the group size is 13 and the sliding group is one short
    specs = [sliding(128)] * 12 + [full()] * 13
    groups = group_layers(specs)
    assert [g.num_layers for g in groups] == [12, 13]
    assert layers_per_pool_block(groups) == 13
    assert pool_block_bytes(groups) == 13 * 65_536


def test_mamba_state_raises_the_attention_block_size() -> None:
    # Jamba-like: 1 attention layer in 8, Mamba state 311,296 B > 65,536 B attention page
    specs = [full() if i % 8 == 4 else MambaSpec(state_bytes=311_296, block_size=16) for i in range(32)]
    unified = unify_page_sizes(specs)
    attention = [s for s in unified if s.kind is LayerKind.FULL_ATTENTION]
    assert {s.block_size for s in attention} == {16 * 5}  # cdiv(311296, 65536) = 5
    assert {s.page_bytes for s in unified} == {80 * 4096}
    states = [s for s in unified if isinstance(s, MambaSpec)]
    assert states[0].state_bytes == 311_296 and states[0].padded_page_bytes == 327_680
    groups = group_layers(specs)
    assert len(groups) == 8 and layers_per_pool_block(groups) == 4
    assert groups[-1].kind is LayerKind.FULL_ATTENTION and groups[-1].layer_ids == (4, 12, 20, 28)
    assert pool_block_bytes(groups) == 4 * 327_680


def test_small_state_is_padded_without_raising_block_size() -> None:
    specs = [full(), MambaSpec(state_bytes=1000, block_size=16)]
    unified = unify_page_sizes(specs)
    assert unified[0] == full()
    assert unified[1].page_bytes == 65_536 and unified[1].state_bytes == 1000


def test_smaller_attention_page_gets_a_proportionally_larger_block() -> None:
    unified = unify_page_sizes([full(head_dim=128), full(head_dim=64)])
    assert [s.block_size for s in unified] == [16, 32]
    assert {s.page_bytes for s in unified} == {65_536}


def test_incompatible_attention_pages_are_an_error() -> None:
    with pytest.raises(ConfigError, match="cannot share one pool"):
        unify_page_sizes([full(head_dim=128), full(head_dim=96)])


def test_state_only_model() -> None:
    groups = group_layers([MambaSpec(state_bytes=500, block_size=16)] * 4)
    assert len(groups) == 1 and groups[0].page_bytes == 500


def test_empty_and_non_spec_input_are_errors() -> None:
    with pytest.raises(ConfigError, match="empty"):
        group_layers([])
    with pytest.raises(ConfigError, match="layer 1"):
        group_layers([full(), "full"])  # type: ignore[list-item]


def test_group_accessors_for_runtimes() -> None:
    group = KVCacheGroup(spec=sliding(4096), layer_ids=(0, 2))
    assert group.kind is LayerKind.SLIDING_WINDOW
    assert (group.block_size, group.sliding_window, group.attention_chunk_size) == (16, 4096, None)
    assert group.block_bytes == 2 * 65_536
    with pytest.raises(ConfigError, match="ascending"):
        KVCacheGroup(spec=full(), layer_ids=(2, 0))
    with pytest.raises(ConfigError, match="empty"):
        KVCacheGroup(spec=full(), layer_ids=())


def test_pool_block_bytes_rejects_unequal_pages() -> None:
    groups = (KVCacheGroup(spec=full(), layer_ids=(0,)), KVCacheGroup(spec=full(head_dim=64), layer_ids=(1,)))
    with pytest.raises(ConfigError, match="equal page bytes"):
        pool_block_bytes(groups)


_spec_choices = st.sampled_from(
    [full(), sliding(512), sliding(4096), full(head_dim=64), MambaSpec(state_bytes=200_000, block_size=16)]
)


@settings(max_examples=200, deadline=None)
@given(st.lists(_spec_choices, min_size=1, max_size=60))
def test_grouping_partitions_layers_with_equal_pages(specs: list) -> None:
    groups = group_layers(specs)
    ids = sorted(i for g in groups for i in g.layer_ids)
    assert ids == list(range(len(specs)))  # every layer exactly once
    assert len({g.page_bytes for g in groups}) == 1
    width = layers_per_pool_block(groups)
    assert all(1 <= g.num_layers <= width for g in groups)
    assert pool_block_bytes(groups) == width * groups[0].page_bytes
    unified = unify_page_sizes(specs)
    for g in groups:  # each group's layers share one (unified) spec
        assert {unified[i] for i in g.layer_ids} == {g.spec}
    assert group_layers(specs) == groups  # deterministic
    for spec in unified:
        if not isinstance(spec, MambaSpec):
            assert spec.block_size % 16 == 0


def test_cdiv() -> None:
    assert [cdiv(0, 16), cdiv(1, 16), cdiv(16, 16), cdiv(17, 16)] == [0, 1, 1, 2]
