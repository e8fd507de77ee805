"""vLLM's launch lines on kvpool's commands (issue 30): --dtype, --tensor-parallel-size, --max-model-len 4k,
$VLLM_API_KEY, key files that are not JSON. Every refusal comes before the engine loads anything."""

from __future__ import annotations

import json
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from kvpool.checks import parse_token_count
from kvpool.cli.commands import cli
from kvpool.cli.params import TOKEN_COUNT
from kvpool.errors import ConfigError
from kvpool.tenancy import API_KEY_FILE_EXAMPLE, KeyRing


@pytest.mark.parametrize(
    ("text", "count"),
    [("4096", 4096), (" 4096 ", 4096), ("4k", 4000), ("4K", 4096), ("25.6k", 25600), ("1m", 10**6), ("1M", 2**20),
     ("2g", 2 * 10**9), ("1G", 2**30), (512, 512)],
)  # fmt: skip
def test_a_token_count_reads_as_vllm_reads_max_model_len(text: str | int, count: int) -> None:
    assert parse_token_count(text, field="max_model_len") == count
    assert TOKEN_COUNT.convert(text, None, None) == count


@pytest.mark.parametrize(
    ("text", "words"),
    [("1.5K", "did you mean 1.5k"), ("4 k", "not a token count"), ("4kb", "not a token count"), ("-1", "not a token"),
     ("", "not a token count"), ("0", "at least 2"), ("1", "at least 2"), (True, "token count"), (None, "token count")],
)  # fmt: skip
def test_a_bad_token_count_is_refused_naming_it(text: object, words: str) -> None:
    with pytest.raises(ConfigError, match="max_model_len") as caught:
        parse_token_count(text, field="max_model_len", minimum=2)  # type: ignore[arg-type]
    assert words in str(caught.value)


def test_max_model_len_takes_a_suffix_on_generate_and_serve() -> None:
    for command in ("generate", "serve"):
        result = CliRunner().invoke(
            cli, [command, *(["hi"] if command == "generate" else []), "--max-model-len", "1.5K"]
        )
        assert result.exit_code == 2, result.output
        assert "--max-model-len" in result.output and "did you mean 1.5k" in result.output


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_tensor_parallel_size_other_than_1_is_refused_with_the_reason(command: str) -> None:
    args = [command, *(["hi"] if command == "generate" else []), "--tensor-parallel-size", "2", "--dtype", "bfloat16"]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 2, result.output
    assert "tensor_parallel_size 2 is not supported" in result.output and "one device" in result.output


def test_dtype_and_tensor_parallel_size_map_to_engine_options() -> None:
    from kvpool.cli.generate import _engine_options
    from kvpool.cli.shared_flags import engine_options

    seen: dict[str, object] = {}

    @click.command()
    @_engine_options
    def probe(**kw: object) -> None:
        seen.update(engine_options(kw))

    result = CliRunner().invoke(probe, ["--dtype", "bfloat16", "--tensor-parallel-size", "1", "--max-model-len", "4k"])
    assert result.exit_code == 0, result.output
    assert seen["dtype"] == "bfloat16" and seen["tensor_parallel_size"] == 1 and seen["max_model_len"] == 4000
    pytest.importorskip("torch")
    from kvpool.engine.startup import EngineOptions

    options = EngineOptions(**seen)  # type: ignore[arg-type]
    assert options.dtype == "bfloat16" and options.tensor_parallel_size == 1
    for bad in (0, 2, True):
        with pytest.raises(ConfigError, match="tensor_parallel_size"):
            EngineOptions(model="smollm2-135m", tensor_parallel_size=bad)


def test_vllm_api_key_is_the_key_without_api_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # the key from the environment meets a key file naming it for another tenant: refused before the engine loads
    (tmp_path / "keys.json").write_text(json.dumps({"sk-env": "alice"}))
    monkeypatch.setenv("VLLM_API_KEY", "sk-env")
    result = CliRunner().invoke(cli, ["serve", "--api-key-file", str(tmp_path / "keys.json")])
    assert result.exit_code == 2, result.output
    assert "API key from $VLLM_API_KEY" in result.output and "also a key of tenant 'alice'" in result.output
    # an --api-key given wins over the environment, as in vLLM
    (tmp_path / "flag.json").write_text(json.dumps({"sk-flag": "bob"}))
    result = CliRunner().invoke(cli, ["serve", "--api-key", "sk-flag", "--api-key-file", str(tmp_path / "flag.json")])
    assert result.exit_code == 2, result.output
    assert "VLLM_API_KEY" not in result.output and "also a key of tenant 'bob'" in result.output


@pytest.mark.parametrize("content", ["sk-one\nsk-two\n", "{not json", "12345\n", '["sk-one"]'])
def test_a_key_file_that_is_not_a_json_object_shows_the_format(tmp_path: Path, content: str) -> None:
    path = tmp_path / "keys.txt"
    path.write_text(content)
    with pytest.raises(ConfigError) as caught:
        KeyRing.load_json(path)
    message = str(caught.value)
    assert str(path) in message and API_KEY_FILE_EXAMPLE in message
    assert json.loads(API_KEY_FILE_EXAMPLE)  # the example itself is a valid key file
    KeyRing.from_mapping(json.loads(API_KEY_FILE_EXAMPLE))


def test_a_hub_id_is_told_that_a_local_folder_works_and_the_known_names(tmp_path: Path) -> None:
    from kvpool.model_names import known_models, local_model_folder

    with pytest.raises(ConfigError) as caught:
        local_model_folder("HuggingFaceTB/SmolLM2-135M-Instruct")
    message = str(caught.value)
    assert "Hugging Face Hub ID" in message and "local folder works" in message and "--local-dir DIR" in message
    assert all(name in message for name in known_models())
    with pytest.raises(ConfigError) as caught:
        local_model_folder("llama3")  # not an ID: the plain message
    assert "Hub" not in str(caught.value) and "not a known name" in str(caught.value)
    result = CliRunner().invoke(cli, ["generate", "hi", "--model", "HuggingFaceTB/SmolLM2-135M-Instruct"])
    assert result.exit_code == 2 and "local folder works" in result.output, result.output


def test_counts_in_start_up_lines_take_the_right_plural() -> None:
    from types import SimpleNamespace

    from kvpool.checks import counted
    from kvpool.cli.route import _mode_line
    from kvpool.routing import Routing

    assert [counted(n, "tenant") for n in (0, 1, 2)] == ["0 tenants", "1 tenant", "2 tenants"]
    assert counted(1, "replica") == "1 replica" and counted(3, "index", "indices") == "3 indices"
    prefix = Routing.PREFIX
    plain = SimpleNamespace(discover=False, events=None, name="a")
    publishing = SimpleNamespace(discover=False, events=object(), name="b")
    precise = _mode_line("prefix", prefix, SimpleNamespace(value="precise"), [publishing, plain], None)
    assert "; 1 replica publishes no events and is weighed by load only" in precise
    two = _mode_line("prefix", prefix, SimpleNamespace(value="precise"), [plain, plain], None)
    assert "; 2 replicas publish no events and are weighed by load only" in two
    auto = _mode_line("prefix", prefix, SimpleNamespace(value="auto"), [publishing, plain], None)
    assert "precise for 1 replica with KV events, approximate for the 1 without" in auto


def test_plan_and_simulate_take_the_model_as_config_or_model() -> None:
    runner = CliRunner()
    config = runner.invoke(cli, ["plan", "--config", "llama-3.1-8b", "--gpu-memory", "80GB"])
    model = runner.invoke(cli, ["plan", "--model", "llama-3.1-8b", "--gpu-memory", "80GB"])
    assert config.exit_code == 0 and model.exit_code == 0, model.output
    assert model.output == config.output
    base = ["simulate", "synthetic:multi_turn", "--requests", "5", "--kv-memory", "64MiB", "--json"]
    by_model = runner.invoke(cli, [*base, "--model", "smollm2-135m"])
    by_config = runner.invoke(cli, [*base, "--config", "smollm2-135m"])
    assert by_model.exit_code == 0 and by_config.exit_code == 0, by_config.output
    sized, same = json.loads(by_model.stdout)["simulation"], json.loads(by_config.stdout)["simulation"]
    sized.pop("wall_seconds"), same.pop("wall_seconds")
    assert same == sized and sized["num_blocks"] == 182  # 64 MiB of SmolLM2-135M's KV, in blocks


def test_plan_reads_max_model_len_as_vllm_does() -> None:
    runner = CliRunner()
    plain = runner.invoke(cli, ["plan", "--config", "llama-3.1-8b", "--gpu-memory", "80GB", "--max-model-len", "4096"])
    suffixed = runner.invoke(cli, ["plan", "--config", "llama-3.1-8b", "--gpu-memory", "80GB", "--max-model-len", "4K"])
    assert plain.exit_code == 0 and suffixed.output == plain.output and "max_model_len: 4,096 tokens" in plain.output
