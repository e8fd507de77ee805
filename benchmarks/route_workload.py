"""The multi-turn chat workload ``bench_route.py --vllm`` runs through each router: concurrent conversations.

A phase is one router's turn at the fleet: ``conversations`` conversations at once, each on
one of ``system_prompts`` shared system prompts (about three 128-token blocks each) with
its own history: every turn adds a user paragraph of about 150 tokens of its own, and the
answer (``max_tokens``). Each conversation sends its next turn as soon as its answer ends,
so the replicas see several requests at once. After ``wipe_after`` turns every
conversation waits at a barrier, ``on_wipe`` runs (one replica loses its cache), and the
conversations go on. The texts are drawn from a seeded generator under the phase's
``tag``, so no phase meets another's prefixes, and every phase's requests are the same in
shape and length.
"""

from __future__ import annotations

import json
import random
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["PhaseResult", "run_phase", "summary"]

WORDS = (
    "cache block prefix replica router token model prompt answer question system memory server request latency "
    "throughput queue batch stream event index hash chain tenant policy eviction tier disk network engine "
    "kernel attention layer vector page table"
).split()


def system_prompt(tag: str, s: int) -> str:
    """Shared system prompt ``s`` of the phase ``tag``: distinct from its first token on, about 380 tokens."""
    return f"[{tag}-{s}] You are the assistant of team {tag}-{s}. " + f"Answer the team {tag}-{s} briefly. " * 40


def paragraph(rng: random.Random, words: int = 110) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words)) + "?"


@dataclass(slots=True)
class PhaseResult:
    """What one phase measured: prompt tokens and those vLLM served from cache, per-request TTFT, wall time."""

    prompt: int = 0
    cached: int = 0
    requests: int = 0
    failed: int = 0
    wall: float = 0.0
    ttft: list[float] = field(default_factory=list)
    by_turn: dict[int, list[int]] = field(default_factory=dict)  # turn: [prompt tokens, cached tokens]
    lock: threading.Lock = field(default_factory=threading.Lock)


def _send(client: Any, url: str, body: dict[str, Any]) -> tuple[float, str, dict[str, Any] | None]:
    """(time to the first content token, the answer's text, its usage) of one streamed chat request."""
    t0 = time.perf_counter()
    first, text, usage = None, [], None
    with client.stream("POST", url, json=body) as reply:
        reply.raise_for_status()
        for line in reply.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices", []):
                piece = choice.get("delta", {}).get("content")
                if piece:
                    first = first or time.perf_counter()
                    text.append(piece)
    return (first or time.perf_counter()) - t0, "".join(text), usage


def run_phase(
    base: str,
    model: str,
    tag: str,
    *,
    conversations: int,
    turns: int,
    system_prompts: int,
    max_tokens: int,
    wipe_after: int,
    on_wipe: Callable[[], None],
) -> PhaseResult:
    """Run the phase's conversations through the router at ``base``; ``turns`` requests each, ``wipe_after`` in."""
    import httpx

    result = PhaseResult()
    barrier = threading.Barrier(conversations, action=on_wipe) if 0 < wipe_after < turns else None
    url = base + "/v1/chat/completions"

    def converse(i: int, client: httpx.Client) -> None:
        rng = random.Random(f"{tag}/{i}")
        history = [{"role": "system", "content": system_prompt(tag, i % system_prompts)}]
        for turn in range(turns):
            if barrier is not None and turn == wipe_after:
                barrier.wait()
            history.append({"role": "user", "content": paragraph(rng)})
            body = {"model": model, "messages": history, "max_tokens": max_tokens, "temperature": 0,
                    "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
            try:
                ttft, text, usage = _send(client, url, body)
            except httpx.HTTPError:
                with result.lock:
                    result.failed += 1
                history.append({"role": "assistant", "content": "Sure."})
                continue
            history.append({"role": "assistant", "content": text or "Sure."})
            with result.lock:
                result.requests += 1
                result.ttft.append(ttft)
                if usage is not None:
                    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
                    result.prompt += usage["prompt_tokens"]
                    result.cached += cached
                    turn_figures = result.by_turn.setdefault(turn, [0, 0])
                    turn_figures[0] += usage["prompt_tokens"]
                    turn_figures[1] += cached

    t0 = time.perf_counter()
    with httpx.Client(timeout=600, limits=httpx.Limits(max_connections=conversations)) as client:
        threads = [threading.Thread(target=converse, args=(i, client)) for i in range(conversations)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    result.wall = time.perf_counter() - t0
    return result


def _p90(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[int(0.9 * (len(ordered) - 1))]


def summary(results: list[PhaseResult]) -> dict[str, float]:
    """Per router, the median over its phases (rounds) of each figure; TTFT in ms, throughput in requests/s."""
    share = [r.cached / r.prompt if r.prompt else 0.0 for r in results]
    return {
        "cached_share": statistics.median(share),
        "cached": statistics.median(r.cached for r in results),
        "prompt": statistics.median(r.prompt for r in results),
        "ttft_p50": statistics.median(statistics.median(r.ttft) * 1000 for r in results if r.ttft),
        "ttft_p90": statistics.median(_p90(r.ttft) * 1000 for r in results if r.ttft),
        "throughput": statistics.median(r.requests / r.wall for r in results if r.wall),
        "failed": sum(r.failed for r in results),
    }
