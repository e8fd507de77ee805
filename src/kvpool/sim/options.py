"""What a simulation is asked to do: the one statement of the simulator's options.

:class:`SimulateOptions` holds every option of ``kvpool simulate``, each stated
once and checked once, in ``__post_init__``; the command only maps its flags
onto the fields, and :func:`kvpool.sim.study.run_study` does the work. A field
is named as its flag (``kv_tier_write`` is ``--kv-tier-write``), and an error
names the option by its flag and the value, since that is how a user gives it.

Derived from the fields, and fixed with them: the tier targets (the engine's
spec grammar, parsed once) and each tier kind's link, the routing rules to
replay, the pool's block count, and the cost model (its KV bytes per token
taken from ``model`` when not given).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from kvpool.checks import check_flag, check_int
from kvpool.cost_model import DEFAULT_PROFILE, CostProfile, load_profile
from kvpool.errors import ConfigError
from kvpool.hashing import HashAlgo
from kvpool.routing import DEFAULT_ROUTING, Routing
from kvpool.sim.simulator import policy_factory
from kvpool.sim.transfers import DEFAULT_LINKS, TierLink, capacity_blocks
from kvpool.specs import KVCacheGroup
from kvpool.tiers.kinds import TierKind, WritePolicy
from kvpool.tiers.store import TierTarget, parse_specs

__all__ = ["FALLBACK_HASH", "FAST_HASH", "SYNTHETIC_PREFIX", "SimulateOptions", "fast_hash_installed"]

#: A trace named ``synthetic:KIND`` is generated (:mod:`kvpool.sim.workloads`), not read.
SYNTHETIC_PREFIX = "synthetic:"
#: Requests of a synthetic trace when ``requests`` is not given.
SYNTHETIC_REQUESTS = 500
_HASHES = frozenset({a.value for a in HashAlgo} | {"xxh3_128"})
#: The block hash replayed when none is named, with the ``fast`` extra (xxhash) and without it.
#: Hit rates are the same either way: xxh3_128 verifies every hit, so a collision is only a miss.
FAST_HASH = HashAlgo.XXH3_128.value
FALLBACK_HASH = HashAlgo.SHA256.value


def fast_hash_installed() -> bool:
    """Whether xxhash (the ``fast`` extra) can be imported, for :data:`FAST_HASH`."""
    try:
        import xxhash  # noqa: F401  # only whether it is there
    except ImportError:
        return False
    return True


def _number(flag: str, value: object, *, positive: bool = False) -> float:
    """A finite number >= 0 (> 0 when ``positive``), as a float; ConfigError naming the flag and value."""
    ok = not isinstance(value, bool) and isinstance(value, int | float) and math.isfinite(value)
    if not ok or value < 0 or (positive and value == 0):  # type: ignore[operator]  # a number once ok
        raise ConfigError(f"{flag} must be a finite number {'> 0' if positive else '>= 0'}, got {value!r}")
    return float(value)  # type: ignore[arg-type]  # a number once ok


def _strings(flag: str, value: object) -> tuple[str, ...]:
    if isinstance(value, str) or not isinstance(value, tuple | list) or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"{flag} must be a list of strings, got {value!r}")
    return tuple(value)


def _kind_values(flag: str, items: tuple[str, ...], kinds: set[str]) -> dict[str, float]:
    """``("cpu=25", ...)`` as ``{"cpu": 25.0}``: a configured tier kind, a finite number > 0 (latency: >= 0)."""
    values: dict[str, float] = {}
    for item in items:
        kind, sep, number = item.partition("=")
        kind = kind.strip()
        try:
            value = float(number) if sep else math.nan
        except ValueError:
            value = math.nan
        floor_ok = value >= 0 if flag == "--tier-latency" else value > 0
        if not (math.isfinite(value) and floor_ok):
            bound = ">= 0" if flag == "--tier-latency" else "> 0"
            raise ConfigError(f"{flag} {item!r}: give KIND=NUMBER with a finite number {bound}, e.g. cpu=25")
        if kind not in kinds:
            raise ConfigError(f"{flag} {item!r}: no --tier of kind {kind!r} is given")
        values[kind] = value
    return values


def _groups(model: str, block_size: int) -> tuple[KVCacheGroup, ...]:
    """``model``'s layer groups at ``block_size`` (kvpool.specs.group_layers)."""
    from kvpool.model_config import load_model_config
    from kvpool.model_layers import layer_specs_from_config
    from kvpool.specs import group_layers

    return group_layers(layer_specs_from_config(load_model_config(model), block_size=block_size))


def _block_bytes(model: str, block_size: int) -> int:
    """Bytes of one pool block of ``model`` (every layer group) at ``block_size``."""
    from kvpool.model_config import load_model_config
    from kvpool.model_layers import layer_specs_from_config
    from kvpool.specs import group_layers, pool_block_bytes

    return pool_block_bytes(group_layers(layer_specs_from_config(load_model_config(model), block_size=block_size)))


def _curve_sizes(curve: object) -> tuple[int, ...]:
    """``"100,200"`` (or a sequence of ints) as cache sizes in blocks, each >= 1."""
    if isinstance(curve, str):
        try:
            sizes = tuple(int(x) for x in curve.split(",") if x.strip())
        except ValueError:
            raise ConfigError(f"--curve must be comma-separated integers, got {curve!r}") from None
    elif isinstance(curve, tuple | list) and all(type(x) is int for x in curve):
        sizes = tuple(curve)
    else:
        raise ConfigError(f"--curve must be comma-separated integers, got {curve!r}")
    if not sizes or min(sizes) < 1:
        raise ConfigError(f"--curve sizes must be positive, got {curve!r}")
    return sizes


@dataclass(frozen=True, slots=True, kw_only=True)
class SimulateOptions:
    """Every option of a simulation (``kvpool simulate``), checked at construction.

    Attributes:
        trace: a trace file (Mooncake or kvpool's token-level JSONL), or ``synthetic:KIND``.
        kv_blocks: usable KV blocks per replica (the pool gets one more, the null block).
        kv_memory: KV memory per replica (``"40GiB"``), sized in blocks of ``model``; instead of ``kv_blocks``.
        model: a shipped config name or a ``config.json`` path: block bytes for ``kv_memory`` and tier loads.
        block_size: tokens per block.
        policy: the eviction policy's name (``lru`` is vLLM's order).
        sequential: one request at a time in trace order, freed before the next (one pool, no tiers).
        requests: replay only the first N (synthetic: how many to generate); None: all (synthetic: 500).
        seed: seed of a synthetic workload.
        arrival_rate_scale: requests arrive this many times as fast as the trace says (2.0: arrival times
            halved); 1.0 replays the trace's own times.
        max_num_batched_tokens, max_num_seqs: the scheduler's budget per step.
        profile: the cost profile (a built-in name or a JSON file, :mod:`kvpool.cost_model`); None: the
            default, ``round-8b-h100``.
        step_overhead_ms, prefill_us_per_token, decode_us_per_seq: override the profile's step overhead,
            its prefill time per token (at every chunk size) and its decode time per sequence; None: the
            profile's.
        tier: KV tier specs below each replica's pool, in lookup order (the engine's grammar).
        kv_tier_write: when blocks go down to the tiers (a :class:`WritePolicy` or its name).
        load_or_compute: load a tier hit only where that beats computing it (the engine's rule); False loads all.
        tier_bandwidth, tier_latency: ``KIND=GB/S`` and ``KIND=US`` overrides of a tier's link.
        kv_bytes_per_token: KV bytes per token, to size tier loads; None: from ``model``, else the cost model's.
        layer_groups: simulate ``model``'s layer groups (a hybrid model's full-attention and window groups,
            :func:`kvpool.specs.group_layers`) instead of one full-attention group; each group's block is a pool block.
        window_aware_saves: a window group saves only the blocks a request can still read (default False: every full block).
        replicas: simulated replicas, each its own pool.
        routing: the rules that spread arrivals over replicas, each replayed in turn; empty: every rule
            with several replicas or ``ttft_slo``, else prefix.
        routing_load_cost: the prefix rule's weight: cached blocks of 16 tokens one request in flight is
            worth, as ``kvpool route --load-cost`` takes it; None: :data:`~kvpool.routing.DEFAULT_LOAD_COST`.
        ttft_slo: size the deployment instead: the fewest replicas whose TTFT at ``ttft_slo_percentile``
            is at most this many seconds (with ``replicas`` 1).
        ttft_slo_percentile: in (0, 100).
        max_replicas: the largest count ``ttft_slo`` tries.
        hash_algo: the block hash (``xxh3_128`` verifies every hit: the same hit rates, faster); None: the
            fastest installed, :data:`FAST_HASH` with the ``fast`` extra, else :data:`FALLBACK_HASH`.
        curve: also the hit-rate curve (sequential model) at these cache sizes in blocks (or ``"100,200"``).
        curve_policies: the eviction policies the curve compares (besides the optimum).
        lookahead: sequential runs announce the next N requests as waiting (the ``waiting`` policy).
    """

    trace: str
    kv_blocks: int | None = None
    kv_memory: str | None = None
    model: str | None = None
    block_size: int = 16
    policy: str = "lru"
    sequential: bool = False
    requests: int | None = None
    seed: int = 0
    arrival_rate_scale: float = 1.0
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    profile: str | None = None
    step_overhead_ms: float | None = None
    prefill_us_per_token: float | None = None
    decode_us_per_seq: float | None = None
    tier: tuple[str, ...] = ()
    kv_tier_write: WritePolicy = WritePolicy.WRITE_THROUGH
    load_or_compute: bool = True
    tier_bandwidth: tuple[str, ...] = ()
    tier_latency: tuple[str, ...] = ()
    kv_bytes_per_token: int | None = None
    replicas: int = 1
    routing: tuple[Routing, ...] = ()
    routing_load_cost: float | None = None
    ttft_slo: float | None = None
    ttft_slo_percentile: float = 90.0
    max_replicas: int = 64
    hash_algo: str | None = None
    curve: tuple[int, ...] = ()
    curve_policies: tuple[str, ...] = ("lru",)
    lookahead: int = 0
    layer_groups: bool = False
    window_aware_saves: bool = False
    #: The model's layer groups when ``layer_groups`` (a hybrid model's), else empty (one full-attention group).
    groups: tuple[KVCacheGroup, ...] = field(init=False)
    #: The tier specs, parsed.
    tier_targets: tuple[TierTarget, ...] = field(init=False)
    #: Each configured tier kind's link: the defaults, overridden by ``tier_bandwidth`` / ``tier_latency``.
    tier_links: dict[TierKind, TierLink] = field(init=False)
    #: The routing rules replayed, in order (``routing`` with its default applied).
    rules: tuple[Routing, ...] = field(init=False)
    #: Blocks of each replica's pool, the null block included (0 when only the curve is asked for).
    num_blocks: int = field(init=False)
    #: The cost model.
    cost: CostProfile = field(init=False)
    #: The block hash replayed: ``hash_algo``, or the fastest installed when it is None.
    block_hash: str = field(init=False)

    def __post_init__(self) -> None:
        put = object.__setattr__
        if not isinstance(self.trace, str) or not self.trace:
            raise ConfigError(f"the trace must be a file path or synthetic:KIND, got {self.trace!r}")
        for name in ("block_size", "max_num_batched_tokens", "max_num_seqs", "replicas", "max_replicas"):
            check_int(f"--{name.replace('_', '-')}", getattr(self, name))
        for name in ("kv_blocks", "requests", "kv_bytes_per_token"):
            if getattr(self, name) is not None:
                check_int(f"--{name.replace('_', '-')}", getattr(self, name))
        check_int("--lookahead", self.lookahead, minimum=0)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ConfigError(f"--seed must be an integer, got {self.seed!r}")
        put(self, "arrival_rate_scale", _number("--arrival-rate-scale", self.arrival_rate_scale, positive=True))
        for name in ("sequential",):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"--{name} must be a bool, got {getattr(self, name)!r}")
        for name in ("step_overhead_ms", "prefill_us_per_token", "decode_us_per_seq"):
            if getattr(self, name) is not None:
                _number(f"--{name.replace('_', '-')}", getattr(self, name))
        if self.hash_algo is None:
            # Layer groups may search hits from the end (sliding windows), which the verifying xxh3_128 index cannot.
            fast = fast_hash_installed() and not self.layer_groups
            put(self, "block_hash", FAST_HASH if fast else FALLBACK_HASH)
        elif self.hash_algo not in _HASHES:
            raise ConfigError(f"--hash must be one of {sorted(_HASHES)}, got {self.hash_algo!r}")
        elif self.hash_algo == FAST_HASH and not fast_hash_installed():
            raise ConfigError(
                f"--hash {FAST_HASH} needs the xxhash package: pip install 'kvpool[fast]' "
                f"(without --hash, {FALLBACK_HASH} gives the same hit rates, slower)"
            )
        else:
            put(self, "block_hash", self.hash_algo)
        policy_factory(self.policy)  # an unknown name fails before any work
        put(self, "curve_policies", _strings("--curve-policies", self.curve_policies))
        for name in self.curve_policies:
            policy_factory(name)
        put(self, "curve", _curve_sizes(self.curve) if self.curve else ())

        # tiers: the engine's specs, parsed once; each kind's link
        targets = parse_specs(_strings("--tier", self.tier))
        kinds = {t.kind.value for t in targets}
        bandwidth = _kind_values("--tier-bandwidth", _strings("--tier-bandwidth", self.tier_bandwidth), kinds)
        latency = _kind_values("--tier-latency", _strings("--tier-latency", self.tier_latency), kinds)
        links: dict[TierKind, TierLink] = {}
        for target in targets:
            default, name = DEFAULT_LINKS[target.kind], target.kind.value
            links[target.kind] = TierLink(
                bandwidth_bytes_per_s=bandwidth[name] * 1e9 if name in bandwidth else default.bandwidth_bytes_per_s,
                latency_s=latency[name] / 1e6 if name in latency else default.latency_s,
            )
        put(self, "tier_targets", targets)
        put(self, "tier_links", links)
        put(self, "kv_tier_write", WritePolicy.parse(self.kv_tier_write))
        check_flag("load_or_compute", self.load_or_compute)

        # replicas, routing, sizing
        routing = tuple(Routing(r) for r in dict.fromkeys(_routing(self.routing)))
        put(self, "routing", routing)
        if self.routing_load_cost is not None:
            put(self, "routing_load_cost", _number("--routing-load-cost", self.routing_load_cost, positive=True))
        if self.ttft_slo is not None:
            put(self, "ttft_slo", _number("--ttft-slo", self.ttft_slo, positive=True))
        percentile = _number("--ttft-slo-percentile", self.ttft_slo_percentile)
        if not 0 < percentile < 100:
            raise ConfigError(f"--ttft-slo-percentile must be in (0, 100), got {self.ttft_slo_percentile!r}")
        put(self, "ttft_slo_percentile", percentile)
        several = self.replicas > 1 or self.ttft_slo is not None
        put(self, "rules", routing or (tuple(Routing) if several else (DEFAULT_ROUTING,)))
        if self.ttft_slo is not None and self.replicas > 1:
            raise ConfigError(f"--ttft-slo searches for the number of replicas; drop --replicas {self.replicas}")
        if self.sequential and (self.replicas > 1 or routing or self.ttft_slo is not None or targets):
            raise ConfigError(
                "--sequential replays one pool alone; drop it to use --tier, --replicas, --routing or --ttft-slo"
            )

        # the pool and the cost model
        put(self, "num_blocks", 0 if self.curve_only else self._pool_blocks())
        check_flag("--layer-groups", self.layer_groups)
        check_flag("--kv-tier-window-aware-saves", self.window_aware_saves)
        groups: tuple[KVCacheGroup, ...] = ()
        if self.layer_groups:
            if self.model is None:
                raise ConfigError("--layer-groups simulates a model's layer groups: give --model CONFIG")
            groups = _groups(self.model, self.block_size)
            if any(g.block_size != self.block_size for g in groups):
                raise ConfigError(
                    f"--layer-groups: {self.model} groups blocks of {sorted({g.block_size for g in groups})} tokens "
                    f"at --block-size {self.block_size}; give a --block-size its groups keep"
                )
        put(self, "groups", groups)
        kv_bytes = self.kv_bytes_per_token
        if kv_bytes is None and self.model is not None:
            kv_bytes = max(1, _block_bytes(self.model, self.block_size) // self.block_size)
        cost = load_profile(DEFAULT_PROFILE if self.profile is None else self.profile)
        overrides: dict[str, Any] = {}
        if self.step_overhead_ms is not None:
            overrides["step_overhead_s"] = self.step_overhead_ms / 1e3
        if self.prefill_us_per_token is not None:
            overrides["prefill_s_per_token"] = ((1, self.prefill_us_per_token / 1e6),)
        if self.decode_us_per_seq is not None:
            overrides["decode_s_per_seq"] = self.decode_us_per_seq / 1e6
        if kv_bytes is not None:
            overrides["kv_bytes_per_token"] = kv_bytes
        cost = cost.with_fields(**overrides) if overrides else cost
        put(self, "cost", cost)
        for target in targets:
            capacity_blocks(target, self.block_size * cost.kv_bytes_per_token)  # a tier holding no block fails here

    @property
    def curve_only(self) -> bool:
        """Only the hit-rate curve is asked for (no pool size given)."""
        return bool(self.curve) and self.kv_blocks is None and self.kv_memory is None

    @property
    def synthetic(self) -> str | None:
        """The synthetic workload's kind, or None for a trace file."""
        return self.trace[len(SYNTHETIC_PREFIX) :] if self.trace.startswith(SYNTHETIC_PREFIX) else None

    def _pool_blocks(self) -> int:
        if self.kv_blocks is not None:
            return self.kv_blocks + 1  # plus the null block
        if self.kv_memory is None or self.model is None:
            raise ConfigError("give --kv-blocks N, or --kv-memory SIZE with --model CONFIG")
        from kvpool.planner import parse_size

        budget = parse_size(self.kv_memory, field="--kv-memory")
        block_bytes = _block_bytes(self.model, self.block_size)
        blocks = budget // block_bytes
        if blocks < 2:
            raise ConfigError(
                f"--kv-memory {self.kv_memory} holds {blocks} blocks of {block_bytes:,} B for {self.model}"
            )
        return blocks


def _routing(value: Any) -> tuple[Any, ...]:
    if isinstance(value, str) or not isinstance(value, tuple | list):
        raise ConfigError(f"--routing must be a list of rules {[r.value for r in Routing]}, got {value!r}")
    for rule in value:
        if not isinstance(rule, Routing) and rule not in {r.value for r in Routing}:
            raise ConfigError(f"--routing {rule!r} is not one of {[r.value for r in Routing]}")
    return tuple(value)
