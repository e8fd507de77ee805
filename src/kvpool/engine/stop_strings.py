"""Stop strings: found in a request's generated text across token boundaries, never shown past.

A :class:`StopStrings` is fed the text of each new token (from the
:class:`~kvpool.engine.outputs.IncrementalDetokenizer`) and answers with the
text that may be shown now. It holds back the longest end of the text that
is the beginning of some stop string, since the next tokens may complete it;
that text is released as soon as it cannot (or when the request finishes for
another reason). With ``include_stop_str_in_output`` nothing needs holding
back: the stop string itself is shown, and nothing after it.

A stop string counts only once more than ``min_tokens`` tokens were
generated, and only if it ends in the text of such a token (it may begin
earlier), as in vLLM. When a token's text completes several stop strings the
one that ends first wins, ties going to the earlier in ``stop``.
"""

from __future__ import annotations

__all__ = ["StopStrings"]


class StopStrings:
    """One request's stop-string matcher (see the module docstring). Costs O(len(piece) + sum of stop lengths²) a token."""

    __slots__ = ("_stop", "_include", "_min_tokens", "_text", "_shown", "matched", "_cut")

    def __init__(self, stop: tuple[str, ...], *, include_in_output: bool, min_tokens: int) -> None:
        self._stop = stop
        self._include = include_in_output
        self._min_tokens = min_tokens
        self._text = ""
        self._shown = 0  # characters of _text handed out so far
        #: The stop string that ended the text, once one did.
        self.matched: str | None = None
        self._cut = 0  # where the text ends once a stop string matched

    @property
    def text(self) -> str:
        """The text so far: cut at the stop string once one matched."""
        return self._text[: self._cut] if self.matched is not None else self._text

    def add(self, piece: str, num_output_tokens: int) -> str:
        """Take the text of the ``num_output_tokens``-th token; return what may be shown now.

        After a stop string matched (``matched`` is set), nothing more is taken.
        """
        if self.matched is not None:
            return ""
        before = len(self._text)
        self._text += piece
        if piece and num_output_tokens > self._min_tokens:
            self._match(before)
        if self.matched is not None:
            end = self._cut
        else:
            end = len(self._text) - (0 if self._include else self._partial_length())
        return self._show(end)

    def flush(self) -> str:
        """Everything not shown yet (the request finished for another reason)."""
        return self._show(len(self.text))

    def _show(self, end: int) -> str:
        if end <= self._shown:
            return ""
        out = self._text[self._shown : end]
        self._shown = end
        return out

    def _match(self, new_from: int) -> None:
        """Find the first stop string that ends after ``new_from``; set ``matched`` and the cut."""
        text = self._text
        best: tuple[int, int, str] | None = None  # (end, start, stop string)
        for stop in self._stop:
            start = text.find(stop, max(0, new_from - len(stop) + 1))
            if start >= 0 and (best is None or start + len(stop) < best[0]):
                best = (start + len(stop), start, stop)
        if best is not None:
            end, start, stop = best
            self.matched = stop
            self._cut = end if self._include else start

    def _partial_length(self) -> int:
        """Length of the longest end of the text that begins some stop string (shorter than it)."""
        text = self._text
        longest = 0
        for stop in self._stop:
            for k in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:k]):
                    longest = k
                    break
        return longest
