"""A sweep: the grid of configurations a sweep file names, each one simulation (``kvpool simulate --sweep``).

A sweep file is TOML. Each top-level key is one of ``kvpool simulate``'s options, spelt as its flag
without the dashes in front (``kv-blocks``; ``kv_blocks`` is the same key), and its value is the
non-empty list of values to try::

    replicas = [1, 2]
    routing = ["prefix", "round-robin"]
    kv-blocks = [2000, 8000]
    tier = [[], ["cpu:4GiB"]]          # each value a list of tier specs ([]: no tier)
    policy = ["lru", "frequency"]
    arrival-rate-scale = [1.0, 2.0]

Every configuration of the cross product (in the file's key order, the last key varying fastest) is
one :class:`SweepJob`: the command's own options with the configuration's values put over them. The
whole grid is checked when the :class:`Sweep` is built, each configuration as
:class:`~kvpool.sim.options.SimulateOptions` would check it, so a bad grid is refused, naming the key
and the value, before any simulation runs. A job is a pure function of its fields (the trace is read
inside it, the seed is its own), so its figures are the same in any process, in any order.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, fields
from enum import Enum
from pathlib import Path
from typing import Any

from kvpool.errors import ConfigError
from kvpool.routing import Routing
from kvpool.sim.options import SimulateOptions

__all__ = ["SWEEP_KEYS", "Sweep", "SweepConfig", "SweepJob", "job_figures"]

#: The keys a sweep file may sweep (the flag's spelling) and the :class:`SimulateOptions` field each sets.
SWEEP_KEYS: dict[str, str] = {
    "replicas": "replicas",
    "routing": "routing",
    "routing-load-cost": "routing_load_cost",
    "kv-blocks": "kv_blocks",
    "kv-memory": "kv_memory",
    "block-size": "block_size",
    "tier": "tier",
    "kv-tier-write": "kv_tier_write",
    "tier-bandwidth": "tier_bandwidth",
    "tier-latency": "tier_latency",
    "policy": "policy",
    "arrival-rate-scale": "arrival_rate_scale",
    "ttft-slo": "ttft_slo",
    "ttft-slo-percentile": "ttft_slo_percentile",
    "max-num-seqs": "max_num_seqs",
    "max-num-batched-tokens": "max_num_batched_tokens",
    "profile": "profile",
}
#: The keys whose value is a list of strings (a tier spec list); a single string is a list of one.
_LIST_KEYS = frozenset({"tier", "tier-bandwidth", "tier-latency"})
_OPTION_FIELDS = frozenset(f.name for f in fields(SimulateOptions) if f.init)


def _plain(value: Any) -> Any:
    """A field's value as JSON can hold it: enums by their value, tuples as lists."""
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, tuple | list):
        return [_plain(v) for v in value]
    return value


def _frozen(value: Any) -> Any:
    """A TOML value with its lists as tuples, so a configuration is hashable and compares by value."""
    return tuple(_frozen(v) for v in value) if isinstance(value, list) else value


@dataclass(frozen=True, slots=True)
class SweepConfig:
    """One configuration of the grid: the swept keys (the file's spelling) and their values, in the file's order."""

    values: tuple[tuple[str, Any], ...]

    def to_json(self) -> dict[str, Any]:
        return {key: _plain(value) for key, value in self.values}

    def describe(self) -> str:
        """``replicas = 2, routing = 'prefix'``, for messages."""
        return ", ".join(f"{key} = {_plain(value)!r}" for key, value in self.values)

    def option_fields(self) -> dict[str, Any]:
        """The :class:`SimulateOptions` fields this configuration sets."""
        out: dict[str, Any] = {}
        for key, value in self.values:
            if key == "routing":
                if value not in {r.value for r in Routing}:
                    raise ConfigError(f"routing {value!r} is not one of {[r.value for r in Routing]}")
                value = (Routing(value),)
            elif key in _LIST_KEYS and isinstance(value, str):
                value = (value,)
            out[SWEEP_KEYS[key]] = value
        return out


@dataclass(frozen=True, slots=True, kw_only=True)
class SweepJob:
    """One task of a sweep: its place in the grid, its configuration, and every option of its simulation.

    ``key`` names the job's whole input (the base options and the configuration): a results file that
    holds a line with the same key already holds this job's figures.
    """

    index: int
    config: SweepConfig
    option_fields: Mapping[str, Any]

    @property
    def key(self) -> str:
        text = json.dumps({k: _plain(v) for k, v in self.option_fields.items()}, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:32]

    def options(self) -> SimulateOptions:
        return SimulateOptions(**self.option_fields)

    def run(self) -> dict[str, Any]:
        """Simulate this configuration: its figures (no wall-clock time, so they repeat bit for bit)."""
        from kvpool.sim.study import load_requests, run_study

        options = self.options()
        return job_figures(run_study(options, load_requests(options)))


def _without_wall_time(figures: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in figures.items() if not k.startswith("wall")}


def job_figures(report: Any) -> dict[str, Any]:
    """A :class:`~kvpool.sim.study.StudyReport`'s figures as JSON-ready data, its timelines and wall times left out."""
    from dataclasses import asdict

    out: dict[str, Any] = {"requests": report.requests}
    if report.sequential is not None:
        out["sequential"] = _without_wall_time(asdict(report.sequential))
    if report.results:
        out["routing"] = {
            rule.value: _without_wall_time(
                {k: v for k, v in r.to_dict().items() if k not in ("usage_timeline", "queue_timeline")}
            )
            for rule, r in report.results.items()
        }
    if report.sizing is not None:
        out["sizing"] = {
            name: {**asdict(answer), "ttft_by_replicas": {str(n): t for n, t in answer.ttft_by_replicas.items()}}
            | {"overloaded_by_replicas": {str(n): o for n, o in answer.overloaded_by_replicas.items()}}
            for name, answer in report.sizing.items()
        }
    if report.curve is not None:
        out["curve"] = report.curve.to_dict()
    plain: dict[str, Any] = json.loads(json.dumps(out))  # plain JSON types, as a results file gives them back
    return plain


def _axis(source: str, key: object, values: object) -> tuple[str, tuple[Any, ...]]:
    """One key of the file and its values, checked: a known key, a non-empty list, no value twice."""
    if not isinstance(key, str) or key.replace("_", "-") not in SWEEP_KEYS:
        raise ConfigError(f"{source}: unknown key {key!r}; a sweep file sweeps any of {sorted(SWEEP_KEYS)}")
    name = key.replace("_", "-")
    if not isinstance(values, list):
        raise ConfigError(f"{source}: {key} must be a list of values to try, got {values!r}")
    if not values:
        raise ConfigError(f"{source}: {key} = [] names no value to try")
    frozen = tuple(_frozen(v) for v in values)
    for value in frozen:
        if isinstance(value, dict):
            raise ConfigError(f"{source}: {key} value {value!r} is a table, not a value")
        if frozen.count(value) > 1:
            raise ConfigError(f"{source}: {key} lists {_plain(value)!r} twice")
    return name, frozen


@dataclass(frozen=True, slots=True, kw_only=True)
class Sweep:
    """Every job of a grid, checked: built by :meth:`from_file` or :meth:`from_grid`."""

    source: str
    jobs: tuple[SweepJob, ...]

    @classmethod
    def from_file(cls, path: str | Path, base: Mapping[str, Any]) -> Sweep:
        """The sweep ``path`` names over the options ``base`` (:class:`SimulateOptions` fields)."""
        try:
            grid = tomllib.loads(Path(path).read_text(encoding="utf-8"))
        except OSError as exc:
            raise ConfigError(f"--sweep {str(path)!r} cannot be read: {exc.strerror or exc}") from None
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError(f"--sweep {str(path)!r} is not a TOML file: {exc}") from None
        return cls.from_grid(grid, base, source=str(path))

    @classmethod
    def from_grid(cls, grid: Mapping[str, Any], base: Mapping[str, Any], *, source: str = "sweep") -> Sweep:
        """The sweep of ``grid`` (key -> values) over ``base``; ConfigError naming the key and value if any is refused."""
        unknown = set(base) - _OPTION_FIELDS
        if unknown:
            raise ConfigError(f"not options of a simulation: {sorted(unknown)}")
        if not grid:
            raise ConfigError(f"{source}: the sweep names no key; give at least one, e.g. replicas = [1, 2]")
        axes = [_axis(source, key, values) for key, values in grid.items()]
        jobs = []
        for index, combo in enumerate(itertools.product(*(values for _, values in axes))):
            config = SweepConfig(tuple((name, value) for (name, _), value in zip(axes, combo, strict=True)))
            jobs.append(_checked_job(source, index, config, base))
        return cls(source=source, jobs=tuple(jobs))


def _checked_job(source: str, index: int, config: SweepConfig, base: Mapping[str, Any]) -> SweepJob:
    """The job of one configuration, its options checked now so a bad one stops the sweep before it runs."""
    try:
        job = SweepJob(index=index, config=config, option_fields={**base, **config.option_fields()})
        job.options()
    except (ValueError, TypeError) as exc:  # ConfigError and the parsers' own refusals
        raise ConfigError(f"{source}: the configuration {config.describe()} is refused: {exc}") from None
    return job
