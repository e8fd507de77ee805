"""Shared helpers for the engine tests.

The whole folder is left out of collection when torch or transformers is not
installed (the engine is an optional extra).

The helpers stand in for the real block manager: a block allocator that hands
out IDs (reusing freed ones, so stale blocks get overwritten) and a greedy
driver that feeds a :class:`~kvpool.engine.model_runner.ModelRunner` step by
step.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field

import pytest

_ENGINE_DEPS = ("torch", "transformers")
if any(importlib.util.find_spec(name) is None for name in _ENGINE_DEPS):
    collect_ignore_glob = ["test_*.py"]


class BlockAllocator:
    """Hands out block IDs 1..num_blocks-1; freed IDs are reused first."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._next = 1
        self._free: list[int] = []

    def allocate(self) -> int:
        if self._free:
            return self._free.pop()
        if self._next >= self.num_blocks:
            raise RuntimeError("test allocator ran out of blocks")
        block = self._next
        self._next += 1
        return block

    def free(self, block_id: int) -> None:
        self._free.append(block_id)


@dataclass
class SeqState:
    """Test-side state of one request.

    ``block_tables`` holds one table per KV cache group; a prefix-cache hit is
    set up by pre-filling the tables with another sequence's blocks and setting
    ``num_computed`` to the number of tokens they hold.
    """

    request_id: str
    tokens: list[int]
    max_new_tokens: int
    chunk_size: int | None = None
    block_tables: list[list[int]] | None = None
    num_computed: int = 0
    prompt_len: int = 0
    logits: list = field(default_factory=list)

    def __post_init__(self) -> None:
        self.prompt_len = len(self.tokens)

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_len :]

    @property
    def done(self) -> bool:
        return len(self.generated) >= self.max_new_tokens


class GreedyDriver:
    """Feeds sequences through a runner, one forward pass per step.

    Each step every unfinished sequence contributes one chunk: the next
    ``chunk_size`` uncomputed tokens (all of them if None), or its newest token
    when decoding. For a group with a sliding window, blocks that no position
    can see any more are freed, poisoned with NaN, and replaced by the null
    block ``0``; ``num_nulled`` counts them.
    """

    def __init__(self, runner, allocator: BlockAllocator, group_windows: list[int | None] | None = None) -> None:
        self.runner = runner
        self.allocator = allocator
        self.group_windows = group_windows or [None] * runner.num_groups
        assert len(self.group_windows) == runner.num_groups
        self.block_size = runner.block_size
        self.num_nulled = 0

    def _release_out_of_window(self, seq: SeqState, group: int, window: int) -> None:
        table = seq.block_tables[group]
        first_visible = seq.num_computed - window + 1
        layers = [i for i, info in enumerate(self.runner.layers) if info.group == group]
        for index, block_id in enumerate(table):
            if block_id != 0 and (index + 1) * self.block_size <= first_visible:
                table[index] = 0
                self.allocator.free(block_id)
                self.num_nulled += 1
                # If attention ever read a freed block, NaN would surface in the logits.
                for layer in layers:
                    key_cache, value_cache = self.runner.kv_caches.layer(layer)
                    key_cache[block_id] = float("nan")
                    value_cache[block_id] = float("nan")

    def step(self, seqs: list[SeqState]) -> None:
        from kvpool.engine.batch import SequenceChunk

        active = [s for s in seqs if not s.done]
        chunks = []
        for seq in active:
            if seq.block_tables is None:
                seq.block_tables = [[] for _ in self.group_windows]
            remaining = len(seq.tokens) - seq.num_computed
            take = remaining if seq.chunk_size is None else min(remaining, seq.chunk_size)
            end = seq.num_computed + take
            for group, window in enumerate(self.group_windows):
                if window is not None:
                    self._release_out_of_window(seq, group, window)
                table = seq.block_tables[group]
                while len(table) * self.block_size < end:
                    table.append(self.allocator.allocate())
            chunks.append(
                SequenceChunk(
                    request_id=seq.request_id,
                    token_ids=tuple(seq.tokens[seq.num_computed : end]),
                    start_position=seq.num_computed,
                    block_tables=tuple(tuple(t) for t in seq.block_tables),
                    sample=end == len(seq.tokens),
                )
            )
        logits = self.runner.execute(chunks)
        row = 0
        for seq, chunk in zip(active, chunks):
            seq.num_computed = chunk.end_position
            if chunk.sample:
                seq.logits.append(logits[row].clone())
                seq.tokens.append(int(logits[row].argmax()))
                row += 1
        assert row == logits.shape[0]

    def run(self, seqs: list[SeqState], max_steps: int = 1000) -> None:
        for _ in range(max_steps):
            if all(s.done for s in seqs):
                return
            self.step(seqs)
        raise AssertionError("sequences did not finish")


@pytest.fixture
def make_runner():
    """``make_runner(model, num_blocks=64, block_size=4)`` -> (runner, allocator)."""

    def factory(model, num_blocks: int = 64, block_size: int = 4, **kwargs):
        from kvpool.engine.kv_cache import KVCacheSpec, allocate_kv_caches
        from kvpool.engine.model_runner import ModelRunner

        spec = KVCacheSpec.from_model_config(model.config, block_size=block_size, dtype=model.dtype)
        caches = allocate_kv_caches(spec, num_blocks)
        return ModelRunner(model, caches, **kwargs), BlockAllocator(num_blocks)

    return factory


@pytest.fixture
def driver_cls():
    return GreedyDriver


@pytest.fixture
def seq_cls():
    return SeqState


def reference_generate(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Greedy tokens from transformers' own ``generate`` (EOS never stops it)."""
    import torch

    input_ids = torch.tensor([prompt], dtype=torch.int64)
    with torch.inference_mode():
        out = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


@pytest.fixture
def reference():
    return reference_generate
