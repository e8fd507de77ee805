"""Hostile input to the simulator's library: a TraceError or ConfigError naming the value, before any large allocation."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from kvpool.cost_model import CostProfile
from kvpool.errors import ConfigError
from kvpool.sim.simulator import SimulationConfig, simulate
from kvpool.sim.traces import (
    MAX_REQUEST_TOKENS,
    OutputSegment,
    SharedSegment,
    TraceError,
    TraceRequest,
    UniqueSegment,
    load_trace,
)
from kvpool.sim.workloads import MAX_WORKLOAD_REQUESTS, WorkloadConfig, generate_workload


def _write(tmp_path: Path, content: bytes) -> Path:
    path = tmp_path / "t.jsonl"
    path.write_bytes(content)
    return path


# -- files ---------------------------------------------------------------------------------------------


def test_a_folder_is_not_a_trace(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="cannot read the trace file") as info:
        load_trace(tmp_path)
    assert info.value.file == str(tmp_path)


@pytest.mark.parametrize("name", ["missing.jsonl", "file/below-a-file.jsonl"])
def test_missing_or_unreachable_file(tmp_path: Path, name: str) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(TraceError) as info:
        load_trace(tmp_path / name)
    assert str(tmp_path / name) in str(info.value)


@pytest.mark.parametrize("depth", [1_000, 100_000])
@pytest.mark.parametrize(("open_", "close"), [(b"[", b"]"), (b'{"id":', b"}")])
def test_deep_nesting_is_malformed_json(tmp_path: Path, depth: int, open_: bytes, close: bytes) -> None:
    path = _write(tmp_path, open_ * depth + b"1" + close * depth + b"\n")
    with pytest.raises(TraceError, match="line 1") as info:
        load_trace(path)
    assert info.value.line == 1


@pytest.mark.parametrize(
    "raw", [b"\xff\xfe\x80\x81", b'{"id": "caf\xe9"}', b"\x80" * 9, b'{"a": ' + b"7" * 5000 + b"}"]
)
def test_undecodable_lines_are_malformed_json(tmp_path: Path, raw: bytes) -> None:
    with pytest.raises(TraceError, match="t.jsonl line 2: malformed JSON"):
        load_trace(_write(tmp_path, b'{"id": "a", "arrival_ms": 0, "output_length": 1, "token_ids": [1]}\n' + raw))


# -- sizes are refused before tokens exist ---------------------------------------------------------------


@pytest.mark.parametrize("length", [MAX_REQUEST_TOKENS + 1, 10**10, 10**30])
@pytest.mark.parametrize("make", [UniqueSegment, lambda n: SharedSegment("s", n), lambda n: OutputSegment("r", n)])
def test_absurd_segment_lengths(make, length: int) -> None:
    with pytest.raises(TraceError, match=str(length)):
        make(length)


def test_a_request_over_the_token_limit_is_refused() -> None:
    half = MAX_REQUEST_TOKENS // 2 + 1
    with pytest.raises(TraceError, match=f"{2 * half:,} prompt"):
        TraceRequest.create("r", 0, [UniqueSegment(half), UniqueSegment(half)], 1)
    with pytest.raises(TraceError, match="output"):
        TraceRequest.create("r", 0, [UniqueSegment(MAX_REQUEST_TOKENS)], 1)
    assert (
        TraceRequest.create("r", 0, [UniqueSegment(MAX_REQUEST_TOKENS - 1)], 1).prompt_length == MAX_REQUEST_TOKENS - 1
    )


@pytest.mark.parametrize(
    "record",
    [
        {"id": "a", "arrival_ms": 0, "output_length": 1, "segments": [{"unique": 10**10}]},
        {"id": "a", "arrival_ms": 0, "output_length": 10**12, "segments": [{"unique": 1}]},
        {"id": "a", "arrival_ms": 0, "output_length": 1, "segments": [{"unique": 2**24}, {"unique": 2**24}]},
        {"timestamp": 0, "input_length": 10**10, "output_length": 1, "hash_ids": [1]},
        {"timestamp": 0, "input_length": 512, "output_length": 2**24, "hash_ids": [1]},
    ],
)
def test_oversized_lines_name_the_line(tmp_path: Path, record: dict) -> None:
    with pytest.raises(TraceError, match="t.jsonl line 1: field"):
        load_trace(_write(tmp_path, json.dumps(record).encode() + b"\n"))


# -- cost model, config and workload numbers --------------------------------------------------------------


@pytest.mark.parametrize("field", ["step_overhead_s", "prefill_s_per_token", "decode_s_per_seq"])
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, -1.0, True, "0.01"])
def test_cost_model_refuses_non_finite_or_negative(field: str, value: object) -> None:
    with pytest.raises(ConfigError, match=field):
        CostProfile.flat(
            **{"step_overhead_s": 0.01, "prefill_s_per_token": 5e-5, "decode_s_per_seq": 1e-4, field: value}
        )


@pytest.mark.parametrize("value", [math.nan, math.inf, 0, -1.0, True])
def test_usage_interval_must_be_finite_and_positive(value: object) -> None:
    with pytest.raises(ConfigError, match="usage_interval_s"):
        SimulationConfig(num_blocks=10, usage_interval_s=value)


@pytest.mark.parametrize("count", [MAX_WORKLOAD_REQUESTS + 1, 10**11, -1])
def test_absurd_workload_sizes(count: int) -> None:
    with pytest.raises(ConfigError, match=str(count)):
        generate_workload("agent", num_requests=count, seed=0)
    if count > 0:
        with pytest.raises(ConfigError, match="num_tenants"):
            WorkloadConfig(num_tenants=count)


# -- requests that never fit ------------------------------------------------------------------------------


def _request(i: int, length: int, arrival_ms: float) -> TraceRequest:
    return TraceRequest.create(f"r{i}", arrival_ms, [UniqueSegment(length)], 2)


@pytest.mark.parametrize(
    ("lengths", "rejected"),
    [([40, 40, 5000], 1), ([5000], 1), ([5000, 40], 1), ([40, 5000, 40, 6000], 2), ([5000] * 4, 4)],
)
def test_requests_that_never_fit_are_counted_and_skipped(lengths: list[int], rejected: int) -> None:
    trace = [_request(i, n, 10.0 * i) for i, n in enumerate(lengths)]
    done: list[int] = []
    result = simulate(trace, SimulationConfig(num_blocks=21), progress=done.append)
    assert result.rejected == rejected and result.requests == len(lengths)
    assert sum(done) == len(lengths)
    assert result.prompt_tokens == sum(n for n in lengths if n <= 300)


def test_the_last_arrival_rejected_after_an_idle_gap() -> None:
    trace = [_request(0, 40, 0.0), _request(1, 9000, 60_000.0)]
    result = simulate(trace, SimulationConfig(num_blocks=21))
    assert result.rejected == 1 and result.output_tokens == 2
