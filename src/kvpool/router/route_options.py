"""What ``kvpool route`` is told: :class:`RouteOptions`, checked once, read by every part of the router."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvpool.errors import ConfigError
from kvpool.router.monitor import Ejection
from kvpool.router.prompt_hashes import Tokenizer
from kvpool.router.replica_config import ReplicaSpec
from kvpool.router.replicas import MAX_BLOCK_SIZE, check_distinct
from kvpool.routing import PrefixMode, Routing
from kvpool.tenancy import KeyRing, SaltPolicy

if TYPE_CHECKING:
    from kvpool.kv_events import CurveTrust

__all__ = ["RouteOptions"]


@dataclass(frozen=True, slots=True, kw_only=True)
class RouteOptions:
    """Everything ``kvpool route`` is told on its command line, checked.

    ``load_cost``: cached blocks of :data:`~kvpool.router.ranking.LOAD_COST_TOKENS` tokens one request queued or
    running at a replica is worth (the ``prefix`` rule's exchange rate; 8: 128 tokens); ``routing``: the rule (the others, for comparison, ignore prefixes). ``admin_key``: sent to the replicas'
    ``/kv-events``, which only their loopback interface may read without one. ``admin_keys``: the keys that
    open the router's own ``/health?verbose=1`` to clients off its loopback interface (None: loopback only).
    ``keys`` None: the replicas are
    single-tenant. ``salts`` must be the replicas' own rule (the same secret file, or
    shared when they run without tenant isolation), or no prefix will ever match.
    ``upstream_timeout``: the longest a replica may stay silent (seconds without a byte: before its
    answer starts, which for a request that does not stream is the whole generation, and between
    streamed chunks); one that does is out of rotation for ``quarantine`` seconds.
    ``eject_after``, ``eject_time``, ``eject_max_time``: the passive health rule
    (:class:`~kvpool.router.monitor.Ejection`): that many failed answers in a row (5xx, broken
    connections) take a replica out of rotation for ``eject_time`` seconds, doubled for each
    further ejection in a row up to ``eject_max_time``. Each replica is named once (the same
    scheme, host and port twice is refused).
    """

    replicas: tuple[str | ReplicaSpec, ...]  # a URL: a kvpool replica (GET /kv-events); a spec: as described
    tokenizer: Tokenizer | None
    keys: KeyRing | None
    salts: SaltPolicy
    load_cost: float = 8.0
    admin_key: str | None = None
    admin_keys: KeyRing | None = None
    routing: Routing = Routing.PREFIX
    health_interval: float = 0.5
    health_timeout: float = 2.0
    connect_timeout: float = 2.0
    upstream_timeout: float = 300.0
    quarantine: float = 30.0
    eject_after: int = 3
    eject_time: float = 10.0
    eject_max_time: float = 300.0
    max_body_bytes: int = 8 * 2**20
    prefix_mode: PrefixMode = PrefixMode.AUTO
    approx_block_size: int = 16
    approx_max_blocks: int = 2**18
    event_trust: CurveTrust | None = None  # CURVE keys for replicas' event streams (None: plain streams only)

    def __post_init__(self) -> None:
        for name in ("approx_block_size", "approx_max_blocks"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ConfigError(f"{name} must be an integer >= 1, got {value!r}")
        if self.approx_block_size > MAX_BLOCK_SIZE:
            raise ConfigError(f"approx_block_size must be at most {MAX_BLOCK_SIZE}, got {self.approx_block_size!r}")
        _ = self.ejection  # checks the eject_* fields, naming the bad one
        check_distinct([entry if isinstance(entry, str) else entry.url for entry in self.replicas])
        for name in ("health_interval", "health_timeout", "connect_timeout", "upstream_timeout", "quarantine"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or isinstance(value, bool) or not 0 < value < float("inf"):
                raise ConfigError(f"{name} must be a positive number of seconds, got {value!r}")

    @property
    def ejection(self) -> Ejection:
        """The passive health rule the ``eject_*`` fields make."""
        return Ejection(after=self.eject_after, time=self.eject_time, max_time=self.eject_max_time)
