"""Structured output through the engine: a JSON schema's or any JSON object's grammar keeps SmolLM2's tokens
inside it (greedy and sampled), the request ends with ``stop`` once the document is whole, and a schema
that cannot be compiled is refused before anything is queued.

Needs llguidance (the ``structured`` extra): skipped without it, failed under ``CI=true``.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from kvpool.engine.sampling import RowContext, SamplingParams, sample_rows
from kvpool.engine.structured import JSON_OBJECT, JSON_SCHEMA, StructuredOutput
from kvpool.errors import ConfigError
from kvpool.scheduler import FinishReason
from tests.services import unavailable

pytestmark = [pytest.mark.engine]

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 30},
        "age": {"type": "integer", "minimum": 0},
        "city": {"type": "string", "maxLength": 30},
        "pets": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 3},
    },
    "required": ["name", "age", "city", "pets"],
    "additionalProperties": False,
}


@pytest.fixture(autouse=True)
def _llguidance() -> None:
    if importlib.util.find_spec("llguidance") is None:
        unavailable("llguidance is not installed (pip install 'kvpool[structured]')")


@pytest.fixture(scope="module")
def engine() -> Iterator[Any]:
    from kvpool.engine.llm_engine import LLMEngine

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield LLMEngine(
            kv_cache_memory="64MiB", max_model_len=512, max_num_batched_tokens=256, threads=1, log=lambda line: None
        )
    finally:
        torch.set_num_threads(threads)


def _chat(engine: Any, text: str) -> list[int]:
    return engine.encode(engine.render_chat([{"role": "user", "content": text}]), add_special_tokens=False)


def _is_person(document: Any) -> None:
    """What the schema says, checked by hand."""
    assert isinstance(document, dict) and set(document) == {"name", "age", "city", "pets"}, document
    assert isinstance(document["name"], str) and len(document["name"]) <= 30
    assert type(document["age"]) is int and document["age"] >= 0
    assert isinstance(document["city"], str) and len(document["city"]) <= 30
    assert isinstance(document["pets"], list) and len(document["pets"]) <= 3
    assert all(isinstance(p, str) and len(p) <= 20 for p in document["pets"])


@pytest.mark.slow
def test_a_json_schema_request_answers_a_document_the_schema_accepts(engine: Any) -> None:
    prompt = _chat(engine, "Describe a person with a name, an age, a city and their pets.")
    params = SamplingParams(max_tokens=200, structured=StructuredOutput.json_schema(PERSON))
    rid = engine.add_request(prompt, params)
    out = engine.run_until_done([rid])[rid]
    _is_person(json.loads(out.text))
    # Ended by its grammar: stop, with no stop token to name, and the last token's text kept.
    assert out.finish_reason is FinishReason.STOP and out.stop_reason is None
    assert out.text.endswith("}")
    assert out.text == engine.decode(out.output_token_ids)
    # Unconstrained, the same greedy request does not write this document.
    free = engine.add_request(prompt, SamplingParams(max_tokens=len(out.output_token_ids)))
    assert engine.run_until_done([free])[free].text != out.text


@pytest.mark.slow
def test_sampled_sequences_of_one_schema_each_follow_it(engine: Any) -> None:
    prompt = _chat(engine, "Write a person as JSON.")
    spec = StructuredOutput.json_schema(PERSON)
    params = [SamplingParams(max_tokens=200, temperature=1.0, seed=s, structured=spec) for s in range(3)]
    ids = engine.add_requests([prompt] * 3, params)
    outs = engine.run_until_done(ids)
    for rid in ids:
        _is_person(json.loads(outs[rid].text))
        assert outs[rid].finish_reason is FinishReason.STOP


@pytest.mark.slow
def test_a_json_object_request_answers_an_object(engine: Any) -> None:
    prompt = _chat(engine, "Give me the capital of France.")
    rid = engine.add_request(prompt, SamplingParams(max_tokens=120, structured=StructuredOutput(JSON_OBJECT)))
    out = engine.run_until_done([rid])[rid]
    assert isinstance(json.loads(out.text), dict), out.text
    assert out.finish_reason is FinishReason.STOP


@pytest.mark.parametrize(
    ("kind", "schema", "words"),
    [
        (JSON_SCHEMA, '{"type": "foo"}', "cannot be compiled"),
        (JSON_SCHEMA, '{"type": "string", "pattern": "(["}', "cannot be compiled"),
        (JSON_SCHEMA, '{"properties": {"a": {"$ref": "#/nowhere"}}}', "cannot be compiled"),
        (JSON_SCHEMA, "{not json", "not valid JSON"),
        (JSON_SCHEMA, "[1, 2]", "must be a JSON object"),
        (JSON_SCHEMA, None, "must be JSON text"),
        (JSON_OBJECT, "{}", "must be None"),
        ("yaml", None, "structured.kind"),
    ],
)
def test_a_spec_that_cannot_be_served_is_refused_naming_it(kind: str, schema: str | None, words: str) -> None:
    with pytest.raises(ConfigError, match="structured") as caught:
        StructuredOutput(kind, schema)
    assert words in str(caught.value)


def test_sampling_params_refuse_a_structured_that_is_not_a_spec() -> None:
    with pytest.raises(ConfigError, match="structured must be None or a StructuredOutput"):
        SamplingParams(structured={"type": "json_object"})  # type: ignore[arg-type]


def test_the_grammar_mask_comes_before_greedy_sampling_and_logprobs() -> None:
    logits = torch.tensor([[5.0, 4.0, 1.0, 0.0], [5.0, 4.0, 1.0, 0.0]])
    allowed = torch.tensor([False, False, True, True])
    rows = sample_rows(
        logits,
        [SamplingParams(logprobs=1), SamplingParams(logprobs=1)],
        [None, None],
        [RowContext(allowed_tokens=allowed), None],
    )
    assert [r.token_id for r in rows] == [2, 0]  # type: ignore[union-attr]
    masked = rows[0].logprobs  # type: ignore[union-attr]
    assert masked is not None and [t for t, _ in masked.top] == [2]
    # Only the two allowed tokens share the probability.
    assert masked.logprob == pytest.approx(float(torch.log_softmax(torch.tensor([1.0, 0.0]), 0)[0]))
    assert logits[0, 0] == 5.0  # the caller's logits are left alone


def test_a_row_whose_grammar_allows_nothing_fails_alone() -> None:
    logits = torch.zeros(2, 4)
    rows = sample_rows(
        logits,
        [SamplingParams(), SamplingParams()],
        [None, None],
        [RowContext(allowed_tokens=torch.zeros(4, dtype=torch.bool)), None],
    )
    assert getattr(rows[0], "reason", None) == "every logit is -inf"
    assert getattr(rows[1], "token_id", None) == 0
