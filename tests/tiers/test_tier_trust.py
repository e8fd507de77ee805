"""A shared tier (disk, Redis) is opened with a secret, or only on the operator's explicit word.

Without a secret an entry's checksum (XXH3-128 or CRC-32) is recomputable by anyone, so whoever
writes to the directory or the Redis server could plant KV the engine serves. The one rule is
:func:`kvpool.tiers.store.check_tier_trust`; the vLLM connector's options ask it here, the
engine's options and commands in ``tests/engine/test_tier_trust.py``.
"""

from __future__ import annotations

import pytest

from kvpool.errors import ConfigError
from kvpool.integrations.vllm.plan import ConnectorOptions
from kvpool.tiers import BACKENDS, TierKind, check_tier_trust, parse_specs

DISK = "disk:/tmp/kvpool-trust:1GiB"
REDIS = "redis://127.0.0.1:6379/0"
NAMES = {"secret_name": "the_secret", "unauthenticated_name": "the_flag"}


def test_the_registry_says_which_tiers_are_shared():
    assert {kind for kind, backend in BACKENDS.items() if backend.shared} == {TierKind.DISK, TierKind.REDIS}


@pytest.mark.parametrize("specs", [[DISK], [REDIS], ["cpu:1MiB", DISK, REDIS]])
def test_a_shared_tier_without_a_secret_is_refused_naming_both_ways_out(specs):
    targets = parse_specs(specs)
    with pytest.raises(ConfigError, match="without a secret") as info:
        check_tier_trust(targets, secret=False, unauthenticated=False, **NAMES)
    message = str(info.value)
    assert "the_secret" in message and "the_flag" in message and "damage, not tampering" in message
    for target in targets:
        assert (target.kind.value in message) is BACKENDS[target.kind].shared


@pytest.mark.parametrize("specs", [[DISK], [REDIS], ["cpu:1MiB", REDIS]])
def test_a_shared_tier_opens_with_a_secret_or_with_the_explicit_word(specs):
    targets = parse_specs(specs)
    assert check_tier_trust(targets, secret=True, unauthenticated=False, **NAMES) is False
    assert check_tier_trust(targets, secret=False, unauthenticated=True, **NAMES) is True


def test_the_cpu_tier_is_private_and_needs_no_secret():
    assert check_tier_trust(parse_specs(["cpu:1MiB"]), secret=False, unauthenticated=False, **NAMES) is False
    assert check_tier_trust((), secret=False, unauthenticated=False, **NAMES) is False


@pytest.mark.parametrize(
    ("specs", "secret", "unauthenticated", "match"),
    [
        ([DISK], True, True, "the_flag and the_secret are both given"),
        (["cpu:1MiB"], False, True, "the_flag is given, but no KV tier is shared"),
        ([], False, True, "the_flag is given, but no KV tier is shared"),
        ([DISK], False, "yes", "the_flag must be true or false, got 'yes'"),
        ([DISK], False, 1, "the_flag must be true or false, got 1"),
    ],
)
def test_an_unauthenticated_word_that_says_nothing_true_is_refused(specs, secret, unauthenticated, match):
    with pytest.raises(ConfigError, match=match):
        check_tier_trust(parse_specs(specs), secret=secret, unauthenticated=unauthenticated, **NAMES)


# -- the vLLM connector's options ask the rule ---------------------------------------------------


@pytest.mark.parametrize("specs", [[DISK], ["cpu:1MiB", REDIS]])
def test_the_connector_refuses_a_shared_tier_without_a_secret(specs):
    with pytest.raises(ConfigError, match="'secret_file'.*'unauthenticated'"):
        ConnectorOptions.from_extra_config({"tiers": specs})


def test_the_connector_takes_a_secret_or_the_explicit_word():
    signed = ConnectorOptions.from_extra_config({"tiers": [DISK], "secret_file": "/etc/kvpool/tier.secret"})
    assert signed.secret_file == "/etc/kvpool/tier.secret" and not signed.unauthenticated
    open_ = ConnectorOptions.from_extra_config({"tiers": ["cpu:1MiB", REDIS], "unauthenticated": True})
    assert open_.unauthenticated and open_.secret_file is None
    assert not ConnectorOptions.from_extra_config({"tiers": ["cpu:1MiB"]}).unauthenticated


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ({"tiers": [DISK], "unauthenticated": "true"}, "'unauthenticated' must be true or false, got 'true'"),
        ({"tiers": ["cpu:1MiB"], "unauthenticated": True}, "no KV tier is shared"),
        ({"tiers": [DISK], "unauthenticated": True, "secret_file": "/s"}, "both given"),
    ],
)
def test_the_connector_refuses_an_unauthenticated_word_naming_it(extra, match):
    with pytest.raises(ConfigError, match=match):
        ConnectorOptions.from_extra_config(extra)
