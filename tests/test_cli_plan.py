"""``kvpool plan`` through click's test runner: output, JSON, and one-line errors with exit status 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

click = pytest.importorskip("click")
from click.testing import CliRunner  # noqa: E402

from kvpool.cli.commands import cli  # noqa: E402
from kvpool.model_config import load_model_config, shipped_config_names  # noqa: E402

EXACT_40GIB = [
    "--gpu-memory", "40GiB", "--gpu-memory-utilization", "1",
    "--weights-memory", "0", "--activation-memory", "0", "--other-memory", "0",
]  # fmt: skip


def run(*args: str):
    return CliRunner().invoke(cli, ["plan", *args])


def test_capacity_line_llama_8b() -> None:
    result = run("--config", "llama-3.1-8b", *EXACT_40GIB)
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[-1] == "KV cache size: 327,680 tokens; maximum concurrency for 131,072 tokens per request: 2.50x"
    assert "20,480 blocks" in result.stdout
    assert "65,536" in result.stdout and "2,097,152" in result.stdout
    assert "GB = 10^9 B; GiB = 2^30 B" in result.stdout


def test_table_shows_every_term_and_marks_estimates() -> None:
    result = run("--config", "llama-3.1-8b", "--gpu-memory", "80GB")
    assert result.exit_code == 0, result.output
    out = result.stdout
    for label in (
        "GPU memory",
        "x gpu_memory_utilization 0.9",
        "- weights",
        "- activations",
        "- other overhead",
        "= KV cache budget",
        "/ pool block bytes",
    ):
        assert label in out
    assert "80,000,000,000" in out and "72,000,000,000" in out
    assert out.count("estimate:") == 3
    assert "16,060,522,496" in out  # 8,030,261,248 parameters x 2 bytes


def test_fp8_tp_and_block_size_options() -> None:
    result = run(
        "--config",
        "llama-3.1-8b",
        *EXACT_40GIB,
        "--kv-cache-dtype",
        "fp8",
        "--tp",
        "2",
        "--block-size",
        "32",
        "--max-model-len",
        "8192",
    )
    assert result.exit_code == 0, result.output
    # per GPU: 32 layers x 2 x 32 tokens x 4 heads x 128 x 1 byte = 1 MiB per block
    assert "= 40,960 blocks" in result.stdout
    assert result.stdout.splitlines()[-1] == (
        "KV cache size: 1,310,720 tokens; maximum concurrency for 8,192 tokens per request: 160.00x"
    )


def test_json_output() -> None:
    result = run("--config", "gemma-3-12b", *EXACT_40GIB, "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    for key in (
        "model",
        "groups",
        "budget",
        "num_blocks",
        "pool_block_bytes",
        "kv_cache_tokens",
        "max_concurrency",
        "blocks_per_request",
        "fits_max_model_len",
        "max_fitting_model_len",
        "capacity_line",
        "notes",
    ):
        assert key in data
    assert data["num_blocks"] == 40 * 2**30 // (8 * 131_072)
    assert [g["kind"] for g in data["groups"]] == ["sliding_window"] * 5 + ["full_attention"]
    assert data["groups"][0]["spec"]["sliding_window"] == 1024
    assert set(data["budget"]) >= {
        "gpu_memory_bytes",
        "usable_bytes",
        "weights",
        "activations",
        "other",
        "kv_budget_bytes",
    }


def test_list_shipped_configs() -> None:
    result = run("--list")
    assert result.exit_code == 0
    for name in shipped_config_names():
        assert name in result.stdout
    assert "24 no cache" in result.stdout  # Nemotron-H's MLP-only layers


def test_config_path(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(load_model_config("smollm2-135m")))
    result = run("--config", str(tmp_path), *EXACT_40GIB)
    assert result.exit_code == 0, result.output
    assert "tokens per request" in result.stdout.splitlines()[-1]


def test_hybrid_notes_block_size_raise() -> None:
    result = run("--config", "nemotron-h-8b", "--gpu-memory", "80GB")
    assert result.exit_code == 0, result.output
    assert "Block size: 1040 tokens (requested 16)" in result.stdout
    assert "raised from 16 to 1040" in result.stdout


def _missing_field_config(tmp_path: Path) -> str:
    config = load_model_config("llama-3.1-8b")
    del config["num_hidden_layers"]
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return str(path)


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--config", "no-such-model", "--gpu-memory", "80GB"], "no-such-model"),
        (["--config", "llama-3.1-8b", "--gpu-memory", "80G"], "--gpu-memory '80G'"),
        (["--config", "llama-3.1-8b", "--gpu-memory", "eighty"], "--gpu-memory 'eighty'"),
        (["--config", "llama-3.1-8b", "--gpu-memory", "-80GB"], "must not be negative"),
        (["--config", "llama-3.1-8b", "--gpu-memory", "80GB", "--weights-memory", "100GB"], "weights"),
        (
            ["--config", "llama-3.1-8b", "--gpu-memory", "80GB", "--gpu-memory-utilization", "1.5"],
            "gpu_memory_utilization must be in (0, 1], got 1.5",
        ),
        (
            ["--config", "llama-3.1-8b", "--gpu-memory", "80GB", "--gpu-memory-utilization", "0"],
            "gpu_memory_utilization",
        ),
        (["--config", "llama-3.1-8b", "--gpu-memory", "80GB", "--tp", "3"], "3 does not divide num_key_value_heads 8"),
        (["--config", "llama-3.1-8b", "--gpu-memory", "80GB", "--kv-cache-dtype", "int4"], "kv_cache_dtype"),
        (["--config", "llama-3.1-8b", "--gpu-memory", "80GB", "--other-memory", "5XB"], "--other-memory"),
        (["--config", "llama-3.1-8b"], "--gpu-memory"),
        (["--gpu-memory", "80GB"], "--config"),
        (["--config", "llama-3.1-8b", "--gpu-memory", "80GB", "--block-size", "0"], "block_size"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args: list[str], needle: str) -> None:
    result = run(*args)
    assert result.exit_code == 2
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert needle in lines[0]
    assert "Traceback" not in result.output


def test_missing_config_field_is_named(tmp_path: Path) -> None:
    result = run("--config", _missing_field_config(tmp_path), "--gpu-memory", "80GB")
    assert result.exit_code == 2
    assert "config.json field 'num_hidden_layers' is missing" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_click_type_errors_also_exit_2() -> None:
    result = run("--config", "llama-3.1-8b", "--gpu-memory", "80GB", "--tp", "two")
    assert result.exit_code == 2
    assert "Traceback" not in result.output
