"""Hostile calls into the compiled modules: the same error, type and message, in both builds.

mypyc checks a typed argument before the function body runs: a compiled
build would answer a wrong type with its own ``TypeError`` ("int object
expected; got str") and read ``True`` as ``1``. So every public entry point
of a module in ``kvpool.build_info.COMPILED_MODULES`` (the constructors and
configuration functions a caller reaches, and the entry points of the pure
modules that hand values on to them) takes such arguments as objects and
checks them first. The table below is written from the pure build's rules;
CI runs this module against both builds (``.ci/run``), so it passes in both
only when they agree: the exact exception class and message, and nothing
changed after a refused call.

Left out on purpose: the per-step bookkeeping methods of the core
(``FreeList.popleft_n``, ``BlockPool.get_new_blocks``, ``PrefixIndex`` runs,
group steps, ``block_ids``, ``BlockHasher.chain``), which only the manager
calls with values it has checked; a check there would sit in the hot path.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import FrozenInstanceError, dataclass

import pytest

from kvpool import (
    ConfigError,
    HashAlgo,
    InvalidTokenError,
    KVCacheManager,
    KVPoolError,
    MultiModalInput,
    Request,
    RequestStateError,
)
from kvpool.block import KVBlock
from kvpool.block_pool import BlockPool
from kvpool.coordinator import Coordinator, make_group_managers
from kvpool.free_queue import FreeBlockQueue
from kvpool.groups import FullAttentionManager, SlidingWindowManager
from kvpool.hashing import BlockHasher
from kvpool.linked_blocks import FreeList
from kvpool.specs import KVDtype, SlidingWindowSpec
from tests.helpers import admit, snapshot


class Hostile:
    """An object of no expected type, with a stable repr."""

    def __repr__(self) -> str:
        return "<hostile>"


HOSTILE = Hostile()
#: Not ints: text, floats (even integral), None, bools (a flag is not a count), objects, containers.
NOT_INTS: tuple[object, ...] = ("4", 4.0, 1.5, None, True, False, HOSTILE, [4], (4,))
#: Not switches: ints (even 0 and 1), None, text, floats.
NOT_FLAGS: tuple[object, ...] = (1, 0, None, "yes", 1.0, HOSTILE)
#: Not text cache keys: numbers, bytes, the empty string, bools, objects, containers.
NOT_TEXT: tuple[object, ...] = (5, b"x", "", True, 1.5, HOSTILE, ["a"])
NOT_ALGOS: tuple[object, ...] = (5, None, b"sha256", True, 1.5, HOSTILE, "crc32")
ALGOS = "kvpool_sha256, xxh3_128, sha256, sha256_cbor"
SPEC = SlidingWindowSpec(block_size=4, num_kv_heads=1, head_dim=8, dtype=KVDtype.FP16, sliding_window=8)


@dataclass(frozen=True)
class Case:
    label: str
    call: Callable[[], object]
    error: type[KVPoolError]
    message: str


def _bound(minimum: int) -> str:
    return {0: "a non-negative integer", 1: "a positive integer"}.get(minimum, f"an integer >= {minimum}")


def _counts(
    label: str, name: str, minimum: int, call: Callable[[object], object], *, optional: bool = False
) -> Iterator[Case]:
    """Every wrong type, and each int just below ``minimum``, refused as checks.check_int refuses it.

    ``optional``: None means "not given" here, so it is not hostile.
    """
    for value in (*NOT_INTS, minimum - 1, -(2**70)):
        if optional and value is None:
            continue
        message = f"{name} must be {_bound(minimum)}, got {value!r}"
        yield Case(f"{label}={value!r}", lambda v=value: call(v), ConfigError, message)


def _flags(label: str, name: str, call: Callable[[object], object]) -> Iterator[Case]:
    for value in NOT_FLAGS:
        yield Case(
            f"{label}={value!r}", lambda v=value: call(v), ConfigError, f"{name} must be True or False, got {value!r}"
        )


def _texts(
    label: str, prefix: str, call: Callable[[object], object], error: type[KVPoolError] = ConfigError
) -> Iterator[Case]:
    for value in (*NOT_TEXT, "\ud800"):
        problem = (
            f"valid Unicode text, got {value!r} (it holds a lone surrogate)"
            if value == "\ud800"
            else f"a non-empty string, got {value!r}"
        )
        yield Case(f"{label}={value!r}", lambda v=value: call(v), error, f"{prefix}{problem}")


def _objects(label: str, values: tuple[object, ...], message: str, call: Callable[[object], object]) -> Iterator[Case]:
    for value in values:
        yield Case(f"{label}={value!r}", lambda v=value: call(v), ConfigError, message.format(value=repr(value)))


def _media(**changes: object) -> MultiModalInput:
    return MultiModalInput(**{"identifier": "img", "offset": 0, "length": 2, **changes})  # type: ignore[arg-type]


def _cases() -> Iterator[Case]:
    pool = BlockPool
    # hashing: the hasher, its algorithm names, multimodal items, hashes without a manager
    yield from _counts("BlockHasher(block_size)", "block_size", 1, lambda v: BlockHasher(v))
    yield from _counts("MultiModalInput(offset)", "multimodal offset", 0, lambda v: _media(offset=v))
    yield from _counts("MultiModalInput(length)", "multimodal length", 1, lambda v: _media(length=v))
    yield from _texts("MultiModalInput(identifier)", "multimodal identifier must be ", lambda v: _media(identifier=v))
    for value in NOT_ALGOS:
        message = f"unknown hash algorithm {value!r}; choose one of: {ALGOS}"
        yield Case(f"BlockHasher(algo={value!r})", lambda v=value: BlockHasher(4, v), ConfigError, message)
        yield Case(f"HashAlgo.parse({value!r})", lambda v=value: HashAlgo.parse(v), ConfigError, message)
        yield Case(
            f"KVCacheManager(hash_algo={value!r})",
            lambda v=value: KVCacheManager(8, 4, hash_algo=v),
            ConfigError,
            message,
        )
    for value in (5, "seed", b"", True, 1.5, HOSTILE, [b"x"]):
        message = f"hash seed of 'kvpool_sha256' must be non-empty bytes, got {value!r}"
        yield Case(f"BlockHasher(seed={value!r})", lambda v=value: BlockHasher(4, seed=v), ConfigError, message)
        yield Case(
            f"KVCacheManager(hash_seed={value!r})",
            lambda v=value: KVCacheManager(8, 4, hash_seed=v),
            ConfigError,
            message,
        )
    for value in (5, b"seed", "", True, HOSTILE):
        message = f"the seed of vLLM's hash algorithms must be a non-empty string, got {value!r}"
        yield Case(
            f"BlockHasher('sha256', seed={value!r})", lambda v=value: BlockHasher(4, "sha256", v), ConfigError, message
        )
    hasher = BlockHasher(4)
    for key in ("cache_salt", "lora_name", "lora_path"):
        extra: dict[str, object] = {"lora_name": "adapter"} if key == "lora_path" else {}
        yield from _texts(
            f"hash_token_ids({key})",
            f"{key} must be ",
            lambda v, k=key, e=extra: hasher.hash_token_ids([1, 2, 3, 4], **{k: v, **e}),  # type: ignore[arg-type]
        )
    yield from _objects(
        "hash_token_ids(mm_inputs)",
        ("abc", b"ab", [5], 5, None, (HOSTILE,)),
        "mm_inputs must be a sequence of MultiModalInput, got {value}",
        lambda v: hasher.hash_token_ids([1, 2, 3, 4], mm_inputs=v),
    )
    yield Case(
        "hash_token_ids(lora_path without lora_name)",
        lambda: hasher.hash_token_ids([1, 2, 3, 4], lora_path="p"),
        ConfigError,
        "lora_path 'p' was given without a lora_name",
    )
    for tokens, problem in (
        ("ab", "token_ids must be a sequence of integer token IDs, got str"),
        (5, "token_ids must be a sequence of integer token IDs, got int"),
        (None, "token_ids must be a sequence of integer token IDs, got NoneType"),
        ([1, True], "token_ids[1] = True is not an integer token ID"),
        ([1.0], "token_ids[0] = 1.0 is not an integer token ID"),
        ([HOSTILE], "token_ids[0] = <hostile> is not an integer token ID"),
        ([-1], "token_ids[0] = -1 is out of range: token IDs must be in [0, 2**32)"),
        ([2**32], "token_ids[0] = 4294967296 is out of range: token IDs must be in [0, 2**32)"),
    ):
        yield Case(f"hash_token_ids({tokens!r})", lambda t=tokens: hasher.hash_token_ids(t), InvalidTokenError, problem)  # type: ignore[arg-type]
        yield Case(
            f"Request(prompt_token_ids={tokens!r})",
            lambda t=tokens: Request("r", t),  # type: ignore[arg-type]
            InvalidTokenError,
            problem.replace("token_ids", "prompt_token_ids", 1),
        )
    # the request's keys, handed to the hashing module
    yield from _texts(
        "Request(cache_salt)",
        "request 'r': cache_salt must be None or ",
        lambda v: Request("r", [1], cache_salt=v),
        RequestStateError,
    )  # type: ignore[arg-type]
    yield from _texts(
        "Request(lora_name)",
        "request 'r': lora_name must be None or ",
        lambda v: Request("r", [1], lora_name=v),
        RequestStateError,
    )  # type: ignore[arg-type]
    # block records, free lists and the pool
    for value in ("4", 4.0, None, True, HOSTILE):
        yield Case(
            f"KVBlock({value!r})",
            lambda v=value: KVBlock(v),
            ConfigError,
            f"block_id must be an integer, got {value!r}",
        )
    yield from _counts("BlockPool(num_blocks)", "num_blocks", 1, lambda v: pool(v))
    yield from _counts("BlockPool(num_groups)", "num_groups", 1, lambda v: pool(8, num_groups=v))
    for flag in ("enable_caching", "verify_content", "enable_events"):
        yield from _flags(f"BlockPool({flag})", flag, lambda v, f=flag: pool(8, **{f: v}))
    yield from _objects(
        "BlockPool(free_queue_factory)",
        (5, None, "lru"),
        "free_queue_factory must be a free-queue factory, got {value}",
        lambda v: pool(8, free_queue_factory=v),
    )
    yield from _counts("FreeBlockQueue(num_blocks)", "num_blocks", 0, lambda v: FreeBlockQueue([], v))
    yield from _counts("FreeList(num_blocks)", "num_blocks", 1, lambda v: FreeList([KVBlock(0)], v))
    yield from _objects(
        "FreeList(blocks)",
        (5, None, "ab", (KVBlock(0),), [5]),
        "blocks must be the pool's list of KVBlock records, got {value}",
        lambda v: FreeList(v, 4),
    )
    # layer groups and the coordinator
    yield from _counts(
        "FullAttentionManager(block_size)", "block_size", 1, lambda v: FullAttentionManager(pool(8), 0, v, True)
    )
    yield from _counts(
        "FullAttentionManager(group_id)", "group_id", 0, lambda v: FullAttentionManager(pool(8), v, 4, True)
    )
    yield from _counts(
        "SlidingWindowManager(hash_block_size)",
        "hash_block_size",
        1,
        lambda v: SlidingWindowManager(pool(8), 0, 4, True, spec=SPEC, hash_block_size=v),
        optional=True,
    )
    yield from _flags(
        "FullAttentionManager(enable_caching)", "enable_caching", lambda v: FullAttentionManager(pool(8), 0, 4, v)
    )
    yield from _objects(
        "FullAttentionManager(pool)",
        (5, None, "pool", [], HOSTILE),
        "pool must be a kvpool.block_pool.BlockPool, got {value}",
        lambda v: FullAttentionManager(v, 0, 4, True),
    )
    yield from _objects(
        "SlidingWindowManager(spec)",
        (5, "SLIDING_WINDOW", HOSTILE),
        "spec must be a kvpool.specs layer spec or None, got {value}",
        lambda v: SlidingWindowManager(pool(8), 0, 4, True, spec=v),
    )
    yield Case(
        "FullAttentionManager(group_id past the pool's groups)",
        lambda: FullAttentionManager(pool(8), 1, 4, True),
        ConfigError,
        "group_id 1 is not a group of the pool, which has 1",
    )
    yield Case(
        "FullAttentionManager(block_size not a multiple of hash_block_size)",
        lambda: FullAttentionManager(pool(8), 0, 6, True, hash_block_size=4),
        ConfigError,
        "block_size 6 is not a multiple of hash_block_size 4",
    )
    yield from _counts(
        "make_group_managers(block_size)", "block_size", 1, lambda v: make_group_managers(pool(8), (), v, True)
    )
    yield from _flags(
        "make_group_managers(enable_caching)", "enable_caching", lambda v: make_group_managers(pool(8), (), 4, v)
    )
    yield from _objects(
        "make_group_managers(pool)",
        (5, None, HOSTILE),
        "pool must be a kvpool.block_pool.BlockPool, got {value}",
        lambda v: make_group_managers(v, (), 4, True),
    )
    yield from _objects(
        "make_group_managers(groups)",
        (5, None, "ab", HOSTILE),
        "groups must be a sequence of KVCacheGroup, got {value}",
        lambda v: make_group_managers(pool(8), v, 4, True),
    )
    yield Case(
        "make_group_managers(groups=[5])",
        lambda: make_group_managers(pool(8), [5], 4, True),
        ConfigError,
        "groups[0] must be a kvpool.specs.KVCacheGroup, got 5",
    )
    yield from _objects(
        "Coordinator(groups)",
        (5, None, "ab", (), [HOSTILE], (5,), (HOSTILE,)),
        "groups must be a non-empty tuple of group managers, got {value}",
        lambda v: Coordinator(v),
    )
    # the manager's own arguments, before they reach the compiled core
    yield from _counts("KVCacheManager(block_size)", "block_size", 1, lambda v: KVCacheManager(8, v))
    yield from _counts(
        "KVCacheManager(max_model_len)",
        "max_model_len",
        2,
        lambda v: KVCacheManager(8, 4, max_model_len=v),
        optional=True,
    )
    for flag in ("enable_caching", "enable_events"):
        yield from _flags(f"KVCacheManager({flag})", flag, lambda v, f=flag: KVCacheManager(8, 4, **{f: v}))
    yield Case(
        "KVCacheManager(groups=[5])",
        lambda: KVCacheManager(8, 4, groups=[5]),  # type: ignore[list-item]
        ConfigError,
        "groups[0] must be a kvpool.specs.KVCacheGroup, got 5",
    )


CASES = list(_cases())


@pytest.mark.parametrize("case", CASES, ids=[case.label for case in CASES])
def test_a_hostile_call_raises_the_pure_builds_error(case: Case) -> None:
    with pytest.raises(KVPoolError) as refused:
        case.call()
    assert type(refused.value) is case.error, f"{type(refused.value).__name__}: {refused.value}"
    assert str(refused.value) == case.message


def test_the_table_covers_every_kind_of_hostile_value() -> None:
    labels = {case.label for case in CASES}
    assert len(labels) == len(CASES), "two cases share a label"
    for value in (*NOT_INTS, *NOT_FLAGS, *NOT_TEXT, *NOT_ALGOS):
        assert any(case.label.endswith(f"={value!r}") or f"({value!r})" in case.label for case in CASES), value


COUNTS = ("num_new_tokens", "num_lookahead_tokens", "num_encoder_tokens", "num_external_computed_tokens")


@pytest.mark.parametrize("name", COUNTS)
@pytest.mark.parametrize("value", ["3", 3.0, None, True, -1, HOSTILE], ids=repr)
def test_hostile_step_counts_change_nothing(name: str, value: object) -> None:
    mgr = KVCacheManager(16, 4)
    running = Request("a", list(range(10)))
    admit(mgr, running)
    fresh = Request("b", list(range(20, 30)))
    before = snapshot(mgr)
    args: dict[str, object] = {"num_new_tokens": 10, name: value}
    with pytest.raises(RequestStateError) as refused:
        mgr.allocate_slots(fresh, **args)  # type: ignore[arg-type]
    assert str(refused.value) == f"request 'b': {name}={value!r}, expected a non-negative int"
    assert snapshot(mgr) == before
    mgr.check_invariants()


@pytest.mark.parametrize("value", [4, 4.0, b"x", True, HOSTILE], ids=repr)
def test_hostile_hashing_arguments_leave_the_hasher_as_it_was(value: object) -> None:
    hasher = BlockHasher(4)
    signature, root = hasher.signature, hasher.root
    expected = hasher.hash_token_ids(list(range(8)), cache_salt="t")
    with pytest.raises(ConfigError):
        hasher.hash_token_ids(list(range(8)), cache_salt="t", lora_name=value)
    assert (hasher.signature, hasher.root) == (signature, root)
    assert hasher.hash_token_ids(list(range(8)), cache_salt="t") == expected


def test_what_the_pure_build_accepts_the_compiled_build_accepts_alike() -> None:
    huge = 2**70
    assert BlockHasher(4, seed=bytearray(b"seed")).seed == b"seed"
    assert BlockHasher(4, "SHA256").algo is HashAlgo.VLLM_SHA256
    item = MultiModalInput(identifier="img", offset=huge, length=huge)
    assert (item.offset, item.length) == (huge, huge)
    assert type(item.offset) is int and item == MultiModalInput(identifier="img", offset=huge, length=huge)
    assert hash(item) == hash(MultiModalInput(identifier="img", offset=huge, length=huge))
    with pytest.raises(FrozenInstanceError):
        item.offset = 1  # type: ignore[misc]
    assert BlockPool(huge).num_free_blocks == huge - 1
    assert KVBlock(-1).block_id == -1  # the free lists' sentinels
    assert FreeBlockQueue([], 3).num_free_blocks == 3
    groups = make_group_managers(BlockPool(8), [], 4, False)
    assert Coordinator(groups).block_size == 4 and not groups[0].enable_caching
    media = (item for item in [MultiModalInput(identifier="img", offset=0, length=4)])  # a generator is read once
    assert len(BlockHasher(4).hash_token_ids([1, 2, 3, 4], mm_inputs=media)) == 1
