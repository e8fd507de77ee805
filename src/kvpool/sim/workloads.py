"""Seeded synthetic workloads with known prefix-sharing structure.

:func:`generate_workload` returns a list of :class:`~kvpool.sim.traces.TraceRequest`
in arrival order. Kinds (:class:`WorkloadKind`):

* ``SHARED_PREFIX`` -- one-shot requests: a shared system prompt (one of a few,
  chosen with a Zipf skew) followed by a unique user message.
* ``MULTI_TURN`` -- chat sessions: turn 1 is system prompt + user message; each
  later turn is the previous prompt + the previous output + a new user message
  (``follows`` the previous turn). Sessions interleave.
* ``AGENT`` -- agent loops: an agent system prompt (tool descriptions) + a task;
  each step appends the previous step's output (a tool call) and a tool result
  to the same context. Outputs are short, tool results long.
* ``MULTI_TENANT`` -- several tenants, each with its own ``cache_salt`` (and
  optionally a LoRA adapter), running shared-prefix requests and chats over the
  *same* system prompts: only the salt keeps tenants from sharing blocks.
* ``MIXED`` -- each arrival comes from one of the above, by ``mixed_weights``.

Arrivals form a Poisson process (exponential gaps at ``rate_per_s``), drawn
from a random stream separate from the content, so changing the rate moves
requests in time without changing their tokens. Every size is drawn uniformly
from an inclusive ``(low, high)`` range of :class:`WorkloadConfig`.

Determinism: the same kind, ``num_requests``, seed and config always give equal
requests (``random.Random`` seeded with strings, which CPython hashes with
SHA-512, so results do not depend on ``PYTHONHASHSEED``). Standard library only.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from enum import Enum
from typing import Any, Protocol, cast

from kvpool.errors import ConfigError
from kvpool.sim.traces import Segment, SharedSegment, TraceRequest, UniqueSegment

__all__ = ["MAX_WORKLOAD_REQUESTS", "WorkloadConfig", "WorkloadKind", "generate_workload"]

#: Most requests one call of :func:`generate_workload` builds (and most prompts, sessions or tenants).
MAX_WORKLOAD_REQUESTS = 1_000_000


class WorkloadKind(Enum):
    """The synthetic workloads :func:`generate_workload` can produce."""

    SHARED_PREFIX = "shared_prefix"
    MULTI_TURN = "multi_turn"
    AGENT = "agent"
    MULTI_TENANT = "multi_tenant"
    MIXED = "mixed"


@dataclass(frozen=True, slots=True)
class WorkloadConfig:
    """Sizes and rates of a synthetic workload; ranges are inclusive ``(low, high)`` tokens.

    Defaults describe a small chat service: 10 requests/s, four system prompts of
    500-2,000 tokens, user messages of 50-500 tokens, outputs of 50-400 tokens,
    8 interleaved sessions of 2-8 turns, agent loops of 3-12 steps with tool
    results of 100-1,500 tokens, 4 tenants, contexts capped at 32,768 tokens.
    """

    rate_per_s: float = 10.0
    num_system_prompts: int = 4
    system_prompt_tokens: tuple[int, int] = (500, 2000)
    prompt_skew: float = 1.0  # Zipf exponent over system prompts and tenants (0 = uniform)
    user_tokens: tuple[int, int] = (50, 500)
    output_tokens: tuple[int, int] = (50, 400)
    concurrent_sessions: int = 8
    turns: tuple[int, int] = (2, 8)
    num_agent_prompts: int = 2
    agent_prompt_tokens: tuple[int, int] = (1000, 3000)
    agent_task_tokens: tuple[int, int] = (50, 300)
    agent_steps: tuple[int, int] = (3, 12)
    agent_output_tokens: tuple[int, int] = (20, 150)
    tool_output_tokens: tuple[int, int] = (100, 1500)
    max_context_tokens: int = 32768
    num_tenants: int = 4
    tenant_lora: bool = False
    mixed_weights: tuple[tuple[WorkloadKind, float], ...] = (
        (WorkloadKind.SHARED_PREFIX, 0.4),
        (WorkloadKind.MULTI_TURN, 0.3),
        (WorkloadKind.AGENT, 0.2),
        (WorkloadKind.MULTI_TENANT, 0.1),
    )

    def __post_init__(self) -> None:
        if not _is_number(self.rate_per_s) or self.rate_per_s <= 0:
            raise ConfigError(f"rate_per_s must be a positive finite number, got {self.rate_per_s!r}")
        if not _is_number(self.prompt_skew) or self.prompt_skew < 0:
            raise ConfigError(f"prompt_skew must be a finite number >= 0, got {self.prompt_skew!r}")
        if type(self.max_context_tokens) is not int or self.max_context_tokens < 1:
            raise ConfigError(f"max_context_tokens must be a positive integer, got {self.max_context_tokens!r}")
        for name in ("num_system_prompts", "concurrent_sessions", "num_agent_prompts", "num_tenants"):
            value = getattr(self, name)
            if type(value) is not int or not 1 <= value <= MAX_WORKLOAD_REQUESTS:
                raise ConfigError(f"{name} must be an integer in [1, {MAX_WORKLOAD_REQUESTS:,}], got {value!r}")
        for f in fields(self):
            if f.name.endswith(("_tokens", "turns", "_steps")) and f.name != "max_context_tokens":
                _check_range(f.name, getattr(self, f.name), 1 if f.name in ("turns", "agent_steps") else 0)
        kinds = [k for k, _ in self.mixed_weights] if isinstance(self.mixed_weights, tuple) else None
        if (
            kinds is None
            or any(not isinstance(k, WorkloadKind) or k is WorkloadKind.MIXED for k in kinds)
            or len(set(kinds)) != len(kinds)
            or any(not _is_number(w) or w < 0 for _, w in self.mixed_weights)
            or sum(w for _, w in self.mixed_weights) <= 0
        ):
            raise ConfigError(
                "mixed_weights must be distinct (WorkloadKind other than MIXED, weight >= 0) pairs "
                f"with a positive total, got {self.mixed_weights!r}"
            )


def _is_number(value: object) -> bool:
    return type(value) in (int, float) and math.isfinite(cast(float, value))  # an int or a float by now


def _check_range(name: str, value: object, low_bound: int) -> None:
    if (
        not isinstance(value, tuple)
        or len(value) != 2
        or any(type(v) is not int for v in value)
        or not low_bound <= value[0] <= value[1]
    ):
        raise ConfigError(
            f"{name} must be a (low, high) pair of integers with {low_bound} <= low <= high, got {value!r}"
        )


def _zipf_weights(n: int, skew: float) -> list[float]:
    return [1.0 / (i + 1) ** skew for i in range(n)]


def _draw(rng: random.Random, bounds: tuple[int, int]) -> int:
    return rng.randint(bounds[0], bounds[1])


@dataclass(frozen=True, slots=True)
class _Prompts:
    """A family of shared prompts: names, fixed lengths, popularity weights."""

    segments: tuple[SharedSegment, ...]
    weights: tuple[float, ...]

    @classmethod
    def make(cls, rng: random.Random, prefix: str, count: int, bounds: tuple[int, int], skew: float) -> _Prompts:
        segs = tuple(SharedSegment(f"{prefix}-{k}", _draw(rng, bounds)) for k in range(count))
        return cls(segs, tuple(_zipf_weights(count, skew)))

    def pick(self, rng: random.Random) -> SharedSegment:
        return rng.choices(self.segments, self.weights)[0]


class _Source(Protocol):
    """Where a workload's requests come from: one ``next`` per request."""

    def next(self, rng: random.Random, rid: str, arrival_ms: float) -> TraceRequest: ...


class _SharedPrefixSource:
    """One-shot requests: shared system prompt + unique user message."""

    def __init__(self, cfg: WorkloadConfig, prompts: _Prompts, salt: str | None, lora: str | None) -> None:
        self._cfg, self._prompts, self._salt, self._lora = cfg, prompts, salt, lora

    def next(self, rng: random.Random, rid: str, arrival_ms: float) -> TraceRequest:
        segments: list[Segment] = [self._prompts.pick(rng), UniqueSegment(_draw(rng, self._cfg.user_tokens))]
        return TraceRequest.create(
            rid, arrival_ms, segments, _draw(rng, self._cfg.output_tokens), cache_salt=self._salt, lora_name=self._lora
        )


class _SessionSource:
    """Interleaved growing contexts: chats (``agent=False``) or agent loops.

    ``concurrent_sessions`` slots each hold a live session (its last request and
    the steps left). An arrival goes to a random slot; a finished or full
    session is replaced by a new one there. O(1) per request plus the request's
    segment tuple (O(turns so far)).
    """

    def __init__(
        self, cfg: WorkloadConfig, prompts: _Prompts, salt: str | None, lora: str | None, *, agent: bool
    ) -> None:
        self._cfg, self._prompts, self._salt, self._lora, self._agent = cfg, prompts, salt, lora, agent
        self._slots: list[tuple[TraceRequest, int] | None] = [None] * cfg.concurrent_sessions

    def next(self, rng: random.Random, rid: str, arrival_ms: float) -> TraceRequest:
        cfg = self._cfg
        slot = rng.randrange(len(self._slots))
        if self._agent:
            first, later, steps = cfg.agent_task_tokens, cfg.tool_output_tokens, cfg.agent_steps
            outputs = cfg.agent_output_tokens
        else:
            first, later, outputs, steps = cfg.user_tokens, cfg.user_tokens, cfg.output_tokens, cfg.turns
        output = _draw(rng, outputs)
        live = self._slots[slot]
        req = None
        if live is not None and live[1] > 0:
            prev, left = live
            new = _draw(rng, later)
            if prev.prompt_length + prev.output_length + new + output <= cfg.max_context_tokens:
                req = TraceRequest.create(
                    rid,
                    arrival_ms,
                    [UniqueSegment(new)],
                    output,
                    follows=prev,
                    cache_salt=self._salt,
                    lora_name=self._lora,
                )
                self._slots[slot] = (req, left - 1)
        if req is None:
            segments: list[Segment] = [self._prompts.pick(rng), UniqueSegment(_draw(rng, first))]
            req = TraceRequest.create(rid, arrival_ms, segments, output, cache_salt=self._salt, lora_name=self._lora)
            self._slots[slot] = (req, _draw(rng, steps) - 1)
        return req


class _TenantSource:
    """Tenants with their own salt over shared system prompts; half one-shot, half chats."""

    def __init__(self, cfg: WorkloadConfig, prompts: _Prompts, tag: str) -> None:
        self._weights = _zipf_weights(cfg.num_tenants, cfg.prompt_skew)
        self._tenants: list[tuple[_SharedPrefixSource, _SessionSource]] = []
        for t in range(cfg.num_tenants):
            salt = f"{tag}-tenant-{t}"
            lora = f"tenant-{t}-adapter" if cfg.tenant_lora else None
            self._tenants.append(
                (_SharedPrefixSource(cfg, prompts, salt, lora), _SessionSource(cfg, prompts, salt, lora, agent=False))
            )

    def next(self, rng: random.Random, rid: str, arrival_ms: float) -> TraceRequest:
        one_shot, chat = rng.choices(self._tenants, self._weights)[0]
        return (one_shot if rng.random() < 0.5 else chat).next(rng, rid, arrival_ms)


def generate_workload(
    kind: WorkloadKind | str,
    *,
    num_requests: int,
    seed: int,
    config: WorkloadConfig | None = None,
    **overrides: Any,
) -> list[TraceRequest]:
    """``num_requests`` synthetic requests of ``kind``, in arrival order.

    ``config`` (default :class:`WorkloadConfig()`) may be adjusted field by
    field through keyword ``overrides`` (``rate_per_s=50.0``, ``turns=(4, 4)``).
    Request IDs are ``"<kind>/<seed>/<index>"``; shared prompts are named
    ``"s<seed>/system-<k>"`` and ``"s<seed>/agent-<k>"`` and tenant salts
    ``"s<seed>-tenant-<t>"``, so workloads with different seeds never share
    prefixes by accident. Follow-up turns always arrive after the turn they
    extend. Raises ConfigError for bad arguments. O(total segments) time; no
    tokens are materialised.
    """
    try:
        kind = WorkloadKind(kind)
    except ValueError:
        raise ConfigError(f"unknown workload kind {kind!r}; use one of {[k.value for k in WorkloadKind]}") from None
    if type(num_requests) is not int or not 0 <= num_requests <= MAX_WORKLOAD_REQUESTS:
        raise ConfigError(f"num_requests must be an integer in [0, {MAX_WORKLOAD_REQUESTS:,}], got {num_requests!r}")
    if type(seed) is not int:
        raise ConfigError(f"seed must be an integer, got {seed!r}")
    cfg = config if config is not None else WorkloadConfig()
    if overrides:
        known = {f.name for f in fields(WorkloadConfig)}
        if unknown := sorted(set(overrides) - known):
            raise ConfigError(f"unknown workload setting(s) {unknown}; known: {sorted(known)}")
        cfg = replace(cfg, **overrides)

    content = random.Random(f"kvpool-workload/{seed}/content")
    arrivals = random.Random(f"kvpool-workload/{seed}/arrivals")
    tag = f"s{seed}"
    system = _Prompts.make(content, f"{tag}/system", cfg.num_system_prompts, cfg.system_prompt_tokens, cfg.prompt_skew)
    agent = _Prompts.make(content, f"{tag}/agent", cfg.num_agent_prompts, cfg.agent_prompt_tokens, cfg.prompt_skew)
    builders: dict[WorkloadKind, Callable[[], _Source]] = {
        WorkloadKind.SHARED_PREFIX: lambda: _SharedPrefixSource(cfg, system, None, None),
        WorkloadKind.MULTI_TURN: lambda: _SessionSource(cfg, system, None, None, agent=False),
        WorkloadKind.AGENT: lambda: _SessionSource(cfg, agent, None, None, agent=True),
        WorkloadKind.MULTI_TENANT: lambda: _TenantSource(cfg, system, tag),
    }
    if kind is WorkloadKind.MIXED:
        sources: list[_Source] = [builders[k]() for k, _ in cfg.mixed_weights]
        weights = [w for _, w in cfg.mixed_weights]
    else:
        sources, weights = [builders[kind]()], [1.0]

    out: list[TraceRequest] = []
    now_ms = 0.0
    for i in range(num_requests):
        now_ms += arrivals.expovariate(cfg.rate_per_s) * 1000.0
        source = sources[0] if len(sources) == 1 else content.choices(sources, weights)[0]
        out.append(source.next(content, f"{kind.value}/{seed}/{i:06d}", now_ms))
    return out
