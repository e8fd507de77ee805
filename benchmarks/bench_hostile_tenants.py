"""Honest tenants beside a hostile one on a live ``kvpool serve``: what the hostile one costs them.

Several honest tenants each send greedy requests that share a long system turn
of their own (so their prefixes are cached), one after another, streamed with
usage. The run alternates two kinds of phase on one server:

* **quiet**: the honest tenants alone;
* **hostile**: the same honest requests while a hostile tenant, with a valid
  key of its own, keeps sending what has hurt servers before: extreme sampling
  values (``temperature`` 1e-300 and the smallest subnormal, tiny ``top_p``,
  huge ``top_k`` and ``seed``), prompts far over the context (1 MiB of text,
  400,000 characters, 100,000 token IDs), connections that send half their headers and wait,
  streams dropped after the first token, and malformed bodies (JSON nested
  100,000 deep, invalid UTF-8, a truncated body, a prompt that is a mapping,
  ``"n": true``); and, to take the whole server: ``n`` up to 128 with
  ``max_tokens`` omitted and ``ignore_eos`` (each sequence runs to the end of
  the context), ``min_tokens`` of 10**30, hogs that keep requests of long
  prompts running to the end of the context at an ``n`` the server admits
  (together about twice what the pool holds, all the phase long), and several
  connections at once of prompts just under the server's size bound.

What must hold, and is reported:

* every honest answer is token for token the one it got in the quiet phases
  (greedy decoding is deterministic on the same server);
* the honest tenants' cached prefixes survive: each honest request after the
  first round is served at least as many cached tokens as in the quiet phases;
* the honest time to first token: median and p90 per kind of phase, and the
  hostile/quiet ratio of the p90 (the goal: within 2x);
* no honest request fails; the hostile requests' status codes (no 5xx);
* afterwards nothing runs, no block is owned by any request, the pool's
  invariants hold (``/health?verbose=1``).

    python benchmarks/bench_hostile_tenants.py --rounds 3 --threads 2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import socket
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_serve_load import settle  # noqa: E402
from bench_timing_leak import MODEL, serving  # noqa: E402

HOSTILE_KEY = "key-mallory"
#: Hogs running at once, and connections sending prompts just under the size bound at once.
HOGS = 6
NEAR_BOUND_CONNECTIONS = 3


@dataclass(frozen=True, slots=True)
class Attack:
    """How hard the hostile tenant pushes: hogs and near-bound connections at once, half-open connections."""

    hogs: int = HOGS
    near_bound: int = NEAR_BOUND_CONNECTIONS
    max_half_open: int = 16


_TOPICS = (
    "inventory counts",
    "shipping delays",
    "return policies",
    "warranty claims",
    "store hours",
    "gift cards",
    "bulk orders",
    "price matching",
)


def honest_keys(count: int) -> dict[str, str]:
    return {f"key-honest-{i}": f"honest-{i}" for i in range(count)}


def _system_turn(tenant: int) -> str:
    rng = random.Random(tenant)
    rules = " ".join(f"Rule {k}: mention {rng.choice(_TOPICS)} only when asked." for k in range(24))
    return f"You are assistant {tenant} of a hardware store. {rules}"


@dataclass(frozen=True, slots=True)
class Answer:
    """One honest request's answer, as its client saw it."""

    tenant: int
    question: int
    text: str
    ttft: float
    cached_tokens: int
    phase: str
    round: int


@dataclass
class Tally:
    answers: list[Answer] = field(default_factory=list)
    honest_failures: list[str] = field(default_factory=list)
    hostile_statuses: Counter[str] = field(default_factory=Counter)
    half_open_closed_by_server: int = 0
    half_open_sent: int = 0
    max_running: int = 0  # seen in the hostile phases
    max_waiting: int = 0
    max_kv_usage: float = 0.0


# -- the honest tenants ------------------------------------------------------------------------------


async def _honest(
    http: Any, url: str, key: str, tenant: int, questions: int, max_tokens: int, phase: str, rnd: int, tally: Tally
) -> None:
    """One tenant's requests, one after another, each streamed with usage."""
    system = _system_turn(tenant)
    for q in range(questions):
        body = {
            "model": MODEL,
            "messages": [
                {"role": "system", "content": system},
                {"role": "user", "content": f"Question {q}: what should I know about {_TOPICS[q % len(_TOPICS)]}?"},
            ],
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        start = time.perf_counter()
        ttft = None
        text: list[str] = []
        cached = 0
        try:
            async with http.stream(
                "POST", f"{url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}
            ) as response:
                if response.status_code != 200:
                    detail = (await response.aread()).decode(errors="replace")[:200]
                    tally.honest_failures.append(f"tenant {tenant} q{q}: HTTP {response.status_code} {detail}")
                    continue
                async for line in response.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        tally.honest_failures.append(f"tenant {tenant} q{q}: {chunk['error']}")
                        break
                    for choice in chunk.get("choices", []):
                        piece = choice.get("delta", {}).get("content")
                        if piece:
                            if ttft is None:
                                ttft = time.perf_counter() - start
                            text.append(piece)
                    usage = chunk.get("usage")
                    if usage:
                        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        except Exception as exc:  # any transport error is a failure of the server towards an honest tenant
            tally.honest_failures.append(f"tenant {tenant} q{q}: {type(exc).__name__}: {exc}")
            continue
        if ttft is None:
            tally.honest_failures.append(f"tenant {tenant} q{q}: no token streamed")
            continue
        tally.answers.append(Answer(tenant, q, "".join(text), ttft, cached, phase, rnd))


# -- the hostile tenant ------------------------------------------------------------------------------


def _bodies() -> list[tuple[str, bytes]]:
    """(label, raw request body) of every malformed or extreme request the hostile tenant sends."""

    def dumps(body: dict[str, Any]) -> bytes:
        return json.dumps(body).encode()

    chat = [{"role": "user", "content": "Tell me a story about a lighthouse."}]
    extreme = [
        ("temperature 1e-300", {"temperature": 1e-300}),
        ("temperature 5e-324", {"temperature": 5e-324}),
        ("top_p 5e-324", {"temperature": 1.0, "top_p": 5e-324}),
        ("top_k 2**31", {"temperature": 1.0, "top_k": 2**31}),
        ("seed 2**63-1", {"temperature": 1.5, "seed": 2**63 - 1}),
        ("temperature 1e300", {"temperature": 1e300}),
    ]
    out = [(label, dumps({"model": MODEL, "messages": chat, "max_tokens": 16, **fields})) for label, fields in extreme]
    out += [
        ("1 MiB prompt", dumps({"model": MODEL, "prompt": "lighthouse " * (2**20 // 11), "max_tokens": 4})),
        ("400k-character prompt", dumps({"model": MODEL, "prompt": "lighthouse " * 40_000, "max_tokens": 4})),
        ("100k token IDs", dumps({"model": MODEL, "prompt": [1000] * 100_000, "max_tokens": 4})),
        ("nested 100k", b'{"model": "x", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"),
        ("invalid UTF-8", b'{"model": "x", "prompt": "\xff\xfe"}'),
        ("truncated", b'{"model": "x", "prompt": "abc'),
        ("prompt is a mapping", dumps({"model": MODEL, "prompt": {"a": 1}})),
        ("n: true", dumps({"model": MODEL, "prompt": "hi", "n": True})),
        ("min_tokens 10**30", dumps({"model": MODEL, "prompt": "hi", "min_tokens": 10**30})),
        ("repetition_penalty 1e-300", dumps({"model": MODEL, "prompt": "hi", "repetition_penalty": 1e-300})),
    ]
    return out


_HI = [{"role": "user", "content": "Hi"}]
#: Requests that would take the whole server: every sequence runs to the end of the context (a chat without
#: max_tokens does; a completion without it stops at 16, as in vLLM, or ran to the end before). Sent at once,
#: at the start of a hostile phase, beside the honest tenants' requests.
TAKERS = (
    ("completion n 128, no max_tokens, ignore_eos", {"model": MODEL, "prompt": "Hi", "n": 128, "ignore_eos": True}),
    *(
        (f"chat n {n}, no max_tokens, ignore_eos", {"model": MODEL, "messages": _HI, "n": n, "ignore_eos": True})
        for n in (128, 64, 16)
    ),
)


async def _taker(http: Any, url: str, headers: dict[str, str], tally: Tally, label: str, body: Any) -> None:
    """One request that would take the server, waited for until the phase ends."""
    try:
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        response = await http.post(f"{url}{path}", json=body, headers=headers, timeout=None)
        tally.hostile_statuses[f"{label}: {response.status_code}"] += 1
    except asyncio.CancelledError:
        tally.hostile_statuses[f"{label}: running at the phase's end"] += 1
        raise
    except Exception as exc:
        tally.hostile_statuses[f"{label}: {type(exc).__name__}"] += 1


#: What a hog asks for: sequences of a long prompt of its own, each to the end of the context (what fits
#: the server's per-request limit); a few hogs together ask for about twice the pool.
HOG_N = 4
HOG_PROMPT_TOKENS = 880
HOG_MAX_TOKENS = 1024 - HOG_PROMPT_TOKENS - 1  # to the end of the server's context


async def _hog(http: Any, url: str, headers: dict[str, str], tally: Tally, which: int) -> None:
    """Requests that run to the end of the context, one after another, until cancelled."""
    rng = random.Random(1000 + which)
    prompt = [rng.randrange(1000, 40000) for _ in range(HOG_PROMPT_TOKENS)]
    body = {"model": MODEL, "prompt": prompt, "n": HOG_N, "max_tokens": HOG_MAX_TOKENS, "ignore_eos": True}
    while True:
        try:
            response = await http.post(f"{url}/v1/completions", json=body, headers=headers, timeout=None)
            tally.hostile_statuses[f"hog n={HOG_N} to the end of the context: {response.status_code}"] += 1
        except asyncio.CancelledError:
            tally.hostile_statuses[f"hog n={HOG_N} to the end of the context: running at the phase's end"] += 1
            raise
        except Exception as exc:
            tally.hostile_statuses[f"hog: {type(exc).__name__}"] += 1
            await asyncio.sleep(0.1)


async def _size_bound(http: Any, url: str, headers: dict[str, str]) -> int:
    """The most characters the server reads for a prompt, as its refusal of a longer one says."""
    body = {"model": MODEL, "prompt": "lighthouse " * 60_000, "max_tokens": 1}
    response = await http.post(f"{url}/v1/completions", json=body, headers=headers, timeout=120)
    match = re.search(r"(?:reads at most|no text over) (\d+) characters", response.text)  # this round's, or before
    if match is None:
        raise RuntimeError(f"the server did not state its size bound: {response.status_code} {response.text[:200]}")
    return int(match.group(1))


async def _near_bound(http: Any, url: str, headers: dict[str, str], chars: int, tally: Tally) -> None:
    """One connection sending prompts just under the size bound, one after another, until cancelled."""
    text = ("lighthouse keeper " * (chars // 18 + 1))[: chars - 16]
    body = {"model": MODEL, "prompt": text, "max_tokens": 4}
    while True:
        try:
            response = await http.post(f"{url}/v1/completions", json=body, headers=headers, timeout=300)
            tally.hostile_statuses[f"prompt just under the size bound: {response.status_code}"] += 1
        except Exception as exc:
            tally.hostile_statuses[f"prompt just under the size bound: {type(exc).__name__}"] += 1
            await asyncio.sleep(0.1)


def _half_open(host: str, port: int) -> socket.socket:
    """A connection that sends the start of a request's headers and then nothing."""
    sock = socket.create_connection((host, port), timeout=5)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n")
    sock.setblocking(False)
    return sock


def _closed_by_peer(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


async def _hostile(
    http: Any, url: str, stop: asyncio.Event, tally: Tally, attack: Attack, passes: asyncio.Event
) -> None:
    """Attack until ``stop``: one of each kind per pass, half-open connections kept up to the attack's bound.

    ``passes`` is set once a first whole pass is done: a phase lasts at least that long.
    """
    host, port = url.removeprefix("http://").split(":")
    headers = {"Authorization": f"Bearer {HOSTILE_KEY}", "Content-Type": "application/json"}
    bodies = _bodies()
    held: list[socket.socket] = []
    bound = await _size_bound(http, url, headers)
    background = [asyncio.ensure_future(_taker(http, url, headers, tally, *taker)) for taker in TAKERS]
    background += [asyncio.ensure_future(_hog(http, url, headers, tally, i)) for i in range(attack.hogs)]
    background += [
        asyncio.ensure_future(_near_bound(http, url, headers, bound, tally)) for _ in range(attack.near_bound)
    ]
    try:
        while not stop.is_set():
            for label, raw in bodies:
                path = "/v1/chat/completions" if b'"messages"' in raw[:200] else "/v1/completions"
                try:
                    response = await http.post(f"{url}{path}", content=raw, headers=headers, timeout=120)
                    tally.hostile_statuses[f"{label}: {response.status_code}"] += 1
                except Exception as exc:
                    tally.hostile_statuses[f"{label}: {type(exc).__name__}"] += 1
                if stop.is_set():
                    break
            # a stream dropped after its first token
            try:
                body = {"model": MODEL, "prompt": "Count to a thousand:", "max_tokens": 200, "stream": True}
                async with http.stream("POST", f"{url}/v1/completions", json=body, headers=headers) as response:
                    async for _ in response.aiter_lines():
                        break
                tally.hostile_statuses[f"dropped stream: {response.status_code}"] += 1
            except Exception as exc:
                tally.hostile_statuses[f"dropped stream: {type(exc).__name__}"] += 1
            # half-sent connections: count those the server closed, open new ones up to the bound
            still = []
            for sock in held:
                if _closed_by_peer(sock):
                    tally.half_open_closed_by_server += 1
                    sock.close()
                else:
                    still.append(sock)
            held = still
            while len(held) < attack.max_half_open:
                try:
                    held.append(_half_open(host, int(port)))
                    tally.half_open_sent += 1
                except OSError as exc:
                    tally.hostile_statuses[f"half-open connect: {type(exc).__name__}"] += 1
                    break
            try:  # how full the server is: the hogs' sequences among the running and waiting
                health = (await http.get(f"{url}/health", params={"verbose": "1"}, timeout=30)).json()
                tally.max_running = max(tally.max_running, health["running"])
                tally.max_waiting = max(tally.max_waiting, health["waiting"])
                tally.max_kv_usage = max(tally.max_kv_usage, health["kv_cache_usage"])
            except Exception as exc:
                tally.hostile_statuses[f"health: {type(exc).__name__}"] += 1
            passes.set()
            await asyncio.sleep(0)
    finally:
        for task in background:
            task.cancel()
        await asyncio.gather(*background, return_exceptions=True)
        for sock in held:
            sock.close()


# -- a run ----------------------------------------------------------------------------------------------


async def _phase(
    url: str, honest: int, questions: int, max_tokens: int, hostile: bool, rnd: int, tally: Tally, attack: Attack
) -> None:
    import httpx

    keys = list(honest_keys(honest))
    limits = httpx.Limits(max_connections=4 * honest + 8 + len(TAKERS) + attack.hogs + attack.near_bound)
    async with httpx.AsyncClient(timeout=300, limits=limits) as http:
        stop, passed = asyncio.Event(), asyncio.Event()
        attacker = asyncio.ensure_future(_hostile(http, url, stop, tally, attack, passed)) if hostile else None
        phase = "hostile" if hostile else "quiet"
        await asyncio.gather(
            *(_honest(http, url, keys[t], t, questions, max_tokens, phase, rnd, tally) for t in range(honest))
        )
        if attacker is not None:
            waiting = asyncio.ensure_future(passed.wait())  # every kind of attack made at least once in the phase
            await asyncio.wait({attacker, waiting}, return_when=asyncio.FIRST_COMPLETED)
            waiting.cancel()
            stop.set()
            await attacker  # raises what stopped the attacker early


def _percentile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (nearest rank; the median for 0.5 of an odd count); NaN for no values."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def run(
    url: str, *, honest: int, rounds: int, questions: int, max_tokens: int, attack: Attack | None = None
) -> dict[str, Any]:
    """Alternate quiet and hostile phases ``rounds`` times on the server at ``url``; the figures."""
    attack = Attack() if attack is None else attack
    tally = Tally()
    began = time.monotonic()
    for rnd in range(rounds):
        for hostile in (False, True):
            asyncio.run(_phase(url, honest, questions, max_tokens, hostile, rnd, tally, attack))
            print(
                f"  round {rnd + 1}/{rounds} {'hostile' if hostile else 'quiet'}: {len(tally.answers)} honest answers, "
                f"{len(tally.honest_failures)} failed, {sum(tally.hostile_statuses.values())} hostile requests",
                file=sys.stderr,
                flush=True,
            )
    health = settle(url)
    reference: dict[tuple[int, int], str] = {}
    for a in tally.answers:
        if a.phase == "quiet":
            reference.setdefault((a.tenant, a.question), a.text)
    differing = [
        f"tenant {a.tenant} q{a.question} ({a.phase}, round {a.round})"
        for a in tally.answers
        if a.text != reference.get((a.tenant, a.question), a.text)
    ]
    # cached prefixes: after the first quiet phase, every honest request finds its tenant's system turn
    quiet_cached = {
        (a.tenant, a.question): a.cached_tokens for a in tally.answers if a.phase == "quiet" and a.round > 0
    }
    lost_prefix = [
        f"tenant {a.tenant} q{a.question} round {a.round}: {a.cached_tokens} cached, {quiet_cached[a.tenant, a.question]} when quiet"
        for a in tally.answers
        if a.phase == "hostile" and a.round > 0 and a.cached_tokens < quiet_cached.get((a.tenant, a.question), 0)
    ]
    ttft = {p: [a.ttft for a in tally.answers if a.phase == p and a.round > 0] for p in ("quiet", "hostile")}
    if not ttft["quiet"]:  # a single round: its first requests pay for the cold cache in both phases alike
        ttft = {p: [a.ttft for a in tally.answers if a.phase == p] for p in ("quiet", "hostile")}
    server_errors = {k: v for k, v in tally.hostile_statuses.items() if k.rsplit(": ", 1)[1].startswith("5")}
    return {
        "seconds": time.monotonic() - began,
        "honest_answers": len(tally.answers),
        "honest_failures": tally.honest_failures,
        "honest_answers_differing": differing,
        "honest_prefix_lost": lost_prefix,
        "ttft_quiet_p50_ms": 1000 * _percentile(ttft["quiet"], 0.5),
        "ttft_quiet_p90_ms": 1000 * _percentile(ttft["quiet"], 0.9),
        "ttft_hostile_p50_ms": 1000 * _percentile(ttft["hostile"], 0.5),
        "ttft_hostile_p90_ms": 1000 * _percentile(ttft["hostile"], 0.9),
        "ttft_p90_ratio": _percentile(ttft["hostile"], 0.9) / _percentile(ttft["quiet"], 0.9),
        "hostile_requests": sum(tally.hostile_statuses.values()),
        "hostile_statuses": dict(sorted(tally.hostile_statuses.items())),
        "hostile_server_errors": server_errors,
        "hostile_phase_max_running": tally.max_running,
        "hostile_phase_max_waiting": tally.max_waiting,
        "hostile_phase_max_kv_usage": tally.max_kv_usage,
        "half_open_sent": tally.half_open_sent,
        "half_open_closed_by_server": tally.half_open_closed_by_server,
        "blocks_owned_after": health["blocks_owned"],
        "invariants_after": health["invariants"],
    }


def server_flags(keys_file: Path) -> list[str]:
    """The server of the run: tenants by key, a context of 1,024 tokens, the default connection limits."""
    return [
        "--api-key-file",
        str(keys_file),
        "--max-model-len",
        "1024",
        "--kv-cache-memory",
        "256MiB",
        "--max-waiting",
        "64",
    ]


def write_keys(folder: Path, honest: int) -> Path:
    keys = folder / "keys.json"
    keys.write_text(json.dumps({**honest_keys(honest), HOSTILE_KEY: "mallory"}))
    return keys


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--honest", type=int, default=3, help="honest tenants")
    parser.add_argument("--rounds", type=int, default=3, help="quiet/hostile phase pairs")
    parser.add_argument("--questions", type=int, default=8, help="requests per honest tenant per phase")
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--threads", type=int, default=None, help="the server's torch threads [torch's default]")
    parser.add_argument("--json", type=Path, default=None, help="write the figures here too")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as folder:
        keys = write_keys(Path(folder), args.honest)
        print(f"starting kvpool serve; then {args.rounds} quiet/hostile rounds", file=sys.stderr, flush=True)
        with serving(server_flags(keys), args.threads) as server:
            result = run(
                server.url, honest=args.honest, rounds=args.rounds, questions=args.questions, max_tokens=args.max_tokens
            )
    for name, value in result.items():
        if isinstance(value, float):
            print(f"{name:>28}: {value:.3f}")
        elif isinstance(value, list):
            print(f"{name:>28}: {len(value)}")
            for item in value[:5]:
                print(f"{'':>30}{item}")
        elif isinstance(value, dict):
            print(f"{name:>28}:")
            for key, count in value.items():
                print(f"{'':>30}{key}: {count}")
        else:
            print(f"{name:>28}: {value}")
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1))
    ok = (
        not result["honest_failures"]
        and not result["honest_answers_differing"]
        and not result["honest_prefix_lost"]
        and not result["hostile_server_errors"]
        and result["blocks_owned_after"] == 0
        and result["invariants_after"] == "ok"
    )
    print(("PASS" if ok else "FAIL") + f" (TTFT p90 hostile/quiet: {result['ttft_p90_ratio']:.2f}x, goal <= 2x)")
    if not ok:
        sys.exit(1)
    return result


if __name__ == "__main__":
    main()
