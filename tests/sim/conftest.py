"""Fixtures shared by the simulator tests: the public trace kept next to the repository."""

from __future__ import annotations

from pathlib import Path

import pytest

#: ../shared/traces from the repository root.
SHARED_TRACES = Path(__file__).parents[2].parent / "shared" / "traces"


@pytest.fixture(scope="session")
def conversation_trace_path() -> Path:
    path = SHARED_TRACES / "conversation_trace.jsonl"
    if not path.is_file():
        pytest.skip(f"the shared Mooncake trace is absent: expected {path} (../shared/traces from the repo root)")
    return path


@pytest.fixture(scope="session")
def conversation_requests(conversation_trace_path: Path) -> list:
    from kvpool.sim.traces import load_trace

    return load_trace(conversation_trace_path)
