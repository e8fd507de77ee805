"""Tier entries name the weights: a same-shape model never reads another's KV, and the digest is remembered."""

from __future__ import annotations

import time

import pytest
import torch

from kvpool.engine import model_store
from kvpool.engine.llm_engine import LLMEngine
from kvpool.engine.startup import EngineOptions
from kvpool.errors import ConfigError
from kvpool.tiers import weights
from kvpool.tiers.weights import model_digest
from tests.engine.test_tiers import PARAMS, TIERS_AS_TESTED, TINY_POOL, prompts, run
from tests.engine.tiny_models import build_model, save_model

LATER = 10**10  # ten seconds, in nanoseconds: hashing "later" makes freshly written files safe to remember


def later() -> int:
    return time.time_ns() + LATER


def other_weights():
    """The tiny llama with every weight nudged: identical shapes and config, other KV."""
    model = build_model("llama")
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.05)
    return model


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("same-shapes")
    return save_model(build_model("llama"), root / "a"), save_model(other_weights(), root / "b")


def tokens(outs):
    return [tuple(o.output_token_ids) for o in outs]


@pytest.mark.engine
@pytest.mark.slow
def test_same_shapes_other_weights_never_share_tier_entries(folders, tmp_path, redis_server, monkeypatch):
    import redis

    redis_url = redis_server.url  # a Redis of its own: the tiny models' namespaces are the same in every run
    monkeypatch.setenv(model_store.CACHE_DIR_ENV, str(tmp_path / "cache"))
    a, b = folders
    tiers = [f"disk:{tmp_path / 'kv'}:1MiB", redis_url]
    batch = prompts(11, count=2)
    b_alone = tokens(run(LLMEngine(b, **TINY_POOL, log=None), batch))
    assert b_alone != tokens(run(LLMEngine(a, **TINY_POOL, log=None), batch))  # the weights really differ
    writer = LLMEngine(a, **TINY_POOL, kv_tiers=tiers, **TIERS_AS_TESTED, log=None)
    run(writer, batch)
    reader = LLMEngine(b, **TINY_POOL, kv_tiers=tiers, **TIERS_AS_TESTED, log=None)
    outs = run(reader, batch)
    assert tokens(outs) == b_alone
    assert all(o.cached_tokens_by_tier.get("disk", 0) == o.cached_tokens_by_tier.get("redis", 0) == 0 for o in outs)
    a_disk, b_disk = writer.kv_tiers.worker.stores["disk"], reader.kv_tiers.worker.stores["disk"]
    a_redis, b_redis = writer.kv_tiers.worker.stores["redis"], reader.kv_tiers.worker.stores["redis"]
    assert a_disk.root != b_disk.root and a_redis.prefix != b_redis.prefix  # each model its own namespace
    # The first model's entries put where the second looks (a copied directory, a renamed key) are foreign.
    for path in a_disk.root.rglob("*.kv"):
        target = b_disk.root / path.relative_to(a_disk.root)
        target.parent.mkdir(exist_ok=True)
        target.write_bytes(path.read_bytes())
    client = redis.Redis.from_url(redis_url)
    planted = 0
    for key in client.scan_iter(match=a_redis.prefix + b"*"):
        client.set(b_redis.prefix + key[len(a_redis.prefix) :], client.get(key))
        planted += 1
    assert planted > 0
    for tier, spec in zip(("disk", "redis"), tiers):  # one tier each: a refused disk entry ends the lookup
        fresh = LLMEngine(b, **TINY_POOL, kv_tiers=[spec], **TIERS_AS_TESTED, log=None)
        outs = run(fresh, batch)
        assert tokens(outs) == b_alone
        assert all(o.cached_tokens_by_tier.get(tier, 0) == 0 for o in outs)
        figures = fresh.kv_tier_figures()[tier]
        assert figures["hits"] == 0 and figures["corrupt_by_kind"].get("foreign layout", 0) > 0
        assert figures["removed"] > 0  # under its own namespace, a refused entry is removed
    # the first model still finds its own entries, untouched
    again = LLMEngine(a, **TINY_POOL, kv_tiers=tiers[1:], **TIERS_AS_TESTED, log=None)
    assert all(o.cached_tokens_by_tier.get("redis", 0) > 0 for o in run(again, batch))


def count_hashes(monkeypatch) -> list[str]:
    hashed: list[str] = []
    real = weights._hash_file

    def counting(path):
        hashed.append(path.name)
        return real(path)

    monkeypatch.setattr(weights, "_hash_file", counting)
    return hashed


def test_the_digest_is_remembered_while_files_are_unchanged(tmp_path, monkeypatch):
    folder = save_model(build_model("llama"), tmp_path / "model", tokenizer=True)
    hashed = count_hashes(monkeypatch)
    first = model_digest(folder, cache_dir=tmp_path / "cache", clock=later)
    names = sorted(p.name for p in folder.iterdir())
    assert sorted(hashed) == names and first.hashed_files == first.files == len(names)
    assert first.value.startswith("sha256:") and len(first.value) == len("sha256:") + 64
    hashed.clear()
    second = model_digest(folder, cache_dir=tmp_path / "cache", clock=later)
    assert hashed == [] and second.hashed_files == 0 and second.value == first.value
    elsewhere = model_digest(folder, cache_dir=tmp_path / "other cache", clock=later)
    assert len(hashed) == len(names) and elsewhere.value == first.value  # the value does not depend on the cache


def test_files_written_just_now_are_not_remembered(tmp_path, monkeypatch):
    folder = save_model(build_model("llama"), tmp_path / "model")
    hashed = count_hashes(monkeypatch)
    model_digest(folder, cache_dir=tmp_path / "cache")  # within a timestamp tick of their writes: not trusted
    model_digest(folder, cache_dir=tmp_path / "cache")
    assert len(hashed) == 2 * len(list(folder.iterdir()))


def test_a_folder_changed_in_place_gets_a_new_digest(tmp_path, monkeypatch):
    folder = save_model(build_model("llama"), tmp_path / "model")
    before = model_digest(folder, cache_dir=tmp_path / "cache", clock=later)
    weights = folder / "model.safetensors"
    inode, size = weights.stat().st_ino, weights.stat().st_size
    new = (save_model(other_weights(), tmp_path / "new") / "model.safetensors").read_bytes()
    assert len(new) == size and new != weights.read_bytes()
    with open(weights, "r+b") as f:  # the same file rewritten in place: same inode, same size
        f.write(new)
    assert weights.stat().st_ino == inode
    hashed = count_hashes(monkeypatch)
    after = model_digest(folder, cache_dir=tmp_path / "cache", clock=later)
    assert after.value != before.value
    assert hashed == ["model.safetensors"]  # only what changed is read again


def test_bad_folders_are_named(tmp_path):
    with pytest.raises(ConfigError, match="nowhere"):
        model_digest(tmp_path / "nowhere", cache_dir=tmp_path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="empty"):
        model_digest(tmp_path / "empty", cache_dir=tmp_path)


def test_a_damaged_digest_cache_is_rebuilt(tmp_path, monkeypatch):
    folder = save_model(build_model("llama"), tmp_path / "model")
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / model_store.DIGEST_CACHE_FILE).write_text("{not json")
    value = model_digest(folder, cache_dir=cache, clock=later).value
    hashed = count_hashes(monkeypatch)
    assert model_digest(folder, cache_dir=cache, clock=later).value == value and hashed == []


@pytest.mark.parametrize("bad", ["", "has space", "tab\there", "é", "x" * 129, 7])
def test_bad_namespaces_are_refused_by_name(bad):
    with pytest.raises(ConfigError, match="kv_tier_namespace") as info:
        EngineOptions(model="m", kv_tiers=("cpu:1MiB",), kv_tier_namespace=bad)
    assert repr(bad)[:40] in str(info.value)


def test_a_namespace_needs_a_tier():
    with pytest.raises(ConfigError, match="'prod'"):
        EngineOptions(model="m", kv_tier_namespace="prod")


@pytest.mark.engine
def test_a_namespace_replaces_the_digest(folders, tmp_path, monkeypatch):
    monkeypatch.setattr(weights, "_hash_file", lambda path: pytest.fail(f"{path} was hashed"))
    lines: list[str] = []
    engine = LLMEngine(
        folders[0],
        **TINY_POOL,
        kv_tiers=[f"disk:{tmp_path}:1MiB"],
        kv_tier_namespace="prod-7",
        **TIERS_AS_TESTED,
        log=lines.append,
    )
    store = engine.kv_tiers.worker.stores["disk"]
    assert store._codec.fingerprint.weights == "namespace:prod-7"
    assert any("namespace 'prod-7'" in line for line in lines)
    out = run(engine, prompts(12, count=1))
    assert out[0].num_output_tokens == PARAMS.max_tokens


def test_the_flag_reaches_generate_and_serve():
    from click.testing import CliRunner

    from kvpool.cli.generate import generate
    from kvpool.cli.serve import serve

    for command in (generate, serve):
        assert "--kv-tier-namespace" in CliRunner().invoke(command, ["--help"]).output
