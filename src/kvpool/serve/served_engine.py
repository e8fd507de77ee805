"""What the server asks of an engine: the surface ``kvpool serve`` runs over, written down once.

Two engines meet it: kvpool's own (:class:`kvpool.engine.llm_engine.LLMEngine`, which runs
a model with torch) and the emulated replica (:class:`kvpool.emulator.EmulatedEngine`, the
same scheduler and KV cache manager with time from a cost model, no weights and no torch).
The server builds its routes, metrics, events and health over :class:`ServedEngine` and
never names either, so every route behaves the same in front of both.

Only the engine thread (:class:`~kvpool.serve.engine_loop.EngineLoop`) calls ``add_requests``,
``abort``, ``step``, ``rates`` and reads the manager and the scheduler; the tokenizer thread calls
``encode``, ``decode``, ``render_chat`` and reads ``tokenizer``, which must not touch the
rest of the engine.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from kvpool.engine.outputs import RequestDelta
    from kvpool.manager import KVCacheManager
    from kvpool.replica_rates import ReplicaRates
    from kvpool.sampling_params import SamplingParams
    from kvpool.scheduler import Scheduler

__all__ = ["CacheSettings", "EngineSettings", "OffloadTiers", "PoolPlan", "ServedEngine"]


class OffloadTiers(Protocol):
    """An engine's KV offload tiers, as the server sees them: it only closes them when it stops."""

    def close(self) -> None: ...


class CacheSettings(Protocol):
    """The engine's options the server reports: whether it records KV events, and its block hash."""

    @property
    def enable_kv_events(self) -> bool: ...

    @property
    def hash_algo(self) -> object: ...


class PoolPlan(Protocol):
    """The KV pool as planned, for ``cache_config_info`` (vLLM's labels)."""

    @property
    def kv_dtype(self) -> object: ...

    @property
    def num_blocks(self) -> int: ...

    @property
    def pool_block_bytes(self) -> int: ...

    @property
    def kv_cache_tokens(self) -> int: ...

    @property
    def max_concurrency(self) -> float: ...


class EngineSettings(Protocol):
    """How the engine was started: its options and its pool's plan."""

    @property
    def options(self) -> CacheSettings: ...

    @property
    def plan(self) -> PoolPlan: ...


class ServedEngine(Protocol):
    """An engine ``kvpool serve`` serves (see the module docstring for who calls what)."""

    @property
    def manager(self) -> KVCacheManager: ...

    @property
    def scheduler(self) -> Scheduler: ...

    @property
    def setup(self) -> EngineSettings: ...

    @property
    def kv_tiers(self) -> OffloadTiers | None:
        """The KV offload tiers, or None (the server reads whether there are some, and closes them)."""

    @property
    def tokenizer(self) -> Any:
        """A tokenizer with transformers' ``decode(ids, skip_special_tokens=...)`` and ``get_vocab()``, or None."""

    @property
    def max_model_len(self) -> int: ...

    @property
    def num_blocks(self) -> int: ...

    @property
    def pool_tokens(self) -> int: ...

    @property
    def cached_tokens_by_tier(self) -> dict[str, int]: ...

    @property
    def chat_template_supports_tools(self) -> bool: ...

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, token_ids: Sequence[int]) -> str: ...

    def render_chat(self, conversation: Sequence[Mapping[str, str]], *, add_generation_prompt: bool = True) -> str: ...

    def check_token_ids(self, token_ids: Sequence[int], what: str) -> None: ...

    def add_requests(
        self,
        prompts: Sequence[str | Sequence[int]],
        sampling_params: Sequence[SamplingParams | None] | None = None,
        *,
        request_ids: Sequence[str | None] | None = None,
        cache_salts: Sequence[str | None] | None = None,
        add_special_tokens: bool = True,
        tenant: str | None = None,
        max_output_tokens: int | None = None,
    ) -> list[str]: ...

    def abort(self, request_id: str) -> bool: ...

    def has_unfinished_requests(self) -> bool: ...

    def step(self) -> list[RequestDelta]: ...

    def rates(self) -> ReplicaRates | None:
        """How fast it works (``GET /rates``): measured over recent steps; None when it cannot say yet."""
        ...
