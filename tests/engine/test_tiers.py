"""KV tiers through the whole engine, on a tiny model: greedy tokens are the same wherever the KV came from.

A pool of 16 usable blocks of 4 tokens holds barely two 30-token prompts, so
replaying four of them forces everything through the tiers. Every engine test
compares token for token with an engine that computes everything.
"""

from __future__ import annotations

import pytest

from kvpool.engine.llm_engine import LLMEngine
from kvpool.engine.sampling import SamplingParams
from kvpool.errors import ConfigError
from kvpool.tiers.redis_store import RedisStore
from tests.engine.tiny_models import build_model, random_prompt, save_model

pytestmark = [pytest.mark.engine, pytest.mark.slow]  # a dozen engine start-ups

BLOCK = 4
BLOCK_BYTES = 2 * 2 * BLOCK * 2 * 16 * 4  # layers x (K, V) x tokens x KV heads x head dim x float32
TINY_POOL = dict(
    block_size=BLOCK,
    kv_cache_memory=17 * BLOCK_BYTES,
    max_model_len=64,
    max_num_batched_tokens=64,
    max_num_seqs=8,
    threads=1,  # one reduction order: runs are compared token for token
)
PARAMS = SamplingParams(max_tokens=6, ignore_eos=True)
PROMPT_LEN = 30
LOADABLE = (PROMPT_LEN - 1) // BLOCK * BLOCK  # 28: whole blocks before the last prompt token
#: Disk and Redis tiers opened without a secret (their checksum catches damage, not tampering), and every hit
#: loaded (load or compute would decide by this machine's timing, which a loaded machine changes): what these test.
TIERS_AS_TESTED = {"kv_tier_unauthenticated": True, "kv_tier_always_load": True}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_model(build_model("llama"), tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def reference(folder):
    """Greedy outputs with everything computed (a pool large enough never to evict)."""
    engine = LLMEngine(folder, block_size=BLOCK, kv_cache_memory=200 * BLOCK_BYTES, max_model_len=64, log=None)
    cache: dict[tuple[int, ...], tuple[int, ...]] = {}

    def tokens(prompt: list[int]) -> tuple[int, ...]:
        key = tuple(prompt)
        if key not in cache:
            engine.manager.reset_prefix_cache()
            rid = engine.add_request(prompt, PARAMS)
            cache[key] = tuple(engine.run_until_done([rid])[rid].output_token_ids)
        return cache[key]

    return tokens


def prompts(seed: int, count: int = 4) -> list[list[int]]:
    return [random_prompt(PROMPT_LEN, seed * 100 + i) for i in range(count)]


def run(engine: LLMEngine, batch: list[list[int]]):
    """One request after another; their outputs in order."""
    outs = []
    for prompt in batch:
        rid = engine.add_request(prompt, PARAMS)
        outs.append(engine.run_until_done([rid])[rid])
        if engine.kv_tiers is not None:  # disk and Redis saves are written off the step: wait for them
            assert engine.kv_tiers.flush_saves(timeout=60)
    return outs


def assert_same_tokens(outs, batch, reference):
    for out, prompt in zip(outs, batch):
        assert tuple(out.output_token_ids) == reference(prompt)


def test_the_cpu_tier_serves_what_the_pool_evicted(folder, reference):
    engine = LLMEngine(folder, **TINY_POOL, kv_tiers=["cpu:1MiB"], log=None)
    batch = prompts(1)
    first = run(engine, batch)
    assert_same_tokens(first, batch, reference)
    assert all(o.cached_tokens_by_tier == {"gpu": 0} for o in first)
    again = run(engine, batch)
    assert_same_tokens(again, batch, reference)
    for out in again:
        assert out.num_cached_tokens == LOADABLE
        assert out.cached_tokens_by_tier.get("cpu", 0) > 0
        assert sum(out.cached_tokens_by_tier.values()) == LOADABLE
    assert again[0].cached_tokens_by_tier == {"gpu": 0, "cpu": LOADABLE}  # evicted from the pool long ago
    figures = engine.kv_tier_figures()["cpu"]
    assert figures["blocks_loaded"] == engine.cached_tokens_by_tier["cpu"] // BLOCK
    assert figures["bytes_loaded"] == figures["blocks_loaded"] * BLOCK_BYTES
    assert figures["failed_loads"] == 0


def test_preempted_requests_come_back_through_the_cpu_tier(folder, reference):
    engine = LLMEngine(folder, **TINY_POOL, kv_tiers=["cpu:1MiB"], log=None)
    batch = [random_prompt(20, 900 + i) for i in range(4)]
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    ids = engine.add_requests(batch, [params] * len(batch))
    outs = engine.run_until_done(ids)
    assert sum(o.num_preemptions for o in outs.values()) > 0
    big = LLMEngine(folder, block_size=BLOCK, kv_cache_memory=200 * BLOCK_BYTES, max_model_len=64, log=None)
    expected = big.run_until_done(big.add_requests(batch, [params] * len(batch)))
    for rid, eid in zip(ids, expected):
        assert outs[rid].output_token_ids == expected[eid].output_token_ids


def test_the_disk_tier_survives_a_restart(folder, reference, tmp_path):
    spec = f"disk:{tmp_path}:1MiB"
    batch = prompts(2)
    first = LLMEngine(folder, **TINY_POOL, kv_tiers=[spec], **TIERS_AS_TESTED, log=None)
    assert_same_tokens(run(first, batch), batch, reference)
    first.kv_tiers.close()
    second = LLMEngine(folder, **TINY_POOL, kv_tiers=[spec], **TIERS_AS_TESTED, log=None)  # a new engine: an empty pool
    outs = run(second, batch)
    assert_same_tokens(outs, batch, reference)
    assert [o.cached_tokens_by_tier for o in outs] == [{"gpu": 0, "disk": LOADABLE}] * len(batch)
    assert second.kv_tier_figures()["disk"]["hits"] == len(batch) * LOADABLE // BLOCK


def test_damaged_disk_entries_are_computed_and_counted(folder, reference, tmp_path):
    spec = f"disk:{tmp_path}:1MiB"
    batch = prompts(3)
    writer = LLMEngine(folder, **TINY_POOL, kv_tiers=[spec], **TIERS_AS_TESTED, log=None)
    run(writer, batch)
    writer.kv_tiers.close()
    files = sorted(p for p in tmp_path.rglob("*.kv"))
    assert files
    for i, path in enumerate(files):
        data = path.read_bytes()
        if i % 3 == 0:
            path.write_bytes(data[: len(data) // 2])  # truncated
        elif i % 3 == 1:
            path.write_bytes(data[:-5] + bytes(b ^ 0xFF for b in data[-5:]))  # corrupted payload
    reader = LLMEngine(folder, **TINY_POOL, kv_tiers=[spec], **TIERS_AS_TESTED, log=None)
    outs = run(reader, batch)
    assert_same_tokens(outs, batch, reference)
    figures = reader.kv_tier_figures()["disk"]
    assert figures["corrupt"] > 0 and figures["failed_loads"] > 0
    assert set(figures["corrupt_by_kind"]) >= {"truncated"}
    # What the loads did not deliver was computed: the figures say how much came from disk.
    assert sum(o.cached_tokens_by_tier.get("disk", 0) for o in outs) == figures["blocks_loaded"] * BLOCK


def test_entries_signed_with_another_secret_are_never_used(folder, reference, tmp_path):
    spec = f"disk:{tmp_path / 'kv'}:1MiB"
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    ours.write_text("one secret, sixteen bytes or more\n")
    theirs.write_text("another secret, just as long\n")
    batch = prompts(4, count=2)
    writer = LLMEngine(folder, **TINY_POOL, kv_tiers=[spec], kv_tier_secret_file=str(theirs), log=None)
    run(writer, batch)
    writer.kv_tiers.close()
    reader = LLMEngine(folder, **TINY_POOL, kv_tiers=[spec], kv_tier_secret_file=str(ours), log=None)
    outs = run(reader, batch)
    assert_same_tokens(outs, batch, reference)
    assert all(o.cached_tokens_by_tier.get("disk", 0) == 0 for o in outs)
    assert reader.kv_tier_figures()["disk"]["corrupt"] > 0


def test_the_redis_tier_is_shared_between_engines(folder, reference, redis_url):
    # A loaded machine can hold a reply past the store's 1 s socket timeout, which costs a hit; this test counts hits.
    redis_url += ("&" if "?" in redis_url else "?") + "socket_timeout=30"
    batch = prompts(5, count=3)
    first = LLMEngine(folder, **TINY_POOL, kv_tiers=[redis_url], **TIERS_AS_TESTED, log=None)
    assert_same_tokens(run(first, batch), batch, reference)
    second = LLMEngine(folder, **TINY_POOL, kv_tiers=["cpu:64KiB", redis_url], **TIERS_AS_TESTED, log=None)
    outs = run(second, batch)
    assert_same_tokens(outs, batch, reference)
    assert [o.cached_tokens_by_tier for o in outs] == [{"gpu": 0, "redis": LOADABLE}] * len(batch)
    # Loaded from Redis, the blocks were promoted to the CPU tier above it.
    assert second.kv_tier_figures()["cpu"]["blocks_saved"] >= len(batch) * LOADABLE // BLOCK


def test_redis_killed_mid_run_costs_hits_not_tokens(folder, reference, redis_server):
    batch = prompts(6, count=3)
    engine = LLMEngine(folder, **TINY_POOL, kv_tiers=[redis_server.url], **TIERS_AS_TESTED, log=None)
    assert_same_tokens(run(engine, batch[:1]), batch[:1], reference)
    redis_server.stop()
    outs = run(engine, batch)  # the first again (its blocks are in a Redis that is gone), then two new ones
    assert_same_tokens(outs, batch, reference)
    figures = engine.kv_tier_figures()["redis"]
    assert figures["errors"] > 0
    saved = figures["blocks_saved"]
    redis_server.start()  # an empty server comes back: the same engine saves again once its store retries
    [store] = [t.store for t in engine.kv_tiers.connector.tiers if isinstance(getattr(t, "store", None), RedisStore)]
    real_clock = store._clock
    store._clock = lambda: real_clock() + 9.0  # the store's longest backoff (8 s) has passed, without waiting it
    engine.manager.reset_prefix_cache()
    assert_same_tokens(run(engine, batch[1:]), batch[1:], reference)
    assert engine.kv_tier_figures()["redis"]["blocks_saved"] > saved
    again = LLMEngine(folder, **TINY_POOL, kv_tiers=[redis_server.url], **TIERS_AS_TESTED, log=None)
    outs = run(again, batch[1:])
    assert_same_tokens(outs, batch[1:], reference)
    assert all(o.cached_tokens_by_tier.get("redis") == LOADABLE for o in outs)


def test_bad_tier_specs_are_refused_before_loading(folder):
    for spec, match in (
        (["cpu:lots"], "size in tier spec .cpu:lots."),
        (["tape:/dev/st0"], "unknown tier spec"),
        (["cpu:1MiB", "cpu:2MiB"], "given twice"),
        ("cpu:1MiB", "list of tier specs"),
    ):
        with pytest.raises(ConfigError, match=match):
            LLMEngine(folder, **TINY_POOL, kv_tiers=spec, log=None)
    with pytest.raises(ConfigError, match="kv_tier_secret_file"):
        LLMEngine(folder, **TINY_POOL, kv_tier_secret_file="/nonexistent", log=None)
    with pytest.raises(ConfigError, match="cannot read"):
        LLMEngine(folder, **TINY_POOL, kv_tiers=["cpu:1MiB"], kv_tier_secret_file="/nonexistent/secret", log=None)
    with pytest.raises(ConfigError, match="holds no block"):
        LLMEngine(folder, **TINY_POOL, kv_tiers=["cpu:100B"], log=None)


def test_a_failed_request_leaves_no_tier_holding_its_unwritten_blocks_and_resets_none(folder, reference, monkeypatch):
    engine = LLMEngine(folder, **TINY_POOL, kv_tiers=["cpu:1MiB"], log=None)
    batch = prompts(7, count=2)
    run(engine, batch[:1])
    host = engine.kv_tiers.host
    stored = host.num_stored
    assert stored > 0
    runner = engine.setup.runner

    def broken(chunks):
        raise RuntimeError("the device fell over")

    monkeypatch.setattr(runner, "execute", broken)
    rid = engine.add_request(batch[1], PARAMS)
    [failed] = engine.step()  # its saves were planned (host blocks reserved) but never written
    monkeypatch.undo()
    assert failed.request_id == rid and "fell over" in failed.output.error.cause
    assert host.num_stored == stored  # the earlier request's blocks stay; the unwritten ones are gone
    assert engine.scheduler.num_saving == 0 and engine.manager.num_free_blocks == engine.num_blocks - 1
    engine.manager.check_invariants()
    outs = run(engine, batch)
    assert_same_tokens(outs, batch, reference)
    assert outs[0].num_cached_tokens > 0  # the first prompt's blocks were trusted: their K/V was written
    assert outs[1].num_cached_tokens == 0  # nothing of the failed request's step was


def test_damaged_and_foreign_redis_entries_are_computed_and_counted(folder, reference, redis_server):
    import redis

    batch = prompts(8, count=2)
    writer = LLMEngine(folder, **TINY_POOL, kv_tiers=[redis_server.url], **TIERS_AS_TESTED, log=None)
    run(writer, batch)
    writer.kv_tiers.close()
    client = redis.Redis.from_url(redis_server.url)
    keys = sorted(client.scan_iter(match=b"kvpool:*"))
    values = [client.get(k) for k in keys]
    assert len(keys) >= 6
    for i, (key, value) in enumerate(zip(keys, values)):
        if i % 3 == 0:
            client.set(key, value[: len(value) // 2])  # truncated
        elif i % 3 == 1:
            client.set(key, value[:-3] + bytes(b ^ 0x55 for b in value[-3:]))  # corrupted payload
        else:
            client.set(key, values[i - 1])  # another block's entry: stored under another key
    reader = LLMEngine(folder, **TINY_POOL, kv_tiers=[redis_server.url], **TIERS_AS_TESTED, log=None)
    outs = run(reader, batch)
    assert_same_tokens(outs, batch, reference)
    figures = reader.kv_tier_figures()["redis"]
    assert figures["corrupt"] > 0 and figures["failed_loads"] > 0
    assert sum(o.cached_tokens_by_tier.get("redis", 0) for o in outs) == figures["blocks_loaded"] * BLOCK


def test_models_with_sliding_windows_are_refused_tiers(tmp_path):
    folder = save_model(build_model("qwen2-hybrid"), tmp_path / "hybrid")
    with pytest.raises(ConfigError, match="one full-attention layer group"):
        LLMEngine(folder, **TINY_POOL, kv_tiers=["cpu:1MiB"], log=None)
