"""Hostile input to ``kvpool plan`` and ``kvpool simulate``: a short error naming the value, never a traceback.

Each class of bad input is run with several examples. Bad input exits with
status 2 and one line on stderr that names the field or option and the value;
a missing extra exits with status 1 and names the extra to install.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvpool.cli.commands import cli
from kvpool.model_config import load_model_config

ROOT = Path(__file__).resolve().parents[1]
PLAN = ["--gpu-memory", "80GB"]
SYNTHETIC = ["synthetic:shared_prefix", "--requests", "20"]


def invoke(*args: str):
    return CliRunner().invoke(cli, list(args))


def assert_refused(result, *needles: str, status: int = 2) -> str:
    """The command failed with ``status``, without a traceback; return stderr, which holds every needle."""
    assert "Traceback" not in result.output, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert result.exit_code == status, (result.exit_code, result.output)
    for needle in needles:
        assert needle in result.stderr, (needle, result.stderr)
    return result.stderr


def assert_one_line(stderr: str) -> None:
    assert len(stderr.strip().splitlines()) == 1, stderr


def names_option(stderr: str, flag: str) -> bool:
    """The message names ``--flag`` (or its keyword spelling, e.g. tp_size for --tp)."""
    return flag.lstrip("-").replace("-", "_") in stderr.replace("-", "_")


# -- plan --config FILE: every field the reader uses is checked --------------------------------------

NAN, INF = math.nan, math.inf
BAD_FIELDS = [
    ("architectures", 5),
    ("architectures", "LlamaForCausalLM"),
    ("architectures", [1, 2]),
    ("architectures", {"name": "Llama"}),
    ("num_hidden_layers", 1e12),
    ("num_hidden_layers", 10**7),
    ("num_hidden_layers", 2**64),
    ("num_hidden_layers", -1),
    ("num_hidden_layers", 0),
    ("num_hidden_layers", True),
    ("num_hidden_layers", "32"),
    ("num_hidden_layers", [32]),
    ("num_hidden_layers", 32.5),
    ("num_hidden_layers", NAN),
    ("hidden_size", "4096"),
    ("hidden_size", {"value": 4096}),
    ("hidden_size", -4096),
    ("hidden_size", False),
    ("hidden_size", INF),
    ("hidden_size", 2**40),
    ("num_attention_heads", [32]),
    ("num_key_value_heads", NAN),
    ("num_key_value_heads", True),
    ("vocab_size", -INF),
    ("vocab_size", 1e300),
    ("intermediate_size", "big"),
    ("max_position_embeddings", 10**30),
    ("max_position_embeddings", 0),
    ("head_dim", 128.5),
    ("torch_dtype", 16),
    ("torch_dtype", ["bfloat16"]),
    ("model_type", 5),
    ("tie_word_embeddings", "yes"),
    ("tie_word_embeddings", 1),
    ("quantization_config", [1]),
    ("quantization_config", "fp8"),
    ("text_config", [1]),
    ("text_config", "llama"),
    ("layer_types", 5),
    ("layer_types", "full_attention"),
    ("layer_types", [1] * 32),
    ("sliding_window", -4096),
    ("max_window_layers", -1),
    ("no_rope_layers", "yes"),
    ("mlp_only_layers", [-1]),
    ("num_experts", -8),
    ("n_shared_experts", 1.5),
    ("first_k_dense_replace", "1"),
    ("hybrid_override_pattern", 5),
]


def _config_file(tmp_path: Path, **fields: object) -> str:
    config = load_model_config("llama-3.1-8b")
    config.update(fields)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return str(path)


@pytest.mark.parametrize(("field", "value"), BAD_FIELDS, ids=[f"{f}={v!r}"[:40] for f, v in BAD_FIELDS])
def test_type_confused_config_field_is_named(tmp_path: Path, field: str, value: object) -> None:
    result = invoke("plan", "--config", _config_file(tmp_path, **{field: value}), *PLAN)
    stderr = assert_refused(result, f"config.json field {field!r}", repr(value)[:30])
    assert_one_line(stderr)
    assert result.stdout == ""


@pytest.mark.parametrize(
    ("quantization", "field", "value"),
    [
        ({"quant_method": "gptq", "bits": -4}, "quantization_config.bits", "-4"),
        ({"quant_method": "gptq", "bits": "4"}, "quantization_config.bits", "'4'"),
        ({"quant_method": 8}, "quantization_config.quant_method", "8"),
    ],
)
def test_nested_quantization_fields_are_named(tmp_path: Path, quantization: dict, field: str, value: str) -> None:
    result = invoke("plan", "--config", _config_file(tmp_path, quantization_config=quantization), *PLAN)
    assert_one_line(assert_refused(result, f"field {field!r}", value))


@pytest.mark.parametrize("entries", [5_000, 100_000])
def test_overlong_per_layer_list_is_refused(tmp_path: Path, entries: int) -> None:
    path = _config_file(tmp_path, layer_types=["full_attention"] * entries, num_hidden_layers=None)
    assert_one_line(assert_refused(invoke("plan", "--config", path, *PLAN), "'layer_types'", f"{entries:,}"))


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
        (b'{"a":' * 100_000 + b"1" + b"}" * 100_000, "nested too deeply"),
        (b"\xff\xfe\x80 not utf-8", "config.json"),
        (b'{"hidden_size": "caf\xe9"}', "config.json"),
        (b'{"vocab_size": ' + b"9" * 5000 + b"}", "config.json"),
        (b"[1, 2, 3]", "JSON object"),
        (b"", "config.json"),
    ],
    ids=["deep-list", "deep-object", "binary", "latin-1", "5000-digits", "array", "empty"],
)
def test_unreadable_config_file_is_one_line(tmp_path: Path, content: bytes, needle: str) -> None:
    path = tmp_path / "config.json"
    path.write_bytes(content)
    assert_one_line(assert_refused(invoke("plan", "--config", str(path), *PLAN), needle))


def test_config_folder_without_config_json(tmp_path: Path) -> None:
    assert_one_line(assert_refused(invoke("plan", "--config", str(tmp_path), *PLAN), str(tmp_path)))


# -- numeric options --------------------------------------------------------------------------------

PLAN_FLAGS = [
    ("--gpu-memory-utilization", "nan"),
    ("--gpu-memory-utilization", "inf"),
    ("--gpu-memory-utilization", "-inf"),
    ("--gpu-memory-utilization", "-0.5"),
    ("--tp", "-1"),
    ("--tp", "0"),
    ("--max-model-len", "-5"),
    ("--max-model-len", "0"),
    ("--block-size", "-16"),
    ("--gpu-memory", "nan"),
    ("--gpu-memory", "inf"),
    ("--gpu-memory", "-80GB"),
    ("--gpu-memory", "1e400GB"),
    ("--weights-memory", "-1"),
    ("--activation-memory", "infGiB"),
    ("--other-memory", "nan"),
]


@pytest.mark.parametrize(("flag", "value"), PLAN_FLAGS)
def test_plan_rejects_bad_numbers_naming_the_option(flag: str, value: str) -> None:
    args = ["--config", "llama-3.1-8b", *PLAN, flag, value] if flag != "--gpu-memory" else [
        "--config", "llama-3.1-8b", flag, value]  # fmt: skip
    stderr = assert_refused(invoke("plan", *args), value)
    assert names_option(stderr, flag), stderr


SIMULATE_FLAGS = [
    ("--requests", "-1"),
    ("--requests", "0"),
    ("--kv-blocks", "-1"),
    ("--kv-blocks", "0"),
    ("--kv-blocks", "nan"),
    ("--block-size", "0"),
    ("--block-size", "-16"),
    ("--max-num-seqs", "0"),
    ("--max-num-batched-tokens", "-5"),
    ("--step-overhead-ms", "nan"),
    ("--step-overhead-ms", "inf"),
    ("--step-overhead-ms", "-1"),
    ("--prefill-us-per-token", "nan"),
    ("--prefill-us-per-token", "-inf"),
    ("--prefill-us-per-token", "1e400"),
    ("--decode-us-per-seq", "inf"),
    ("--decode-us-per-seq", "-0.1"),
    ("--lookahead", "-1"),
]


@pytest.mark.parametrize(("flag", "value"), SIMULATE_FLAGS)
def test_simulate_rejects_bad_numbers_naming_the_option(flag: str, value: str) -> None:
    args = [*SYNTHETIC, "--kv-blocks", "100", "--sequential" if flag == "--lookahead" else "--json", flag, value]
    stderr = assert_refused(invoke("simulate", *args), flag, "inf" if value == "1e400" else value)
    assert names_option(stderr, flag)


def test_simulate_refuses_an_absurd_synthetic_request_count() -> None:
    stderr = assert_refused(invoke("simulate", "synthetic:agent", "--requests", "99999999999", "--kv-blocks", "10"))
    assert "99999999999" in stderr and "num_requests" in stderr


# -- simulate TRACE: files that cannot be read, lines that cannot be parsed --------------------------


def test_trace_that_is_a_folder(tmp_path: Path) -> None:
    assert_one_line(assert_refused(invoke("simulate", str(tmp_path), "--kv-blocks", "10"), str(tmp_path), "directory"))


@pytest.mark.parametrize("name", ["missing.jsonl", "no/such/folder/t.jsonl"])
def test_trace_that_is_missing(tmp_path: Path, name: str) -> None:
    path = str(tmp_path / name)
    assert_one_line(assert_refused(invoke("simulate", path, "--kv-blocks", "10"), "no such trace file", path))


def test_trace_under_a_regular_file(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    path = str(tmp_path / "file" / "t.jsonl")
    assert_one_line(assert_refused(invoke("simulate", path, "--kv-blocks", "10"), path))


GOOD = {"id": "a", "arrival_ms": 0, "output_length": 4, "segments": [{"unique": 40}]}
MOONCAKE = {"timestamp": 0, "input_length": 600, "output_length": 4, "hash_ids": [1, 2]}
BAD_LINES = [
    (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
    (b'{"id":' * 100_000 + b'"a"' + b"}" * 100_000, "nested too deeply"),
    (b"\xff\xfe\x80\x81", "malformed JSON"),
    (b'{"id": "caf\xe9", "arrival_ms": 0, "output_length": 1, "segments": []}', "malformed JSON"),
    (b"\x00\x00\x00\x00", "malformed JSON"),
    (json.dumps({**GOOD, "segments": [{"unique": 10**10}]}).encode(), "10000000000"),
    (json.dumps({**GOOD, "segments": [{"shared": "s", "length": 10**10}]}).encode(), "10000000000"),
    (json.dumps({**GOOD, "output_length": 10**12}).encode(), "1000000000000"),
    (json.dumps({**GOOD, "segments": [{"unique": 2**24}, {"unique": 2**24}]}).encode(), "33,554,432"),
    (json.dumps({**MOONCAKE, "input_length": 10**10}).encode(), "10000000000"),
    (json.dumps({**GOOD, "id": 5}).encode(), "'id'"),
    (json.dumps({**GOOD, "arrival_ms": "soon"}).encode(), "'arrival_ms'"),
    (json.dumps({**GOOD, "arrival_ms": math.nan}).encode(), "'arrival_ms'"),
    (json.dumps({**GOOD, "output_length": "4"}).encode(), "'output_length'"),
    (json.dumps({**GOOD, "output_length": 4.5}).encode(), "'output_length'"),
    (json.dumps({**GOOD, "segments": {"unique": 4}}).encode(), "'segments'"),
    (json.dumps({**GOOD, "segments": [5]}).encode(), "'segments[0]'"),
    (json.dumps({**GOOD, "segments": [{"unique": True}]}).encode(), "'segments[0].unique'"),
    (json.dumps({**GOOD, "segments": [{"tokens": [1, "2"]}]}).encode(), "'segments[0].tokens'"),
    (json.dumps({**GOOD, "cache_salt": 5}).encode(), "'cache_salt'"),
    (json.dumps({**MOONCAKE, "hash_ids": "1,2"}).encode(), "'hash_ids'"),
    (json.dumps({**MOONCAKE, "timestamp": [0]}).encode(), "'timestamp'"),
    (json.dumps({**MOONCAKE, "input_length": 600.0}).encode(), "'input_length'"),
]


@pytest.mark.parametrize(("line", "needle"), BAD_LINES, ids=[f"line{i}" for i in range(len(BAD_LINES))])
def test_bad_trace_line_is_one_line_naming_it(tmp_path: Path, line: bytes, needle: str) -> None:
    path = tmp_path / "t.jsonl"
    path.write_bytes(line + b"\n")
    stderr = assert_refused(invoke("simulate", str(path), "--kv-blocks", "100"), "t.jsonl line 1", needle)
    assert_one_line(stderr)


# -- --plot-dir that cannot exist ----------------------------------------------------------------------


@pytest.mark.parametrize("below", ["plots", "a/b/c"])
def test_plot_dir_under_a_regular_file(tmp_path: Path, below: str) -> None:
    (tmp_path / "file").write_text("x")
    plot_dir = str(tmp_path / "file" / below)
    result = invoke("simulate", *SYNTHETIC, "--kv-blocks", "100", "--plot-dir", plot_dir)
    assert_one_line(assert_refused(result, "--plot-dir", plot_dir))


def test_plot_dir_that_is_a_file(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    result = invoke("simulate", *SYNTHETIC, "--kv-blocks", "100", "--plot-dir", str(tmp_path / "file"))
    assert_refused(result, "--plot-dir", "file")


# -- requests that never fit are rejected, counted, and the replay goes on -----------------------------


def _trace(tmp_path: Path, lengths: list[int]) -> str:
    path = tmp_path / "t.jsonl"
    lines = [
        json.dumps({"id": f"r{i}", "arrival_ms": 10 * i, "output_length": 2, "segments": [{"unique": n}]})
        for i, n in enumerate(lengths)
    ]
    path.write_text("\n".join(lines) + "\n")
    return str(path)


@pytest.mark.parametrize(
    ("lengths", "rejected"),
    [([40, 40, 5000], 1), ([5000], 1), ([5000, 40], 1), ([40, 5000, 40, 6000], 2), ([5000, 6000, 7000], 3)],
)
def test_requests_larger_than_the_pool_are_rejected(tmp_path: Path, lengths: list[int], rejected: int) -> None:
    trace = _trace(tmp_path, lengths)
    table = invoke("simulate", trace, "--kv-blocks", "20")
    assert table.exit_code == 0, table.output
    assert re.search(rf"^  rejected +{rejected} \(", table.stdout, re.MULTILINE), table.stdout
    as_json = invoke("simulate", trace, "--kv-blocks", "20", "--json")
    assert as_json.exit_code == 0, as_json.output
    data = json.loads(as_json.stdout)["simulation"]
    assert data["rejected"] == rejected and data["requests"] == len(lengths)


def test_a_one_block_pool_rejects_everything_and_reports_it() -> None:
    result = invoke("simulate", *SYNTHETIC, "--kv-blocks", "1", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["simulation"]["rejected"] == 20


# -- the last line of defence ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("error", "status"),
    [(ValueError("bad value 42"), 2), (OSError(28, "No space left on device"), 1), (PermissionError(13, "denied"), 1)],
)
def test_an_error_escaping_a_command_is_one_line(monkeypatch, error: Exception, status: int) -> None:
    def boom(*args: object, **kwargs: object) -> None:
        raise error

    monkeypatch.setattr("kvpool.cli.plan.plan_kv_cache", boom)
    stderr = assert_refused(invoke("plan", "--config", "llama-3.1-8b", *PLAN), "kvpool: error:", status=status)
    assert_one_line(stderr)
    assert str(error) in stderr


# -- a plain install: click is the one dependency, extras are named when missing -----------------------


def test_click_is_a_core_dependency_and_the_cli_extra_remains() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert any(dep.startswith("click") for dep in project["dependencies"])
    assert "cli" in project["optional-dependencies"]


def _blocked(*modules: str, code: str) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter in which importing ``modules`` fails."""
    prelude = f"import sys\nfor m in {modules!r}:\n    sys.modules[m] = None\n"
    return subprocess.run([sys.executable, "-c", prelude + code], capture_output=True, text=True, timeout=120)


def _cli(*args: str) -> str:
    return f"from kvpool.cli import main\nsys.exit(main({list(args)!r}))"


HEAVY = ("torch", "numpy", "matplotlib", "transformers")


def test_plan_works_without_torch_numpy_or_matplotlib() -> None:
    done = _blocked(*HEAVY, code=_cli("plan", "--config", "llama-3.1-8b", "--gpu-memory", "80GB"))
    assert done.returncode == 0, done.stderr
    assert "KV cache size: " in done.stdout and "Traceback" not in done.stderr


def test_simulate_without_numpy_works_and_curve_names_the_sim_extra() -> None:
    done = _blocked("numpy", "matplotlib", code=_cli("simulate", *SYNTHETIC, "--kv-blocks", "100", "--json"))
    assert done.returncode == 0, done.stderr
    for extra_flag, module in (("--curve", "numpy"), ("--plot-dir", "matplotlib")):
        value = "10,20" if extra_flag == "--curve" else "plots-never-made"
        done = _blocked(module, code=_cli("simulate", *SYNTHETIC, "--kv-blocks", "100", extra_flag, value))
        assert done.returncode == 1, done.stderr
        assert "Traceback" not in done.stderr and module in done.stderr
        assert "pip install 'kvpool[sim]'" in done.stderr and len(done.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("command", [["generate", "hello"], ["chat"], ["generate", "hi", "--max-tokens", "4"]])
def test_engine_commands_name_the_engine_extra(command: list[str]) -> None:
    done = _blocked("torch", "transformers", code=_cli(*command))
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr and "pip install 'kvpool[engine]'" in done.stderr


def test_the_library_needs_neither_click_nor_the_extras() -> None:
    code = (
        "import kvpool, kvpool.planner, kvpool.model_config, kvpool.scheduler\n"
        "import kvpool.sim.traces, kvpool.sim.workloads, kvpool.sim.simulator, kvpool.sim.sequential\n"
        "heavy = ('click', 'torch', 'numpy', 'matplotlib')\n"
        "print(sorted(m for m, mod in sys.modules.items() if mod is not None and m.split('.')[0] in heavy))\n"
        + _cli("plan")
    )
    done = _blocked("click", *HEAVY, code=code)
    assert done.stdout.strip() == "[]", done.stdout
    assert done.returncode == 1 and "needs click" in done.stderr and "Traceback" not in done.stderr
