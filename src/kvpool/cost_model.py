"""How long an engine step takes: one cost model, with named profiles, for the simulator and the emulated replicas.

A :class:`CostProfile` turns one step's work into seconds::

    step = step_overhead_s
         + prefill_tokens x rate(prefill_tokens)       rate: seconds per token, by the step's prefill chunk
         + decode_s_per_seq x decode_seqs
         + s_per_context_token x context_tokens        the KV every scheduled sequence's attention reads

``rate`` is interpolated linearly between the profile's ``(chunk tokens, seconds per token)`` points and held
flat past either end: a small chunk pays more per token than a full one (the weights are read once a step
either way). ``context_tokens`` is the number of tokens already in the KV cache that the step's sequences
attend to (a decoding sequence reads its whole context; a prefill chunk reads what precedes it).

Profiles have a name and a source (where the figures come from: a citation, or the server and time
``kvpool calibrate`` fitted them against). The built-in ones are JSON files shipped in
``kvpool/cost_profiles/``; :func:`load_profile` takes a built-in name or the path of such a file.
Standard library only: the simulator, the emulated replicas and ``kvpool calibrate`` all import it.
"""

from __future__ import annotations

import json
import math
from bisect import bisect_right
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from kvpool.errors import ConfigError

__all__ = [
    "DEFAULT_PROFILE",
    "LLAMA_8B_KV_BYTES_PER_TOKEN",
    "PROFILE_DIR",
    "CostProfile",
    "builtin_profiles",
    "default_profile",
    "load_profile",
]

#: Where the built-in profiles live (package data).
PROFILE_DIR = Path(__file__).resolve().parent / "cost_profiles"
#: The profile ``kvpool simulate`` uses when none is named (round figures, kept so its results compare
#: across versions).
DEFAULT_PROFILE = "round-8b-h100"

#: KV bytes per token of Llama-3.1-8B in bf16 (32 layers x 8 KV heads x 128 x K and V x 2 bytes).
LLAMA_8B_KV_BYTES_PER_TOKEN = 131_072

_SECONDS = ("step_overhead_s", "decode_s_per_seq", "s_per_context_token")


def _seconds(name: str, value: object) -> float:
    """A finite number >= 0 as a float; ConfigError naming the field otherwise."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < math.inf:
        raise ConfigError(f"cost profile field {name} must be a finite number >= 0, got {value!r}")
    return float(value)


def _points(value: object) -> tuple[tuple[int, float], ...]:
    """``[[chunk, s_per_token], ...]`` as a tuple of pairs, chunks strictly increasing integers >= 1."""
    name = "prefill_s_per_token"
    if isinstance(value, str | bytes) or not isinstance(value, tuple | list) or not value:
        raise ConfigError(f"cost profile field {name} must be a non-empty list of [chunk tokens, seconds per token]")
    points: list[tuple[int, float]] = []
    for i, point in enumerate(value):
        if isinstance(point, str | bytes) or not isinstance(point, tuple | list) or len(point) != 2:
            raise ConfigError(
                f"cost profile field {name}[{i}] must be [chunk tokens, seconds per token], got {point!r}"
            )
        chunk, rate = point
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
            raise ConfigError(f"cost profile field {name}[{i}] chunk must be an integer >= 1, got {chunk!r}")
        if points and chunk <= points[-1][0]:
            raise ConfigError(f"cost profile field {name} chunks must increase, got {chunk} after {points[-1][0]}")
        points.append((chunk, _seconds(f"{name}[{i}]", rate)))
    return tuple(points)


@dataclass(frozen=True, slots=True, kw_only=True)
class CostProfile:
    """Seconds an engine step takes, from its prefill tokens, its decoding sequences and the context they read.

    Checked at construction (``ConfigError`` naming the field). Immutable: :meth:`with_fields` gives a copy
    with some fields replaced (``kvpool simulate``'s cost flags override a profile that way).
    """

    name: str
    #: Where the figures come from: a citation, or "fitted by kvpool calibrate against URL at TIME".
    source: str
    step_overhead_s: float
    #: ``(chunk tokens, seconds per token)`` points, interpolated by the step's prefill tokens.
    prefill_s_per_token: tuple[tuple[int, float], ...]
    decode_s_per_seq: float
    #: Attention / KV read cost per context token each scheduled sequence reads in a step.
    s_per_context_token: float
    kv_bytes_per_token: int

    def __post_init__(self) -> None:
        put = object.__setattr__
        for name in ("name", "source"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value.strip():
                raise ConfigError(f"cost profile field {name} must be a non-empty string, got {value!r}")
        for name in _SECONDS:
            put(self, name, _seconds(name, getattr(self, name)))
        put(self, "prefill_s_per_token", _points(self.prefill_s_per_token))
        kv = self.kv_bytes_per_token
        if isinstance(kv, bool) or not isinstance(kv, int) or kv < 1:
            raise ConfigError(f"cost profile field kv_bytes_per_token must be an integer >= 1, got {kv!r}")

    def prefill_rate(self, tokens: int) -> float:
        """Seconds per token of a step that prefills ``tokens``: the points interpolated, flat past the ends."""
        points = self.prefill_s_per_token
        if tokens <= points[0][0]:
            return points[0][1]
        if tokens >= points[-1][0]:
            return points[-1][1]
        i = bisect_right(points, (tokens, math.inf))
        (x0, y0), (x1, y1) = points[i - 1], points[i]
        return y0 + (y1 - y0) * (tokens - x0) / (x1 - x0)

    def prefill_seconds(self, tokens: int) -> float:
        """Seconds of prefill work for ``tokens`` in one step (no overhead): ``tokens x prefill_rate(tokens)``."""
        return tokens * self.prefill_rate(tokens) if tokens > 0 else 0.0

    def step_seconds(self, prefill_tokens: int, decode_seqs: int, *, context_tokens: int = 0) -> float:
        """Seconds one step takes: overhead + prefill + decode per sequence + context read."""
        return (
            self.step_overhead_s
            + self.prefill_seconds(prefill_tokens)
            + self.decode_s_per_seq * decode_seqs
            + self.s_per_context_token * context_tokens
        )

    def servable_prefill_tokens_per_s(self, max_num_batched_tokens: int) -> float:
        """Prefill tokens per second one replica computes at most: full batches of prefill, no decode."""
        batch = max_num_batched_tokens
        return batch / (self.step_overhead_s + self.prefill_seconds(batch))

    @classmethod
    def flat(
        cls,
        *,
        step_overhead_s: float,
        prefill_s_per_token: float,
        decode_s_per_seq: float,
        s_per_context_token: float = 0.0,
        kv_bytes_per_token: int = LLAMA_8B_KV_BYTES_PER_TOKEN,
        name: str = "flat",
        source: str = "given by its caller",
    ) -> CostProfile:
        """A profile whose prefill costs the same per token at every chunk size (one point)."""
        return cls(
            name=name,
            source=source,
            step_overhead_s=step_overhead_s,
            prefill_s_per_token=((1, prefill_s_per_token),),
            decode_s_per_seq=decode_s_per_seq,
            s_per_context_token=s_per_context_token,
            kv_bytes_per_token=kv_bytes_per_token,
        )

    def with_fields(self, **changes: Any) -> CostProfile:
        """A copy with ``changes`` applied, checked as a new profile."""
        return replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """The profile as JSON-ready data (what :meth:`from_dict` and :func:`load_profile` read)."""
        out: dict[str, Any] = {f.name: getattr(self, f.name) for f in fields(self)}
        out["prefill_s_per_token"] = [list(p) for p in self.prefill_s_per_token]
        return out

    @classmethod
    def from_dict(cls, data: object) -> CostProfile:
        """A profile from :meth:`to_dict`'s shape; a missing, unknown or bad field is refused by its name."""
        if not isinstance(data, dict):
            raise ConfigError(f"a cost profile must be a JSON object, got {type(data).__name__}")
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(data) - set(known))
        if unknown:
            raise ConfigError(f"cost profile has unknown fields {unknown}; the fields are {known}")
        missing = [name for name in known if name not in data]
        if missing:
            raise ConfigError(f"cost profile is missing the fields {missing}")
        return cls(**data)


def default_profile() -> CostProfile:
    """The built-in :data:`DEFAULT_PROFILE`."""
    return load_profile(DEFAULT_PROFILE)


def builtin_profiles() -> tuple[str, ...]:
    """Names of the built-in profiles, sorted."""
    return tuple(sorted(p.stem for p in PROFILE_DIR.glob("*.json")))


def load_profile(name_or_path: str) -> CostProfile:
    """A built-in profile by name, or a profile read from a JSON file; ConfigError naming what is wrong."""
    if not isinstance(name_or_path, str) or not name_or_path:
        raise ConfigError(f"a cost profile is a built-in name or a JSON file path, got {name_or_path!r}")
    builtin = PROFILE_DIR / f"{name_or_path}.json"
    if "/" not in name_or_path and "\\" not in name_or_path and builtin.is_file():
        path = builtin
    else:
        path = Path(name_or_path)
        if not path.is_file():
            raise ConfigError(
                f"cost profile {name_or_path!r} is neither a built-in profile {list(builtin_profiles())} nor a file"
            )
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"cost profile {str(path)!r} cannot be read as JSON: {exc}") from None
    try:
        return CostProfile.from_dict(data)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None
