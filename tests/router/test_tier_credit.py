"""The router credits a prefix by where a replica holds it: in full on GPU, by what a load saves below it."""

from __future__ import annotations

import dataclasses

import click
import pytest

from kvpool.cli.route import route
from kvpool.errors import ConfigError
from kvpool.events import MEDIUM_CPU, MEDIUM_GPU, MEDIUM_STORAGE, BlockRemoved, BlockStored
from kvpool.kv_events import decode_batch, encode_batch
from kvpool.router import MemoryIndex, RouteOptions, Router
from kvpool.router.feed import apply_events
from kvpool.router.replica_config import parse_replica
from kvpool.router.route_options import parse_medium_link
from kvpool.routing import MediumCost
from kvpool.tenancy import SaltPolicy
from kvpool.tiers.store import medium_links
from tests.router.fakes import ByteTokenizer
from tests.router.test_rank import keys_of

BLOCK = 16


def router_with(**options: object) -> Router:
    specs = tuple(
        parse_replica(f"http://127.0.0.1:{port},events=tcp://127.0.0.1:{port + 1},block-size={BLOCK},hash=sha256")
        for port in (9301, 9401)
    )
    given = RouteOptions(replicas=specs, tokenizer=ByteTokenizer(), keys=None, salts=SaltPolicy.shared(), **options)  # type: ignore[arg-type]  # the fields under test
    router = Router(given, MemoryIndex())
    for replica in router.replicas:
        replica.up, replica.events = True, replica.described  # as the monitor would; nothing here talks to them
    return router


def gpu_versus_storage(router: Router) -> str:
    """Replica 0 holds 4 blocks of the prompt on GPU, replica 1 holds 10 only in STORAGE: which one is first."""
    keys = keys_of(router, "y" * (12 * BLOCK))
    hashes = keys.hashes[next(iter(keys.hashes))]
    gpu, storage = router.replicas
    router.index.store(gpu.url, hashes[:4], MEDIUM_GPU)
    router.index.store(storage.url, hashes[:10], MEDIUM_STORAGE)
    ranked = router.rank(keys)
    assert {r.url: n for r, n in ranked} == {gpu.url: 4, storage.url: 10}  # what each holds is as before
    return "gpu" if ranked[0][0] is gpu else "storage"


def test_a_longer_prefix_in_storage_wins_only_where_loading_it_saves_enough() -> None:
    # 16-token blocks, 1 KiB per token, 10,000 prompt tokens a second: a block computes in 1.6 ms
    figures = {"kv_bytes_per_token": 1024, "prefill_tokens_per_s": 10_000.0}
    # a link that loads a block in a tenth of that: the 10 blocks are worth 9, more than the 4 on GPU
    assert gpu_versus_storage(router_with(**figures, medium_links=("STORAGE=102.4MB",))) == "storage"
    # at a third of computing's speed... 10 x (1 - 1/3) = 6.7 blocks: still worth more than 4
    assert gpu_versus_storage(router_with(**figures, medium_links=("STORAGE=30.72MB",))) == "storage"
    # a link slower than computing: the STORAGE prefix is worth nothing, the GPU one wins
    # (every medium counted alike, the 10 blocks won here too)
    assert gpu_versus_storage(router_with(**figures, medium_links=("STORAGE=5MB",))) == "gpu"
    # fast enough per byte, but a 20 ms fetch eats what it saves on 10 blocks (16 ms of compute)
    assert gpu_versus_storage(router_with(**figures, medium_links=("STORAGE=1GB,0.02",))) == "gpu"
    # the prefill rate moves the line the other way: a slow replica gains more from any load
    assert gpu_versus_storage(router_with(kv_bytes_per_token=1024, prefill_tokens_per_s=500.0)) == "storage"


def test_the_defaults_come_from_the_tier_registry() -> None:
    options = router_with().options
    links = medium_links()
    for medium in (MEDIUM_CPU, MEDIUM_STORAGE):
        bandwidth, latency = links[medium]
        expected = MediumCost.of_link(bandwidth, latency, kv_bytes_per_token=options.kv_bytes_per_token)
        assert options.credit.media[medium] == expected
    assert options.credit.other == options.credit.media[MEDIUM_STORAGE]  # a medium it does not know: as storage
    assert options.credit.main_pool == {None, MEDIUM_GPU}
    given = router_with(medium_links=("CPU=50GB,0.00002",)).options.credit.media[MEDIUM_CPU]
    assert given == MediumCost.of_link(50e9, 2e-5, kv_bytes_per_token=options.kv_bytes_per_token)


def test_the_verbose_health_shows_the_credit() -> None:
    router = router_with(kv_bytes_per_token=1024, prefill_tokens_per_s=10_000.0, medium_links=("STORAGE=30.72MB",))
    shown = router.figures()["tier_credit"]
    assert shown["prefill_tokens_per_s"] == 10_000.0
    assert shown["media"]["STORAGE"] == {"latency_s": 0.0, "seconds_per_token": 1024 / 30.72e6, "worth": 0.6667}
    assert shown["other"] == shown["media"]["STORAGE"] and set(shown["media"]) == {MEDIUM_CPU, MEDIUM_STORAGE}


def test_the_command_line_defaults_are_the_options_defaults() -> None:
    defaults = {p.name: p.default for p in route.params if isinstance(p, click.Option)}
    fields = {f.name: f.default for f in dataclasses.fields(RouteOptions)}
    for name in ("prefill_tokens_per_s", "kv_bytes_per_token"):
        assert defaults[name] == fields[name], name
    assert fields["medium_links"] == ()  # the flag, when not given, leaves the registry's links as they are


def test_vllm_media_round_trip_the_wire_and_reach_the_index() -> None:
    h = [bytes([i]) * 32 for i in range(3)]
    events = [
        BlockStored(
            block_hashes=(h[0], h[1]),
            parent_block_hash=None,
            token_ids=tuple(range(2 * BLOCK)),
            block_size=BLOCK,
            lora_name=None,
            extra_keys=(None, None),
            medium=MEDIUM_GPU,
        ),
        BlockStored(
            block_hashes=(h[0], h[1], h[2]),
            parent_block_hash=None,
            token_ids=tuple(range(3 * BLOCK)),
            block_size=BLOCK,
            lora_name=None,
            extra_keys=(None, None, None),
            medium=MEDIUM_CPU,
        ),
        BlockStored(
            block_hashes=(h[2],),
            parent_block_hash=h[1],
            token_ids=tuple(range(BLOCK)),
            block_size=BLOCK,
            lora_name=None,
            extra_keys=(None,),
            medium=MEDIUM_STORAGE,
        ),
        BlockRemoved(block_hashes=(h[1],), medium=MEDIUM_GPU),
    ]
    back = decode_batch(encode_batch(events, ts=1.0)).events
    assert [e.medium for e in back] == [MEDIUM_GPU, MEDIUM_CPU, MEDIUM_STORAGE, MEDIUM_GPU]  # type: ignore[union-attr]  # no clears here
    index = MemoryIndex()
    apply_events(index, "r", back)
    assert index.match_media(h, ["r"]) == [
        (
            (frozenset({MEDIUM_GPU, MEDIUM_CPU}), 1),
            (frozenset({MEDIUM_CPU}), 1),
            (frozenset({MEDIUM_CPU, MEDIUM_STORAGE}), 1),
        )
    ]


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("STORAGE", "MEDIUM=BANDWIDTH"),
        ("=1GB", "MEDIUM=BANDWIDTH"),
        ("STORAGE=", "MEDIUM=BANDWIDTH"),
        ("STORAGE=fast", "not a size"),
        ("STORAGE=0", "more than 0"),
        ("STORAGE=1GB,soon", "latency"),
        ("STORAGE=1GB,-1", "latency"),
        ("STORAGE=1GB,nan", "latency"),
        ("GPU=1GB", "own pool"),
    ],
)
def test_a_bad_medium_link_is_refused_by_name(spec: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_medium_link(spec)


def test_medium_links_parse() -> None:
    assert parse_medium_link("STORAGE=2GB,0.0005") == ("STORAGE", 2e9, 0.0005)
    assert parse_medium_link(" CPU = 25GiB ") == ("CPU", float(25 * 2**30), 0.0)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"medium_links": ("CPU=1GB", "CPU=2GB")}, "given twice"),
        ({"medium_links": "CPU=1GB"}, "tuple"),
        ({"prefill_tokens_per_s": 0.0}, "prefill_tokens_per_s"),
        ({"kv_bytes_per_token": 0}, "kv_bytes_per_token"),
    ],
)
def test_bad_credit_options_are_refused_by_name(options: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        RouteOptions(replicas=("http://127.0.0.1:9",), tokenizer=None, keys=None, salts=SaltPolicy.shared(), **options)  # type: ignore[arg-type]  # bad on purpose
