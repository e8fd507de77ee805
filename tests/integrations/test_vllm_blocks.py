"""The vLLM connector's worker side without vLLM: a block's tensors as an entry payload, loads, saves, refusals."""

from __future__ import annotations

import pytest
import torch

from kvpool.errors import ConfigError
from kvpool.integrations.vllm.blocks import KVBlockLayout, TierWorker
from kvpool.integrations.vllm.plan import StepPlan, VllmBlockLoad, VllmBlockSave
from kvpool.tiers import DiskStore, EntryCodec, LayoutFingerprint, TierStats

LAYERS, BLOCKS, HEADS, BS, HEAD = 3, 6, 2, 4, 8


def fingerprint(weights: str = "namespace:test") -> LayoutFingerprint:
    return LayoutFingerprint(
        architecture="LlamaForCausalLM@vllm/cpu",
        num_layers=LAYERS,
        num_kv_heads=HEADS,
        head_size=HEAD,
        dtype="bfloat16",
        block_size=BS,
        hash_algo="sha256",
        hash_seed="vllm-none-hash",
        weights=weights,
    )


def cpu_caches(seed: int = 0) -> list[torch.Tensor]:
    """vLLM-CPU's shape: [blocks, kv_heads, block_size, 2 * head_size]."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(BLOCKS, HEADS, BS, 2 * HEAD, generator=g).to(torch.bfloat16) for _ in range(LAYERS)]


def flash_caches(seed: int = 0) -> list[torch.Tensor]:
    """Flash attention's shape: [2, blocks, block_size, kv_heads, head_size]."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, BLOCKS, BS, HEADS, HEAD, generator=g).to(torch.bfloat16) for _ in range(LAYERS)]


@pytest.mark.parametrize("caches", [cpu_caches, flash_caches])
def test_a_block_round_trips_through_its_payload(caches):
    source, target = caches(1), caches(2)
    block_bytes = fingerprint().block_bytes
    src, dst = KVBlockLayout(source, BLOCKS, block_bytes), KVBlockLayout(target, BLOCKS, block_bytes)
    payload = src.read(3)
    assert payload.dtype == torch.uint8 and payload.numel() == block_bytes
    dst.write(5, payload)
    dim = 0 if caches is cpu_caches else 1
    for a, b in zip(source, target):
        assert torch.equal(a.select(dim, 3), b.select(dim, 5))
        assert not torch.equal(a.select(dim, 0), b.select(dim, 0))  # other blocks untouched


def test_a_layout_that_does_not_match_the_fingerprint_is_refused_naming_the_shape():
    with pytest.raises(ConfigError, match=r"\(6, 2, 4, 16\)"):
        KVBlockLayout(cpu_caches(), BLOCKS, fingerprint().block_bytes * 2)
    with pytest.raises(ConfigError, match="no dimension of 7 blocks"):
        KVBlockLayout(cpu_caches(), 7, fingerprint().block_bytes)


def test_a_payload_of_the_wrong_size_is_refused_naming_it():
    layout = KVBlockLayout(cpu_caches(), BLOCKS, fingerprint().block_bytes)
    with pytest.raises(ConfigError, match="got 10 torch.uint8"):
        layout.write(0, torch.zeros(10, dtype=torch.uint8))


def worker(tmp_path, caches, *, weights="namespace:test", secret=None, host_slots=None):
    codec = EntryCodec(fingerprint(weights), secret)
    store = DiskStore(tmp_path, 1 << 30, codec)
    return TierWorker(KVBlockLayout(caches, BLOCKS, codec.fingerprint.block_bytes), {"disk": store}, host_slots), store


def test_saved_blocks_load_into_another_process_s_blocks(tmp_path):
    source, target = cpu_caches(1), cpu_caches(2)
    writer, _ = worker(tmp_path, source)
    writer.save(StepPlan(saves=(VllmBlockSave(key=b"k1", block_id=2, tiers=("disk",)),)))
    reader, store = worker(tmp_path, target)
    failed = reader.load(StepPlan(loads=(VllmBlockLoad(request_id="r", tier="disk", key=b"k1", block_id=4),)))
    assert failed == set()
    assert all(torch.equal(a[2], b[4]) for a, b in zip(source, target))
    assert reader.figures.loaded["disk"] == 1 and store.stats.hits == 1


def test_the_host_tier_copies_at_its_slots(tmp_path):
    caches = cpu_caches(1)
    w, _ = worker(tmp_path, caches, host_slots=2)
    w.save(StepPlan(saves=(VllmBlockSave(key=b"k", block_id=1, tiers=("cpu",), slot=2),)))
    w.load(StepPlan(loads=(VllmBlockLoad(request_id="r", tier="cpu", key=b"k", block_id=3, slot=2),)))
    assert all(torch.equal(layer[1], layer[3]) for layer in caches)
    assert w.figures.saved["cpu"] == 1 and w.figures.loaded["cpu"] == 1


def test_corrupt_foreign_and_unsigned_entries_are_failed_loads_counted_and_untouched_blocks(tmp_path):
    secret = b"s" * 16
    writer, _ = worker(tmp_path, cpu_caches(1), secret=secret)
    writer.save(
        StepPlan(saves=tuple(VllmBlockSave(key=k, block_id=i, tiers=("disk",)) for i, k in enumerate([b"a", b"b"])))
    )
    # flip one payload byte of entry "a"
    [path] = [p for p in tmp_path.rglob("*.kv") if p.name == b"a".hex() + ".kv"]
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    target = cpu_caches(2)
    before = [layer.clone() for layer in target]
    reader, store = worker(tmp_path, target, secret=secret)
    plan = StepPlan(
        loads=(
            VllmBlockLoad(request_id="r", tier="disk", key=b"a", block_id=0),
            VllmBlockLoad(request_id="r", tier="disk", key=b"b", block_id=1),
        )
    )
    assert reader.load(plan) == {0}
    assert store.stats.corrupt_by_kind == {"checksum": 1}
    assert all(torch.equal(a[0], b[0]) for a, b in zip(before, target))  # a refused block is never written
    assert reader.figures.failed_loads["disk"] == 1 and reader.figures.loaded["disk"] == 1
    # another weights' reader does not see the entries at all (another namespace): a miss, not a load
    foreign, _ = worker(tmp_path, cpu_caches(3), weights="namespace:other", secret=secret)
    assert foreign.load(StepPlan(loads=(VllmBlockLoad(request_id="r", tier="disk", key=b"b", block_id=1),))) == {1}
    # a reader with another secret refuses the signed entry
    other, other_store = worker(tmp_path, cpu_caches(3), secret=b"t" * 16)
    assert other.load(StepPlan(loads=(VllmBlockLoad(request_id="r", tier="disk", key=b"b", block_id=1),))) == {1}
    assert other_store.stats.corrupt_by_kind == {"bad signature": 1}
    assert "1 refused (checksum 1)" in reader.describe()


class RaisingStore:
    name = "redis"
    stats = TierStats(errors=2)

    def get_many(self, keys):
        raise ConnectionError("gone")

    def put_many(self, items):
        raise ConnectionError("gone")


def test_a_store_that_raises_costs_loads_and_saves_never_the_step():
    layout = KVBlockLayout(cpu_caches(), BLOCKS, fingerprint().block_bytes)
    w = TierWorker(layout, {"redis": RaisingStore()}, None)  # type: ignore[dict-item]
    assert w.load(StepPlan(loads=(VllmBlockLoad(request_id="r", tier="redis", key=b"k", block_id=2),))) == {2}
    w.save(StepPlan(saves=(VllmBlockSave(key=b"k", block_id=2, tiers=("redis",)),)))
    assert w.figures.failed_saves["redis"] == 1
    assert "redis: 0 loaded, 1 not loaded, 0 saved, 0 refused, 2 errors" in w.describe()
