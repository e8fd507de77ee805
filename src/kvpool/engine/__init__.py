"""kvpool's reference inference engine (needs the ``engine`` extra: torch, transformers).

Importing this package is cheap: torch and transformers load only when one of
the torch-backed names below is first used.

* :func:`SequenceChunk` (:mod:`.batch`): a chunk built by hand, checked; the scheduler makes the same type.
* :mod:`.kv_cache`: :class:`KVCacheSpec`, :func:`allocate_kv_caches`,
  :func:`num_blocks_for_budget`.
* :mod:`.paged_attention`: writing K/V at slots and attention through block tables.
* :class:`ModelRunner` (:mod:`.model_runner`): one forward pass per batch of chunks.
* :mod:`.model_store`: :func:`resolve_model`, :func:`load_model`.
* :mod:`.sampling`: :func:`make_generator`, :func:`sample_tokens`; :class:`SamplingParams`
  (torch-free, from :mod:`kvpool.sampling_params`).
* :class:`StructuredOutput` (:mod:`.structured`): JSON or a JSON Schema the output must follow
  (the ``structured`` extra).
* :mod:`.memory`: the KV cache budget (measured on CUDA, estimated on the CPU).
* :mod:`.startup`: loading, profiling and the one-time KV cache allocation.
* :class:`LLMEngine` (:mod:`.llm_engine`): the step loop (scheduler, runner, sampler).
* :class:`KVTransferWorker` (:mod:`.kv_transfer`): KV tiers' copies (CPU host memory, disk, Redis).
* :class:`LLM` (:mod:`.llm`): the offline API, ``generate`` and ``chat``.
* :class:`RequestOutput`, :class:`RequestDelta` (:mod:`.outputs`): what requests return.
"""

from __future__ import annotations

import importlib
from typing import Any

from kvpool.engine.batch import SequenceChunk

__all__ = [
    "DEFAULT_MODEL",
    "EngineOptions",
    "KVCacheSpec",
    "KVCaches",
    "KVTransferWorker",
    "LLM",
    "LLMEngine",
    "ModelRunner",
    "RequestDelta",
    "RequestOutput",
    "SamplingParams",
    "SequenceChunk",
    "StructuredOutput",
    "TokenLogprobs",
    "allocate_kv_caches",
    "load_model",
    "make_generator",
    "num_blocks_for_budget",
    "resolve_model",
    "sample_tokens",
]

_LAZY = {
    "EngineOptions": "startup",
    "KVCacheSpec": "kv_cache",
    "KVCaches": "kv_cache",
    "allocate_kv_caches": "kv_cache",
    "num_blocks_for_budget": "kv_cache",
    "ModelRunner": "model_runner",
    "KVTransferWorker": "kv_transfer",
    "LLM": "llm",
    "LLMEngine": "llm_engine",
    "RequestOutput": "outputs",
    "RequestDelta": "outputs",
    "TokenLogprobs": "outputs",
    "DEFAULT_MODEL": "model_store",
    "resolve_model": "model_store",
    "load_model": "model_store",
    "SamplingParams": "sampling",  # kvpool.sampling_params's, re-exported there
    "make_generator": "sampling",
    "sample_tokens": "sampling",
    "StructuredOutput": "structured",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
