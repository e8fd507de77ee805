"""``kvpool serve --emulate``: bad profiles and flags refused by name; ``--replicas 3 --port 0`` serves three."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvpool.cli.commands import cli
from kvpool.cost_model import load_profile

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

#: The command line run with torch and transformers made unimportable: an emulated replica needs neither.
NO_TORCH = (
    "import sys; sys.modules['torch'] = None; sys.modules['transformers'] = None; "
    "from kvpool.cli import main; sys.exit(main(sys.argv[1:]))"
)


def _profile_file(tmp_path: Path, **changes: object) -> str:
    data = load_profile("llama-3.1-8b-h100").to_dict()
    data.update(changes)
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(data))
    return str(path)


def _serve(args: list[str]) -> tuple[int, str]:
    result = CliRunner().invoke(cli, ["serve", *args])
    return result.exit_code, result.output


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"decode_s_per_seq": -1}, "decode_s_per_seq"),
        ({"prefill_s_per_token": [[8, 0.1], [4, 0.1]]}, "prefill_s_per_token"),
        ({"kv_bytes_per_token": 0}, "kv_bytes_per_token"),
        ({"step_overhead": 0.01}, "step_overhead"),  # unknown: the message lists the fields
    ],
)
def test_a_bad_profile_is_refused_naming_its_field(
    tmp_path: Path, tokenizer_folder: Path, changes: dict[str, object], field: str
) -> None:
    status, output = _serve(["--emulate", _profile_file(tmp_path, **changes), "--model", str(tokenizer_folder)])
    assert status == 2
    assert field in output and "cost profile" in output


def test_an_unknown_profile_lists_the_built_in_ones(tokenizer_folder: Path) -> None:
    status, output = _serve(["--emulate", "no-such-gpu", "--model", str(tokenizer_folder)])
    assert status == 2
    assert "'no-such-gpu'" in output and "llama-3.1-8b-h100" in output


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--replicas", "3"], "--replicas needs --emulate"),
        (["--time-scale", "2"], "--time-scale needs --emulate"),
        (["--emulate", "llama-3.1-8b-h100", "--kv-tier", "cpu:1GiB"], "--kv-tiers is not emulated"),
        (["--emulate", "llama-3.1-8b-h100", "--threads", "2"], "--threads is not emulated"),
        (["--emulate", "llama-3.1-8b-h100", "--threads", "torch"], "--threads is not emulated"),
        (["--emulate", "llama-3.1-8b-h100", "--kv-cache-memory", "auto"], "--kv-cache-memory auto"),
        (["--emulate", "llama-3.1-8b-h100", "--kv-cache-memory", "1KiB"], "at least 2"),
    ],
)
def test_flags_that_do_not_apply_are_refused(tokenizer_folder: Path, args: list[str], named: str) -> None:
    status, output = _serve([*args, "--model", str(tokenizer_folder)])
    assert status == 2
    assert named in output


def test_three_replicas_on_port_0_each_answer_health(tokenizer_folder: Path) -> None:
    httpx = pytest.importorskip("httpx")
    args = ["serve", "--emulate", "llama-3.1-8b-h100", "--model", str(tokenizer_folder), "--replicas", "3"]
    args += ["--port", "0", "--max-model-len", "512", "--disable-log-stats"]
    args += ["--kv-events-endpoint", "bind:tcp://127.0.0.1:0", "--no-tenant-isolation"]
    process = subprocess.Popen(
        [sys.executable, "-c", NO_TORCH, *args],
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert process.stderr is not None
    try:
        urls, lines = [], []
        while len(urls) < 3:
            line = process.stderr.readline()
            assert line, f"kvpool serve ended before serving three replicas: {''.join(lines)}"
            lines.append(line)
            if " serving " in line:
                urls.append(line.rsplit(" on ", 1)[1].strip().removesuffix("/v1"))
        assert len(set(urls)) == 3
        for url in urls:
            response = httpx.get(f"{url}/health", timeout=30)
            assert (response.status_code, response.json()) == (200, {"status": "ok"})
        described = [httpx.get(f"{url}/kv-events", timeout=30).json() for url in urls]
        assert all(d["enabled"] for d in described)
        assert len({d["endpoint"] for d in described}) == 3  # each replica publishes on its own endpoint
        answer = httpx.post(
            f"{urls[2]}/v1/completions",
            json={"model": str(tokenizer_folder), "prompt": list(range(10, 40)), "max_tokens": 2},
            timeout=30,
        ).json()
        assert answer["usage"]["completion_tokens"] == 2
        assert any("3 replicas" in line for line in lines)
    finally:
        process.send_signal(signal.SIGTERM)
        _, rest = process.communicate(timeout=60)
    assert process.returncode == 128 + signal.SIGTERM, rest
    assert rest.count("stopped serving") == 3


def test_replicas_take_consecutive_ports_and_event_endpoints() -> None:
    from kvpool.emulator.fleet import replica_endpoint, replica_port
    from kvpool.errors import ConfigError

    assert [replica_port(8001, i) for i in range(3)] == [8001, 8002, 8003]
    assert [replica_port(0, i) for i in range(3)] == [0, 0, 0]
    assert replica_endpoint("bind:tcp://127.0.0.1:5557", 2) == "bind:tcp://127.0.0.1:5559"
    assert replica_endpoint("tcp://*:5557", 1) == "tcp://*:5558"
    assert replica_endpoint("bind:tcp://127.0.0.1:0", 5) == "bind:tcp://127.0.0.1:0"
    assert replica_endpoint("ipc:///tmp/events", 0) == "ipc:///tmp/events"
    with pytest.raises(ConfigError, match="ipc:///tmp/events"):
        replica_endpoint("ipc:///tmp/events", 1)
    with pytest.raises(ConfigError, match="65536"):
        replica_port(65535, 1)
