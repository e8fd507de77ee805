"""vLLM's --kv-events-config in kvpool's terms (kv_events.vllm_config), and what a BlockStored may carry (EventContent)."""

from __future__ import annotations

import json

import pytest

from kvpool.errors import ConfigError
from kvpool.kv_events.vllm_config import VLLM_DEFAULT_ENDPOINT, VllmEventsConfig, from_vllm_config
from kvpool.kv_events.wire import EventContent


def _config(**fields: object) -> str:
    return json.dumps(fields)


def test_the_whole_config_is_the_endpoints_and_the_publisher_options() -> None:
    text = _config(
        enable_kv_cache_events=True,
        publisher="zmq",
        endpoint="tcp://*:6000",
        replay_endpoint="tcp://*:6001",
        topic="kv",
        buffer_steps=5,
        hwm=7,
    )
    assert from_vllm_config(text) == VllmEventsConfig(
        endpoint="tcp://*:6000",
        replay_endpoint="tcp://*:6001",
        publisher_options={"topic": "kv", "buffer_steps": 5, "hwm": 7},
    )


def test_enabled_without_an_endpoint_is_vllms_default_on_every_interface() -> None:
    config = from_vllm_config(_config(enable_kv_cache_events=True))
    assert config.endpoint == VLLM_DEFAULT_ENDPOINT == "tcp://*:5557"
    assert config.replay_endpoint is None and config.publisher_options == {} and config.ignored == ()


@pytest.mark.parametrize(
    "text",
    [
        _config(),
        _config(enable_kv_cache_events=False, endpoint="tcp://*:6000"),
        _config(enable_kv_cache_events=True, publisher="null", endpoint="tcp://*:6000"),
    ],
)
def test_events_off_leave_the_flags_as_given(text: str) -> None:
    assert from_vllm_config(text) == VllmEventsConfig(endpoint=None, replay_endpoint=None)
    given = from_vllm_config(text, endpoint="bind:tcp://127.0.0.1:5557", replay_endpoint="tcp://127.0.0.1:5558")
    assert (given.endpoint, given.replay_endpoint) == ("bind:tcp://127.0.0.1:5557", "tcp://127.0.0.1:5558")


def test_a_flag_and_the_config_may_name_the_same_endpoint_but_not_two() -> None:
    text = _config(enable_kv_cache_events=True, endpoint="tcp://*:1", replay_endpoint="tcp://*:2")
    assert from_vllm_config(text, endpoint="tcp://*:1", replay_endpoint="tcp://*:2").endpoint == "tcp://*:1"
    assert from_vllm_config(_config(enable_kv_cache_events=True), endpoint="tcp://*:9").endpoint == "tcp://*:9"
    with pytest.raises(ConfigError, match=r"--kv-events-endpoint 'tcp://\*:3' and .* 'tcp://\*:1' disagree"):
        from_vllm_config(text, endpoint="tcp://*:3")
    with pytest.raises(ConfigError, match=r"--kv-events-replay-endpoint 'tcp://\*:4' .* disagree"):
        from_vllm_config(text, replay_endpoint="tcp://*:4")


def test_max_queue_size_is_read_and_reported_as_ignored() -> None:
    config = from_vllm_config(_config(enable_kv_cache_events=True, max_queue_size=10))
    assert config.ignored == ("max_queue_size",) and "max_queue_size" not in config.publisher_options


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("{nope", "--kv-events-config is not JSON"),
        ("[1, 2]", "must be a JSON object, got '[1, 2]'"),
        (_config(enable_kv_cache_events=True, endpoit="tcp://*:5557"), "unknown keys ['endpoit']"),
        (_config(enable_kv_cache_events=1), "must be true or false"),
        (_config(enable_kv_cache_events=True, publisher="kafka"), "'kafka'"),
    ],
)
def test_a_bad_config_is_refused_naming_the_value(text: str, words: str) -> None:
    with pytest.raises(ConfigError) as caught:
        from_vllm_config(text)
    assert words in str(caught.value)


@pytest.mark.parametrize(
    ("isolated", "include_token_ids", "content"),
    [
        (True, False, EventContent.HASHES),  # isolated tenants: nothing a subscriber could read a prompt from
        (True, True, EventContent.FULL),  # unless the operator trusts every subscriber
        (False, False, EventContent.FULL),  # shared tenants keep no secret from each other
        (False, True, EventContent.FULL),
    ],
)
def test_what_a_block_stored_may_carry_follows_tenant_isolation(
    isolated: bool, include_token_ids: bool, content: EventContent
) -> None:
    assert EventContent.for_tenants(isolated=isolated, include_token_ids=include_token_ids) is content
