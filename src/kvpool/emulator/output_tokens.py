"""The emulated replica's output tokens: drawn from a seed, the same for the same request every time.

A request's draw is seeded by the replica's seed, the request's own ``seed`` when it
gives one, and otherwise its prompt's tokens (BLAKE2b of them), so a prompt sent twice
is answered with the same tokens, and a follow-up turn that quotes the answer meets the
blocks the first turn left. Tokens are drawn uniformly from the model's ordinary
vocabulary: every ID below the vocabulary size that is not a special token (so never
the EOS, nor a chat token such as ``<|im_end|>``). A request therefore ends at its
``max_tokens``, a stop token or a stop string. Each token costs one call of a Mersenne
Twister; nothing here is a model.
"""

from __future__ import annotations

import hashlib
import math
import random
from array import array
from collections.abc import Iterable

from kvpool.checks import check_int
from kvpool.engine.outputs import TokenLogprobs
from kvpool.errors import ConfigError

__all__ = ["OutputTokens", "TokenDraw"]


class TokenDraw:
    """One request's stream of output tokens (see the module docstring)."""

    __slots__ = ("_rng", "_tokens", "_logprob")

    def __init__(self, seed: int, tokens: array[int]) -> None:
        self._rng = random.Random(seed)
        self._tokens = tokens
        self._logprob = -math.log(len(tokens))

    def next(self) -> int:
        """The next output token."""
        return self._tokens[self._rng.randrange(len(self._tokens))]

    def logprobs(self, token: int, top: int) -> TokenLogprobs:
        """The draw's own log-probability of ``token`` (uniform), with ``top`` equally likely tokens, it first."""
        tokens = self._tokens
        n = len(tokens)
        start = _index(tokens, token)
        ranked = tuple((tokens[(start + i) % n], self._logprob) for i in range(min(top, n)))
        return TokenLogprobs(token_id=token, logprob=self._logprob, top=ranked)


def _index(tokens: array[int], token: int) -> int:
    """Where ``token`` is in the sorted ``tokens`` (0 if absent)."""
    lo, hi = 0, len(tokens)
    while lo < hi:
        mid = (lo + hi) // 2
        if tokens[mid] < token:
            lo = mid + 1
        else:
            hi = mid
    return lo if lo < len(tokens) and tokens[lo] == token else 0


class OutputTokens:
    """The draws of one replica: its ordinary vocabulary and its seed.

    Args:
        vocab_size: token IDs are in ``[0, vocab_size)``.
        special_token_ids: IDs never drawn (the tokenizer's special tokens, EOS among them).
        seed: the replica's seed, mixed into every draw.
    """

    __slots__ = ("_tokens", "_seed")

    def __init__(self, vocab_size: int, special_token_ids: Iterable[int], *, seed: int = 0) -> None:
        check_int("vocab_size", vocab_size)
        check_int("seed", seed, minimum=0)
        special = frozenset(special_token_ids)
        self._tokens = array("I", (t for t in range(vocab_size) if t not in special))
        if not self._tokens:
            raise ConfigError(f"the tokenizer's {vocab_size} tokens are all special: no output token can be drawn")
        self._seed = seed

    def for_request(self, prompt_token_ids: array[int], seed: int | None) -> TokenDraw:
        """The draw of a request with these prompt tokens and this ``seed`` (None: seeded by the prompt)."""
        digest = hashlib.blake2b(digest_size=8)
        digest.update(self._seed.to_bytes(8, "little"))
        if seed is None:
            digest.update(prompt_token_ids.tobytes())
        else:
            digest.update(b"seed" + seed.to_bytes(8, "little", signed=True))
        return TokenDraw(int.from_bytes(digest.digest(), "little"), self._tokens)
