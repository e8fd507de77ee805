"""``kvpool serve``'s KV event flags: checked before the engine starts; what the events carry under tenants."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

pytest.importorskip("zmq")
import zmq.auth  # noqa: E402

from kvpool.cli.commands import cli  # noqa: E402
from kvpool.cli.serve import _events_setup  # noqa: E402
from kvpool.kv_events import CurveServer, EventContent  # noqa: E402


@pytest.fixture
def certs(tmp_path: Path) -> dict[str, str]:
    (tmp_path / "replica").mkdir()
    (tmp_path / "router").mkdir()
    _, secret = zmq.auth.create_certificates(tmp_path / "replica", "replica")
    public, _ = zmq.auth.create_certificates(tmp_path / "router", "router")
    return {"secret": str(secret), "clients": str(public), "missing": str(tmp_path / "nope.key_secret")}


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["--kv-events-endpoint", "tcp://0.0.0.0:5557"], "'tcp://0.0.0.0:5557' is ambiguous"),
        (["--kv-events-endpoint", "bind:127.0.0.1:5557"], "'bind:127.0.0.1:5557'"),
        (["--kv-events-endpoint", "tcp://*:0", "--kv-events-replay-endpoint", "connect:tcp://h:1"], "always bound"),
        (["--kv-events-include-token-ids"], "--kv-events-include-token-ids needs --kv-events-endpoint"),
        (["--kv-events-client-keys", "{clients}"], "--kv-events-client-keys needs --kv-events-endpoint"),
        (["--kv-events-endpoint", "tcp://*:0", "--kv-events-secret-key", "{secret}"], "go together"),
        (
            [
                "--kv-events-endpoint",
                "tcp://*:0",
                "--kv-events-secret-key",
                "{missing}",
                "--kv-events-client-keys",
                "{clients}",
            ],
            "nope.key_secret",
        ),
        (
            [
                "--kv-events-endpoint",
                "tcp://*:0",
                "--kv-events-secret-key",
                "{clients}",
                "--kv-events-client-keys",
                "{clients}",
            ],
            "holds a public key only",
        ),
    ],
)
def test_bad_event_flags_are_refused_before_the_engine_starts(certs, flags, words):
    result = CliRunner().invoke(cli, ["serve", *(f.format(**certs) for f in flags)])
    assert result.exit_code == 2, result.output
    assert words in result.output


@pytest.mark.parametrize(
    ("isolated", "include", "content"),
    [
        (True, False, EventContent.HASHES),  # the default: a tenant's prompts never leave in events
        (True, True, EventContent.FULL),  # the operator trusts every subscriber
        (False, False, EventContent.FULL),  # --no-tenant-isolation: clients' salts pass through anyway
    ],
)
def test_events_carry_prompts_only_when_tenants_share_or_the_operator_says_so(isolated, include, content):
    setup = _events_setup("bind:tcp://127.0.0.1:5557", None, None, None, include_token_ids=include, isolated=isolated)
    assert setup is not None and setup["content"] is content and setup["curve"] is None


def test_curve_keys_reach_the_publisher(certs):
    setup = _events_setup(
        "bind:tcp://127.0.0.1:5557",
        "tcp://127.0.0.1:5558",
        certs["secret"],
        certs["clients"],
        include_token_ids=False,
        isolated=True,
    )
    assert setup is not None and isinstance(setup["curve"], CurveServer)
    assert setup["curve"].clients == {zmq.auth.load_certificate(certs["clients"])[0]}
    assert _events_setup(None, None, None, None, include_token_ids=False, isolated=True) is None
