"""The KV cache manager: the one object a scheduler talks to.

::

    mgr = KVCacheManager(num_blocks=12, block_size=4)
    hit, num_hit = mgr.get_computed_blocks(req)              # lookup; changes nothing
    new = mgr.allocate_slots(req, req.num_tokens - num_hit, num_hit, hit)
    ...                                                      # None: no room, preempt or wait
    mgr.free(req)                                            # tail first

Each scheduling step calls ``allocate_slots`` once per request. It first
checks everything it is handed against what it issued itself: the lookup
result (same manager, same request object, nothing evicted or reset since),
the request's progress (an ``int`` that never moves back nor past the slots
allocated) and ``max_model_len``; a violation raises with nothing changed.
Then it counts the blocks that the request's computed, new and lookahead
tokens occupy in every layer group; if the free blocks fall short it answers
``None`` and takes nothing (a running request still gives back the blocks
that left its window, as every step does). Otherwise it claims the prefix-hit
blocks, pops new ones in eviction order, extends the block tables, and
registers every block that just filled up in the prefix-cache index.

Hybrid models are several layer groups sharing the pool, each with its own
rules and block size (see docs/hybrid.md)::

    groups = group_layers(layer_specs_from_config(config))    # kvpool.specs, kvpool.model_config
    mgr = KVCacheManager.from_groups(groups, num_blocks=4096)  # hashes at the gcd of the block sizes
    mgr.get_block_ids("A")                                     # one table per group

With one full-attention group (the default) this is exactly vLLM V1's
single-group manager, decision for decision.
"""

from __future__ import annotations

from collections.abc import Sequence
from math import gcd
from typing import TYPE_CHECKING, Any

from kvpool.block import NULL_BLOCK_ID, KVBlock, block_ids
from kvpool.block_pool import BlockPool
from kvpool.checks import MIN_MODEL_LEN, check_int
from kvpool.coordinator import Coordinator, make_group_managers
from kvpool.errors import CapacityError, ConfigError, RequestStateError
from kvpool.events import BlockStored, KVCacheEvent
from kvpool.hashing import BlockHasher, HashAlgo
from kvpool.invariants import check_manager
from kvpool.request import Request
from kvpool.specs import KVCacheGroup
from kvpool.stats import PrefixCacheStats, StatsCounter

if TYPE_CHECKING:
    from kvpool.eviction import FreeQueueFactory

__all__ = ["HitBlocks", "KVCacheManager"]

_NO_LIMIT = 2**62
_ZERO = 0


def _check_request(request: object) -> None:
    if not isinstance(request, Request):
        raise RequestStateError(f"expected a kvpool.Request, got {type(request).__name__} {request!r}")


class HitBlocks:
    """The cached blocks a lookup found, one list per layer group: a capability, not a list of IDs.

    Only :meth:`KVCacheManager.allocate_slots` of the manager that issued it
    accepts it, for the very :class:`Request` object it was looked up for,
    and only while every block in it is still cached as it was at the lookup
    (no eviction, reset or reuse in between; with a fast hash, no eviction or
    reset anywhere in the pool). Anything else is refused with a
    :class:`RequestStateError`, so a stale or foreign result can never put
    another prompt's KV into a block table. Read-only.
    """

    __slots__ = ("_blocks", "_num_tokens", "_request", "_issuer", "_evictions", "_resets")

    def __init__(
        self,
        blocks: tuple[list[KVBlock], ...],
        num_tokens: int,
        request: Request | None,
        issuer: KVCacheManager | None,
        evictions: int,
        resets: int,
    ) -> None:
        self._blocks = blocks
        self._num_tokens = num_tokens
        self._request = request
        self._issuer = issuer
        self._evictions = evictions
        self._resets = resets

    @property
    def num_tokens(self) -> int:
        """Tokens the hit covers (pass it as ``num_new_computed_tokens``)."""
        return self._num_tokens

    @property
    def request_id(self) -> str:
        return self._request.request_id if self._request is not None else ""

    @property
    def blocks(self) -> tuple[list[KVBlock], ...]:
        """The hit block records per group (copies of the lists)."""
        return tuple(list(group) for group in self._blocks)

    @property
    def block_ids(self) -> tuple[list[int], ...]:
        return tuple([b.block_id for b in group] for group in self._blocks)

    def __len__(self) -> int:
        return len(self._blocks[0]) if self._blocks else 0

    def __repr__(self) -> str:
        return f"HitBlocks({self.request_id!r}, tokens={self._num_tokens}, blocks={self.block_ids})"


class _Held:
    """What the manager allocated to one running request, to check its progress against.

    ``request`` is the object admitted (not merely its ID); ``computed`` is the
    last ``num_computed_tokens`` the manager accepted (progress never moves
    back past it); ``slots`` is the token positions its blocks cover (progress
    never moves past them: a token is computed only in a slot the request holds).
    ``quiet`` is the single group's quiet bound (``GroupManager.step``): a
    plain step to fewer tokens changes no block, so it is not called; 0 until
    the group sets it, and again after any other kind of step.
    """

    __slots__ = ("request", "computed", "slots", "quiet")

    def __init__(self, request: Request, computed: int, slots: int) -> None:
        self.request = request
        self.computed = computed
        self.slots = slots
        self.quiet = 0


class KVCacheManager:
    """Paged KV cache manager with prefix caching.

    Args:
        num_blocks: blocks in the pool, including the reserved null block 0.
        block_size: tokens per block.
        enable_caching: prefix caching on (default) or off.
        hash_algo: ``"kvpool_sha256"`` (default; a cryptographic hash is
            required when tenants do not trust each other), ``"xxh3_128"``
            (the ``fast`` extra; every hit is verified against the block's
            content), or vLLM's ``"sha256"`` / ``"sha256_cbor"`` (hashes
            identical to vLLM's, for fleets whose routers compute them).
        hash_seed: what the chain's root derives from (see
            :class:`kvpool.hashing.BlockHasher`); None: the algorithm's default.
        enable_events: record KV events for :meth:`take_events`.
        max_model_len: cap on the tokens one request may hold slots for.
        groups: the model's layer groups (``KVCacheGroup`` objects from
            :mod:`kvpool.specs`); None means one full-attention group. Each
            group keeps its spec's block size, which must be a multiple of
            ``block_size`` (the size request hashes are computed at);
            :meth:`from_groups` picks ``block_size`` for you.
        eviction_policy: factory of the free-block structure; None means
            vLLM's order (:class:`kvpool.free_queue.FreeBlockQueue`).
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int = 16,
        *,
        enable_caching: bool = True,
        hash_algo: HashAlgo | str = HashAlgo.SHA256,
        hash_seed: bytes | str | None = None,
        enable_events: bool = False,
        max_model_len: int | None = None,
        groups: Sequence[KVCacheGroup] | None = None,
        eviction_policy: FreeQueueFactory | None = None,
    ) -> None:
        if type(num_blocks) is not int or num_blocks < 2:
            raise ConfigError(f"num_blocks must be an integer >= 2 (block 0 is reserved), got {num_blocks!r}")
        if type(block_size) is not int or block_size < 1:
            raise ConfigError(f"block_size must be a positive integer, got {block_size!r}")
        if max_model_len is not None:
            check_int("max_model_len", max_model_len, minimum=MIN_MODEL_LEN)
        for name, flag in (("enable_caching", enable_caching), ("enable_events", enable_events)):
            if type(flag) is not bool:
                raise ConfigError(f"{name} must be True or False, got {flag!r}")
        if groups is not None and (isinstance(groups, str | bytes) or not isinstance(groups, Sequence)):
            raise ConfigError(f"groups must be a sequence of KVCacheGroup or None, got {groups!r}")
        if eviction_policy is not None and not callable(eviction_policy):
            raise ConfigError(f"eviction_policy must be a free-queue factory or None, got {eviction_policy!r}")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.max_model_len = max_model_len
        # The token limit as a number, so hot paths compare without a None test.
        self._max_len = max_model_len if max_model_len is not None else _NO_LIMIT
        self.hasher = BlockHasher(block_size, hash_algo, hash_seed)
        group_specs = tuple(groups) if groups else ()
        num_groups = max(1, len(group_specs))
        pool_kwargs = {} if eviction_policy is None else {"free_queue_factory": eviction_policy}
        self.pool = BlockPool(
            num_blocks,
            num_groups=num_groups,
            enable_caching=self.enable_caching,
            verify_content=self.hasher.stores_contents,
            enable_events=enable_events,
            **pool_kwargs,
        )
        self.groups = make_group_managers(self.pool, group_specs, block_size, self.enable_caching)
        self.pool.group_kinds = tuple((g.spec.kind.value, g.spec.sliding_window) for g in self.groups)
        if self.hasher.stores_contents and any(not g.supports_verified_index for g in self.groups):
            raise ConfigError(
                f"hash_algo {self.hasher.algo.value!r} verifies hits by walking prefixes from the first "
                "block, which sliding-window, chunked-local and state-space groups do not do; use 'sha256'"
            )
        self.coordinator = Coordinator(self.groups)
        self._single_group = self.groups[0] if len(self.groups) == 1 else None
        self._owners: dict[str, _Held] = {}
        self._stats = StatsCounter()

    @classmethod
    def from_groups(cls, groups: Sequence[KVCacheGroup], num_blocks: int, **kwargs: Any) -> KVCacheManager:
        """A manager for a model's layer groups, hashing at the greatest common divisor of their block sizes.

        ``groups`` are ``KVCacheGroup`` objects, e.g. from
        ``kvpool.specs.group_layers``; ``kwargs`` are the other constructor
        arguments (``block_size`` excluded).
        """
        groups = tuple(groups)
        if not groups:
            raise ConfigError("from_groups needs at least one KVCacheGroup, got none")
        if "block_size" in kwargs:
            raise ConfigError(
                f"from_groups derives block_size from the groups; do not pass block_size={kwargs['block_size']!r}"
            )
        if not all(isinstance(g, KVCacheGroup) for g in groups):
            raise ConfigError(f"from_groups needs KVCacheGroup objects, got {groups!r}")
        return cls(num_blocks, gcd(*(g.block_size for g in groups)), groups=groups, **kwargs)

    # -- sizes -------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return self.pool.free_queue.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of the non-null blocks in use (0.0 .. 1.0)."""
        return self.pool.usage

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats:
        return self._stats.snapshot()

    # -- hashing -------------------------------------------------------------------

    def hash_request(self, request: Request) -> None:
        """Compute the request's block hashes now (e.g. on an engine's input thread).

        Otherwise they are computed when the manager first sees the request.
        Either way each block is hashed once.
        """
        _check_request(request)
        if self.enable_caching:
            request._bind(self.hasher)

    # -- lookup --------------------------------------------------------------------

    def get_computed_blocks(self, request: Request) -> tuple[HitBlocks, int]:
        """The longest cached prefix of the request, and its length in tokens.

        The hit covers at most ``num_tokens - 1`` tokens: the model must compute
        at least the last token to produce logits, so a fully cached,
        block-aligned prompt recomputes its whole last block. Changes no
        reference count. The :class:`HitBlocks` is valid only for this
        request object, on this manager, until the next eviction or reset.

        Raises:
            CapacityError: the request is longer than ``max_model_len``.
        """
        _check_request(request)
        if request.num_tokens > self._max_len:
            raise CapacityError(
                f"request {request.request_id!r} has {request.num_tokens} tokens, more than "
                f"max_model_len={self.max_model_len}"
            )
        pool = self.pool
        if not self.enable_caching:
            empty: tuple[list[KVBlock], ...] = tuple([] for _ in self.groups)
            return HitBlocks(empty, 0, request, self, pool.num_evictions, pool.num_resets), 0
        request._bind(self.hasher)
        blocks, num_hit = self.coordinator.find_longest_cache_hit(request, request.num_tokens - 1)
        self._stats.record(request.num_tokens, num_hit, request.num_preemptions > 0)
        return HitBlocks(blocks, num_hit, request, self, pool.num_evictions, pool.num_resets), num_hit

    # -- allocation ----------------------------------------------------------------

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: HitBlocks | None = None,
        num_lookahead_tokens: int = 0,
        *,
        num_encoder_tokens: int = 0,
        num_external_computed_tokens: int = 0,
    ) -> tuple[list[int], ...] | None:
        """Make room for ``num_new_tokens`` new tokens of ``request``.

        Args:
            request: the request; ``request.num_computed_tokens`` tokens are
                already in its blocks. It must be an ``int`` between the value
                the previous call accepted and the slots allocated so far.
            num_new_tokens: tokens to compute in this step.
            num_new_computed_tokens: tokens just found in the prefix cache
                (first allocation of a request only).
            new_computed_blocks: the :class:`HitBlocks` of that lookup, from
                this manager, for this request object, with no eviction or
                reset since.
            num_lookahead_tokens: extra slots (speculative tokens), not cached;
                trimmed at ``max_model_len``.
            num_encoder_tokens: the encoder input's length, for cross-attention
                groups only (encoder-decoder models); pass it on the step that
                should allocate those blocks, 0 otherwise.
            num_external_computed_tokens: tokens right after the prefix hit
                whose KV an external source (a KV connector, e.g. an offload
                tier) will load into the new blocks instead of the model
                computing them (first allocation of a request only). They get
                slots like new tokens, count as computed, and their full
                blocks are cached at once, like computed ones.

        Returns:
            The newly allocated block IDs, one list per group, or None when the
            free blocks cannot cover the step. A refusal takes no block and
            caches nothing; the one thing it may do is what every step of a
            running request starts with: give back the blocks that no later
            step reads (outside a sliding window or a finished chunk, an
            older state), and record the request's progress.

        Raises:
            RequestStateError: the arguments contradict the request's state
                (nothing has changed).
            CapacityError: the step would pass ``max_model_len``, or the
                request needs more blocks than the pool holds.
        """
        try:
            held = self._owners.get(request._request_id)
        except AttributeError:
            held = None  # not a Request: the general path says so
        single = self._single_group
        if (
            held is not None
            and single is not None
            and held.request is request
            and new_computed_blocks is None
            and type(num_new_tokens) is int
            and num_new_tokens > 0
            # The int 0, by identity (CPython keeps one): any other zero (False,
            # 0.0, a NumPy zero) fails here and meets the general path's checks.
            and num_new_computed_tokens is _ZERO
            and num_lookahead_tokens is _ZERO
            and num_encoder_tokens is _ZERO
            and num_external_computed_tokens is _ZERO
        ):
            # The common step of a running request (a decode or a prefill chunk)
            # in a single-group model: the same checks and decisions as the
            # general path below, without its per-group fan-out.
            computed = request.num_computed_tokens
            total = computed + num_new_tokens if type(computed) is int else _NO_LIMIT
            if total <= len(request._token_ids) and total <= self._max_len and held.computed <= computed <= held.slots:
                held.computed = computed
                if total < held.quiet:  # the group said this step changes nothing there
                    if total > held.slots:
                        held.slots = total
                    return ([],)
                new, held.quiet = single.step(request, computed, total)
                if new is None:
                    self._refuse(request, total, computed)
                    return None
                if total > held.slots:
                    held.slots = total
                return (new,)
        return self._allocate(
            request,
            num_new_tokens,
            num_new_computed_tokens,
            new_computed_blocks,
            num_lookahead_tokens,
            num_encoder_tokens,
            num_external_computed_tokens,
            False,
        )

    def allocate_slots_to_load(
        self,
        request: Request,
        num_new_computed_tokens: int,
        new_computed_blocks: HitBlocks | None,
        num_external_computed_tokens: int,
    ) -> tuple[list[int], ...] | None:
        """Admit ``request`` to wait for an asynchronous load: slots for its prefix hit and the
        ``num_external_computed_tokens`` after it, none computed in this step, and nothing cached yet
        (blocks must not be found before their KV arrives; :meth:`cache_loaded_blocks` caches them once
        it has). The arguments and refusals are :meth:`allocate_slots`' (vLLM's ``delay_cache_blocks``)."""
        return self._allocate(
            request, 0, num_new_computed_tokens, new_computed_blocks, 0, 0, num_external_computed_tokens, True
        )

    def _allocate(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int,
        new_computed_blocks: HitBlocks | None,
        num_lookahead_tokens: int,
        num_encoder_tokens: int,
        num_external_computed_tokens: int,
        delay_cache_blocks: bool,
    ) -> tuple[list[int], ...] | None:
        """:meth:`allocate_slots`' general path (every check; then the groups), caching unless ``delay_cache_blocks``."""
        held = self._owners.get(request._request_id) if isinstance(request, Request) else None
        # Validate everything first: past this block, nothing can fail.
        _check_request(request)
        rid = request.request_id
        for name, count in (
            ("num_new_tokens", num_new_tokens),
            ("num_new_computed_tokens", num_new_computed_tokens),
            ("num_lookahead_tokens", num_lookahead_tokens),
            ("num_encoder_tokens", num_encoder_tokens),
            ("num_external_computed_tokens", num_external_computed_tokens),
        ):
            if type(count) is not int or count < 0:
                raise RequestStateError(f"request {rid!r}: {name}={count!r}, expected a non-negative int")
        if num_encoder_tokens and not any(g.uses_encoder_tokens for g in self.groups):
            raise RequestStateError(
                f"request {rid!r}: num_encoder_tokens={num_encoder_tokens} but the model has no cross-attention group"
            )
        computed = request.num_computed_tokens
        if type(computed) is not int:
            raise RequestStateError(f"request {rid!r}: num_computed_tokens must be an int, got {computed!r}")
        running = held is not None and held.request is request
        if running:
            if (
                num_new_computed_tokens
                or num_external_computed_tokens
                or (
                    new_computed_blocks is not None
                    and (not isinstance(new_computed_blocks, HitBlocks) or new_computed_blocks._num_tokens)
                )
            ):
                raise RequestStateError(
                    f"request {rid!r} already holds blocks; prefix hits are only taken on its first allocation"
                )
            if new_computed_blocks is not None and new_computed_blocks._issuer is not self:
                raise RequestStateError(f"request {rid!r}: the HitBlocks was issued by another KVCacheManager")
            self._check_progress(rid, held, computed)  # type: ignore[arg-type]  # running: held is not None
        else:
            self._check_admission(request, held, computed, num_new_computed_tokens, new_computed_blocks)
        total_computed = computed + num_new_computed_tokens
        # Loaded tokens count as computed, but their blocks are new (a hit's
        # window rules see only the local prefix): ``local`` is what the groups
        # take as hits, ``total_computed`` the request's progress after the step.
        local = total_computed
        total_computed += num_external_computed_tokens
        num_tokens = request.num_tokens
        if total_computed + num_new_tokens > num_tokens:
            external = f" + {num_external_computed_tokens} loaded" if num_external_computed_tokens else ""
            raise RequestStateError(
                f"request {rid!r}: {computed} computed + {num_new_computed_tokens} cached{external} + "
                f"{num_new_tokens} new tokens exceed its {num_tokens} tokens"
            )
        if total_computed + num_new_tokens == 0:
            raise RequestStateError(f"request {rid!r}: num_new_tokens must be positive when nothing is computed")
        if total_computed + num_new_tokens > self._max_len:
            raise CapacityError(
                f"request {rid!r}: {total_computed} computed + {num_new_tokens} new tokens exceed "
                f"max_model_len={self.max_model_len}"
            )
        need = total_computed + num_new_tokens + num_lookahead_tokens
        if need > self._max_len:
            need = self._max_len

        coordinator = self.coordinator
        if running:
            # Blocks that left the window go back first, even if the step is
            # then refused: no later step reads them (vLLM does the same).
            held.computed = computed  # type: ignore[union-attr]  # running: held is not None
            held.quiet = 0  # type: ignore[union-attr]  # running: held is not None
            coordinator.remove_skipped_blocks(rid, computed)
            num_needed = coordinator.num_blocks_to_allocate(rid, need, None, total_computed, num_encoder_tokens)
            if num_needed > self.pool.free_queue.num_free_blocks:
                self._refuse(request, need, total_computed, num_encoder_tokens)
                return None
            new_blocks = coordinator.allocate_new_blocks(rid, need, num_encoder_tokens)
            if need > held.slots:  # type: ignore[union-attr]  # running: held is not None
                held.slots = need  # type: ignore[union-attr]  # running: held is not None
        else:
            hits = new_computed_blocks._blocks if new_computed_blocks is not None else None
            num_needed = coordinator.num_blocks_to_allocate(rid, need, hits, local, num_encoder_tokens)
            if num_needed > self.pool.free_queue.num_free_blocks:
                self._refuse(request, need, local, num_encoder_tokens)
                return None
            coordinator.add_hit_blocks(rid, hits or tuple([] for _ in self.groups), local)
            new_blocks = coordinator.allocate_new_blocks(rid, need, num_encoder_tokens)
            self._owners[rid] = _Held(request, total_computed, need)
        if self.enable_caching and not delay_cache_blocks:
            cached = total_computed + num_new_tokens
            coordinator.cache_blocks(request, cached if cached < num_tokens else num_tokens)
        return tuple(map(block_ids, new_blocks))

    def cache_loaded_blocks(self, request: Request, num_tokens: int) -> None:
        """The first ``num_tokens`` tokens of ``request`` have their KV in place: cache their full blocks.

        For an admission made with ``delay_cache_blocks`` (an asynchronous
        load), once its loads are done. ``num_tokens`` is at least what the
        request already has cached (its local hit) and at most what that
        admission counted as computed; less (a load that failed part-way)
        becomes the request's progress, and the tokens past it are computed.
        """
        _check_request(request)
        rid = request.request_id
        check_int("num_tokens", num_tokens, minimum=0)
        held = self._owners.get(rid)
        if held is None or held.request is not request:
            raise RequestStateError(f"request {rid!r} holds no blocks here; nothing was loaded for it")
        cached = max((g.num_cached.get(rid, 0) * g.block_size for g in self.groups), default=0)
        if not cached <= num_tokens <= held.computed:
            raise RequestStateError(
                f"request {rid!r}: num_tokens={num_tokens} loaded, expected {cached} (its cached tokens) "
                f"to {held.computed} (what its admission counted as computed)"
            )
        held.computed = num_tokens
        held.quiet = 0
        if self.enable_caching:
            self.coordinator.cache_blocks(request, min(num_tokens, request.num_tokens))

    @staticmethod
    def _check_progress(rid: str, held: _Held, computed: int) -> None:
        """A running request's progress moves forward, and only through slots it holds."""
        if computed < held.computed:
            raise RequestStateError(
                f"request {rid!r}: num_computed_tokens={computed} moved backwards from {held.computed}; "
                "progress only moves forward (free the request to start over)"
            )
        if computed > held.slots:
            raise RequestStateError(
                f"request {rid!r}: num_computed_tokens={computed} is past the {held.slots} token slots it holds; "
                "a token can only be computed in a slot allocated to it"
            )

    def _check_admission(
        self,
        request: Request,
        held: _Held | None,
        computed: int,
        num_new_computed_tokens: int,
        hit: HitBlocks | None,
    ) -> None:
        """Validate a request's first allocation (or re-admission after a free); changes no block."""
        rid = request.request_id
        if held is not None:
            raise RequestStateError(
                f"request ID {rid!r} already holds blocks for a different Request object; free it first"
            )
        if computed != 0:
            raise RequestStateError(
                f"request {rid!r} claims num_computed_tokens={computed} but holds no blocks; "
                "reset it to 0 before admitting it (again)"
            )
        if self.enable_caching:
            request._bind(self.hasher)  # hashing is derived data: the pool is untouched
        if hit is None:
            if num_new_computed_tokens:
                raise RequestStateError(
                    f"request {rid!r}: num_new_computed_tokens={num_new_computed_tokens} without the lookup's blocks (its HitBlocks)"
                )
            return
        if not isinstance(hit, HitBlocks):
            raise RequestStateError(
                f"request {rid!r}: new_computed_blocks must be the HitBlocks from get_computed_blocks, "
                f"got {type(hit).__name__}"
            )
        if hit._issuer is not self:
            raise RequestStateError(f"request {rid!r}: the HitBlocks was issued by another KVCacheManager")
        if hit._request is not request:
            raise RequestStateError(
                f"request {rid!r}: the HitBlocks was looked up for another Request object "
                f"({hit.request_id!r}); look this request up itself"
            )
        if hit._num_tokens != num_new_computed_tokens:
            raise RequestStateError(
                f"request {rid!r}: num_new_computed_tokens={num_new_computed_tokens} but the hit covers "
                f"{hit._num_tokens} tokens"
            )
        pool = self.pool
        if hit._resets != pool.num_resets or (
            hit._evictions != pool.num_evictions
            # A cryptographic hash vouches for the content of a block still cached
            # under it; a fast hash does not, so any eviction voids its hits.
            and (self.hasher.stores_contents or not self.coordinator.hit_still_valid(request, hit._blocks))
        ):
            raise RequestStateError(
                f"request {rid!r}: the HitBlocks went stale (a block was evicted or the cache reset since "
                "the lookup); look the request up again"
            )

    def _refuse(self, request: Request, need: int, num_computed: int, num_encoder_tokens: int = 0) -> None:
        """No room now (the caller answers None). Raise instead if the step could never fit, even alone."""
        most = self.coordinator.blocks_held_after(num_computed, need, num_encoder_tokens)
        if most > self.num_blocks - 1:
            encoder = f" and {num_encoder_tokens} encoder tokens" if num_encoder_tokens else ""
            raise CapacityError(
                f"request {request.request_id!r} needs {most} blocks for {need} tokens{encoder}, "
                f"but the pool has only {self.num_blocks - 1} usable blocks"
            )

    # -- release ---------------------------------------------------------------------

    def free(self, request: Request) -> None:
        """Release the request's blocks, last block first. A no-op if it holds none."""
        _check_request(request)
        rid = request.request_id
        held = self._owners.get(rid)
        if held is None:
            return
        if held.request is not request:
            raise RequestStateError(f"request ID {rid!r} holds blocks for a different Request object")
        del self._owners[rid]
        self.coordinator.free(rid)

    def uncache_from(self, request: Request, num_tokens: int) -> int:
        """Take the request's blocks holding any token at or past ``num_tokens`` out of the prefix cache.

        For a step that failed: its blocks were cached when allocated, but
        their KV was never written. Blocks wholly before ``num_tokens`` stay
        cached; the request keeps every block (free it next). Returns how many
        blocks left the index. O(blocks of the request).
        """
        _check_request(request)
        check_int("num_tokens", num_tokens, minimum=0)
        rid = request.request_id
        held = self._owners.get(rid)
        if held is None or held.request is not request:
            return 0
        count = 0
        for group in self.groups:
            table = group.tables.get(rid, [])
            first = num_tokens // group.block_size
            for block in table[first:]:
                if block.block_hash is not None and block.block_id != NULL_BLOCK_ID:
                    self.pool.uncache(block)
                    count += 1
            if group.num_cached.get(rid, 0) > first:
                group.num_cached[rid] = first
        return count

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block. Refused (returns False) while any block is in use."""
        return self.pool.reset_prefix_cache()

    # -- inspection ------------------------------------------------------------------

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """The request's block table in every group (empty lists if it holds none)."""
        return tuple([b.block_id for b in g.tables.get(request_id, ())] for g in self.groups)

    def free_queue_block_ids(self) -> list[int]:
        """Block IDs in free-queue order: front (reused first) to back."""
        return list(self.pool.free_queue.block_ids())

    def snapshot_events(self) -> list[BlockStored]:
        """Every block the prefix cache holds, as ``BlockStored`` events (one per group; see
        :meth:`BlockPool.snapshot_events`). Pending events are not taken: a publisher takes
        them first, so that the snapshot follows its last batch."""
        return self.pool.snapshot_events([g.block_size for g in self.groups])

    def take_events(self) -> list[KVCacheEvent]:
        """KV events recorded since the last call (empty unless ``enable_events``)."""
        return self.pool.take_events()

    def running_request_ids(self) -> list[str]:
        """IDs of the requests that hold blocks."""
        return list(self._owners)

    def check_invariants(self) -> None:
        """Verify the pool's bookkeeping in O(blocks); raises InvariantViolation."""
        check_manager(
            self.pool,
            self.groups,
            {rid: (held.request, held.computed, held.slots) for rid, held in self._owners.items()},
        )

    def note_waiting(self, requests: Sequence[Request]) -> bool:
        """Tell the eviction policy which requests wait for admission (all of them, each call).

        Each call replaces the previous waiting set. A policy that supports
        hints (``note_waiting`` on the free queue, e.g. the ``"waiting"``
        policy) keeps the cached blocks of these requests' prefixes for last;
        other policies ignore it. Requests are hashed here if they were not
        yet (once, as on lookup). Returns whether the policy took the hint.
        O(len(requests)) plus the policy's cost for requests new to the set.
        """
        if isinstance(requests, str | bytes) or not isinstance(requests, Sequence):
            raise RequestStateError(f"note_waiting takes a sequence of Request, got {requests!r}")
        for request in requests:
            _check_request(request)
        hint = getattr(self.pool.free_queue, "note_waiting", None)
        if hint is None or not self.enable_caching:
            return False
        waiting = {}
        for request in requests:
            request._bind(self.hasher)
            waiting[request.request_id] = request._block_hashes
        hint(waiting)
        return True
