"""Emulated replicas: vLLM's cache decisions with no weights and no torch, time from a cost model.

``kvpool serve --emulate PROFILE`` serves one or many (``--replicas N``) of them with every
route of a real replica: the OpenAI endpoints, streaming at the modelled pace,
``usage.prompt_tokens_details.cached_tokens``, KV events in vLLM's wire format, vLLM's
metric names, ``/health``. So a router, or a fleet of them, is measured on one machine
against replicas that cache exactly as vLLM's would (docs/emulator.md).

* :mod:`.engine`: :class:`EmulatedEngine`, the real scheduler and KV cache manager, stepped
  at the cost profile's pace.
* :mod:`.options`: :class:`EmulatorOptions` (profile, pool, limits, ``time_scale``, seed).
* :mod:`.clock`: where the modelled time passes (the wall clock, or a manual one for tests).
* :mod:`.output_tokens`: the deterministic draw of output tokens.
* :mod:`.fleet`: many replicas in one process (their event endpoints, one after another).

It imports the engine package's torch-free modules only (what requests return, stop strings).
"""

from __future__ import annotations

from kvpool.emulator.clock import ManualClock, StepClock, WallClock
from kvpool.emulator.engine import EmulatedEngine, EmulatedPool, EmulatedSetup
from kvpool.emulator.options import EmulatorOptions, blocks_for_memory
from kvpool.emulator.output_tokens import OutputTokens, TokenDraw

__all__ = [
    "EmulatedEngine",
    "EmulatedPool",
    "EmulatedSetup",
    "EmulatorOptions",
    "ManualClock",
    "OutputTokens",
    "StepClock",
    "TokenDraw",
    "WallClock",
    "blocks_for_memory",
]
