"""A request as the KV cache manager sees it: token IDs, cache keys, progress.

Token IDs are stored as a compact ``array('I')`` (4 bytes per token), which
also validates them: anything that is not an integer in ``[0, 2**32)`` is
rejected when it enters.

Block hashes are computed once. A request is *bound* to a manager's hasher the
first time the manager sees it (or earlier, through
``KVCacheManager.hash_request``, which an engine can call on its input
thread); from then on each block that becomes full as output tokens are
appended is hashed right away.

Everything a block hash covers is fixed at construction: the request ID, the
prompt, the cache salt, the LoRA name and the multimodal inputs are read-only
(assigning one raises :class:`ReadOnlyFieldError`), and the token and hash
views hand out copies. A request therefore cannot change tenant, or have its
tokens rewritten, after its blocks were hashed. Output tokens only grow
through :meth:`Request.append_output_token_ids`.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Sequence
from operator import attrgetter
from typing import TYPE_CHECKING

from kvpool.errors import InvalidTokenError, ReadOnlyFieldError, RequestStateError
from kvpool.hashing import (
    TOKEN_LIMIT,
    BlockHash,
    BlockHasher,
    ExtraKey,
    MultiModalInput,
    extra_keys_readable,
    key_text_problem,
    lora_key,
    salt_key,
    to_token_array,
    token_bytes,
)

__all__ = ["Request"]

_NEVER = 2**62


def _fixed(name: str, doc: str) -> property:
    """A read-only view of the private slot ``_<name>``; assigning raises :class:`ReadOnlyFieldError`."""

    def refuse(self: Request, value: object) -> None:
        raise ReadOnlyFieldError(
            f"request {self._request_id!r}: {name} is fixed at construction (it is part of the block hashes "
            f"or the manager's bookkeeping); cannot set it to {value!r}: build a new Request instead"
        )

    return property(attrgetter("_" + name), refuse, doc=doc)


def _text_field(request_id: str, name: str, value: object) -> None:
    """Refuse a text key that is neither None nor text that hashes one way (see ``key_text_problem``)."""
    problem = None if value is None else key_text_problem(value)
    if problem is not None:
        raise RequestStateError(f"request {request_id!r}: {name} must be None or {problem}")


class Request:
    """A request's tokens, cache keys and progress.

    Args:
        request_id: unique among the requests that hold blocks.
        prompt_token_ids: the prompt; at least one token.
        cache_salt: tenant isolation; requests with different salts never
            share cached blocks (the salt enters the first block's hash).
        lora_name: the LoRA adapter; enters every block's hash.
        mm_inputs: multimodal items (identifier and placeholder range).

    ``num_computed_tokens`` is advanced by the caller after each step has run,
    as a scheduler does; the manager checks it against the slots it allocated
    (an ``int`` that never moves backwards nor past those slots).
    Every other field is read-only.
    """

    __slots__ = (
        "_request_id",
        "_token_ids",
        "_num_prompt_tokens",
        "num_computed_tokens",
        "_cache_salt",
        "_lora_name",
        "_mm_inputs",
        "_block_hashes",
        "num_preemptions",
        "_hasher",
        "_next_full",
        "_block_contents",
        "_lora_key",
        "_salt_key",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        *,
        cache_salt: str | None = None,
        lora_name: str | None = None,
        mm_inputs: Sequence[MultiModalInput] = (),
    ) -> None:
        problem = key_text_problem(request_id)
        if problem is not None:
            raise RequestStateError(f"request_id must be {problem}")
        tokens = to_token_array(prompt_token_ids, "prompt_token_ids", ordered=True)
        if len(tokens) == 0:
            raise RequestStateError(
                f"request {request_id!r}: prompt_token_ids is empty; a prompt needs at least one token"
            )
        _text_field(request_id, "cache_salt", cache_salt)
        _text_field(request_id, "lora_name", lora_name)
        if isinstance(mm_inputs, str | bytes) or not isinstance(mm_inputs, Iterable):
            raise RequestStateError(
                f"request {request_id!r}: mm_inputs must be a sequence of MultiModalInput, got {mm_inputs!r}"
            )
        items = tuple(mm_inputs)
        for item in items:
            if not isinstance(item, MultiModalInput):
                raise RequestStateError(f"request {request_id!r}: mm_inputs must hold MultiModalInput, got {item!r}")
            if item.offset + item.length > len(tokens):
                raise RequestStateError(
                    f"request {request_id!r}: multimodal item {item.identifier!r} covers positions "
                    f"{item.offset}..{item.offset + item.length - 1}, beyond the prompt's {len(tokens)} tokens"
                )
        self._request_id = request_id
        self._token_ids = tokens
        self._num_prompt_tokens = len(tokens)
        self.num_computed_tokens = 0
        self._cache_salt = cache_salt
        self._lora_name = lora_name
        self._mm_inputs = tuple(sorted(items, key=lambda m: m.offset))
        self._block_hashes: list[BlockHash] = []
        self.num_preemptions = 0
        self._hasher: BlockHasher | None = None
        # Token count at which the next block becomes full (hashing is due then).
        self._next_full = _NEVER
        self._block_contents: list[bytes] | None = None
        self._lora_key = lora_key(lora_name)
        self._salt_key = salt_key(cache_salt)

    # -- fixed at construction ------------------------------------------------------

    if TYPE_CHECKING:  # what the read-only views below return, for the type checker

        @property
        def request_id(self) -> str: ...
        @property
        def num_prompt_tokens(self) -> int: ...
        @property
        def cache_salt(self) -> str | None: ...
        @property
        def lora_name(self) -> str | None: ...
        @property
        def mm_inputs(self) -> tuple[MultiModalInput, ...]: ...

    else:  # C-level getters (``attrgetter``): these are read on every step
        request_id = _fixed("request_id", "Unique among the requests that hold blocks.")
        num_prompt_tokens = _fixed("num_prompt_tokens", "Length of the prompt.")
        cache_salt = _fixed("cache_salt", "Tenant isolation key: enters the first block's hash.")
        lora_name = _fixed("lora_name", "LoRA adapter: enters every block's hash.")
        mm_inputs = _fixed("mm_inputs", "Multimodal items, sorted by offset: enter the blocks they overlap.")

    @property
    def block_hashes(self) -> list[BlockHash]:
        """The hashes of the full blocks computed so far (a copy)."""
        return list(self._block_hashes)

    # -- sizes -------------------------------------------------------------------

    @property
    def num_tokens(self) -> int:
        return len(self._token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self._token_ids) - self.num_prompt_tokens

    @property
    def all_token_ids(self) -> array[int]:
        """Prompt and output token IDs (a copy, as an ``array('I')``)."""
        return self._token_ids[:]

    @property
    def prompt_token_ids(self) -> array[int]:
        return self._token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> array[int]:
        return self._token_ids[self.num_prompt_tokens :]

    # -- growth --------------------------------------------------------------------

    def append_output_token_ids(self, token_ids: int | Iterable[int]) -> None:
        """Append sampled tokens; hashes of blocks that became full follow at once."""
        tokens = self._token_ids
        if type(token_ids) is int:
            if not 0 <= token_ids < TOKEN_LIMIT:
                raise InvalidTokenError(f"output token ID {token_ids} is out of range: token IDs must be in [0, 2**32)")
            tokens.append(token_ids)
        else:
            tokens.extend(to_token_array(token_ids, "output token_ids", ordered=True))  # type: ignore[arg-type]  # a bool or other non-int is refused there
        if len(tokens) >= self._next_full:
            self._hash_new_blocks()

    # -- cache keys ---------------------------------------------------------------

    def extra_keys(self, start: int, end: int) -> tuple[ExtraKey, ...] | None:
        """Readable extra keys of the block covering ``[start, end)`` (for KV events)."""
        return extra_keys_readable(self._lora_name, self._cache_salt, self._mm_inputs, start, end)

    def _bind(self, hasher: BlockHasher) -> None:
        """Attach the hasher that will hash this request's blocks from now on."""
        current = self._hasher
        if current is hasher:
            return
        if current is not None:
            if current.signature == hasher.signature:
                return
            raise RequestStateError(
                f"request {self.request_id!r} was hashed with block_size={current.block_size}, "
                f"algo={current.algo.value}; this manager uses block_size={hasher.block_size}, algo={hasher.algo.value}"
            )
        self._hasher = hasher
        self._block_contents = [] if hasher.stores_contents else None
        self._hash_new_blocks()

    def _hash_new_blocks(self) -> None:
        """Hash every block that is full but not yet hashed (O(1) when none is)."""
        hasher: BlockHasher = self._hasher  # type: ignore[assignment]  # bound before any block is due
        bs = hasher.block_size
        hashes = self._block_hashes
        start = len(hashes)
        stop = len(self._token_ids) // bs
        self._next_full = (stop + 1) * bs
        if stop <= start:
            return
        new, contents = hasher.chain_blocks(
            hashes[-1] if hashes else None,
            token_bytes(self._token_ids[start * bs : stop * bs]),
            start,
            lora_key=self._lora_key,
            salt_key=self._salt_key,
            mm_inputs=self._mm_inputs,
        )
        hashes.extend(new)
        if contents is not None:
            self._block_contents.extend(contents)  # type: ignore[union-attr]  # set with the hasher

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, tokens={self.num_tokens}, prompt={self.num_prompt_tokens}, "
            f"computed={self.num_computed_tokens})"
        )
