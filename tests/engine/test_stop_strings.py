"""Stop strings across token boundaries, with a tokenizer of single characters and longer pieces.

Each case feeds tokens one at a time through a request's
:class:`~kvpool.engine.live_request.LiveRequest` (the incremental
detokenizer, then the stop-string matcher) and checks the text shown after
every token, the stop string found, and the final text.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.engine.live_request import LiveRequest
from kvpool.engine.sampling import SamplingParams
from kvpool.engine.stop_strings import StopStrings

pytestmark = pytest.mark.engine

PIECES = ["<eos>", "a", "b", "c", "S", "T", "O", "P", "ST", "OP", "STOP!", "xS", "Tx", " ", "é"]
EOS = 0


class PieceTokenizer:
    """Token i decodes to PIECES[i]; ``<eos>`` is special."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(PIECES[i] for i in ids if not (skip_special_tokens and i == EOS))


def ids(*pieces: str) -> list[int]:
    return [PIECES.index(p) for p in pieces]


def run(pieces: list[str], **fields: object) -> tuple[list[str], LiveRequest, int]:
    """Feed the tokens until the text stops; the pieces shown, the request's state, tokens taken."""
    params = SamplingParams(max_tokens=64, **fields)  # type: ignore[arg-type]
    live = LiveRequest(params, None, PieceTokenizer(), [EOS])
    shown = []
    for n, token in enumerate(ids(*pieces), start=1):
        shown.append(live.take(token, None, n, ended=False))
        if live.stop_string is not None:
            return shown, live, n
    shown.append(live.flush())
    return shown, live, len(pieces)


def test_a_stop_string_split_over_tokens_ends_the_text_before_it() -> None:
    shown, live, taken = run(["a", "b", "S", "T", "OP", "c"], stop=("STOP",))
    assert live.stop_string == "STOP" and taken == 5
    assert shown == ["a", "b", "", "", ""]  # "S", "ST" were held back: they could have been the start
    assert "".join(shown) == live.final_text([], ended=False) == "ab"


def test_held_back_text_is_released_once_it_cannot_become_a_stop_string() -> None:
    shown, live, _ = run(["a", "S", "T", "a", "b"], stop=("STOP",))
    assert live.stop_string is None
    assert shown == ["a", "", "", "STa", "b", ""]
    assert live.final_text([], ended=False) == "aSTab"


def test_a_stop_string_inside_one_token_cuts_that_tokens_text() -> None:
    shown, live, _ = run(["a", "xS", "Tx"], stop=("ST",))
    assert live.stop_string == "ST"
    assert "".join(shown) == live.final_text([], ended=False) == "ax"


def test_include_stop_str_in_output_keeps_the_string_and_nothing_after_it() -> None:
    shown, live, _ = run(["a", "xS", "Tx", "b"], stop=("ST",), include_stop_str_in_output=True)
    assert live.stop_string == "ST"
    assert shown == ["a", "xS", "T"]  # nothing held back: the string is shown anyway
    assert live.final_text([], ended=False) == "axST"


def test_the_stop_string_that_ends_first_wins_then_the_first_listed() -> None:
    _, live, _ = run(["a", "STOP!"], stop=("OP!", "TOP", "STO"))
    assert live.stop_string == "STO" and live.final_text([], ended=False) == "a"
    _, live, _ = run(["a", "STOP!"], stop=("TO", "ST"))
    assert live.stop_string == "ST"
    _, live, _ = run(["ST"], stop=("ST", "S"))  # "S" ends first, though listed second
    assert live.stop_string == "S"


def test_min_tokens_keeps_a_stop_string_from_ending_the_request_early() -> None:
    # "ST" is complete after token 2; with min_tokens=2 it cannot end there, the next one can.
    shown, live, taken = run(["S", "T", "a", "S", "T", "b"], stop=("ST",), min_tokens=2)
    assert live.stop_string == "ST" and taken == 5
    assert "".join(shown) == live.final_text([], ended=False) == "STa"
    # A stop string may begin before min_tokens and end after it.
    _, live, taken = run(["a", "S", "T"], stop=("ST",), min_tokens=2)
    assert live.stop_string == "ST" and taken == 3 and live.final_text([], ended=False) == "a"


def test_the_text_of_a_stop_token_is_left_out_unless_asked_for() -> None:
    params = SamplingParams(stop_token_ids=tuple(ids("b")))
    live = LiveRequest(params, None, PieceTokenizer(), [EOS])
    assert live.take(ids("a")[0], None, 1, ended=False) == "a"
    assert live.take(ids("b")[0], None, 2, ended=True) == ""
    assert live.final_text(ids("a", "b"), ended=True) == "a"
    kept = LiveRequest(
        SamplingParams(stop_token_ids=tuple(ids("b")), include_stop_str_in_output=True), None, PieceTokenizer(), [EOS]
    )
    assert kept.take(ids("b")[0], None, 1, ended=True) == "b"
    assert kept.final_text(ids("b"), ended=True) == "b"


def test_without_stop_strings_nothing_is_held_back() -> None:
    shown, live, _ = run(["S", "T", "a"])
    assert shown == ["S", "T", "a", ""]


@settings(max_examples=200, deadline=None)
@given(
    tokens=st.lists(st.sampled_from(PIECES[1:]), max_size=12),
    stops=st.lists(st.text(alphabet="abcSTOPx!", min_size=1, max_size=4), min_size=1, max_size=3),
    include=st.booleans(),
    min_tokens=st.integers(0, 3),
)
def test_shown_text_is_always_a_prefix_of_the_final_text(tokens, stops, include, min_tokens) -> None:
    """Whatever the pieces and stop strings: no text is shown that the final text lacks, and the final
    text holds no stop string ending past min_tokens (it is cut at the first)."""
    shown, live, taken = run(tokens, stop=tuple(stops), include_stop_str_in_output=include, min_tokens=min_tokens)
    final = live.final_text([], ended=False)
    assert "".join(shown) == final
    full = "".join(tokens[:taken])
    if live.stop_string is None:
        assert final == full
    else:
        assert final.endswith(live.stop_string) if include else full.startswith(final + live.stop_string)


def test_the_matcher_alone_takes_nothing_after_a_match() -> None:
    matcher = StopStrings(("ab",), include_in_output=False, min_tokens=0)
    assert matcher.add("xa", 1) == "x"
    assert matcher.add("bc", 2) == ""
    assert matcher.matched == "ab" and matcher.text == "x"
    assert matcher.add("more", 3) == "" and matcher.flush() == ""
