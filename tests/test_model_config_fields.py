"""The config reader checks every field it reads, once, before any work proportional to it."""

from __future__ import annotations

import math
import re
import sys
import types
from pathlib import Path

import pytest

from kvpool import model_config
from kvpool.errors import ConfigError
from kvpool.estimates import estimate_parameters
from kvpool.model_config import (
    MAX_FIELD_VALUE,
    MAX_LAYERS,
    load_model_config,
    shipped_config_names,
    text_config_view,
)
from kvpool.model_layers import decoder_layers, layer_specs_from_config
from kvpool.planner import plan_kv_cache

SRC = Path(model_config.__file__).resolve().parent
LLAMA = load_model_config("llama-3.1-8b")


def test_every_field_read_has_a_rule() -> None:
    """The readers (config reader, estimates, planner) name no field the rule table does not know."""
    read = set()
    for name in ("model_config.py", "model_layers.py", "recurrent_state.py", "estimates.py", "planner.py"):
        text = (SRC / name).read_text()
        read |= set(re.findall(r'cfg\.get\("(\w+)"', text))
        read |= set(re.findall(r'cfg\["(\w+)"\]', text))
        for call in re.findall(r"_(?:pos_int|first_int|field)\(cfg, ([^)]*)\)", text):
            read |= set(re.findall(r'"(\w+)"', call))
    quantization = {"quant_method", "bits"}
    assert read - quantization <= set(model_config._FIELD_RULES), read - set(model_config._FIELD_RULES)


@pytest.mark.parametrize("name", shipped_config_names())
def test_shipped_configs_obey_the_rules(name: str) -> None:
    assert text_config_view(load_model_config(name))


class _StepBudget:
    """Counts the Python lines run while active; past ``limit`` it stops the code under test with an error.

    A count of steps, not seconds: the same on an idle machine and a loaded one.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.lines = 0

    def _trace(self, frame: types.FrameType, event: str, arg: object) -> object:
        if event == "line":
            self.lines += 1
            if self.lines > self.limit:
                raise AssertionError(f"more than {self.limit} lines run: work proportional to the value")
        return self._trace

    def __enter__(self) -> _StepBudget:
        sys.settrace(self._trace)
        return self

    def __exit__(self, *exc: object) -> None:
        sys.settrace(None)


@pytest.mark.parametrize("layers", [MAX_LAYERS + 1, 10**9, 1e12, 10**100])
def test_huge_layer_counts_are_refused_at_once(layers: float) -> None:
    for reader in (decoder_layers, layer_specs_from_config, estimate_parameters):
        # Refused before any work per layer: far fewer lines than the 4,097 layers of the smallest value.
        with pytest.raises(ConfigError, match="'num_hidden_layers' must be at most 4,096"), _StepBudget(2_000):
            reader({**LLAMA, "num_hidden_layers": layers})


def test_the_largest_allowed_values_still_work() -> None:
    assert len(decoder_layers({**LLAMA, "num_hidden_layers": MAX_LAYERS})) == MAX_LAYERS
    longest = {**LLAMA, "max_position_embeddings": MAX_FIELD_VALUE}
    assert plan_kv_cache(longest, gpu_memory_bytes="80GB").max_model_len == MAX_FIELD_VALUE


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("hidden_size", 4096.0, None),  # an integral float is an integer
        ("hidden_size", 4096.5, "'hidden_size' must be a positive integer, got 4096.5"),
        ("hidden_size", math.nan, "got nan"),
        ("vocab_size", MAX_FIELD_VALUE + 1, "'vocab_size' must be at most 4,294,967,296"),
        ("first_k_dense_replace", 0, None),  # index fields may be 0
        ("first_k_dense_replace", -1, "'first_k_dense_replace' must be an integer >= 0"),
        ("use_sliding_window", 0, "'use_sliding_window' must be true or false, got 0"),
        ("architectures", ["A", 1], "'architectures' must be a list of strings"),
        ("no_rope_layers", [1, True], "'no_rope_layers' must be a list of integers >= 0"),
        ("quantization_config", {"quant_method": "gptq", "bits": 0}, "'quantization_config.bits'"),
        ("text_config", 5, "'text_config' must be a JSON object, got 5"),
        ("mamba_head_dim", "auto", None),  # published files say "auto"
        ("mamba_head_dim", "big", "'mamba_head_dim' must be a positive integer, got 'big'"),
        ("layer_types", [10**9] * 200, "got [1000000000, 1000000000"),
    ],
)
def test_field_rules(field: str, value: object, message: str | None) -> None:
    config = {**LLAMA, field: value}
    if message is None:
        text_config_view(config)
    else:
        with pytest.raises(ConfigError, match=re.escape(message)) as info:
            text_config_view(config)
        assert len(str(info.value)) < 200  # a long value is cut, not printed whole


def test_text_config_fields_are_checked_too() -> None:
    wrapped = {"architectures": ["Wrapper"], "text_config": {**LLAMA, "num_key_value_heads": "8"}}
    with pytest.raises(ConfigError, match="'num_key_value_heads' must be a positive integer, got '8'"):
        layer_specs_from_config(wrapped)
