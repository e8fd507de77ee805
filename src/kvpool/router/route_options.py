"""What ``kvpool route`` is told: :class:`RouteOptions`, checked once, read by every part of the router."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvpool import checks
from kvpool.cost_model import LLAMA_8B_KV_BYTES_PER_TOKEN
from kvpool.errors import ConfigError
from kvpool.events import MEDIUM_GPU, MEDIUM_STORAGE
from kvpool.router.monitor import Ejection
from kvpool.router.prompt_hashes import Tokenizer
from kvpool.router.replica_config import ReplicaSpec
from kvpool.router.replicas import MAX_BLOCK_SIZE, check_distinct
from kvpool.routing import DEFAULT_LOAD_COST, DEFAULT_ROUTING, MediumCost, PrefixMode, Routing, TierCredit
from kvpool.tenancy import KeyRing, SaltPolicy
from kvpool.tiers.store import medium_links

if TYPE_CHECKING:
    from kvpool.kv_events import CurveTrust

__all__ = ["DEFAULT_KV_BYTES_PER_TOKEN", "DEFAULT_PREFILL_TOKENS_PER_S", "RouteOptions", "parse_medium_link"]

#: A replica's prefill rate when the router is told none: about an 8B model's on one H100-class GPU.
DEFAULT_PREFILL_TOKENS_PER_S = 20_000.0
#: KV bytes of one token when the router is told none: Llama-3.1-8B's in bf16, as the cost profiles' default.
DEFAULT_KV_BYTES_PER_TOKEN = LLAMA_8B_KV_BYTES_PER_TOKEN


def parse_medium_link(spec: str) -> tuple[str, float, float]:
    """``MEDIUM=BANDWIDTH[,LATENCY]`` as ``(medium, bytes per second, seconds per fetch)``; ConfigError naming it.

    BANDWIDTH is bytes per second in :func:`kvpool.checks.parse_size`'s units (``25GB``,
    ``4GiB``), LATENCY seconds (``0.0003``; 0 when left out): ``STORAGE=2GB,0.0005``.
    """
    if not isinstance(spec, str):
        raise ConfigError(f"a medium link is MEDIUM=BANDWIDTH[,LATENCY] such as STORAGE=2GB,0.0005, got {spec!r}")
    medium, equals, link = spec.partition("=")
    bandwidth_text, _, latency_text = link.partition(",")
    if not equals or not medium.strip() or not bandwidth_text.strip():
        raise ConfigError(f"medium link {spec!r} is not MEDIUM=BANDWIDTH[,LATENCY] such as STORAGE=2GB,0.0005")
    bandwidth = checks.parse_size(bandwidth_text.strip(), field=f"bandwidth in medium link {spec!r}")
    if bandwidth <= 0:
        raise ConfigError(f"the bandwidth in medium link {spec!r} must be more than 0 bytes per second")
    try:
        latency = float(latency_text) if latency_text.strip() else 0.0
    except ValueError:
        raise ConfigError(f"the latency in medium link {spec!r} must be a number of seconds") from None
    if not math.isfinite(latency) or latency < 0:
        raise ConfigError(f"the latency in medium link {spec!r} must be a finite number of seconds >= 0")
    if medium.strip() == MEDIUM_GPU:
        raise ConfigError(f"medium link {spec!r}: {MEDIUM_GPU} is the replicas' own pool, which loads nothing")
    return medium.strip(), float(bandwidth), latency


@dataclass(frozen=True, slots=True, kw_only=True)
class RouteOptions:
    """Everything ``kvpool route`` is told on its command line, checked.

    ``load_cost``: cached blocks of :data:`~kvpool.routing.LOAD_COST_TOKENS` tokens one request queued or
    running at a replica is worth (the ``prefix`` rule's exchange rate; 8: 128 tokens, a hand-set weight that
    overrides nothing else); ``routing``: the rule (:data:`~kvpool.routing.DEFAULT_ROUTING` unless told;
    ``round-robin`` and ``least-loaded``, for comparison, ignore prefixes). ``admin_key``: sent to the replicas'
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

    Tier credit (:class:`~kvpool.routing.TierCredit`, built once as :attr:`credit`): a
    prefix a replica holds only in a tier below its GPU memory counts for the prefill time
    loading it saves. ``prefill_tokens_per_s``: the replicas' prefill rate (also the ``expected-ttft``
    rule's for a replica that advertises no rates of its own);
    ``kv_bytes_per_token``: one token's KV bytes (what a load moves); ``medium_links``:
    ``MEDIUM=BANDWIDTH[,LATENCY]`` specs (:func:`parse_medium_link`), each medium at most
    once, over the defaults from the tier registry (:func:`kvpool.tiers.store.medium_links`:
    ``CPU`` at PCIe speed, ``STORAGE`` at the slowest of disk and Redis). A medium neither
    names is costed as ``STORAGE``.
    """

    replicas: tuple[str | ReplicaSpec, ...]  # a URL: a kvpool replica (GET /kv-events); a spec: as described
    tokenizer: Tokenizer | None
    keys: KeyRing | None
    salts: SaltPolicy
    load_cost: float = DEFAULT_LOAD_COST
    admin_key: str | None = None
    admin_keys: KeyRing | None = None
    routing: Routing = DEFAULT_ROUTING
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
    prefill_tokens_per_s: float = DEFAULT_PREFILL_TOKENS_PER_S
    kv_bytes_per_token: int = DEFAULT_KV_BYTES_PER_TOKEN
    medium_links: tuple[str, ...] = ()
    credit: TierCredit = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "credit", self._tier_credit())
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

    def _tier_credit(self) -> TierCredit:
        if isinstance(self.medium_links, str) or not isinstance(self.medium_links, tuple):
            raise ConfigError(
                f"medium_links must be a tuple of MEDIUM=BANDWIDTH[,LATENCY] specs, got {self.medium_links!r}"
            )
        links = dict(medium_links())
        given: set[str] = set()
        for spec in self.medium_links:
            medium, bandwidth, latency = parse_medium_link(spec)
            if medium in given:
                raise ConfigError(f"medium {medium!r} is given twice in the medium links ({spec!r}); name each once")
            given.add(medium)
            links[medium] = (bandwidth, latency)
        costs = {
            medium: MediumCost.of_link(bandwidth, latency, kv_bytes_per_token=self.kv_bytes_per_token)
            for medium, (bandwidth, latency) in links.items()
        }
        return TierCredit(
            prefill_tokens_per_s=self.prefill_tokens_per_s,
            main_pool=frozenset({None, MEDIUM_GPU}),
            media=costs,
            other=costs.get(MEDIUM_STORAGE),
        )

    @property
    def ejection(self) -> Ejection:
        """The passive health rule the ``eject_*`` fields make."""
        return Ejection(after=self.eject_after, time=self.eject_time, max_time=self.eject_max_time)
