"""The engine and its commands open a disk or Redis tier only with a secret, or on the operator's explicit word.

The rule is :func:`kvpool.tiers.store.check_tier_trust` (``tests/tiers/test_tier_trust.py``);
here: ``EngineOptions`` asks it before anything loads, and ``generate``, ``chat`` and ``serve``
map ``--kv-tier-unauthenticated`` onto ``kv_tier_unauthenticated``.
"""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from kvpool.cli.commands import cli
from kvpool.engine.startup import EngineOptions
from kvpool.errors import ConfigError

pytestmark = pytest.mark.engine

SHARED = ["disk:/tmp/kvpool-trust:1MiB", "redis://127.0.0.1:6379/0"]


@pytest.mark.parametrize("spec", SHARED)
def test_engine_options_refuse_a_shared_tier_without_a_secret(spec):
    with pytest.raises(ConfigError, match="without a secret.*--kv-tier-secret-file.*--kv-tier-unauthenticated"):
        EngineOptions(model="m", kv_tiers=("cpu:1MiB", spec))


@pytest.mark.parametrize("spec", SHARED)
def test_engine_options_take_a_secret_or_the_explicit_word(spec, tmp_path):
    assert EngineOptions(model="m", kv_tiers=(spec,), kv_tier_secret_file=tmp_path / "s").kv_tier_secret_file
    assert EngineOptions(model="m", kv_tiers=(spec,), kv_tier_unauthenticated=True).kv_tier_unauthenticated
    assert not EngineOptions(model="m", kv_tiers=("cpu:1MiB",)).kv_tier_unauthenticated  # private: no secret


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"kv_tiers": ("cpu:1MiB",), "kv_tier_unauthenticated": True}, "no KV tier is shared"),
        ({"kv_tier_unauthenticated": True}, "no KV tier is shared"),
        ({"kv_tiers": (SHARED[0],), "kv_tier_unauthenticated": "no"}, "must be true or false, got 'no'"),
        ({"kv_tiers": (SHARED[0],), "kv_tier_unauthenticated": True, "kv_tier_secret_file": "/s"}, "both given"),
    ],
)
def test_engine_options_refuse_an_unauthenticated_word_that_says_nothing_true(fields, match):
    with pytest.raises(ConfigError, match=match):
        EngineOptions(model="m", **fields)


@pytest.mark.parametrize("command", ["generate", "chat", "serve"])
def test_the_commands_refuse_a_shared_tier_without_a_secret_before_loading(command, tmp_path):
    prompt = ["w1"] if command == "generate" else []
    args = [command, *prompt, "--model", str(tmp_path / "no-model"), "--kv-tier", f"disk:{tmp_path}:1MiB"]
    result = CliRunner().invoke(cli, args, input="")
    assert result.exit_code == 2, result.output
    assert "without a secret" in result.stderr and "--kv-tier-unauthenticated" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("command", ["generate", "chat", "serve"])
def test_the_commands_map_the_flag_to_the_engine_option(command, monkeypatch, tmp_path):
    from kvpool.cli import shared_flags

    seen = {}

    def engine_options(kw):
        seen.update(kw)
        raise ConfigError("stop here")

    monkeypatch.setattr(shared_flags, "engine_options", engine_options)
    prompt = ["w1"] if command == "generate" else []
    args = [command, *prompt, "--kv-tier", f"disk:{tmp_path}:1MiB", "--kv-tier-unauthenticated"]
    result = CliRunner().invoke(cli, args, input="")
    assert "stop here" in result.stderr
    assert seen["kv_tier_unauthenticated"] is True


def test_engine_options_parse_the_tier_specs_once(monkeypatch):
    """The specs are parsed once, into ``kv_tier_targets``, which the engine's start-up opens as they are."""
    from kvpool.engine import startup
    from kvpool.tiers import CpuTarget

    calls = []
    real = startup.parse_specs
    monkeypatch.setattr(startup, "parse_specs", lambda specs: calls.append(tuple(specs)) or real(specs))
    options = EngineOptions(model="smollm2-135m", kv_tiers=["cpu:1MiB"])
    assert calls == [("cpu:1MiB",)]
    assert options.kv_tier_targets == (CpuTarget(2**20),)
