"""How far ``kvpool route`` trusts its replicas: passive health and retries, credentials in replica URLs.

A replica that fails fast (5xx at once, or connections reset) is always the least loaded and
would take most requests: its failed answers eject it, and a request it failed before any
byte reached the client is retried once elsewhere. A replica URL's password goes to the
replica and nowhere else.
"""

from __future__ import annotations

import base64
import contextlib
import logging
import socket
import threading
from collections.abc import Iterator

import httpx
import pytest

from kvpool.errors import ConfigError
from kvpool.router import MemoryIndex, RouteOptions, Router
from kvpool.tenancy import SaltPolicy
from tests.router.fakes import ByteTokenizer, FakeReplica, RouterThread, bound_socket, wait_for

SALTS = SaltPolicy.isolated(b"s" * 32)


def route(urls: list[str], **options: object) -> RouterThread:
    settings = RouteOptions(
        replicas=tuple(urls),
        tokenizer=ByteTokenizer(),
        keys=None,
        salts=SALTS,
        health_interval=0.1,
        **options,  # type: ignore[arg-type]  # RouteOptions' own fields, by name
    )
    return RouterThread(Router(settings, MemoryIndex()))


def ask(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


@pytest.fixture
def pair() -> Iterator[tuple[FakeReplica, FakeReplica]]:
    bad, good = FakeReplica("bad", SALTS).start(), FakeReplica("good", SALTS).start()
    yield bad, good
    for replica in (bad, good):
        replica.kill()


def test_a_replica_answering_500_at_once_is_ejected_and_its_requests_retried(
    pair: tuple[FakeReplica, FakeReplica],
) -> None:
    bad, good = pair
    router = route(
        [bad.url, good.url], eject_after=3, eject_time=600.0, eject_max_time=600.0
    )  # ejected for the whole test
    try:
        wait_for(lambda: all(r.up for r in router.router.replicas), "both replicas up")
        bad.fail_with = 500
        replies = [router.chat(ask(f"question {i}")) for i in range(40)]
        assert [r.status_code for r in replies] == [200] * 40  # each failure was retried on the good one
        assert {r.json()["replica"] for r in replies} == {"good"}
        assert bad.failed == 3  # three failed answers in a row, then out of rotation
        state = router.router.replicas[0]
        assert not state.up and state.ejected == 1
        described = router.client.get("/health").json()["replicas"][0]
        assert described["quarantined"] and "ejected" in described["last_error"]
        metrics = router.client.get("/metrics").text
        assert f'kvpool_router_server_errors_total{{replica="{bad.url}"}} 3' in metrics
        assert f'kvpool_router_ejections_total{{replica="{bad.url}"}} 1' in metrics
    finally:
        router.stop()


def test_an_ejected_replica_is_tried_again_after_its_back_off(pair: tuple[FakeReplica, FakeReplica]) -> None:
    bad, good = pair
    router = route([bad.url, good.url], eject_after=1, eject_time=0.2, eject_max_time=0.4)
    state = router.router.replicas[0]
    try:
        wait_for(lambda: all(r.up for r in router.router.replicas), "both replicas up")
        bad.fail_with = 503
        sent = 0
        while state.ejected < 2:  # ejected, back after 0.2 s, failing again: ejected again, for twice as long
            assert router.chat(ask(f"q{sent}")).status_code == 200
            sent += 1
            if not state.up:
                wait_for(lambda: state.up, "the back-off to end and the health check to bring it back")
            assert sent < 200
        assert state.ejections == 2
        bad.fail_with = None  # healed: once back, it answers, and the back-off starts over
        wait_for(lambda: state.up, "the replica back")
        wait_for(lambda: router.chat(ask("again")).json()["replica"] == "bad", "a request to reach it")
        assert state.ejections == 0 and state.consecutive_failures == 0
    finally:
        router.stop()


def test_a_failed_request_is_retried_once_and_never_after_bytes_reached_the_client() -> None:
    fleet = [FakeReplica(f"r{i}", SALTS).start() for i in range(3)]
    router = route([r.url for r in fleet], eject_after=100)
    try:
        wait_for(lambda: all(r.up for r in router.router.replicas), "the replicas up")
        for replica in fleet:
            replica.fail_with = 500
        reply = router.chat(ask("anyone?"))
        assert reply.status_code == 500  # the last failure, passed on as it came
        assert sum(r.failed for r in fleet) == 2  # the first try and one retry, not the third replica
        for replica in fleet:
            replica.fail_with = None
        # a stream cut after its first chunk is not moved: the client sees it end there
        hold = threading.Event()
        for replica in fleet:
            replica.hold_stream = hold  # each stream stops after its first chunk
        body = {"model": "fake", "messages": ask("stream"), "stream": True}
        with router.client.stream("POST", "/v1/chat/completions", json=body) as response:
            assert response.status_code == 200
            chunks = response.iter_raw()
            first = next(chunks)
            holder = next(r for r in fleet if r.url == response.headers["x-kvpool-replica"])
            assert holder.name.encode() in first
            asked = [len(r.authorizations) for r in fleet]  # generation requests each replica has seen
            holder.kill()  # the replica dies mid-stream
            rest = b""
            with contextlib.suppress(httpx.HTTPError):  # the client sees its stream cut short
                for chunk in chunks:
                    rest += chunk
        assert b"[DONE]" not in rest and b'"usage"' not in rest
        assert [len(r.authorizations) for r in fleet] == asked  # nothing was sent anywhere again
        hold.set()
    finally:
        router.stop()
        for replica in fleet:
            if replica._thread is not None and replica._thread.is_alive():
                replica.kill()


class ResettingReplica:
    """Answers ``GET /health`` with 200, and resets every other request's connection (no byte answered).

    ``resets`` counts the generation requests reset.
    """

    def __init__(self) -> None:
        self.sock = bound_socket()  # port 0, read back
        self.sock.listen(16)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.resets = 0
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return  # closed
            with conn:
                head = b""
                while b"\r\n\r\n" not in head:
                    data = conn.recv(65536)
                    if not data:
                        break
                    head += data
                if head.startswith(b"GET /health"):
                    body = b'{"status": "ok"}'
                    conn.sendall(
                        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nconnection: close\r\n"
                        b"content-length: %d\r\n\r\n%s" % (len(body), body)
                    )
                    continue
                self.resets += head.startswith(b"POST ")  # (its GET /kv-events is reset too, uncounted)
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")

    def close(self) -> None:
        self.sock.close()


def test_connection_resets_count_against_a_replica_like_5xx_answers() -> None:
    resetting, good = ResettingReplica(), FakeReplica("good", SALTS).start()
    router = route([resetting.url, good.url], eject_after=2, eject_time=600.0, eject_max_time=600.0)
    try:
        wait_for(lambda: all(r.up for r in router.router.replicas), "both replicas up")
        replies = [router.chat(ask(f"q{i}")) for i in range(12)]
        assert [r.status_code for r in replies] == [200] * 12
        assert resetting.resets == 2 and router.router.replicas[0].ejected == 1
        assert not router.router.replicas[0].up
    finally:
        router.stop()
        resetting.close()
        good.kill()


def test_a_replica_url_password_goes_to_the_replica_and_is_shown_nowhere(caplog: pytest.LogCaptureFixture) -> None:
    replica = FakeReplica("r0", SALTS).start()
    secret_url = replica.url.replace("http://", "http://ops:pa55word@")
    with caplog.at_level(logging.DEBUG, logger="kvpool.route"):
        router = route([secret_url])
        try:
            wait_for(lambda: router.router.replicas[0].up, "the replica up")
            reply = router.chat(ask("hi"))
            assert reply.status_code == 200
            # the credentials went with the request, as HTTP basic authentication
            assert replica.authorizations[-1] == "Basic " + base64.b64encode(b"ops:pa55word").decode()
            shown = {
                "header": reply.headers["x-kvpool-replica"],
                "health": router.client.get("/health").text,  # the router's loopback: with the replicas
                "verbose": router.client.get("/health", params={"verbose": "1"}).text,
                "metrics": router.client.get("/metrics").text,
            }
            replica.kill()
            wait_for(lambda: not router.router.replicas[0].up, "the replica down")
            shown["no replica"] = router.chat(ask("hi")).text
        finally:
            router.stop()
    shown["log"] = "\n".join(record.getMessage() for record in caplog.records)
    assert "pa55word" not in repr(router.router.replicas)
    for where, text in shown.items():
        assert "pa55word" not in text, where
    assert shown["header"] == replica.url.replace("http://", "http://***@")
    assert "***@127.0.0.1" in shown["health"] and "***@127.0.0.1" in shown["log"]


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ("http://127.0.0.1:0", "'http://127.0.0.1:0'"),
        ("http://127.0.0.1:99999", "'http://127.0.0.1:99999'"),
        ("http://127.0.0.1:1,events=tcp://127.0.0.1:99999,block-size=16", "tcp://127.0.0.1:99999"),
        ("http://127.0.0.1:1,events=tcp://127.0.0.1:0,block-size=16", "tcp://127.0.0.1:0"),
        ("http://127.0.0.1:1,events=tcp://127.0.0.1:5557,block-size=99999999999", "99999999999"),
        ("http://127.0.0.1:1,events=tcp://127.0.0.1:5557,block-size=16,block_size=32", "'block_size'"),
        ("http://ops:pa55@127.0.0.1:99999", "'http://***@127.0.0.1:99999'"),
    ],
)
def test_the_command_refuses_a_bad_replica_in_one_line_naming_it(text: str, named: str) -> None:
    from click.testing import CliRunner

    from kvpool.cli.commands import cli

    result = CliRunner().invoke(cli, ["route", "--no-tenant-isolation", "--replica", text])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line]
    assert len(lines) == 1 and lines[0].startswith("kvpool route: error:") and named in lines[0], result.output
    assert "pa55" not in result.output


def test_the_same_replica_twice_is_refused_by_the_command_and_the_options() -> None:
    from click.testing import CliRunner

    from kvpool.cli.commands import cli

    args = ["route", "--no-tenant-isolation", "--replica", "http://127.0.0.1:8001", "--replica", "http://LOCALHOST:9"]
    args += ["--replica", "http://127.0.0.1:8001/"]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 2 and "replica http://127.0.0.1:8001 is named twice" in result.output, result.output
    with pytest.raises(ConfigError, match="named twice"):
        RouteOptions(
            replicas=("http://h:80", "http://H"), tokenizer=None, keys=None, salts=SALTS
        )  # port 80 is http's own


def test_bad_ejection_settings_and_an_absurd_block_size_are_refused_by_name() -> None:
    for field, value in (("eject_after", 0), ("eject_time", float("nan")), ("eject_max_time", -1.0)):
        with pytest.raises(ConfigError, match=field):
            RouteOptions(replicas=("http://h:1",), tokenizer=None, keys=None, salts=SALTS, **{field: value})
    with pytest.raises(ConfigError, match="eject_max_time"):
        RouteOptions(replicas=("http://h:1",), tokenizer=None, keys=None, salts=SALTS, eject_time=60, eject_max_time=5)
    with pytest.raises(ConfigError, match="approx_block_size .*1000000"):
        RouteOptions(replicas=("http://h:1",), tokenizer=None, keys=None, salts=SALTS, approx_block_size=10**6)


def test_a_deeply_nested_config_file_is_one_line_naming_the_file(tmp_path: object) -> None:
    from pathlib import Path

    from click.testing import CliRunner

    from kvpool.cli.commands import cli

    assert isinstance(tmp_path, Path)
    deep = tmp_path / "deep.toml"
    deep.write_text("[defaults]\nseed = " + "[" * 50_000 + "]" * 50_000 + "\n")
    wide = tmp_path / "wide.toml"  # nested, but not past the parser: named by its kind, not its repr
    wide.write_text(
        '[[replica]]\nurl = "http://127.0.0.1:1"\nblock_size = 16\nevents = ' + "[" * 300 + "]" * 300 + "\n"
    )
    for path, named in ((deep, "nested too deeply"), (wide, "got a list (1 items)")):
        result = CliRunner().invoke(cli, ["route", "--no-tenant-isolation", "--config", str(path)])
        lines = [line for line in result.output.splitlines() if line]
        assert result.exit_code == 2 and len(lines) == 1 and named in lines[0], result.output
