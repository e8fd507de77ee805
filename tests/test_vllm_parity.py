"""Decision-for-decision parity with vLLM's own KV cache manager, live.

Runs only where vLLM is importable beside kvpool (it is never a dependency;
see ``benchmarks/vllm_reference.py`` for the install commands). Elsewhere
``tests/test_vllm_recorded.py`` replays the same traffic from decisions vLLM
0.33 made once.

The traffic is ``tests/parity_traffic.py``'s seeded driver: admissions with
prefix hits and cache salts, chunked prefill, decodes with lookahead slots,
preemption and re-admission, frees, ``reset_prefix_cache``, and tight pools
that evict; single full-attention groups and hybrid ones (full, sliding
window, chunked local; equal and multiple block sizes). vLLM's manager
decides, kvpool's must decide the same, with the free-queue order and every
block table compared after every operation.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm.v1.core.kv_cache_manager", reason="vLLM is not installed beside kvpool")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from vllm_reference import VLLMReference  # noqa: E402

from tests.parity_traffic import Replayer, Scenario, family_of, generate, recorded_scenarios  # noqa: E402
from tests.test_vllm_recorded import FIXTURES, load_fixture  # noqa: E402

SCENARIOS = recorded_scenarios()


def _reference(sc: Scenario) -> VLLMReference:
    return VLLMReference(sc.num_blocks, sc.groups)


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.name)
def test_identical_decisions_checked_after_every_operation(scenario):
    """One driver, vLLM deciding, kvpool replaying each record as it is made."""
    live = dataclasses.replace(scenario, checkpoint_every=1)
    replayer = Replayer(live)
    for record in generate(live, _reference(live)):
        replayer.apply(record)
    assert replayer.decisions > live.steps


@pytest.mark.parametrize(
    "scenario",
    [dataclasses.replace(s, seed=s.seed + 1, name=s.name + "-b") for s in SCENARIOS[::3]],
    ids=lambda s: s.name,
)
def test_identical_decisions_on_unrecorded_seeds(scenario):
    replayer = Replayer(scenario)
    replayer.replay(generate(scenario, _reference(scenario)))


@pytest.mark.parametrize("family", sorted({family_of(s) for s in SCENARIOS}))
def test_recorded_fixtures_are_current(family):
    """The committed fixtures are what this vLLM decides for this driver's traffic today."""
    import vllm

    meta, recorded = load_fixture(FIXTURES / f"{family}.jsonl.gz")
    if meta["vllm_version"] != vllm.__version__:
        pytest.skip(f"fixtures were recorded with vLLM {meta['vllm_version']}, this is {vllm.__version__}")
    expected = [s for s in SCENARIOS if family_of(s) == family]
    assert [Scenario.from_dict(r["scenario"]) for r in recorded] == expected, (
        "the scenario list changed: rerun benchmarks/record_vllm_decisions.py"
    )
    for sc, rec in zip(expected, recorded):
        assert list(generate(sc, _reference(sc))) == rec["ops"], (
            f"{sc.name}: vLLM's decisions differ from the fixture: rerun benchmarks/record_vllm_decisions.py"
        )
