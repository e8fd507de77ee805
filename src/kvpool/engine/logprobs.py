"""The log-probabilities a request asks for: the sampled token's and the k most likely.

They are taken from the model's own distribution, a log-softmax of the raw
logits in float32, before the min_tokens mask, penalties, temperature and the
top-k/top-p/min-p cuts. That is what vLLM returns by default
(``logprobs_mode="raw_logprobs"``); a sampled token that a cut made certain
still reports the probability the model gave it.
"""

from __future__ import annotations

import torch

from kvpool.engine.outputs import TokenLogprobs

__all__ = ["token_logprobs"]


def token_logprobs(raw_logits: torch.Tensor, token_id: int, num_top: int) -> TokenLogprobs:
    """The log-probability of ``token_id`` under ``raw_logits`` (``[V]``) and the ``num_top`` best, best first.

    Ties among the best keep the lower token ID first. Costs one log-softmax
    and one top-k over ``V``.
    """
    logprobs = torch.log_softmax(raw_logits.float(), dim=-1)
    top: tuple[tuple[int, float], ...] = ()
    if num_top > 0:
        k = min(num_top, logprobs.shape[-1])
        # A stable descending sort orders ties by token ID; topk does not promise any order for them.
        values, ids = torch.sort(logprobs, descending=True, stable=True)
        top = tuple(zip(ids[:k].tolist(), values[:k].tolist()))
    return TokenLogprobs(token_id=token_id, logprob=float(logprobs[token_id]), top=top)
