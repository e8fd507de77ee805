"""``kvpool serve`` as a process: what it says at start, KV events wired to a subscriber, bad flags."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import httpx
import pytest
from click.testing import CliRunner

from kvpool.cli.commands import cli

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from bench_timing_leak import MODEL, serving  # noqa: E402


@pytest.mark.slow
def test_serve_process_single_tenant_unisolated_with_kv_events() -> None:
    pytest.importorskip("zmq")
    from kvpool.events import BlockStored
    from kvpool.kv_events import KVEventSubscriber, SequencedBatch

    args = [
        "--no-tenant-isolation",
        "--kv-events-endpoint", "tcp://*:0",
        "--kv-events-replay-endpoint", "tcp://*:0",
        "--metrics-prefix", "kvpool:",
        "--kv-cache-memory", "32MiB",
        "--max-model-len", "512",
    ]  # fmt: skip
    with serving(args, threads=1) as server:
        log = server.log()
        assert "single-tenant" in log
        assert "WARNING: --no-tenant-isolation" in log
        where = httpx.get(f"{server.url}/kv-events", timeout=30).json()
        assert where["enabled"] is True and where["block_size"] == 16
        assert isinstance(where["num_blocks"], int) and where["num_blocks"] > 0  # no tiers: the pool is all it holds
        port = where["endpoint"].rsplit(":", 1)[1]
        replay_port = where["replay_endpoint"].rsplit(":", 1)[1]
        local, replay = f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay_port}"
        with KVEventSubscriber(local, replay_endpoint=replay) as subscriber:
            body = {"model": MODEL, "prompt": list(range(1000, 1040)), "max_tokens": 2}
            response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)  # no key: single tenant
            assert response.status_code == 200, response.text
            # The replay socket holds every batch published, whenever the live subscription started to receive.
            stored: list[BlockStored] = []
            deadline = time.monotonic() + 60
            while not stored:
                assert time.monotonic() < deadline, "no BlockStored event was published"
                for item in subscriber.replay(0):
                    if isinstance(item, SequencedBatch):
                        stored += [e for e in item.batch.events if isinstance(e, BlockStored)]
                if not stored:
                    time.sleep(0.1)
        metrics = httpx.get(f"{server.url}/metrics", timeout=30).text
        assert 'kvpool:prompt_tokens_total{engine="0",model_name="smollm2-135m"} 40.0' in metrics


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["--api-key-file", "{missing}"], "cannot read the API key file"),
        (["--api-key-file", "{keys}"], "names no API key"),
        (["--tenant-secret-file", "{short}"], "at least 16"),
        (["--metrics-prefix", "9bad"], "metrics prefix"),
        (["--kv-events-replay-endpoint", "tcp://*:0"], "needs --kv-events-endpoint"),
        (["--kv-events-config", "{nope"], "--kv-events-config is not JSON"),
        (
            ["--kv-events-config", '{"enable_kv_cache_events": true, "endpoit": "tcp://*:5557"}'],
            "unknown keys ['endpoit']",
        ),
        (["--kv-events-config", '{"enable_kv_cache_events": 1}'], "must be true or false"),
        (
            [
                "--kv-events-config",
                '{"enable_kv_cache_events": true, "endpoint": "tcp://*:1"}',
                "--kv-events-endpoint",
                "tcp://*:2",
            ],
            "disagree",
        ),
        (["other-model", "--model", "smollm2-360m"], "the model is given twice"),
        (["--gpu-memory-utilization", "0.5", "--kv-cache-memory", "1GiB"], "leave out --kv-cache-memory"),
        (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization"),
        (["--header-timeout", "0"], "--header-timeout"),
        (["--max-connections", "0"], "--max-connections"),
        (["--api-key", "k1", "--api-key-file", "{alice}"], "also a key of tenant 'alice'"),
    ],
)
def test_bad_flags_are_refused_before_the_engine_starts(tmp_path: Path, flags: list[str], words: str) -> None:
    (tmp_path / "keys.json").write_text(json.dumps({}))
    (tmp_path / "short").write_text("tiny")
    (tmp_path / "alice.json").write_text(json.dumps({"k1": "alice"}))
    paths = {
        "missing": tmp_path / "nope.json",
        "keys": tmp_path / "keys.json",
        "short": tmp_path / "short",
        "alice": tmp_path / "alice.json",
    }
    result = CliRunner().invoke(cli, ["serve", *(str(paths[f[1:-1]]) if f[1:-1] in paths else f for f in flags)])
    assert result.exit_code == 2, result.output
    assert words in result.output
