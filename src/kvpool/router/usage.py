"""``cached_tokens`` read back from a replica's answer, as it passes through the router.

An OpenAI-compatible server reports the prompt tokens it served from its prefix cache
in ``usage.prompt_tokens_details.cached_tokens``: in the JSON body of an answer that
does not stream, and in the one streamed chunk that carries ``usage`` (vLLM sends it
when the client asks with ``stream_options: {"include_usage": true}``). The router
reads it without holding the answer back: a streamed answer is scanned line by line as
its bytes go by, and only a line that mentions ``prompt_tokens_details`` is decoded.
An answer without the figure reports nothing (None), never 0.
"""

from __future__ import annotations

import json

__all__ = ["UsageScanner", "cached_tokens_of"]

#: The longest partial line a scanner keeps between chunks; a longer line is skipped.
MAX_LINE_BYTES = 1 << 20


def _cached(payload: object) -> int | None:
    if not isinstance(payload, dict):
        return None
    usage = payload.get("usage")
    details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return cached if type(cached) is int and cached >= 0 else None


def cached_tokens_of(body: bytes) -> int | None:
    """The ``cached_tokens`` of a JSON answer, or None where it has none (or is not JSON)."""
    if b"prompt_tokens_details" not in body:
        return None
    try:
        return _cached(json.loads(body))
    except (ValueError, RecursionError):
        return None


class UsageScanner:
    """Reads a server-sent-events stream chunk by chunk; :attr:`cached_tokens` is the last figure seen."""

    __slots__ = ("cached_tokens", "_partial", "_skipping")

    def __init__(self) -> None:
        self.cached_tokens: int | None = None
        self._partial = bytearray()
        self._skipping = False  # inside a line too long to keep

    def feed(self, chunk: bytes) -> None:
        lines = chunk.split(b"\n")
        for i, piece in enumerate(lines):
            last = i == len(lines) - 1
            if self._skipping:
                if not last:
                    self._skipping = False
                continue
            self._partial += piece
            if last:
                if len(self._partial) > MAX_LINE_BYTES:
                    self._partial.clear()
                    self._skipping = True
                return
            line = bytes(self._partial).strip()
            self._partial.clear()
            if line.startswith(b"data:") and b"prompt_tokens_details" in line:
                found = cached_tokens_of(line[5:].strip())
                if found is not None:
                    self.cached_tokens = found
