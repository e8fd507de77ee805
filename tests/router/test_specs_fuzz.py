"""Replica specs under Hypothesis: anything is a spec or a one-line ConfigError, never another exception.

The text of ``--replica`` and the values of a ``[[replica]]`` table (any TOML value,
nested) go through the parser; a refusal names the value it refuses and never shows a
password that was in the URL.
"""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.errors import ConfigError
from kvpool.router.replica_config import ReplicaSpec, build_spec, parse_replica

KEYS = ["events", "replay", "block-size", "block_size", "hash", "seed", "block-hash", "num-blocks", "bogus"]
PASSWORD = "Zq9pa55"  # in every URL below that has credentials: never in an error

hosts = st.sampled_from(["127.0.0.1", "h", "[::1]", "10.0.0.5", "", "ops:" + PASSWORD + "@127.0.0.1"])
ports = st.one_of(st.integers(-5, 70000).map(str), st.sampled_from(["", "x", "٣", "0", "65535", "99999"]))
urls = st.builds(
    lambda scheme, host, port, tail: f"{scheme}://{host}{':' + port if port else ''}{tail}",
    st.sampled_from(["http", "https", "ftp", "tcp"]),
    hosts,
    ports,
    st.sampled_from(["", "/", "/v1", "?q", "#f", " ", "\n"]),
)
endpoints = st.one_of(
    st.builds(
        lambda scheme, host, port: f"{scheme}://{host}:{port}",
        st.sampled_from(["tcp", "ipc", "inproc", "udp"]),
        st.sampled_from(["*", "127.0.0.1", "0.0.0.0", "", "h"]),
        st.one_of(st.integers(-1, 70000).map(str), st.sampled_from(["", "x", "²"])),
    ),
    st.sampled_from(["none", "ipc://", "ipc:///tmp/e", "tcp://h"]),
)
values = st.one_of(
    endpoints,
    st.integers(-(2**70), 2**70).map(str),
    st.sampled_from(["16", "128", "0", "-1", "1e3", "٣", "9" * 5000, "sha256", "sha256_cbor", "kvpool_sha256"]),
    st.sampled_from(["int64", "bytes", "md5", ""]),
    st.text(max_size=20),
)
pairs = st.lists(st.tuples(st.sampled_from(KEYS), values), max_size=6)
toml_values: st.SearchStrategy[Any] = st.recursive(
    st.one_of(st.integers(-(2**63), 2**63 - 1), st.booleans(), st.floats(), st.text(max_size=10), values),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=5), inner, max_size=3)),
    max_leaves=20,
)


def _refused_well(error: ConfigError) -> str:
    message = str(error)
    assert "\n" not in message and message, message  # one line
    assert PASSWORD not in message, message
    return message


@settings(max_examples=400, deadline=None)
@given(urls, pairs, st.text(max_size=30))
def test_any_replica_text_is_a_spec_or_a_config_error(url: str, fields: list[tuple[str, str]], junk: str) -> None:
    for text in (",".join([url, *(f"{k}={v}" for k, v in fields)]), url + "," + junk, junk):
        try:
            spec = parse_replica(text)
        except ConfigError as error:
            _refused_well(error)
        else:
            assert isinstance(spec, ReplicaSpec)
            assert PASSWORD not in repr(spec) and PASSWORD not in spec.name
            if spec.events is not None:
                assert 1 <= spec.events.block_size <= 2**16


@settings(max_examples=300, deadline=None)
@given(
    st.sampled_from(["http://127.0.0.1:8000", f"http://ops:{PASSWORD}@h:1"]),
    st.dictionaries(st.sampled_from(KEYS), toml_values, max_size=5),
)
def test_any_table_is_a_spec_or_a_config_error(url: str, table: dict[str, Any]) -> None:
    try:
        build_spec(url, table)
    except ConfigError as error:
        _refused_well(error)


@settings(max_examples=200, deadline=None)
@given(
    st.sampled_from(["block-size", "num-blocks"]),
    st.one_of(
        st.integers(-(2**40), 0).map(str), st.integers(2**16 + 1, 2**62).map(str), st.sampled_from(["x", "1.5", "٣"])
    ),
)
def test_a_bad_number_is_refused_naming_it(key: str, value: str) -> None:
    base = "http://127.0.0.1:1,events=tcp://127.0.0.1:5557,block-size=16"
    text = f"{base},{key}={value}" if key == "num-blocks" else base.replace("16", value)
    if key == "num-blocks" and value.isascii() and value.isdigit():
        return  # any positive count of blocks is one (the index caps its entries)
    try:
        parse_replica(text)
    except ConfigError as error:
        assert value in _refused_well(error) and key in str(error)
    else:
        raise AssertionError(f"{text!r} was accepted")
