"""``kvpool generate`` and ``kvpool chat`` through click's test runner on a tiny model folder."""

from __future__ import annotations

import re

import pytest
from click.testing import CliRunner

from kvpool.cli.commands import cli
from kvpool.engine.llm import LLM
from kvpool.engine.sampling import SamplingParams
from tests.engine.tiny_models import build_model, save_model

pytestmark = pytest.mark.engine

CAPACITY = re.compile(r"KV cache size: [\d,]+ tokens; maximum concurrency for 64 tokens per request: \d+\.\d\dx$")
REQUEST = re.compile(
    r"request (\S+): (\d+) prompt tokens \((\d+) cached, (\d+) computed\), (\d+) output tokens; "
    r"time to first token \d+ ms; [\d.]+ tokens/s; finished: (length|eos|stop)"
)
SIZES = ["--block-size", "4", "--kv-cache-memory", "64KiB", "--max-model-len", "64"]
#: Pinned to one thread: what is streamed is compared token for token with the offline API's output.
ENGINE = [*SIZES, "--threads", "1"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return str(save_model(build_model("llama"), tmp_path_factory.mktemp("llama-tok"), tokenizer=True))


def invoke(*args: str, stdin: str | None = None):
    return CliRunner().invoke(cli, list(args), input=stdin)


def request_lines(stderr: str) -> list[tuple[str, ...]]:
    return [m.groups() for m in map(REQUEST.search, stderr.splitlines()) if m]


def test_generate_logs_startup_streams_text_and_logs_each_request(folder):
    prompt = "w1 w2 w3 w4 w5 w6 w7"
    result = invoke("generate", prompt, "--model", folder, "--max-tokens", "6", "--repeat", "2", *ENGINE)
    assert result.exit_code == 0, result.output
    err = result.stderr
    assert f"model {folder} (LlamaForCausalLM, 2 layers)" in err
    assert "dtype float32, device cpu" in err
    assert "block size 4" in err and "-> 32 blocks" in err
    assert any(CAPACITY.search(line) for line in err.splitlines()), err
    assert "chat template" in err  # the tiny tokenizer has one
    first, second = request_lines(err)
    assert first[1] == second[1] and int(first[2]) == 0
    assert int(first[3]) == int(first[1])  # "computed" counts prompt tokens: all of the first's, no decode
    assert int(second[2]) > 0  # the repeat found the first request's blocks
    assert int(second[3]) == int(first[3]) - int(second[2])  # and computed only the rest
    # What was streamed is what the offline API produces for the same request.
    llm = LLM(folder, block_size=4, kv_cache_memory="64KiB", max_model_len=64, threads=1, log=lambda line: None)
    [expected] = llm.chat([{"role": "user", "content": prompt}], SamplingParams(max_tokens=6))
    assert result.stdout == f"{expected.text}\n{expected.text}\n"
    assert int(first[4]) == expected.num_output_tokens


def test_generate_raw_sends_the_prompt_as_is(folder):
    result = invoke("generate", "w1 w2 w3", "--model", folder, "--max-tokens", "3", "--raw", *ENGINE)
    assert result.exit_code == 0, result.output
    [line] = request_lines(result.stderr)
    assert line[1] == "3"  # three words, no template around them
    assert "chat template" not in result.stderr


def test_chat_turns_extend_the_conversation_and_hit_the_cache(folder):
    result = invoke("chat", "--model", folder, "--max-tokens", "4", *ENGINE, stdin="w1 w2 w3\n\nw4 w5\n/exit\nw6\n")
    assert result.exit_code == 0, result.output
    lines = request_lines(result.stderr)
    assert len(lines) == 2  # the empty line is skipped; nothing after /exit runs
    assert int(lines[1][1]) > int(lines[0][1])  # the second turn carries the first
    assert int(lines[1][2]) > 0
    assert len(result.stdout.splitlines()) == 2


def test_chat_ends_at_end_of_input(folder):
    result = invoke("chat", "--model", folder, "--max-tokens", "2", "--system", "w9", *ENGINE, stdin="w1\n")
    assert result.exit_code == 0, result.output
    assert len(request_lines(result.stderr)) == 1


def test_chat_replies_run_to_the_context_while_generate_stops_at_64(folder):
    """vLLM's chat has no max_tokens default: a reply runs to EOS or the end of the context."""
    longer = [*ENGINE, "--max-model-len", "160", "--kv-cache-memory", "1MiB"]
    result = invoke("chat", "--model", folder, *longer, stdin="w1\n")
    assert result.exit_code == 0, result.output
    [(_, prompt, _, _, output, finish)] = request_lines(result.stderr)
    assert finish == "eos" or (finish == "length" and int(prompt) + int(output) == 160), result.stderr
    assert int(output) > 64 or finish == "eos"
    result = invoke("generate", "w1", "--model", folder, *longer)
    assert result.exit_code == 0, result.output
    [line] = request_lines(result.stderr)
    assert int(line[4]) <= 64 and (int(line[4]) == 64 or line[5] == "eos")


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--max-tokens", "0"], "max_tokens must be a positive integer, got 0"),
        (["--temperature", "-1"], "temperature must be a finite number >= 0, got -1.0"),
        (["--top-p", "2"], "top_p must be in (0, 1], got 2.0"),
        (["--kv-cache-memory", "10XB"], "kv_cache_memory '10XB'"),
        (["--block-size", "0"], "block_size must be a positive integer, got 0"),
        (["--repeat", "0"], "--repeat must be >= 1, got 0"),
    ],
)
def test_bad_options_are_one_line_and_exit_2(args, needle, folder):
    result = invoke("generate", "w1 w2", "--model", folder, *ENGINE, *args)
    assert result.exit_code == 2
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert lines == [lines[0]] and needle in lines[0], result.stderr
    assert lines[0].startswith("kvpool generate: error:")


def test_unknown_model_is_one_line_and_exit_2(tmp_path):
    result = invoke("generate", "hello", "--model", str(tmp_path / "missing"))
    assert result.exit_code == 2
    [line] = result.stderr.strip().splitlines()
    assert str(tmp_path / "missing") in line and "Traceback" not in result.output


def test_prompt_too_long_after_startup_is_one_error_line_and_exit_2(folder):
    words = " ".join(f"w{i}" for i in range(70))
    result = invoke("generate", words, "--model", folder, "--raw", *ENGINE)
    assert result.exit_code == 2
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("kvpool generate: error:") and "70 tokens" in last and "max_model_len=64" in last
    assert "Traceback" not in result.output
    assert result.stdout == ""


def test_click_usage_errors_exit_2(folder):
    result = invoke("generate", "--model", folder)  # no prompt
    assert result.exit_code == 2
    result = invoke("chat", "--model", folder, "--max-tokens", "many")
    assert result.exit_code == 2
    assert "Traceback" not in result.output


def test_threads_reach_the_engine_and_bad_counts_are_refused(folder):
    result = invoke("generate", "w1 w2", "--model", folder, "--max-tokens", "2", "--threads", "1", *ENGINE)
    assert result.exit_code == 0, result.output
    assert "(1 thread)" in result.stderr  # the start-up line names the step's threads
    # Without --threads the engine follows the free cores (the library's default); 'torch' leaves torch's count.
    default = invoke("generate", "w1 w2", "--model", folder, "--max-tokens", "2", *SIZES)
    assert default.exit_code == 0 and "following the free cores)" in default.stderr, default.stderr
    torch_count = invoke("generate", "w1 w2", "--model", folder, "--max-tokens", "2", "--threads", "torch", *SIZES)
    assert torch_count.exit_code == 0 and "following the free cores" not in torch_count.stderr, torch_count.stderr
    for bad, needle in (("0", "give at least 1"), ("many", "neither 'auto', 'torch' nor a thread count")):
        refused = invoke("generate", "w1", "--model", folder, "--threads", bad, *SIZES)
        assert refused.exit_code == 2 and needle in refused.stderr, refused.stderr
