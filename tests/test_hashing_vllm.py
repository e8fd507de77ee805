"""vLLM's block hashes (sha256, sha256_cbor): bit-identical to recorded vLLM 0.33 hashes, and live where vLLM runs."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool import BlockHasher, ConfigError, HashAlgo, KVCacheManager, MultiModalInput, Request
from kvpool.hashing import VLLM_DEFAULT_SEED

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures" / "vllm_hashes"
ALGOS = ["sha256", "sha256_cbor"]


def _cases(directory: Path, algo: str) -> list[dict]:
    data = json.loads((directory / f"{algo}.json").read_text())
    assert data["algorithm"] == algo and data["cases"]
    return data["cases"]


def _set_seed(monkeypatch: pytest.MonkeyPatch, seed: str | None) -> None:
    if seed is None:
        monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    else:
        monkeypatch.setenv("PYTHONHASHSEED", seed)


def check_recording(directory: Path, monkeypatch: pytest.MonkeyPatch) -> int:
    """Every recorded case hashes the same through hash_token_ids and, where it can, through a manager."""
    checked = 0
    for algo in ALGOS:
        for case in _cases(directory, algo):
            _set_seed(monkeypatch, case["seed_env"])
            bs = case["block_size"]
            media = [MultiModalInput(**m) for m in case["mm_inputs"]]
            hasher = BlockHasher(bs, algo)
            assert hasher.root.hex() == case["none_hash"]
            assert hasher.seed_name == ("vllm-default" if case["seed_env"] is None else "PYTHONHASHSEED")
            got = hasher.hash_token_ids(
                case["token_ids"],
                cache_salt=case["cache_salt"],
                lora_name=case["lora_name"],
                lora_path=case["lora_path"],
                mm_inputs=media,
            )
            want = case["block_hashes"]
            assert [h.hex() for h in got] == want, (algo, case["seed_env"], bs)
            assert len(want) == len(case["token_ids"]) // bs
            # A manager's request (prompt first, outputs appended) gets the same hashes;
            # kvpool's requests name adapters only, so the adapter's path must equal its name.
            if case["lora_path"] == case["lora_name"]:
                mgr = KVCacheManager(8, bs, hash_algo=algo)
                prompt = case["num_prompt_tokens"]
                request = Request(
                    "r",
                    case["token_ids"][:prompt],
                    cache_salt=case["cache_salt"],
                    lora_name=case["lora_name"],
                    mm_inputs=media,
                )
                mgr.hash_request(request)
                request.append_output_token_ids(case["token_ids"][prompt:])
                assert [h.hex() for h in request.block_hashes] == want
            checked += 1
    return checked


def test_hashes_equal_the_recorded_vllm_hashes(monkeypatch):
    assert check_recording(FIXTURES, monkeypatch) == 48


def test_the_recording_covers_salts_loras_media_seeds_and_block_sizes():
    cases = _cases(FIXTURES, "sha256") + _cases(FIXTURES, "sha256_cbor")
    assert {c["seed_env"] for c in cases} == {None, "0", "12345"}
    assert {c["block_size"] for c in cases} >= {1, 4, 8, 16, 32, 64}
    assert any(c["cache_salt"] and c["lora_name"] and c["mm_inputs"] for c in cases)
    assert any(c["lora_name"] and c["lora_path"] != c["lora_name"] for c in cases)
    assert any(len(c["token_ids"]) > c["num_prompt_tokens"] for c in cases)  # outputs hashed as they arrive
    assert any(t >= 2**31 for c in cases for t in c["token_ids"])


def _vllm_python() -> str | None:
    """A Python that can import vLLM: this one, or $VLLM_PYTHON."""
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    candidate = os.environ.get("VLLM_PYTHON")
    return candidate if candidate and shutil.which(candidate) else None


@pytest.mark.slow
def test_live_vllm_hashes_match(tmp_path, monkeypatch):
    """Record afresh with the installed vLLM and compare (vLLM is a library, not a service: skipped without it)."""
    python = _vllm_python()
    if python is None:
        pytest.skip("vLLM is not importable here; set VLLM_PYTHON to a Python that has it")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    subprocess.run(
        [python, str(ROOT / "benchmarks" / "record_vllm_hashes.py"), "--out", str(tmp_path)],
        check=True,
        env=env,
        capture_output=True,
        timeout=600,
    )
    assert check_recording(tmp_path / "vllm_hashes", monkeypatch) == 48
    recorded = json.loads((tmp_path / "vllm_events" / "batches.json").read_text())
    assert recorded["batches"] == json.loads((ROOT / "tests/fixtures/vllm_events/batches.json").read_text())["batches"]


def test_seed_rules(monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    default = BlockHasher(16, "sha256_cbor")
    assert (default.seed, default.seed_name) == (VLLM_DEFAULT_SEED, "vllm-default")
    monkeypatch.setenv("PYTHONHASHSEED", "7")
    from_env = BlockHasher(16, "sha256_cbor")
    assert (from_env.seed, from_env.seed_name) == ("7", "PYTHONHASHSEED")
    assert from_env.root != default.root
    explicit = BlockHasher(16, "sha256_cbor", seed="7")
    assert explicit.seed_name == "custom" and explicit.root == from_env.root
    # kvpool's own chain keeps its own seed, whatever the environment says
    native = BlockHasher(16)
    assert native.algo is HashAlgo.SHA256 and native.seed_name == "kvpool-default"
    monkeypatch.delenv("PYTHONHASHSEED")
    assert BlockHasher(16).root == native.root


@pytest.mark.parametrize(
    ("algo", "seed", "message"),
    [
        ("sha256", b"bytes", "must be a non-empty string"),
        ("sha256_cbor", "", "must be a non-empty string"),
        ("kvpool_sha256", "text", "must be non-empty bytes"),
    ],
)
def test_a_seed_of_the_wrong_kind_is_refused(algo, seed, message):
    with pytest.raises(ConfigError, match=message):
        BlockHasher(16, algo, seed=seed)


def test_names_and_properties():
    assert HashAlgo.parse("sha256") is HashAlgo.VLLM_SHA256
    assert HashAlgo.parse("sha256_cbor") is HashAlgo.VLLM_SHA256_CBOR
    assert HashAlgo.parse("kvpool_sha256") is HashAlgo.SHA256
    assert all(a.is_cryptographic for a in (HashAlgo.VLLM_SHA256, HashAlgo.VLLM_SHA256_CBOR))
    assert HashAlgo.VLLM_SHA256.is_vllm and not HashAlgo.SHA256.is_vllm
    assert KVCacheManager(8, 4).hasher.algo is HashAlgo.SHA256  # kvpool's chain stays the default
    assert not BlockHasher(4, "sha256").stores_contents


def test_cbor_needs_the_events_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "cbor2", None)
    with pytest.raises(ConfigError, match=r"kvpool\[events\]"):
        BlockHasher(16, "sha256_cbor")
    BlockHasher(16, "sha256")  # pickle needs nothing


def test_lora_path_needs_a_lora_name_and_enters_only_vllm_hashes():
    with pytest.raises(ConfigError, match="without a lora_name"):
        BlockHasher(4, "sha256").hash_token_ids(range(8), lora_path="/a")
    vllm = BlockHasher(4, "sha256")
    assert vllm.hash_token_ids(range(8), lora_name="a", lora_path="/a") != vllm.hash_token_ids(
        range(8), lora_name="a", lora_path="/b"
    )
    native = BlockHasher(4)
    assert native.hash_token_ids(range(8), lora_name="a", lora_path="/a") == native.hash_token_ids(
        range(8), lora_name="a"
    )


def test_a_request_bound_to_a_vllm_hasher_cannot_move_to_another_algorithm():
    request = Request("r", list(range(8)))
    KVCacheManager(8, 4, hash_algo="sha256").hash_request(request)
    with pytest.raises(ValueError, match="algo=sha256"):
        KVCacheManager(8, 4, hash_algo="sha256_cbor").hash_request(request)


@settings(max_examples=60, deadline=None)
@given(
    tokens=st.lists(st.integers(min_value=0, max_value=2**32 - 1), min_size=1, max_size=40),
    block_size=st.sampled_from([1, 2, 4]),
    salt=st.sampled_from([None, "t"]),
    lora=st.sampled_from([None, "adapter"]),
    media=st.lists(st.tuples(st.integers(0, 30), st.integers(1, 6)), max_size=3),
    split=st.integers(min_value=1, max_value=40),
    algo=st.sampled_from(ALGOS),
)
def test_incremental_hashing_equals_hashing_at_once(tokens, block_size, salt, lora, media, split, algo):
    items = sorted(
        (
            MultiModalInput(identifier=f"img{i}", offset=o, length=n)
            for i, (o, n) in enumerate(media)
            if o + n <= min(split, len(tokens))
        ),
        key=lambda m: m.offset,
    )
    hasher = BlockHasher(block_size, algo, seed="s")
    expected = hasher.hash_token_ids(tokens, cache_salt=salt, lora_name=lora, mm_inputs=items)
    cut = min(split, len(tokens))
    request = Request("r", tokens[:cut], cache_salt=salt, lora_name=lora, mm_inputs=items)
    request._bind(hasher)
    for t in tokens[cut:]:
        request.append_output_token_ids(t)
    assert request.block_hashes == expected
