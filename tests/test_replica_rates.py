"""ReplicaRates: checked fields, the JSON round trip, bad bodies refused by name, rates from a profile."""

import json
import math

import pytest

from kvpool.cost_model import CostProfile, load_profile
from kvpool.errors import ConfigError
from kvpool.replica_rates import NOT_MEASURED_YET, ReplicaRates, StepWindow


def _rates(**changes: object) -> dict[str, object]:
    fields: dict[str, object] = {
        "prefill_tokens_per_s": 20_000.0,
        "decode_step_s": 0.012,
        "step_overhead_s": 0.004,
        "tier_load_tokens_per_s": {"CPU": 250_000.0},
        "source": "measured",
    }
    fields.update(changes)
    return fields


def test_json_round_trip_keeps_every_field() -> None:
    rates = ReplicaRates(**_rates())
    body = json.dumps(rates.to_json()).encode()
    back = ReplicaRates.from_json(body, "GET http://r/rates")
    assert back == rates
    assert hash(back) == hash(rates)
    assert back is not None and back.tier_load_tokens_per_s == {"CPU": 250_000.0}


def test_optional_fields_default_and_the_mapping_is_a_copy() -> None:
    tiers = {"STORAGE": 1000.0}
    rates = ReplicaRates(prefill_tokens_per_s=5, decode_step_s=0, tier_load_tokens_per_s=tiers, source="flag")
    tiers["CPU"] = 1.0
    assert dict(rates.tier_load_tokens_per_s) == {"STORAGE": 1000.0}
    assert rates.step_overhead_s == 0.0 and isinstance(rates.prefill_tokens_per_s, float)
    minimal = ReplicaRates.from_json({"prefill_tokens_per_s": 1, "decode_step_s": 0.5, "source": "flag"}, "here")
    assert minimal is not None and minimal.tier_load_tokens_per_s == {} and minimal.step_overhead_s == 0.0


def test_none_yet_reads_as_unknown() -> None:
    assert ReplicaRates.from_json({"source": NOT_MEASURED_YET}, "here") is None
    with pytest.raises(ConfigError, match="carries no figures"):
        ReplicaRates.from_json({"source": NOT_MEASURED_YET, "decode_step_s": 1.0}, "here")
    with pytest.raises(ConfigError, match="none yet"):
        ReplicaRates(**_rates(source=NOT_MEASURED_YET))


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"prefill_tokens_per_s": 0}, "prefill_tokens_per_s"),
        ({"prefill_tokens_per_s": math.inf}, "prefill_tokens_per_s"),
        ({"prefill_tokens_per_s": True}, "prefill_tokens_per_s"),
        ({"decode_step_s": -1}, "decode_step_s"),
        ({"decode_step_s": "fast"}, "decode_step_s"),
        ({"step_overhead_s": math.nan}, "step_overhead_s"),
        ({"tier_load_tokens_per_s": {"CPU": 0}}, "tier_load_tokens_per_s\\['CPU'\\]"),
        ({"tier_load_tokens_per_s": {"": 1.0}}, "medium name"),
        ({"tier_load_tokens_per_s": [1.0]}, "tier_load_tokens_per_s"),
        ({"source": ""}, "source"),
        ({"source": 3}, "source"),
    ],
)
def test_bad_fields_are_refused_by_name(changes: dict[str, object], named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        ReplicaRates(**_rates(**changes))
    with pytest.raises(ConfigError, match=f"GET http://r/rates: .*{named}"):
        ReplicaRates.from_json(_rates(**changes), "GET http://r/rates")


@pytest.mark.parametrize(
    ("body", "said"),
    [
        (b"{not json", "not JSON"),
        (b"\xff\xfe", "not JSON"),
        ("[1, 2]", "JSON object, got list"),
        ({**_rates(), "speed": 1}, "unknown fields \\['speed'\\]"),
        ({"decode_step_s": 1.0, "source": "measured"}, "missing the fields \\['prefill_tokens_per_s'\\]"),
    ],
)
def test_bad_bodies_are_refused_naming_where(body: object, said: str) -> None:
    with pytest.raises(ConfigError, match=f"^replica r: .*{said}"):
        ReplicaRates.from_json(body, "replica r")


def test_from_profile_reads_the_chunk_rate_and_the_decode_step() -> None:
    profile = CostProfile.flat(step_overhead_s=0.005, prefill_s_per_token=1e-4, decode_s_per_seq=0.001, name="toy")
    rates = ReplicaRates.from_profile(profile, decode_seqs=8)
    assert rates.prefill_tokens_per_s == pytest.approx(10_000.0)
    assert rates.decode_step_s == pytest.approx(0.005 + 8 * 0.001)
    assert rates.step_overhead_s == 0.005
    assert rates.source == "profile:toy" and rates.tier_load_tokens_per_s == {}
    shipped = load_profile("llama-3.1-8b-h100")
    small, full = (ReplicaRates.from_profile(shipped, chunk_tokens=n) for n in (16, 8192))
    assert full.prefill_tokens_per_s >= small.prefill_tokens_per_s > 0  # a full chunk pays less a token


def test_from_profile_refuses_bad_arguments_and_a_free_prefill() -> None:
    profile = CostProfile.flat(step_overhead_s=0, prefill_s_per_token=1e-4, decode_s_per_seq=0)
    with pytest.raises(ConfigError, match="chunk_tokens must be an integer >= 1, got 0"):
        ReplicaRates.from_profile(profile, chunk_tokens=0)
    with pytest.raises(ConfigError, match="decode_seqs"):
        ReplicaRates.from_profile(profile, decode_seqs=True)
    free = CostProfile.flat(step_overhead_s=0, prefill_s_per_token=0, decode_s_per_seq=0, name="free")
    with pytest.raises(ConfigError, match="free prefills at 0 seconds"):
        ReplicaRates.from_profile(free)


def test_step_window_measures_prefill_and_decode_from_recent_steps() -> None:
    window = StepWindow(size=4)
    assert window.rates() is None
    window.note(0, 8, 0.02)
    assert window.rates() is None  # no prefill yet: no rate
    window.note(1000, 8, 0.12)  # 0.1 s of prefill on top of the 0.02 s decode step
    rates = window.rates({"CPU": 5e5})
    assert rates is not None and rates.source == "measured"
    assert rates.prefill_tokens_per_s == pytest.approx(10_000.0)
    assert rates.decode_step_s == pytest.approx(0.02)
    assert rates.tier_load_tokens_per_s == {"CPU": 5e5}
    for _ in range(4):  # the window forgets: only these prefill-only steps remain
        window.note(500, 0, 0.1)
    later = window.rates()
    assert later is not None and later.prefill_tokens_per_s == pytest.approx(5000.0) and later.decode_step_s == 0.0
    with pytest.raises(ConfigError, match="size must be an integer >= 1, got 0"):
        StepWindow(0)
