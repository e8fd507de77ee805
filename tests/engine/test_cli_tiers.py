"""``kvpool generate --kv-tier``: separate processes share KV through Redis and through a disk directory."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from click.testing import CliRunner

from kvpool.cli.commands import cli
from tests.engine.tiny_models import build_model, save_model

pytestmark = pytest.mark.engine

BLOCK = 4
ENGINE = ["--block-size", str(BLOCK), "--kv-cache-memory", "64KiB", "--max-model-len", "96", "--max-tokens", "5"]
PROMPT = " ".join(f"w{(i * 37) % 240 + 1}" for i in range(41))  # 41 tokens with --raw: 10 full blocks


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return str(save_model(build_model("llama"), tmp_path_factory.mktemp("llama-tok"), tokenizer=True))


def generate(folder: str, *tiers: str, extra: tuple[str, ...] = ()) -> tuple[dict, str]:
    """One ``kvpool generate --json`` process; its JSON object and its stderr."""
    args = ["generate", PROMPT, "--raw", "--json", "--model", folder, *ENGINE, *extra]
    for tier in tiers:
        args += ["--kv-tier", tier]
    if any(not tier.startswith("cpu:") for tier in tiers):
        args.append("--kv-tier-unauthenticated")  # these tests share unsigned entries; the rule: test_tier_trust.py
        args.append("--kv-tier-always-load")  # every hit loads: load or compute would decide by this machine's timing
    code = "import sys; from kvpool.cli.commands import cli; sys.exit(cli())"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300, env=env, check=False
    )
    assert done.returncode == 0, done.stderr
    [line] = done.stdout.splitlines()
    return json.loads(line), done.stderr


def full_prompt_blocks(record: dict) -> int:
    return record["num_prompt_tokens"] // BLOCK


@pytest.mark.slow
def test_a_second_process_gets_the_first_ones_blocks_from_redis(folder, redis_server):
    # A Redis of its own (a shared one may hold this prompt's blocks from an earlier run), with patience for a
    # loaded machine: a reply held past the store's 1 s socket timeout would cost the hits this test counts.
    redis_url = redis_server.url + "?socket_timeout=30"
    first, _ = generate(folder, redis_url, extra=("--cache-salt", "cli-redis"))
    assert first["cached_tokens_by_tier"] == {"gpu": 0, "cpu": 0, "disk": 0, "redis": 0}
    assert first["num_cached_tokens"] == 0
    second, err = generate(folder, "cpu:1MiB", redis_url, extra=("--cache-salt", "cli-redis"))
    assert second["text"] == first["text"]
    from_redis = second["cached_tokens_by_tier"]["redis"]
    assert from_redis // BLOCK >= 0.9 * full_prompt_blocks(first)
    assert second["num_cached_tokens"] == from_redis
    assert second["num_computed_tokens"] == first["num_computed_tokens"] - from_redis
    computed = second["num_prompt_tokens"] - from_redis
    assert f"({from_redis} cached: {from_redis} redis; {computed} computed)" in err  # the log line says it in words
    assert "KV tier cpu:" in err and "KV tier redis:" in err
    for key in ("text", "num_prompt_tokens", "num_cached_tokens", "cached_tokens_by_tier", "time_to_first_token"):
        assert key in second


@pytest.mark.slow
def test_a_restarted_process_gets_its_blocks_from_disk(folder, tmp_path):
    tier = f"disk:{tmp_path}:1MiB"
    first, _ = generate(folder, tier)
    second, _ = generate(folder, tier)
    assert second["text"] == first["text"]
    assert second["cached_tokens_by_tier"]["disk"] // BLOCK >= 0.9 * full_prompt_blocks(first)


def test_bad_tier_flags_are_one_line_and_exit_2(folder, tmp_path):
    runner = CliRunner()
    result = runner.invoke(cli, ["generate", "w1", "--model", folder, *ENGINE, "--kv-tier", "tape:/dev/st0"])
    assert result.exit_code == 2
    assert "unknown tier spec 'tape:/dev/st0'" in result.stderr and "Traceback" not in result.stderr
    secret = tmp_path / "secret"
    secret.write_text("s3cret")
    result = runner.invoke(cli, ["generate", "w1", "--model", folder, *ENGINE, "--kv-tier-secret-file", str(secret)])
    assert result.exit_code == 2 and "given with kv_tiers" in result.stderr


def test_a_redis_password_is_never_logged_nor_shown(folder):
    """The start-up line names a Redis tier by its URL without the password; so does the target's repr."""
    from kvpool.tiers.redis_store import RedisTarget

    url = "redis://:not-for-logs-8a1f@127.0.0.1:1/0"  # nothing listens: the tier only misses
    record, err = generate(folder, url)
    assert record["num_output_tokens"] > 0
    assert "not-for-logs-8a1f" not in err
    assert "KV tier redis: redis://127.0.0.1:1/0" in err
    assert "not-for-logs-8a1f" not in repr(RedisTarget.parse(url))
