"""Finding which requests a failed forward pass belongs to, so that only they fail.

A step's forward pass computes every scheduled chunk at once. When it raises,
:func:`forward_contained` runs the chunks again one at a time, in plan order
(a chunk that reads a block filled earlier in the same step still finds it
written): a chunk that fails alone is that request's failure, and the others
keep the logits of their lone run. When only one chunk was scheduled, the
batched run was already its lone run. Rerunning writes the same K/V into the
same slots, so what the failed batched run left half written is overwritten.

:func:`dependants` names the requests that must fail with a failed one: those
holding a block it was to fill in this step (a prefix hit on a block cached at
allocation, in the same step), whose K/V was never written.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from kvpool.manager import KVCacheManager
from kvpool.scheduler import ScheduledChunk

__all__ = ["ForwardResult", "dependants", "forward_contained"]


@dataclass(frozen=True, slots=True, kw_only=True)
class ForwardResult:
    """One step's forward pass: the last-token logits of each sampled chunk that ran, and who failed.

    ``rows`` maps the request ID of every chunk with ``sample=True`` that ran
    to its ``[V]`` logits; ``failed`` maps each request whose chunk failed to
    the error, in words. ``batched`` holds the ``[N, V]`` logits in chunk
    order when the whole batch ran at once (the usual case), else None.
    """

    rows: Mapping[str, torch.Tensor]
    failed: Mapping[str, str]
    batched: torch.Tensor | None


def _describe(exc: BaseException) -> str:
    return f"the forward pass failed: {type(exc).__name__}: {exc}"


def forward_contained(
    execute: Callable[[Sequence[ScheduledChunk]], torch.Tensor], chunks: Sequence[ScheduledChunk]
) -> ForwardResult:
    """Run ``chunks`` in one pass; if that raises, run each alone to find the ones that fail.

    Only ``Exception`` is contained; an interrupt goes on to the caller.
    """
    sampled = [c.request_id for c in chunks if c.sample]
    try:
        logits = execute(chunks)
    except Exception as exc:
        if len(chunks) == 1:
            return ForwardResult(rows={}, failed={chunks[0].request_id: _describe(exc)}, batched=None)
    else:
        return ForwardResult(rows=dict(zip(sampled, logits)), failed={}, batched=logits)
    rows: dict[str, torch.Tensor] = {}
    failed: dict[str, str] = {}
    for chunk in chunks:
        try:
            alone = execute([chunk])
        except Exception as exc:
            failed[chunk.request_id] = _describe(exc)
            continue
        if chunk.sample:
            rows[chunk.request_id] = alone[0]
    return ForwardResult(rows=rows, failed=failed, batched=None)


def unfilled_blocks(manager: KVCacheManager, chunk: ScheduledChunk) -> set[int]:
    """IDs of the blocks of ``chunk``'s request that hold a position the chunk was to compute."""
    out: set[int] = set()
    for group, table in zip(manager.groups, manager.get_block_ids(chunk.request_id)):
        out.update(b for b in table[chunk.start_position // group.block_size :] if b)
    return out


def dependants(manager: KVCacheManager, chunks: Sequence[ScheduledChunk], failed: Mapping[str, str]) -> dict[str, str]:
    """Requests of ``chunks`` not in ``failed`` that hold a block a failed chunk was to fill; why each fails."""
    if not failed:
        return {}
    by_chunk = {c.request_id: c for c in chunks}
    lost: dict[int, str] = {}
    for rid in failed:
        for block_id in unfilled_blocks(manager, by_chunk[rid]):
            lost.setdefault(block_id, rid)
    out: dict[str, str] = {}
    for chunk in chunks:
        rid = chunk.request_id
        if rid in failed:
            continue
        for table in manager.get_block_ids(rid):
            culprit = next((lost[b] for b in table if b in lost), None)
            if culprit is not None:
                out[rid] = f"it reads blocks that request {culprit!r} was to fill in a step that failed"
                break
    return out
