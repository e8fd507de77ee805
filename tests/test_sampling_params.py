"""``SamplingParams``: one torch-free home for the sampling fields and their ranges, which the OpenAI layer builds.

A bad value of every checked field is refused naming that field, both by ``SamplingParams`` itself and, through
``parse_generation``, as a 400 whose ``param`` is the body's field. The module imports without torch: it is run
in a fresh interpreter in which torch, transformers and numpy cannot be imported.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from typing import Any

import pytest

from kvpool import sampling_params
from kvpool.errors import ConfigError, InvalidTokenError, KVPoolError
from kvpool.openai_http import protocol
from kvpool.openai_http.protocol import APIError, GenerationEndpoint, parse_generation
from kvpool.sampling_params import MAX_LOGPROBS, SamplingParams, field_at_fault
from tests.helpers import without_modules

HEAVY = ("torch", "transformers", "numpy")

# Any import of a heavy module says so on stderr, then fails.
PRELUDE = without_modules(*HEAVY)


def _run_without_torch(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", PRELUDE + code], capture_output=True, text=True, timeout=120)


def test_the_module_works_with_torch_blocked() -> None:
    done = _run_without_torch(
        "from kvpool.errors import ConfigError\n"
        "from kvpool.sampling_params import SamplingParams\n"
        "params = SamplingParams(max_tokens=4, temperature=0.5, seed=3, stop=('x',), stop_token_ids=[7])\n"
        "assert (params.max_tokens, params.seed, params.stop, params.stop_token_ids) == (4, 3, ('x',), (7,))\n"
        "assert not params.greedy and SamplingParams().greedy\n"
        "try:\n"
        "    SamplingParams(top_p=2)\n"
        "except ConfigError as exc:\n"
        "    print('REFUSED', exc)\n"
    )
    assert done.returncode == 0 and "IMPORTED" not in done.stderr, done.stderr
    assert "REFUSED top_p must be in (0, 1], got 2" in done.stdout


def test_the_openai_layer_builds_it_with_torch_blocked() -> None:
    done = _run_without_torch(
        "from kvpool.openai_http.protocol import GenerationEndpoint, parse_generation\n"
        "gen = parse_generation(GenerationEndpoint.COMPLETIONS, {'prompt': 'hi', 'top_k': -1, 'seed': 5})\n"
        "print(type(gen.sampling).__module__, gen.sampling.top_k, gen.sampling.seed)\n"
    )
    assert done.returncode == 0 and "IMPORTED" not in done.stderr, done.stderr
    assert done.stdout.split() == ["kvpool.sampling_params", "0", "5"]


# One bad value per checked field (and the error kind it raises).
BAD: dict[str, tuple[dict[str, Any], type[KVPoolError]]] = {
    "max_tokens": ({"max_tokens": 0}, ConfigError),
    "temperature": ({"temperature": -0.5}, ConfigError),
    "top_p": ({"top_p": 0.0}, ConfigError),
    "top_k": ({"top_k": -1}, ConfigError),
    "seed": ({"seed": 2**63}, ConfigError),
    "stop_token_ids": ({"stop_token_ids": [3, 2**32]}, InvalidTokenError),
    "ignore_eos": ({"ignore_eos": 1}, ConfigError),
    "presence_penalty": ({"presence_penalty": 2.5}, ConfigError),
    "frequency_penalty": ({"frequency_penalty": -2.5}, ConfigError),
    "repetition_penalty": ({"repetition_penalty": 0.0}, ConfigError),
    "min_p": ({"min_p": 1.5}, ConfigError),
    "min_tokens": ({"min_tokens": 5, "max_tokens": 4}, ConfigError),
    "stop": ({"stop": ["a", ""]}, ConfigError),
    "include_stop_str_in_output": ({"include_stop_str_in_output": "yes"}, ConfigError),
    "logprobs": ({"logprobs": MAX_LOGPROBS + 1}, ConfigError),
    "structured": ({"structured": {"type": "json_object"}}, ConfigError),
}


def test_every_field_has_a_bad_value_here() -> None:
    assert set(BAD) == {f.name for f in dataclasses.fields(SamplingParams)}


@pytest.mark.parametrize("name", sorted(BAD))
def test_a_bad_value_is_refused_naming_its_field(name: str) -> None:
    kwargs, kind = BAD[name]
    with pytest.raises(kind, match=f"^{name}") as refused:
        SamplingParams(**kwargs)
    assert field_at_fault(refused.value) == name


def test_replace_checks_again() -> None:
    with pytest.raises(ConfigError, match="seed"):
        dataclasses.replace(SamplingParams(seed=1), seed=-1)


def test_a_message_that_names_no_field_is_no_field() -> None:
    assert field_at_fault(ConfigError("something else went wrong")) is None
    assert field_at_fault(ConfigError("stop[2] must be a non-empty string, got ''")) == "stop"


def test_the_token_bound_is_the_token_rule() -> None:
    from kvpool.hashing import TOKEN_LIMIT

    assert sampling_params._TOKEN_LIMIT == TOKEN_LIMIT


# -- through the OpenAI layer -------------------------------------------------------------------------

CHAT = {"messages": [{"role": "user", "content": "x"}]}

# A body field of the right JSON type whose value SamplingParams refuses, and the param the 400 names.
BAD_BODIES: list[tuple[GenerationEndpoint, dict[str, Any], str]] = [
    (GenerationEndpoint.COMPLETIONS, {"temperature": -1}, "temperature"),
    (GenerationEndpoint.COMPLETIONS, {"top_p": 1.5}, "top_p"),
    (GenerationEndpoint.COMPLETIONS, {"top_k": -2}, "top_k"),
    (GenerationEndpoint.COMPLETIONS, {"min_p": 2}, "min_p"),
    (GenerationEndpoint.COMPLETIONS, {"seed": -1}, "seed"),
    (GenerationEndpoint.COMPLETIONS, {"presence_penalty": 3}, "presence_penalty"),
    (GenerationEndpoint.COMPLETIONS, {"frequency_penalty": -3}, "frequency_penalty"),
    (GenerationEndpoint.COMPLETIONS, {"repetition_penalty": 0}, "repetition_penalty"),
    (GenerationEndpoint.COMPLETIONS, {"repetition_penalty": 1e7}, "repetition_penalty"),
    (GenerationEndpoint.COMPLETIONS, {"min_tokens": -1}, "min_tokens"),
    (GenerationEndpoint.COMPLETIONS, {"min_tokens": 17}, "min_tokens"),  # above the default max_tokens, 16
    (GenerationEndpoint.COMPLETIONS, {"stop_token_ids": [-1]}, "stop_token_ids"),
    (GenerationEndpoint.COMPLETIONS, {"stop_token_ids": [2**32]}, "stop_token_ids"),
    (GenerationEndpoint.COMPLETIONS, {"logprobs": MAX_LOGPROBS + 1}, "logprobs"),
    (GenerationEndpoint.CHAT, {"logprobs": True, "top_logprobs": MAX_LOGPROBS + 1}, "top_logprobs"),
    (GenerationEndpoint.CHAT, {"top_p": 0}, "top_p"),
    (GenerationEndpoint.CHAT, {"max_completion_tokens": 3, "min_tokens": 4}, "min_tokens"),
]


@pytest.mark.parametrize(("endpoint", "fields", "param"), BAD_BODIES, ids=lambda v: str(v))
def test_a_bad_sampling_field_is_a_400_naming_it(
    endpoint: GenerationEndpoint, fields: dict[str, Any], param: str
) -> None:
    body = {**(CHAT if endpoint is GenerationEndpoint.CHAT else {"prompt": "hi"}), **fields}
    with pytest.raises(APIError) as refused:
        parse_generation(endpoint, body)
    assert refused.value.status == 400 and refused.value.param == param
    given = fields[param]
    assert (
        param in refused.value.message and str(given[0] if isinstance(given, list) else given) in refused.value.message
    )
    assert refused.value.body["error"]["param"] == param


def test_every_field_reaches_sampling_params_from_the_body() -> None:
    body = {
        "prompt": "hi",
        "max_tokens": 9,
        "temperature": 0.5,
        "top_p": 0.9,
        "top_k": 4,
        "seed": 11,
        "stop_token_ids": [5, 6],
        "ignore_eos": True,
        "presence_penalty": 0.1,
        "frequency_penalty": 0.2,
        "repetition_penalty": 1.1,
        "min_p": 0.05,
        "min_tokens": 2,
        "stop": ["end"],
        "include_stop_str_in_output": True,
        "logprobs": 3,
    }
    sampling = parse_generation(GenerationEndpoint.COMPLETIONS, body).sampling
    assert {name: getattr(sampling, name) for name in body if name != "prompt"} == {
        **{k: v for k, v in body.items() if k != "prompt"},
        "stop_token_ids": (5, 6),
        "stop": ("end",),
    }
    # Every SamplingParams field but the grammar (the engine's, from response_format) has a body field.
    assert {f.name for f in dataclasses.fields(SamplingParams)} - set(body) == {"structured"}


def test_the_openai_defaults() -> None:
    completion = parse_generation(GenerationEndpoint.COMPLETIONS, {"prompt": "hi"}).sampling
    chat = parse_generation(GenerationEndpoint.CHAT, CHAT).sampling
    assert (completion.max_tokens, completion.temperature) == (16, 1.0)  # OpenAI's, not SamplingParams' greedy
    assert (chat.max_tokens, chat.temperature) == (None, 1.0)
    nulls = {"prompt": "hi", "temperature": None, "top_p": None, "seed": None, "top_k": None}
    assert parse_generation(GenerationEndpoint.COMPLETIONS, nulls).sampling == completion


def test_response_format_stays_on_the_request() -> None:
    gen = parse_generation(GenerationEndpoint.CHAT, {**CHAT, "response_format": {"type": "json_object"}})
    assert gen.response_format == ("json_object", None) and gen.sampling.structured is None


def test_the_shadow_sampling_is_gone() -> None:
    assert not hasattr(protocol, "Sampling") and not hasattr(protocol, "NEUTRAL")
    assert "Sampling" not in protocol.__all__


def test_each_sequence_of_a_seeded_request_draws_with_its_own_seed() -> None:
    pytest.importorskip("pydantic")
    from kvpool.serve.generation import sequence_params

    seeded = parse_generation(GenerationEndpoint.COMPLETIONS, {"prompt": "hi", "n": 3, "seed": 2**63 - 2})
    assert [p.seed for p in sequence_params(seeded)] == [2**63 - 2, 2**63 - 1, 0]
    assert {dataclasses.replace(p, seed=None) for p in sequence_params(seeded)} == {
        dataclasses.replace(seeded.sampling, seed=None)
    }
    unseeded = parse_generation(GenerationEndpoint.COMPLETIONS, {"prompt": "hi", "n": 2})
    assert sequence_params(unseeded) == [unseeded.sampling] * 2


def test_the_engine_re_exports_the_one_class() -> None:
    pytest.importorskip("torch")
    import kvpool.engine
    from kvpool.engine.sampling import SamplingParams as FromSampling

    assert kvpool.engine.SamplingParams is FromSampling is SamplingParams
