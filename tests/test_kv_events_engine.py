"""The engine with vLLM's hashes and KV events on: a router computes the same hashes from the prompt alone."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from click.testing import CliRunner  # noqa: E402

from kvpool import BlockHasher, BlockStored  # noqa: E402
from kvpool.cli.commands import cli  # noqa: E402
from kvpool.engine.llm import LLM  # noqa: E402
from kvpool.engine.sampling import SamplingParams  # noqa: E402
from kvpool.kv_events import KVEventPublisher, KVEventSubscriber  # noqa: E402
from tests.engine.tiny_models import build_model, random_prompt, save_model  # noqa: E402

pytestmark = [pytest.mark.engine, pytest.mark.slow]

BLOCK = 4


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    """A tiny model with a full-attention and a sliding-window layer (two KV cache groups)."""
    return str(save_model(build_model("qwen2-hybrid"), tmp_path_factory.mktemp("hybrid"), tokenizer=True))


def test_engine_events_carry_hashes_a_router_computes_from_the_prompt(hybrid):
    llm = LLM(
        hybrid,
        block_size=BLOCK,
        kv_cache_memory="256KiB",
        hash_algo="sha256_cbor",
        enable_kv_events=True,
        threads=1,
        log=lambda line: None,
    )
    manager = llm.engine.manager
    assert manager.hasher.algo.value == "sha256_cbor"
    prompt = random_prompt(22, seed=5)
    llm.generate([prompt], SamplingParams(max_tokens=3, ignore_eos=True), cache_salt="tenant-a")
    events = manager.take_events()
    stored = [e for e in events if isinstance(e, BlockStored)]
    groups = {e.group_id: e for e in stored}
    assert len(groups) == len(manager.groups) == 2
    assert {e.spec_kind for e in stored} == {"full_attention", "sliding_window"}
    # What a router computes from the prompt tokens alone, as vLLM would:
    expected = BlockHasher(BLOCK, "sha256_cbor").hash_token_ids(prompt, cache_salt="tenant-a")
    full_attention = [h for e in stored if e.spec_kind == "full_attention" for h in e.block_hashes]
    assert full_attention[: len(expected)] == expected
    # Over the wire, with every field.
    with KVEventPublisher("tcp://*:0", replay_endpoint="tcp://*:0") as publisher:  # port 0: the OS picks them
        assert publisher.replay_endpoint is not None
        port, replay = (int(e.rsplit(":", 1)[1]) for e in (publisher.endpoint, publisher.replay_endpoint))
        with KVEventSubscriber(f"tcp://127.0.0.1:{port}", replay_endpoint=f"tcp://127.0.0.1:{replay}") as subscriber:
            publisher.publish(events)
            # heard live, or (when the subscription was not up yet) from the replay socket
            received = subscriber.receive(timeout=1.0) or subscriber.replay(0)
    assert received[0].batch.events == tuple(events)


def test_generate_takes_the_hash_flag(hybrid, monkeypatch):
    import kvpool.engine.llm_engine as llm_engine

    chosen = []
    real = llm_engine.KVCacheManager

    def recording(*args, **kwargs):
        chosen.append(kwargs["hash_algo"])
        return real(*args, **kwargs)

    monkeypatch.setattr(llm_engine, "KVCacheManager", recording)
    engine = ["--model", hybrid, "--block-size", "4", "--kv-cache-memory", "64KiB", "--max-model-len", "64"]
    result = CliRunner().invoke(cli, ["generate", "w1 w2 w3 w4 w5", "--max-tokens", "2", "--hash", "sha256", *engine])
    assert result.exit_code == 0, result.output
    assert chosen == ["sha256"]
    result = CliRunner().invoke(cli, ["generate", "w1", "--hash", "md5", *engine])
    assert result.exit_code == 2 and "sha256_cbor" in result.output
