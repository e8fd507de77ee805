"""kvpool against decisions vLLM 0.33's KV cache manager made, replayed without vLLM.

``tests/fixtures/vllm/*.jsonl.gz`` hold seeded traffic and vLLM's answer to
every operation: each admission's prefix-hit length, hit block IDs and new
blocks, each prefill chunk's and decode's new blocks or refusal, each
``reset_prefix_cache`` result, and, at checkpoints, the free-queue order and
every running request's block tables. Scenarios: one full-attention group
(block sizes 1, 2, 4, 16; roomy, tight and large pools) and hybrid
full / sliding-window / chunked-local groups (equal and multiple block
sizes, roomy and tight pools), with cache salts from several tenants,
chunked prefill, lookahead slots, preemption and re-admission, and resets
both refused and accepted. Each test replays one scenario through kvpool's
``KVCacheManager`` and fails at the first decision that differs, naming the
operation's index and context.

Needs neither vLLM nor torch. To regenerate the fixtures (in a separate
virtual environment that has vLLM 0.33.0; the full install list is in
``benchmarks/record_vllm_decisions.py``)::

    /work/venv-vllm/bin/python benchmarks/record_vllm_decisions.py
    /work/venv-vllm/bin/python -m pytest -q tests/test_vllm_parity.py tests/test_vllm_recorded.py

``tests/test_vllm_parity.py`` then also checks, live, that the fixtures are
what that vLLM decides today.
"""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

from tests.parity_traffic import Replayer, Scenario

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures" / "vllm"
FAMILIES = ("single", "single-tight", "single-large", "hybrid-equal", "hybrid-mixed", "hybrid-tight")


@cache
def load_fixture(path: Path) -> tuple[dict, list[dict]]:
    """A fixture's metadata and its scenarios (``{"scenario": ..., "ops": [...]}`` each)."""
    with gzip.open(path, "rt", encoding="utf-8") as f:
        lines = [json.loads(line) for line in f if line.strip()]
    return lines[0]["meta"], lines[1:]


def _cases():
    for family in FAMILIES:
        path = FIXTURES / f"{family}.jsonl.gz"
        _meta, scenarios = load_fixture(path)
        for i, entry in enumerate(scenarios):
            yield pytest.param(path, i, id=entry["scenario"]["name"])


def test_every_family_is_recorded():
    present = sorted(p.name for p in FIXTURES.glob("*.jsonl.gz"))
    assert present == sorted(f"{f}.jsonl.gz" for f in FAMILIES)
    for family in FAMILIES:
        meta, scenarios = load_fixture(FIXTURES / f"{family}.jsonl.gz")
        assert meta["vllm_version"].startswith("0.33.")
        assert meta["family"] == family
        assert [s["scenario"]["name"] for s in scenarios] == meta["scenarios"]


def test_fixtures_cover_the_behaviours_they_claim():
    """Hits, salts, refusals, preemption, both reset outcomes, eviction pressure and hybrid groups occur."""
    seen: dict[str, int] = {}

    def bump(key: str) -> None:
        seen[key] = seen.get(key, 0) + 1

    for family in FAMILIES:
        for entry in load_fixture(FIXTURES / f"{family}.jsonl.gz")[1]:
            groups = entry["scenario"]["groups"]
            kinds = {g[0] for g in groups}
            if len(groups) > 1:
                bump("hybrid")
                if len({g[1] for g in groups}) > 1:
                    bump("hybrid multiple block sizes")
                if "cl" in kinds:
                    bump("chunked local")
                if "sw" in kinds:
                    bump("sliding window")
            for op in entry["ops"]:
                kind = op["op"]
                bump(kind)
                if kind in ("admit", "readmit") and op["hit"]:
                    bump(f"{kind} with a hit")
                if kind == "admit" and op["salt"] is not None and op["hit"]:
                    bump("salted hit")
                if op.get("new", 0) is None:
                    bump(f"{kind} refused")
                if kind == "reset":
                    bump(f"reset {'accepted' if op['ok'] else 'refused'}")
                if kind == "step" and op["lookahead"]:
                    bump("lookahead")
    for key in (
        "admit with a hit",
        "readmit with a hit",
        "salted hit",
        "admit refused",
        "step refused",
        "readmit",
        "preempt",
        "free",
        "drop",
        "reset accepted",
        "reset refused",
        "lookahead",
        "hybrid",
        "hybrid multiple block sizes",
        "chunked local",
        "sliding window",
    ):
        assert seen.get(key, 0) > 0, f"no {key!r} in the fixtures: {seen}"


@pytest.mark.parametrize(("path", "index"), list(_cases()))
def test_kvpool_replays_vllm_decisions(path, index):
    entry = load_fixture(path)[1][index]
    scenario = Scenario.from_dict(entry["scenario"])
    decisions = Replayer(scenario).replay(entry["ops"])
    assert decisions >= len(entry["ops"]) // 2


def test_replay_needs_neither_vllm_nor_torch():
    """A fresh interpreter in which importing torch or vLLM fails replays a hybrid scenario."""
    code = (
        "import sys\n"
        "sys.modules['torch'] = sys.modules['vllm'] = None\n"  # any import of them raises ImportError
        "from tests.test_vllm_recorded import FIXTURES, load_fixture\n"
        "from tests.parity_traffic import Replayer, Scenario\n"
        "entry = load_fixture(FIXTURES / 'hybrid-mixed.jsonl.gz')[1][0]\n"
        "assert Replayer(Scenario.from_dict(entry['scenario'])).replay(entry['ops']) > 0\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, check=True, timeout=60)
