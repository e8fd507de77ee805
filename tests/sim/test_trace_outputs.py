"""Explicit output tokens in a trace: kept, checked, written and read back, and followed by the next turn."""

from __future__ import annotations

import json

import pytest

from kvpool.sim.traces import TokenSegment, TraceError, TraceRequest, load_trace, write_trace


def test_explicit_outputs_are_the_output_tokens_and_the_next_turn_extends_them():
    first = TraceRequest.create("a", 0, (TokenSegment.of([1, 2, 3]),), 2, outputs=TokenSegment.of([7, 8]))
    assert first.output_token_ids().tolist() == [7, 8]
    second = TraceRequest.create("b", 1, (TokenSegment.of([9]),), 1, follows=first)
    assert second.prompt_token_ids().tolist() == [1, 2, 3, 7, 8, 9]


def test_derived_outputs_are_unchanged_without_explicit_ones():
    derived = TraceRequest.create("a", 0, (TokenSegment.of([1]),), 3)
    assert derived.outputs is None and len(derived.output_token_ids()) == 3


@pytest.mark.parametrize("outputs", [TokenSegment.of([7]), TokenSegment.of([7, 8, 9]), [7, 8]])
def test_outputs_of_another_length_or_type_are_refused_by_name(outputs):
    with pytest.raises(TraceError, match="output_token_ids.*output_length=2") as err:
        TraceRequest.create("a", 0, (TokenSegment.of([1]),), 2, outputs=outputs)
    assert err.value.field == "output_token_ids"


def test_explicit_outputs_survive_writing_and_reading(tmp_path):
    first = TraceRequest.create("a", 0, (TokenSegment.of([1, 2]),), 2, outputs=TokenSegment.of([5, 6]))
    second = TraceRequest.create("b", 1, (TokenSegment.of([3]),), 1, follows=first, outputs=TokenSegment.of([4]))
    path = tmp_path / "t.jsonl"
    write_trace([first, second], path)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert lines[0]["output_token_ids"] == [5, 6] and lines[1]["follows"] == "a"  # the turn is written compactly
    back = load_trace(path)
    assert [r.prompt_token_ids().tolist() for r in back] == [[1, 2], [1, 2, 5, 6, 3]]
    assert [r.output_token_ids().tolist() for r in back] == [[5, 6], [4]]


def test_a_file_with_outputs_of_the_wrong_length_names_line_and_field(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text('{"id": "a", "arrival_ms": 0, "output_length": 3, "token_ids": [1], "output_token_ids": [1, 2]}\n')
    with pytest.raises(TraceError, match=r"t.jsonl line 1: field 'output_token_ids'"):
        load_trace(path)
