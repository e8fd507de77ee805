"""How fast one replica works: its prefill rate, its decode step, its tiers' load rates.

A :class:`ReplicaRates` is what a replica answers on ``GET /rates`` and what the router keeps on each
replica (``Replica.rates``) to weigh a prefix hit against computing the prompt (a block it must load from a
slow tier saves less than one already on the GPU; a replica that prefills faster gains less from a hit)::

    {"prefill_tokens_per_s": 21000.0,     > 0: prompt tokens a second, at a full prefill chunk
     "decode_step_s": 0.012,              >= 0: one decode step's seconds at the replica's recent batch
     "step_overhead_s": 0.004,            >= 0: what every step costs before any token
     "tier_load_tokens_per_s": {"CPU": 250000.0},   medium name -> tokens a second it loads
     "source": "measured"}                "measured", "profile:<name>", "metrics" or "flag"

The figures come from the replica's own step timings (``"measured"``), from a cost profile
(:meth:`ReplicaRates.from_profile`: an emulated replica that has not stepped yet, a vLLM replica whose spec
names a profile), from a vLLM replica's Prometheus counters (``"metrics"``, read by the router), or from
the router's command line (``"flag"``). A replica that has nothing to say yet answers
``{"source": "none yet"}``, which :meth:`ReplicaRates.from_json` reads as ``None`` (unknown).

Standard library only: the engine, the emulator, the server and the router all import it.
"""

from __future__ import annotations

import json
import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from kvpool.cost_model import CostProfile
from kvpool.errors import ConfigError

__all__ = ["NOT_MEASURED_YET", "PROFILE_CHUNK_TOKENS", "RECENT_STEPS", "ReplicaRates", "StepWindow"]

#: The ``source`` of a ``/rates`` body with no figures: the replica has not stepped yet.
NOT_MEASURED_YET = "none yet"
#: The prefill chunk a profile's rate is read at when none is given (vLLM V1's default token budget).
PROFILE_CHUNK_TOKENS = 8192

#: Steps a :class:`StepWindow` remembers: the rates are the recent batch's, not the day's.
RECENT_STEPS = 256

_FIELDS = ("prefill_tokens_per_s", "decode_step_s", "step_overhead_s", "tier_load_tokens_per_s", "source")


def _number(name: str, value: object, *, positive: bool) -> float:
    """``value`` as a finite float (> 0 or >= 0); ConfigError naming ``name`` and the value otherwise."""
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or (value <= 0 if positive else value < 0)
    ):
        bound = "> 0" if positive else ">= 0"
        raise ConfigError(f"replica rates field {name} must be a finite number {bound}, got {value!r}")
    return float(value)


@dataclass(frozen=True, slots=True, kw_only=True)
class ReplicaRates:
    """One replica's measured (or assumed) speeds; checked at construction, ConfigError naming the field.

    ``tier_load_tokens_per_s`` is copied into a read-only mapping: a caller's dict changing later changes
    nothing here.
    """

    prefill_tokens_per_s: float
    decode_step_s: float
    step_overhead_s: float = 0.0
    tier_load_tokens_per_s: Mapping[str, float] = field(default_factory=dict)
    source: str

    def __post_init__(self) -> None:
        put = object.__setattr__
        put(self, "prefill_tokens_per_s", _number("prefill_tokens_per_s", self.prefill_tokens_per_s, positive=True))
        put(self, "decode_step_s", _number("decode_step_s", self.decode_step_s, positive=False))
        put(self, "step_overhead_s", _number("step_overhead_s", self.step_overhead_s, positive=False))
        tiers = self.tier_load_tokens_per_s
        if not isinstance(tiers, Mapping):
            raise ConfigError(
                f"replica rates field tier_load_tokens_per_s must map a medium name to tokens a second, got {tiers!r}"
            )
        checked: dict[str, float] = {}
        for medium, rate in tiers.items():
            if not isinstance(medium, str) or not medium.strip():
                raise ConfigError(
                    f"replica rates field tier_load_tokens_per_s has a medium name that is not a name: {medium!r}"
                )
            checked[medium] = _number(f"tier_load_tokens_per_s[{medium!r}]", rate, positive=True)
        put(self, "tier_load_tokens_per_s", MappingProxyType(checked))
        if not isinstance(self.source, str) or not self.source.strip():
            raise ConfigError(f"replica rates field source must be a non-empty string, got {self.source!r}")
        if self.source == NOT_MEASURED_YET:
            raise ConfigError(f"replica rates with figures cannot have the source {NOT_MEASURED_YET!r}")

    def __hash__(self) -> int:  # the mapping proxy is not hashable; its items are
        return hash(
            (
                self.prefill_tokens_per_s,
                self.decode_step_s,
                self.step_overhead_s,
                tuple(sorted(self.tier_load_tokens_per_s.items())),
                self.source,
            )
        )

    @classmethod
    def from_profile(
        cls, profile: CostProfile, *, chunk_tokens: int = PROFILE_CHUNK_TOKENS, decode_seqs: int = 1
    ) -> ReplicaRates:
        """The rates a cost profile gives: prefill at a ``chunk_tokens`` chunk, a step decoding ``decode_seqs``.

        Prefill tokens a second are the chunk's marginal rate (``1 / prefill_rate(chunk)``: the overhead is
        paid by the step either way); the decode step is the overhead plus ``decode_seqs`` sequences' work.
        A profile knows no tiers. Source ``"profile:<name>"``.
        """
        for name, value in (("chunk_tokens", chunk_tokens), ("decode_seqs", decode_seqs)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"ReplicaRates.from_profile: {name} must be an integer >= 1, got {value!r}")
        per_token = profile.prefill_rate(chunk_tokens)
        if per_token <= 0:
            raise ConfigError(f"cost profile {profile.name} prefills at 0 seconds a token: no rate to read from it")
        return cls(
            prefill_tokens_per_s=1.0 / per_token,
            decode_step_s=profile.step_overhead_s + profile.decode_s_per_seq * decode_seqs,
            step_overhead_s=profile.step_overhead_s,
            source=f"profile:{profile.name}",
        )

    def to_json(self) -> dict[str, Any]:
        """The rates as JSON-ready data: what ``GET /rates`` answers and :meth:`from_json` reads."""
        return {
            "prefill_tokens_per_s": self.prefill_tokens_per_s,
            "decode_step_s": self.decode_step_s,
            "step_overhead_s": self.step_overhead_s,
            "tier_load_tokens_per_s": dict(self.tier_load_tokens_per_s),
            "source": self.source,
        }

    @classmethod
    def from_json(cls, body: object, where: str) -> ReplicaRates | None:
        """Rates from a ``/rates`` body (bytes, text or the parsed object); ``None`` for ``{"source": "none yet"}``.

        ``where`` names the body's origin in errors (``"GET http://10.0.0.5:8000/rates"``). Refused with a
        ConfigError naming ``where`` and the field: a body that is not a JSON object, an unknown field, a
        missing one (``step_overhead_s`` and ``tier_load_tokens_per_s`` may be left out), a bad value.
        """
        data = body
        if isinstance(body, bytes | bytearray | str):
            try:
                data = json.loads(body)
            except (ValueError, UnicodeDecodeError) as err:
                raise ConfigError(f"{where}: the rates body is not JSON ({err})") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{where}: the rates body must be a JSON object, got {type(data).__name__}")
        unknown = sorted(str(k) for k in set(data) - set(_FIELDS))
        if unknown:
            raise ConfigError(f"{where}: the rates body has unknown fields {unknown}; the fields are {list(_FIELDS)}")
        if data.get("source") == NOT_MEASURED_YET:
            figures = sorted(set(data) - {"source"})
            if figures:
                raise ConfigError(
                    f"{where}: a rates body with source {NOT_MEASURED_YET!r} carries no figures, got {figures}"
                )
            return None
        missing = [name for name in ("prefill_tokens_per_s", "decode_step_s", "source") if name not in data]
        if missing:
            raise ConfigError(f"{where}: the rates body is missing the fields {missing}")
        try:
            return cls(**data)
        except ConfigError as err:
            raise ConfigError(f"{where}: {err}") from None


class StepWindow:
    """The last ``size`` steps' timings, and the rates they show (what ``GET /rates`` answers as ``"measured"``).

    :meth:`note` takes one step: its prefill tokens, its decoding sequences, its seconds. :meth:`rates`:

    * ``decode_step_s``: the mean seconds of the window's pure decode steps (no prefill);
    * ``prefill_tokens_per_s``: the window's prefill tokens over the seconds of the steps that prefilled,
      each less the decode step's seconds (a step's overhead, and the decodes riding along, are paid with
      or without the prefill), so a chunk is credited with its own time alone: the marginal rate a prefix
      hit saves, not a short prompt's overhead-bound one;
    * ``None`` until a step prefilled (a rate from decodes alone would be a guess).

    ``step_overhead_s`` is not measured (a step's overhead hides inside its decode time): 0.
    O(1) a step; :meth:`rates` is O(size).
    """

    __slots__ = ("_steps",)

    def __init__(self, size: int = RECENT_STEPS) -> None:
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ConfigError(f"StepWindow size must be an integer >= 1, got {size!r}")
        self._steps: deque[tuple[int, int, float]] = deque(maxlen=size)

    def __len__(self) -> int:
        return len(self._steps)

    def note(self, prefill_tokens: int, decode_seqs: int, seconds: float) -> None:
        """One step (trusted input: the engine's own counts and its clock's seconds)."""
        self._steps.append((prefill_tokens, decode_seqs, seconds))

    def rates(self, tier_load_tokens_per_s: Mapping[str, float] | None = None) -> ReplicaRates | None:
        """The window's rates (source ``"measured"``), with the tiers' load rates given; None before a prefill."""
        decode = [seconds for prefill, seqs, seconds in self._steps if prefill == 0 and seqs > 0]
        decode_step_s = sum(decode) / len(decode) if decode else 0.0
        tokens = 0
        seconds = 0.0
        for prefill, _, took in self._steps:
            if prefill > 0:
                tokens += prefill
                seconds += max(took - decode_step_s, took * 0.01)
        if tokens == 0 or seconds <= 0:
            return None
        return ReplicaRates(
            prefill_tokens_per_s=tokens / seconds,
            decode_step_s=decode_step_s,
            tier_load_tokens_per_s=dict(tier_load_tokens_per_s or {}),
            source="measured",
        )
