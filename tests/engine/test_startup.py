"""Engine startup: KV groups from the config, the memory budget, one allocation, the capacity line."""

from __future__ import annotations

import re

import pytest

from kvpool.engine import memory as engine_memory
from kvpool.engine.memory import MemorySource
from kvpool.engine.startup import EngineOptions, start_engine
from kvpool.errors import ConfigError
from kvpool.planner import plan_kv_cache
from tests.engine.tiny_models import build_model, save_model

pytestmark = pytest.mark.engine

CAPACITY = re.compile(r"^KV cache size: [\d,]+ tokens; maximum concurrency for [\d,]+ tokens per request: \d+\.\d\dx$")
PAGE = 2 * 4 * 2 * 16 * 4  # one layer's block: (K, V) x 4 tokens x 2 KV heads x 16 x float32


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return {
        kind: save_model(build_model(kind), tmp_path_factory.mktemp(kind)) for kind in ("llama", "mistral", "gemma2")
    }


def start(folder, lines=None, **kwargs):
    options = dict(model=folder, block_size=4, kv_cache_memory=64 * 1024, max_num_batched_tokens=32, max_model_len=100)
    options.update(kwargs)
    return start_engine(EngineOptions(**options), (lines if lines is not None else []).append)


@pytest.mark.parametrize(
    ("kind", "kinds", "pairs"),
    [
        ("llama", ["full_attention"], 2),
        ("mistral", ["sliding_window"], 2),
        ("gemma2", ["sliding_window", "full_attention"], 1),  # layer 0 slides, layer 1 is global
    ],
)
def test_groups_slots_and_one_allocation(kind, kinds, pairs, folders):
    lines: list[str] = []
    setup = start(folders[kind], lines)
    assert [g.kind.value for g in setup.groups] == kinds
    caches = setup.kv_caches
    assert caches.num_tensor_pairs == pairs
    pointers = {t.data_ptr() for t in caches.key_caches}
    assert len(pointers) == pairs  # layers of different groups share a slot's tensor
    # One pool block is (layers per group) pages, the planner's figure; nothing more was allocated.
    assert setup.plan.pool_block_bytes == (2 // len(kinds)) * PAGE
    assert setup.plan.num_blocks == 64 * 1024 // setup.plan.pool_block_bytes
    assert caches.nbytes == setup.plan.num_blocks * setup.plan.pool_block_bytes
    assert caches.key_caches[0].shape == (setup.plan.num_blocks, 4, 2, 16)
    assert setup.memory.source is MemorySource.GIVEN and setup.memory.kv_budget_bytes == 64 * 1024
    assert CAPACITY.match(lines[-1]), lines[-1]
    assert any("block size 4" in line for line in lines)


def test_capacity_line_is_the_planners(folders):
    lines: list[str] = []
    setup = start(folders["llama"], lines, max_model_len=100)
    config = {**setup.model.config.to_dict(), "dtype": "float32"}
    plan = plan_kv_cache(
        config, gpu_memory_bytes=64 * 1024, gpu_memory_utilization=1, weights_bytes=0, activation_bytes=0,
        other_overhead_bytes=0, kv_dtype="fp32", block_size=4, max_model_len=100,
    )  # fmt: skip
    assert lines[-1] == plan.capacity_line
    # 64 KiB / (2 layers x 1 KiB) = 32 blocks of 4 tokens; a 100-token request needs 25 blocks.
    assert plan.capacity_line == "KV cache size: 128 tokens; maximum concurrency for 100 tokens per request: 1.28x"


def test_cpu_budget_is_measured_and_reported_as_an_estimate(folders, monkeypatch):
    monkeypatch.setattr(engine_memory, "host_available_bytes", lambda: 48 * 2**20)
    lines: list[str] = []
    setup = start(folders["llama"], lines, kv_cache_memory=None, gpu_memory_utilization=1.0)
    memory = setup.memory
    assert memory.source is MemorySource.CPU_ESTIMATED and not memory.capped
    assert memory.peak_activation_bytes is not None and memory.peak_activation_bytes >= 0
    assert memory.weights_bytes == sum(p.numel() * 4 for p in setup.model.parameters()) + sum(
        b.numel() * b.element_size() for b in setup.model.buffers()
    )
    # total = resident set before loading + MemAvailable; other = that resident set.
    assert memory.total_bytes == memory.other_bytes + 48 * 2**20
    expected = memory.total_bytes - memory.weights_bytes - memory.peak_activation_bytes - memory.other_bytes
    assert memory.kv_budget_bytes == expected
    assert setup.plan.num_blocks == expected // setup.plan.pool_block_bytes
    assert any("CPU estimate" in line for line in lines)


def test_cpu_budget_is_capped(folders, monkeypatch):
    monkeypatch.setattr(engine_memory, "CPU_KV_CACHE_CAP_BYTES", 32 * 1024)
    setup = start(folders["llama"], kv_cache_memory=None, max_model_len=40)
    assert setup.memory.capped
    assert setup.memory.kv_budget_bytes == 32 * 1024
    assert setup.kv_caches.nbytes == 16 * 2 * PAGE


def test_no_memory_left_is_a_config_error(folders, monkeypatch):
    monkeypatch.setattr(engine_memory, "host_available_bytes", lambda: 0)
    with pytest.raises(ConfigError, match="no memory left for the KV cache.*pass kv_cache_memory"):
        start(folders["llama"], kv_cache_memory=None, gpu_memory_utilization=0.5)


@pytest.mark.parametrize(
    ("options", "needle"),
    [
        ({"block_size": -1}, "block_size must be a positive integer, got -1"),
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"max_model_len": 1}, "max_model_len must be an integer >= 2, got 1"),
        ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization must be in (0, 1], got 1.5"),
        ({"kv_cache_memory": "0"}, "kv_cache_memory must be positive"),
        ({"dtype": "int4"}, "'int4'"),
        ({"device": "tpu"}, "'tpu'"),
    ],
)
def test_bad_options_name_the_value(options, needle, folders):
    with pytest.raises(ConfigError, match=re.escape(needle)):
        start(folders["llama"], **options)


def test_first_use_of_the_bundled_model_is_announced(tmp_path, folders):
    from kvpool.engine.model_store import pending_conversion

    bundled = pending_conversion("SmolLM2-135M", cache_dir=tmp_path)  # nothing converted under tmp_path
    assert bundled is not None and bundled.name == "smollm2-135m"
    assert pending_conversion(folders["llama"], cache_dir=tmp_path) is None  # a folder needs no conversion
    assert not any(tmp_path.iterdir())  # asking converted nothing
