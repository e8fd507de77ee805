"""The cost model: profile arithmetic, the built-in profiles, and bad profiles refused by the field's name."""

from __future__ import annotations

import json

import pytest

from kvpool.cost_model import CostProfile, builtin_profiles, load_profile
from kvpool.errors import ConfigError

PROFILE = CostProfile(
    name="test",
    source="written in this test",
    step_overhead_s=0.01,
    prefill_s_per_token=((16, 2e-4), (256, 1e-4)),
    decode_s_per_seq=1e-3,
    s_per_context_token=1e-6,
    kv_bytes_per_token=1000,
)


def test_step_seconds_adds_overhead_prefill_decode_and_context():
    # 136 prefill tokens sit halfway between the points: 1.5e-4 s per token
    assert PROFILE.step_seconds(136, 3, context_tokens=500) == pytest.approx(0.01 + 136 * 1.5e-4 + 3e-3 + 5e-4)
    assert PROFILE.prefill_rate(1) == 2e-4  # flat below the first point
    assert PROFILE.prefill_rate(10_000) == 1e-4  # and past the last
    assert PROFILE.step_seconds(0, 0) == 0.01


def test_round_trip_through_json(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(json.dumps(PROFILE.to_dict()))
    assert load_profile(str(path)) == PROFILE


def test_every_builtin_profile_loads_and_names_its_source():
    assert "llama-3.1-8b-h100" in builtin_profiles()
    for name in builtin_profiles():
        profile = load_profile(name)
        assert profile.name == name
        assert len(profile.source) > 20


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"step_overhead_s": -1}, "step_overhead_s"),
        ({"decode_s_per_seq": float("nan")}, "decode_s_per_seq"),
        ({"s_per_context_token": "1"}, "s_per_context_token"),
        ({"kv_bytes_per_token": 0}, "kv_bytes_per_token"),
        ({"prefill_s_per_token": []}, "prefill_s_per_token"),
        ({"prefill_s_per_token": [[32, 1e-4], [16, 1e-4]]}, "prefill_s_per_token"),
        ({"prefill_s_per_token": [[0, 1e-4]]}, "prefill_s_per_token"),
        ({"name": ""}, "name"),
        ({"surprise": 1}, "surprise"),
    ],
)
def test_bad_profiles_are_refused_naming_the_field(change, field):
    with pytest.raises(ConfigError, match=field):
        CostProfile.from_dict(PROFILE.to_dict() | change)


def test_a_missing_field_is_named(tmp_path):
    data = PROFILE.to_dict()
    del data["decode_s_per_seq"]
    path = tmp_path / "p.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match="decode_s_per_seq"):
        load_profile(str(path))


def test_an_unknown_name_lists_the_builtin_profiles():
    with pytest.raises(ConfigError, match="llama-3.1-8b-h100"):
        load_profile("no-such-profile")
