"""Presence, frequency and repetition penalties: vLLM's rules, applied to one row of logits.

For a row of logits ``l`` over a vocabulary of ``V`` tokens, with ``c[t]`` the
number of times token ``t`` was generated so far and ``seen[t]`` true when
``t`` is in the prompt or was generated:

* repetition (``r > 0``, the CTRL paper's rule, on prompt and output tokens)::

      l[t] = l[t] / r   if seen[t] and l[t] > 0
      l[t] = l[t] * r   if seen[t] and l[t] <= 0

* frequency (``f``, OpenAI's definition, on output tokens)::   ``l[t] -= f * c[t]``
* presence (``p``, OpenAI's definition, on output tokens)::    ``l[t] -= p * (c[t] > 0)``

in that order, on float32 logits, before temperature and every cut. Positive
penalties discourage repeats, negative ones encourage them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["apply_penalties"]


def apply_penalties(
    logits: torch.Tensor,
    prompt_token_ids: Sequence[int],
    output_token_ids: Sequence[int],
    *,
    presence: float,
    frequency: float,
    repetition: float,
) -> torch.Tensor:
    """A new ``[V]`` float32 row: ``logits`` with the three penalties applied (see the module docstring).

    Token IDs at or beyond ``V`` are ignored (they have no logit to penalise).
    Costs O(prompt + output + V).
    """
    out = logits.float().clone()
    vocab = out.shape[-1]
    outputs = torch.as_tensor(list(output_token_ids), dtype=torch.long)
    outputs = outputs[outputs < vocab]
    counts = torch.bincount(outputs, minlength=vocab).to(out.dtype)
    if repetition != 1.0:
        prompt = torch.as_tensor(list(prompt_token_ids), dtype=torch.long)
        seen = counts > 0
        seen[prompt[prompt < vocab]] = True
        # A seen token moves towards less likely: divided when positive, multiplied when not.
        # In float64, so that an extreme penalty saturates to +-inf instead of failing to convert
        # (and -inf times a penalty that float32 would round to 0 stays -inf rather than NaN).
        wide = out.double()
        moved = torch.where(wide > 0, wide / repetition, wide * repetition)
        out = torch.where(seen, moved, wide).float()
    if frequency != 0.0:
        out -= frequency * counts
    if presence != 0.0:
        out -= presence * (counts > 0).to(out.dtype)
    return out
